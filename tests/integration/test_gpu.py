"""On a GPU: snapshots of CUDA tensors (pinned, complete when save returns, put back on their
device) and examples/train_torch.py over NCCL. Skipped, saying why, where torch sees no CUDA
device (CI has none: a plain skip, not `tests.servers.require`, so CLUSTER_REQUIRE_SERVERS=1
does not fail it). `benchmarks/gpu_check.sh` runs these with the rest of the GPU check.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from cluster import CheckpointConfig, CheckpointManager
from cluster.api.memory import InitialState
from cluster.storage.checkpoint_tree import encode
from cluster.storage.host_buffers import HostBuffers, default_buffers
from cluster.storage.snapshot import Snapshot
from cluster.testing import free_port
from tests.procs import PYTHON, ROOT, Procs

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"no CUDA device (torch {torch.__version__}): run benchmarks/gpu_check.sh on a GPU",
)

NOT_DESTROYED = "destroy_process_group() was not called"


def cuda_state() -> dict[str, object]:
    return {
        "w": torch.arange(1 << 20, dtype=torch.float32, device="cuda"),
        "t": torch.rand(64, 32, device="cuda").t(),  # not contiguous
        "host": torch.ones(8),
        "step": 3,
    }


def test_pinned_buffers_are_pinned_and_reused() -> None:
    buffers = HostBuffers(1 << 30)
    first = buffers.acquire(1 << 20, pinned=True)
    assert first.pinned
    assert first.owner.is_pinned()
    buffers.release(first)
    assert buffers.acquire(1000, pinned=True) is first
    assert buffers.allocations == 1


def test_a_save_is_complete_when_it_returns(tmp_path: Path) -> None:
    state = cuda_state()
    expected = {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with CheckpointManager(tmp_path, "g", CheckpointConfig(), rank=0, recovery=False) as manager:
        manager.save(1, state)
        state["w"].add_(1)  # the next step changes the tensors at once
        state["t"].mul_(0)
        with manager.latest_snapshot() as snapshot:
            assert snapshot is not None
            assert snapshot._host is not None
            assert snapshot._host.pinned
        loaded = manager.load(1)
    for key in ("w", "t", "host"):
        assert loaded[key].equal(expected[key]), key
    assert loaded["step"] == 3


def test_a_snapshot_puts_tensors_back_on_their_device() -> None:
    state = cuda_state()
    snapshot = Snapshot(HostBuffers(1 << 30))
    snapshot.fill(1, 0, "g", encode(state))
    back = snapshot.state()
    assert back["w"].device == state["w"].device
    assert back["w"].equal(state["w"])
    assert back["t"].equal(state["t"])
    assert back["host"].device.type == "cpu"
    snapshot.free()


def test_the_loops_state_of_step_0_is_kept_on_the_host_and_not_pinned(tmp_path: Path) -> None:
    """A TrainingLoop's copy of the state of step 0 (`InitialState`) takes no GPU memory and no
    pinned memory, and puts each tensor back on its device."""
    state = cuda_state()
    with CheckpointManager(tmp_path, "g", CheckpointConfig(), rank=0, recovery=False) as manager:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        pinned = default_buffers().pinned_bytes
        initial = InitialState(manager, state)
        assert torch.cuda.memory_allocated() == before
        assert default_buffers().pinned_bytes == pinned
        back = initial.state()
        assert back is not None
        assert back["w"].device == state["w"].device
        assert back["w"].equal(state["w"])
        assert back["t"].equal(state["t"])
        initial.let_go(1)
        assert initial.state() is None


def test_train_torch_over_nccl_exits_clean(processes: Procs, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run = processes.start(
        "run",
        [
            *(PYTHON, "-m", "cluster", "run", "--worker-num", "1"),
            *("--master-port", str(free_port()), "--log-dir", str(logs)),
            str(ROOT / "examples" / "train_torch.py"),
            *("--device", "cuda", "--backend", "nccl", "--steps", "40", "--save-every", "5"),
            *("--out", str(tmp_path / "out")),
        ],
        os.environ,
    )
    assert run.wait(300) == 0, run.output
    worker = (logs / "worker_0.log").read_text()
    assert "final parameters:" in worker, worker
    assert NOT_DESTROYED not in worker, worker


def run_script(processes: Procs, tmp_path: Path, script: str, workers: int) -> tuple[int, str]:
    run = processes.start(
        "run",
        [
            *(PYTHON, "-m", "cluster", "run", "--worker-num", str(workers)),
            *("--master-port", str(free_port()), "--log-dir", str(tmp_path / "logs")),
            str(ROOT / "tests" / "integration" / "scripts" / script),
        ],
        os.environ,
    )
    return run.wait(300), run.output


def test_finalize_destroys_the_nccl_group(processes: Procs, tmp_path: Path) -> None:
    code, output = run_script(processes, tmp_path, "nccl_one_gpu.py", 1)
    assert code == 0, output
    worker = (tmp_path / "logs" / "worker_0.log").read_text()
    assert "rank 0 sum 1.0" in worker, worker
    assert "after finalize, a group left: False" in worker, worker
    assert NOT_DESTROYED not in worker, worker


def test_an_nccl_error_is_named_with_its_first_line(processes: Procs, tmp_path: Path) -> None:
    """Two ranks on one GPU: NCCL refuses them. The launcher names the worker that died and the
    first line of its error, not a broken connection to the scheduler."""
    code, output = run_script(processes, tmp_path, "nccl_one_gpu.py", 2)
    assert code == 1, output
    named = [line for line in output.splitlines() if line.startswith("mscluster: worker ")]
    assert named, output
    assert "exited with code" in named[0] or "had not exited" in named[0], output
    assert "NCCL" in named[0].upper(), output
    # The worker told the scheduler the error it died of, before its connection broke.
    scheduler = (tmp_path / "logs" / "scheduler.log").read_text()
    assert "failed: its process died of an error: torch.distributed.DistBackendError: NCCL" in (
        scheduler
    ), scheduler


def test_an_nccl_group_aborted_beside_a_blocked_main_thread_lets_it_go(
    processes: Procs, tmp_path: Path
) -> None:
    """The agent aborts an NCCL group from a thread of its own when it hears that the group's
    generation is over, while the main thread may be blocked in a CUDA sync (`.item()`) behind
    a collective (see tests/integration/scripts/nccl_abort_blocked.py: one GPU holds no
    collective that never completes, so a long kernel stands in for it). The abort returns, the
    main thread comes back within a bound, the group's next collective fails instead of
    waiting, and the loop's release leaves no group."""
    code, output = run_script(processes, tmp_path, "nccl_abort_blocked.py", 1)
    worker = (tmp_path / "logs" / "worker_0.log").read_text()
    assert code == 0, output + worker
    came_back = re.search(r"main thread: \.item\(\) .* after (\d+\.\d) s", worker)
    assert came_back is not None, worker
    assert float(came_back[1]) < 60, worker
    assert re.search(r"abort returned after \d+\.\d s", worker), worker
    assert "abort done: True" in worker, worker
    assert "next all_reduce raised" in worker, worker
    assert "after release, a group left: False" in worker, worker
    assert NOT_DESTROYED not in worker, worker
