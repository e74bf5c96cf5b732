"""A job that rolls back by hand, without TrainingLoop: real scheduler and workers, recovery on,
a worker SIGKILLed and started again. The scheduler counts such a worker as having put the
rollback step back once it discards the steps past it, and not before."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from cluster.testing import Process, free_port
from tests.procs import ROOT, Procs, job_env

pytest.importorskip("numpy")

SCRIPT = [str(ROOT / "tests" / "integration" / "scripts" / "put_back_by_hand.py")]
WAIT_S = 60.0


def test_a_worker_that_rolls_back_by_hand_is_counted_once_it_discards(
    processes: Procs, tmp_path: Path
) -> None:
    """Generation 2 rolls back to step 20. Rank 0, which survived, lists the abandoned run's
    step 30 once it has heard generation 2 (its write landing late): that list is not its
    put-back yet, so the step every rank keeps stays at 20 although rank 1 holds the new
    run's step 30 (before: it said generation 2, and the answer was the abandoned 30). Then
    each rank rolls back by hand, `discard_newer(cluster.get_rollback_step())`, which puts the
    generation back, and saves step 30 of the new run: rank 1 is killed again, and generation
    3 rolls back to 30, which it could not were either rank not counted as put back."""
    port = free_port()
    env = job_env(
        2,
        port,
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        MS_NODE_TIMEOUT="2",
    )
    args = [*SCRIPT, str(tmp_path / "ckpt")]

    def worker(rank: int, name: str) -> Process:
        return processes.start_role(name, "MS_WORKER", args, {**env, "MS_NODE_ID": str(rank)})

    scheduler = processes.start_role("scheduler", "MS_SCHED", args, env)
    rank0, rank1 = worker(0, "worker0"), worker(1, "worker1")
    for proc in (rank0, rank1):
        proc.wait_for_output("saved rank=", WAIT_S)
    rank1.popen.send_signal(signal.SIGKILL)
    rank1.wait(10)
    rank1 = worker(1, "worker1-again")
    rank0.wait_for_output("saved 30 in generation 2", WAIT_S)
    late = re.search(r"late step=30 held_by_all=(\d+)", rank0.output)
    assert late is not None, rank0.output
    assert int(late.group(1)) == 20, rank0.output
    assert "put back step=20" in rank0.output
    rank1.popen.send_signal(signal.SIGKILL)
    rank1.wait(10)
    rank1 = worker(1, "worker1-third")
    for proc in (rank0, rank1):
        assert proc.wait(WAIT_S) == 0, proc.output
    assert "generation 3 rollback=30 rank=0" in rank0.output
    assert "generation 3 rollback=30 rank=1" in rank1.output
    assert scheduler.wait(WAIT_S) == 0, scheduler.output
