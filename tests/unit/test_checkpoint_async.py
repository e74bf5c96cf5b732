"""The background writer of cluster.checkpoint: copies, back-pressure, buffer reuse, errors,
the in-memory snapshot, the exit of the process, and files of the previous format."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError, ClusterError, SchedulerUnreachableError
from cluster.storage import checkpoint_files
from cluster.testing import wait_until

ROOT = Path(__file__).resolve().parents[2]


def manager(tmp_path: Path, **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("recovery", False)
    kwargs.setdefault("rank", 0)
    return CheckpointManager(tmp_path / "ckpt", "net", CheckpointConfig(1, 3), **kwargs)


def test_the_caller_may_change_its_state_as_soon_as_save_returns(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    ckpt = manager(tmp_path)
    weights = np.arange(100_000, dtype=np.float64)
    tensor = torch.arange(50_000, dtype=torch.float32)
    transposed = np.arange(12.0).reshape(3, 4).T
    state = {"w": weights, "t": tensor, "tt": transposed, "lists": [1, [2]]}
    ckpt.save(1, state)
    weights[:] = -1
    tensor.zero_()
    transposed[:] = 0
    state["lists"][1].append(3)
    loaded = ckpt.load(1)
    assert np.array_equal(loaded["w"], np.arange(100_000, dtype=np.float64))
    assert torch.equal(loaded["t"], torch.arange(50_000, dtype=torch.float32))
    assert np.array_equal(loaded["tt"], np.arange(12.0).reshape(3, 4).T)
    assert loaded["lists"] == [1, [2]]


def test_a_third_save_waits_for_the_writer_and_the_wait_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One save being written and one copied: the next save waits until the first is on disk."""
    disk = threading.Event()
    writing: list[int] = []
    original = checkpoint_files.write

    def slow_write(path: Path, step: int, parts: Any) -> None:
        writing.append(step)
        assert disk.wait(30), "the test never let the disk go on"
        original(path, step, parts)

    monkeypatch.setattr(checkpoint_files, "write", slow_write)
    ckpt = manager(tmp_path)
    ckpt.save(1, {"step": 1})
    wait_until(lambda: writing == [1], 10, "the writer to start on step 1", poll_s=0.001)
    ckpt.save(2, {"step": 2})  # copied: the second snapshot
    assert ckpt.stats.waits == 0
    third = threading.Thread(target=ckpt.save, args=(3, {"step": 3}))
    third.start()
    wait_until(lambda: ckpt.stats.waits == 1, 10, "the third save to wait", poll_s=0.001)
    assert third.is_alive()
    disk.set()
    third.join(30)
    ckpt.flush()
    stats = ckpt.stats
    assert (stats.saves, stats.waits, stats.persisted) == (3, 1, 3)
    assert 0 < stats.wait_s <= stats.pause_s
    assert ckpt.steps() == [1, 2, 3]


def test_steady_state_saves_allocate_nothing(tmp_path: Path) -> None:
    """After the first two saves (one snapshot each), saves of the same layout reuse them."""
    ckpt = manager(tmp_path)
    state = {"w": np.ones(4_000_000, dtype=np.float32), "b": np.zeros(1000), "step": 0}
    for step in (1, 2):
        ckpt.save(step, state)
    ckpt.flush()
    tracemalloc.start()
    try:
        for step in range(3, 8):
            state["step"] = step
            ckpt.save(step, state)
            ckpt.flush()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak} bytes allocated by saves of a 16 MB state"
    assert ckpt.load(7)["step"] == 7


def test_the_snapshot_in_memory_is_the_file(tmp_path: Path) -> None:
    """What #15 sends a peer: the bytes of the newest checkpoint, without reading the disk."""
    ckpt = manager(tmp_path)
    with ckpt.latest_snapshot() as none:
        assert none is None
    ckpt.save(4, {"w": np.arange(1000, dtype=np.float32), "text": "four"})
    ckpt.flush()
    with ckpt.latest_snapshot() as snapshot:
        assert snapshot is not None
        assert (snapshot.step, snapshot.persisted) == (4, True)
        data = b"".join(bytes(chunk) for chunk in snapshot.chunks())
        assert data == ckpt.path(4).read_bytes()
        assert len(data) == snapshot.nbytes
        assert data.endswith(snapshot.checksum())
        # A copy sent elsewhere is written and verified like any checkpoint file.
        copy = tmp_path / "peer" / "net-00000004.ckpt"
        copy.parent.mkdir()
        checkpoint_files.write(copy, 4, snapshot.chunks())
        assert checkpoint_files.read(copy, 4)["text"] == "four"


