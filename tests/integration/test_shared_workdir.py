"""Two hosts of one job that share a working directory (a shared home on NFS), as two launchers
on one machine (`--node-rank 0` and `1`) started in one directory without `--log-dir`: each
keeps its part in `logs/node<R>/` (its own lock, job secret, pids and logs), so neither is
refused the directory nor writes over the other's, and the job runs to its end."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from cluster.testing import free_port, processes_running
from cluster.tools.processes import launched_pids
from tests.procs import Procs, job_env, private_copy, run_args

LIMIT_S = 90


def test_two_hosts_started_in_one_directory_keep_their_logs_apart(
    processes: Procs, tmp_path: Path
) -> None:
    script = private_copy(tmp_path)
    secret = tmp_path / "job.secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    env = job_env(2, 0, CLUSTER_JOB_SECRET_FILE=str(secret))
    port = free_port()
    runs = [
        processes.start(
            f"host{rank}",
            run_args(
                *("--node-rank", str(rank), script),
                worker_num=2,
                local_worker_num=1,
                master_port=port,
            ),
            env,
            tmp_path,  # the hosts' shared working directory
        )
        for rank in (0, 1)
    ]
    for rank, run in enumerate(runs):
        assert run.wait(LIMIT_S) == 0, run.output
        assert f"logs in logs/node{rank}/" in run.output
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["node0", "node1"]
    for rank in (0, 1):
        here = logs / f"node{rank}"
        assert f"allgather rank={rank} size=2" in (here / f"worker_{rank}.log").read_text()
        assert json.loads((here / "launcher.lock").read_text())["port"] == port
        assert f"worker_{rank}" in launched_pids(here)
    assert (logs / "node0" / "scheduler.log").exists()  # node 0 starts the scheduler
    assert not (logs / "node1" / "scheduler.log").exists()
    assert not processes_running(str(script))
