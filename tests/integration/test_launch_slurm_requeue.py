"""A Slurm step of two nodes, requeued: two launchers on this host, each with the variables srun
gives a task of the step (no Slurm daemons), killed whole and started again as the requeued job
starts them (same job and step ids, SLURM_RESTART_COUNT=1)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from cluster.testing import free_port, wait_until
from cluster.tools.processes import alive, launched_pids
from tests.procs import MSCLUSTER, Procs, private_copy, processes_running

JOB_ID = "4242"


def step_env(rank: int, restarts: int) -> dict[str, str]:
    """Node `rank`'s environment in run `restarts` of step 4242.0 (nodes localhost and
    127.0.0.2: both this host), with no job secret given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CLUSTER_JOB_"))}
    return {
        **env,
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost,127.0.0.2",
        "SLURM_NODEID": str(rank),
        "SLURMD_NODENAME": f"n{rank}",
        "SLURM_RESTART_COUNT": str(restarts),
    }


def test_a_requeued_step_with_recovery_resumes_under_its_secret(
    processes: Procs, tmp_path: Path
) -> None:
    """Node 0 made a fresh secret for the requeued run and every node took it: the scheduler
    refused its own saved state as another job's and exited 2, and node 1 waited for it. Node 0
    now publishes the secret its log directory holds, and the step resumes."""
    script, port = private_copy(tmp_path), free_port()
    logs = [tmp_path / "logs" / f"{JOB_ID}.0" / f"node{rank}" for rank in (0, 1)]
    args = [*MSCLUSTER, "run", "--master-port", str(port), "--enable-recovery"]
    args += ["--node-timeout", "2", "--cluster-time-out", "30", str(script)]
    first = [
        processes.start(f"node{rank}-r0", [*args, "--hold", "60"], step_env(rank, 0), tmp_path)
        for rank in (0, 1)
    ]
    first[0].wait_for_output("2/2 registered (ready)", 30)
    secret = (logs[0] / "job.secret").read_bytes()
    everyone = [pid for log in logs for pid in launched_pids(log).values()]
    for pid in everyone:
        os.kill(pid, signal.SIGKILL)
    for run in first:
        run.wait(10)
    wait_until(lambda: not any(alive(pid) for pid in everyone), 10, "the step to be gone")

    again = [
        processes.start(f"node{rank}-r1", args, step_env(rank, 1), tmp_path) for rank in (0, 1)
    ]
    for run in again:
        assert run.wait(60) == 0, run.output
    assert [(log / "job.secret").read_bytes() for log in logs] == [secret, secret]
    assert "resuming job" in (logs[0] / "scheduler.log").read_text()
    assert list((tmp_path / ".mscluster").iterdir()) == []
    assert not processes_running(str(script))
