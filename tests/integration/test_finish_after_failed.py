"""A worker the scheduler failed (stopped past MS_NODE_TIMEOUT, recovery on) that calls
finalize() as soon as it runs again. Its Finish reached the scheduler before it registered
again, was answered as heard though the scheduler held the member failed, and the worker
exited 0 as finished: the job, waiting for that rank to rejoin, failed MS_TOPO_TIMEOUT later
though every worker had finished. The Finish is refused for now (the node registers again,
then finishes), and the job finishes. Real processes, a real SIGSTOP.

Without recovery, a worker cut off as the job failed (its connection broke) that finalized
before it heard so had its Finish answered as heard by the scheduler still serving the failed
job, or given up unheard with its stream down, and exited 0 as finished: it exits 1."""

from __future__ import annotations

import signal
from pathlib import Path

from cluster.testing import Process, free_port
from tests.procs import ROOT, Procs, job_env
from tests.proxy import Proxy

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "finalize_on_cue.py")
BOUND_S = 60.0


def start_cued(
    processes: Procs, tmp_path: Path, base: dict[str, str], w1_port: int | None = None
) -> tuple[Process, list[Process]]:
    """The scheduler and workers '0' and '1' of `SCRIPT`, each worker ready: worker i
    finalizes once the file go<i> in `tmp_path` is there. `w1_port`: where worker '1' reaches
    the scheduler (a proxy's port)."""
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, str(tmp_path / "-")], base)
    ports = {1: str(w1_port or base["MS_SCHED_PORT"])}
    workers = [
        processes.start_role(
            f"w{i}",
            "MS_WORKER",
            [SCRIPT, str(tmp_path / f"go{i}")],
            {**base, "MS_NODE_ID": str(i), "MS_SCHED_PORT": ports.get(i, base["MS_SCHED_PORT"])},
        )
        for i in (0, 1)
    ]
    for worker in workers:
        worker.wait_for_output("ready", BOUND_S)
    return sched, workers


def test_a_failed_workers_finish_waits_for_it_to_rejoin(processes: Procs, tmp_path: Path) -> None:
    recovery = tmp_path / "recovery"
    base = job_env(
        2,
        free_port(),
        MS_NODE_TIMEOUT="3",
        MS_TOPO_TIMEOUT="30",
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(recovery),
    )
    sched, workers = start_cued(processes, tmp_path, base)
    workers[1].signal(signal.SIGSTOP)
    (tmp_path / "go1").touch()  # it finalizes as soon as it runs again
    sched.wait_for_output("node '1' (rank 1) failed: no heartbeat", BOUND_S)
    workers[1].signal(signal.SIGCONT)
    assert workers[1].wait(BOUND_S) == 0, workers[1].output
    assert "finalized" in workers[1].output
    # It rejoined before its Finish counted (how the worker words its way back depends on
    # whether it saw its stream end before its Finish was refused: the scheduler says it).
    sched.wait_for_output("node '1' rejoined: generation 2", BOUND_S)
    (tmp_path / "go0").touch()
    assert workers[0].wait(BOUND_S) == 0, workers[0].output
    assert sched.wait(BOUND_S) == 0, sched.output
    assert "job finished: all 2 nodes finished" in sched.output


def test_without_recovery_a_worker_cut_off_as_the_job_fails_does_not_exit_as_finished(
    processes: Procs, tmp_path: Path
) -> None:
    """Worker '1' reaches the scheduler through a proxy; stopped, its connection cut, it fails
    the job (no recovery); it finalizes as soon as it runs again, before it hears so. Whether
    its Finish reaches the scheduler serving the failed job for its drain (refused with the
    failure) or nothing (held while it registers again, which is refused), it exits 1 with one
    line, never 0 as finished."""
    port = free_port()
    proxy = Proxy(("127.0.0.1", port))
    try:
        base = job_env(2, port, MS_NODE_TIMEOUT="3", MS_TOPO_TIMEOUT="30")
        sched, workers = start_cued(processes, tmp_path, base, w1_port=proxy.port)
        workers[1].signal(signal.SIGSTOP)
        (tmp_path / "go1").touch()  # it finalizes as soon as it runs again
        proxy.cut()
        sched.wait_for_output("job failed: rank 1", BOUND_S)
        workers[1].signal(signal.SIGCONT)
        assert workers[1].wait(BOUND_S) == 1, workers[1].output
        assert "finalized" not in workers[1].output
        assert workers[1].output.splitlines()[-1].startswith("cluster: "), workers[1].output
        assert "Traceback" not in workers[1].output
        assert workers[0].wait(BOUND_S) == 1, workers[0].output
        assert sched.wait(BOUND_S) == 1, sched.output
    finally:
        proxy.close()
