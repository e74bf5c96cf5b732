"""The training loop's copy of its last step boundary (cluster.api.memory.StepMemory): a copy,
not a reference; bounded by CheckpointConfig(memory_snapshot=...); one buffer reused from step
to step; the manager's snapshot shared at a step it saves; what the checkpoint server is told."""

from __future__ import annotations

import tracemalloc
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.api.checkpoint_config import MEMORY_SNAPSHOT_DEFAULT
from cluster.api.memory import InitialState, StepMemory
from cluster.protocol.errors import ConfigError


def memory(tmp_path: Path, limit: int = MEMORY_SNAPSHOT_DEFAULT) -> tuple[StepMemory, list[str]]:
    said: list[str] = []
    config = CheckpointConfig(10, 3, memory_snapshot=limit)
    ckpt = CheckpointManager(tmp_path / "ckpt", "net", config, rank=2, recovery=True)
    return StepMemory(ckpt, said.append), said


def test_the_memory_is_a_copy_not_a_reference(tmp_path: Path) -> None:
    """A step may change the state before its collective fails: the boundary's state stays."""
    mem, _ = memory(tmp_path)
    weights = np.arange(1000, dtype=np.float64)
    transposed = np.arange(12.0).reshape(3, 4).T
    state = {"w": weights, "t": transposed, "lists": [1, [2]], "n": np.float32(1.5)}
    mem.keep(7, state, saved=False)
    weights[:] = -1
    transposed[:] = 0
    state["lists"][1].append(3)
    back = mem.state()
    assert mem.step == 7
    assert np.array_equal(back["w"], np.arange(1000, dtype=np.float64))
    assert np.array_equal(back["t"], np.arange(12.0).reshape(3, 4).T)
    assert back["lists"] == [1, [2]]
    assert back["n"] == np.float32(1.5)
    assert isinstance(back["n"], np.float32)
    # What comes back is a copy too: putting it back and training on cannot change the memory.
    back["w"][:] = 5
    assert np.array_equal(mem.state()["w"], np.arange(1000, dtype=np.float64))


