"""A CheckpointManager made before `cluster.init()`, with real worker processes: each worker's
checkpoints go to its own rank's directory, written as its rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.storage import checkpoint_files
from cluster.testing import free_port
from tests.procs import PYTHON, ROOT, Procs, job_env

pytest.importorskip("numpy")

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "sharded_state.py"
STEPS = 8


def test_a_manager_made_before_init_writes_its_own_ranks_directory(
    processes: Procs, tmp_path: Path
) -> None:
    """Two workers of sharded_state.py (rank r adds r + 1 each step, states differ per rank)
    make their managers before cluster.init(), on one checkpoint directory: rank 1's files are
    under rank_1/ and hold rank 1's state, rank 0's under rank_0/ hold rank 0's."""
    env = job_env(
        2, free_port(), MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(tmp_path / "recovery")
    )
    shared = tmp_path / "checkpoints"
    args = [str(SCRIPT), str(shared), "--early", "--steps", str(STEPS), "--step-delay", "0"]
    processes.start("sched", [PYTHON, "-m", "cluster", "scheduler"], {**env, "MS_ROLE": "MS_SCHED"})
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", args, {**env, "MS_NODE_ID": str(i)})
        for i in range(2)
    ]
    for worker in workers:
        assert worker.wait(60) == 0, worker.output
    for rank in (0, 1):
        assert f"rank {rank} final shard {STEPS * (rank + 1)}.0" in "".join(
            w.output for w in workers
        )
        path = checkpoint_files.rank_directory(shared, rank) / checkpoint_files.file_name(
            "shard", STEPS
        )
        state = checkpoint_files.read(path, STEPS, rank=rank)
        assert state["shard"][0] == STEPS * (rank + 1)