def test_a_report_that_fails_is_raised_by_the_next_flush(tmp_path: Path) -> None:
    def unreachable(steps: list[int]) -> None:
        raise SchedulerUnreachableError("the scheduler at 127.0.0.1:1 did not answer")

    ckpt = manager(tmp_path, report=unreachable)
    ckpt.save(1, {"a": 1})
    with pytest.raises(CheckpointError, match=r"step 1 is saved \(.*net-00000001.ckpt\), but"):
        ckpt.flush()
    assert ckpt.steps() == [1]
    ckpt.flush()  # raised once


def test_the_writer_goes_on_while_a_report_is_under_way_and_the_newest_list_follows_it(
    tmp_path: Path,
) -> None:
    """A scheduler takes a rank's changing reports at most once per 0.1 s: the writer does not
    wait for one (so neither does the loop, `stats.waits`), and while one is under way each
    write's list of the steps held replaces the last: only the newest is reported next.
    `flush` waits for that report's answer."""
    answer = threading.Event()
    reports: list[list[int]] = []

    def report(steps: list[int]) -> int:
        reports.append(steps)
        assert answer.wait(30), "the test never let the scheduler answer"
        return 0

    ckpt = manager(tmp_path, report=report)
    try:
        for step in range(1, 11):
            ckpt.save(step, {"step": step})
            wait_until(
                lambda step=step: ckpt.stats.persisted == step,  # type: ignore[misc]
                10,
                f"the writer to write step {step} (not waiting for the report of step 1)",
                poll_s=0.001,
            )
            if step == 1:
                wait_until(lambda: reports == [[1]], 10, "the report of step 1", poll_s=0.001)
        assert reports == [[1]]
        assert ckpt.stats.waits == 0
    finally:
        answer.set()
    ckpt.flush()
    assert reports == [[1], [8, 9, 10]]
    assert ckpt.steps() == [8, 9, 10]


def test_a_report_that_fails_is_raised_by_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As a write's error: logged when it happens, then raised by the save after it, naming
    the step and its file; once."""
    refused: list[list[int]] = []

    def report(steps: list[int]) -> int:
        if not refused:
            refused.append(steps)
            raise ClusterError("checkpoint report refused by the scheduler: for a test")
        return 0

    ckpt = manager(tmp_path, report=report)
    ckpt.save(1, {"a": 1})
    wait_until(lambda: "could not be reported" in caplog.text, 10, "the refusal", poll_s=0.001)
    saved = r"step 1 is saved \(.*net-00000001.ckpt\), but .* refused by the scheduler"
    with pytest.raises(CheckpointError, match=saved):
        ckpt.save(2, {"a": 2})
    ckpt.save(2, {"a": 2})
    ckpt.flush()
    assert ckpt.steps() == [1, 2]


def test_close_ends_the_writer_thread(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    ckpt = manager(tmp_path)
    ckpt.save(1, {"a": 1})
    assert len(set(threading.enumerate()) - before) == 1  # the writer
    ckpt.close()
    assert not set(threading.enumerate()) - before
    ckpt.save(2, {"a": 2})  # a later save starts another
    ckpt.close()
    assert ckpt.steps() == [1, 2]


def test_a_program_that_exits_right_after_save_still_writes_it(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np\n"
        "from cluster.api.checkpoint import CheckpointConfig, CheckpointManager\n"
        "m = CheckpointManager(sys.argv[1], 'p', CheckpointConfig(), rank=0, recovery=False)\n"
        "m.save(1, {'w': np.ones(5_000_000)})\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60, cwd=ROOT)
    ckpt = CheckpointManager(tmp_path, "p", CheckpointConfig(), rank=0, recovery=False)
    assert np.array_equal(ckpt.load(1)["w"], np.ones(5_000_000))


def as_version_1(data: bytes) -> bytes:
    """A version 2 file rewritten as version 1 wrote it: a SHA-256 footer."""
    magic, _version, flags, header_length, _size = checkpoint_files.PREAMBLE.unpack_from(data)
    body = data[: -checkpoint_files.FOOTER_SIZE]
    size = len(body) + len(checkpoint_files.END_MAGIC) + 32
    preamble = struct.pack("<8sIIQQ", magic, 1, flags, header_length, size)
    body = preamble + body[len(preamble) :]
    return body + checkpoint_files.END_MAGIC + hashlib.sha256(body).digest()


def test_files_of_version_1_still_load_and_are_verified(tmp_path: Path) -> None:
    """A job upgraded mid-run keeps its checkpoints: version 1 (SHA-256) files load."""
    ckpt = manager(tmp_path)
    ckpt.save(1, {"w": np.arange(5000, dtype=np.float32), "step": 1})
    ckpt.flush()
    old = as_version_1(ckpt.path(1).read_bytes())
    ckpt.path(1).write_bytes(old)
    assert ckpt.steps() == [1]
    assert ckpt.load(1)["step"] == 1
    damaged = bytearray(old)
    damaged[len(old) // 2] ^= 1
    ckpt.path(1).write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        ckpt.load(1)