def test_torch_state_dicts_come_back_as_they_were(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    mem, _ = memory(tmp_path)
    net = torch.nn.Linear(4, 3).double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    optimizer.step()
    state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
    mem.keep(3, state, saved=False)
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        net.weight.add_(1.0)
    back = mem.state()
    assert isinstance(back["model"], OrderedDict)
    assert all(torch.equal(back["model"][k], v) for k, v in expected.items())
    net.load_state_dict(back["model"])
    optimizer.load_state_dict(back["optimizer"])
    assert torch.equal(net.weight, expected["weight"])


def test_a_state_over_the_limit_is_not_kept_and_that_is_said_once(tmp_path: Path) -> None:
    mem, said = memory(tmp_path, limit=1000)
    small = {"w": np.zeros(100)}  # 800 bytes
    mem.keep(1, small, saved=False)
    assert mem.step == 1
    big = {"w": np.zeros(200)}  # 1600 bytes
    mem.keep(2, big, saved=False)
    mem.keep(3, big, saved=False)
    assert mem.step is None  # nothing held: not the older step either
    assert len(said) == 1
    assert "larger than CheckpointConfig(memory_snapshot=1000)" in said[0]
    assert "rolls back to the newest checkpoint on disk" in said[0]


def test_zero_turns_it_off_without_a_word(tmp_path: Path) -> None:
    mem, said = memory(tmp_path, limit=0)
    mem.keep(1, {"w": np.zeros(10)}, saved=False)
    assert (mem.step, said) == (None, [])


def test_without_recovery_nothing_is_kept(tmp_path: Path) -> None:
    """A failure ends a job without recovery: the copy would never be used, so it is not made."""
    ckpt = CheckpointManager(tmp_path / "ckpt", "net", CheckpointConfig(10, 3), recovery=False)
    mem = StepMemory(ckpt, print)
    mem.keep(1, {"w": np.zeros(10)}, saved=False)
    assert (mem.limit, mem.step) == (0, None)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1G", None])
def test_a_bad_limit_is_a_config_error_that_names_it(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"memory_snapshot=.* must be a number of bytes >= 0"):
        CheckpointConfig(memory_snapshot=bad)


def test_steady_state_keeps_reuse_one_buffer_and_allocate_nothing(tmp_path: Path) -> None:
    mem, _ = memory(tmp_path)
    state = {"w": np.ones(4_000_000, dtype=np.float32), "step": 0}
    mem.keep(1, state, saved=False)
    first = mem._held
    tracemalloc.start()
    try:
        for step in range(2, 7):
            state["step"] = step
            state["w"] += 1
            mem.keep(step, state, saved=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak} bytes allocated by keeps of a 16 MB state"
    assert mem._held is first  # the same snapshot, refilled
    back = mem.state()
    assert (back["step"], back["w"][0]) == (6, 6.0)


def test_a_saved_step_shares_the_managers_copy(tmp_path: Path) -> None:
    """A step that is also saved is copied once: the loop holds the manager's snapshot."""
    mem, _ = memory(tmp_path)
    ckpt = mem._checkpoints
    state = {"w": np.arange(1000.0)}
    ckpt.save(10, state)
    mem.keep(10, state, saved=True)
    with ckpt.latest_snapshot() as latest:
        assert latest is mem._held
    assert mem._pool._snapshots == []  # the loop's own buffer was never made
    state["w"][:] = 0
    assert np.array_equal(mem.state()["w"], np.arange(1000.0))
    # Saves go on while the loop holds one of the manager's two snapshots.
    for step in range(11, 16):
        ckpt.save(step, state)
        mem.keep(step, state, saved=True)
    ckpt.flush()
    assert mem.step == 15
    assert ckpt.steps() == [13, 14, 15]


def test_the_checkpoint_server_serves_what_is_held_and_nothing_else(tmp_path: Path) -> None:
    mem, _ = memory(tmp_path, limit=10_000)
    served = mem._checkpoints.served
    mem.keep(0, {"w": np.zeros(10)}, saved=False)
    assert (mem.step, served.memory_step()) == (0, None)  # step 0: every worker has it
    mem.keep(1, {"w": np.zeros(10)}, saved=False)
    assert served.memory_step() == 1
    source = served.open(2, 1, any_rank=False)
    assert source is not None
    sent = b"".join(source.pieces())
    source.close()
    assert mem._held is not None
    assert sent == b"".join(bytes(c) for c in mem._held.chunks())
    mem.keep(2, {"w": np.ones(10)}, saved=False)
    assert served.memory_step() == 2
    mem.keep(3, {"w": np.zeros(10_000)}, saved=False)  # over the limit: nothing served
    assert (mem.step, served.memory_step()) == (None, None)
    mem.keep(4, {"w": np.zeros(10)}, saved=False)
    mem.close()
    assert (mem.step, served.memory_step()) == (None, None)


def test_what_is_held_is_a_checkpoint_file_of_this_rank(tmp_path: Path) -> None:
    """The bytes a peer gets from memory are the file this rank would have written."""
    mem, _ = memory(tmp_path)
    ckpt = mem._checkpoints
    state = {"w": np.arange(100.0), "text": "seven"}
    mem.keep(7, state, saved=False)
    ckpt.save(7, state)
    ckpt.flush()
    assert mem._held is not None
    assert b"".join(bytes(c) for c in mem._held.chunks()) == ckpt.path(7).read_bytes()


def test_no_initial_state_is_kept_without_recovery(tmp_path: Path) -> None:
    """Without recovery no rollback comes: the state as constructed is not copied, so a state
    the first steps make checkpointable (a lazy module's, materialised by its first forward)
    is not refused when the loop is constructed."""
    config = CheckpointConfig(10, 3)
    ckpt = CheckpointManager(tmp_path / "ckpt", "net", config, rank=0, recovery=False)
    initial = InitialState(ckpt, {"not_yet": {1, 2}})  # a set: no checkpoint holds it
    assert initial.snapshot is None
    assert initial.state() is None
