"""`mscluster run` with a standby scheduler on a real etcd: the launcher asks the leader."""

from __future__ import annotations

import os
import secrets
import signal
from pathlib import Path

from cluster.testing import free_port, wait_until
from tests.procs import (
    MSCLUSTER,
    PYTHON,
    Procs,
    job_env,
    launched,
    mscluster,
    private_copy,
    reader_env,
    run_args,
)
from tests.servers.etcd import EtcdCluster

LEASE = "2"
NODE_TIMEOUT = "8"


def test_a_worker_failing_after_our_scheduler_handed_over_is_taken_back_by_the_leader(
    processes: Procs, etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    """The operator SIGTERMs the launcher's scheduler (h1): it hands the job to the standby
    (h2) and exits 0. A local worker killed afterwards is started again, as the leader takes
    it back, and the job finishes."""
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    port, url, logs = free_port(), etcd_cluster.state_url(), tmp_path / "logs"
    script = private_copy(tmp_path)
    options = ["--master-addr", "127.0.0.1,127.0.0.2", "--max-restarts", "1"]
    # The leader that takes the job over holds the killed worker's id for MS_NODE_TIMEOUT (it has
    # not heard the old process since it restored the job): short here, as is the hold after.
    options += ["--state-url", url, "--lease", LEASE, "--node-timeout", NODE_TIMEOUT]
    args = run_args(*options, script, "--hold", "12", worker_num=2, master_port=port, log_dir=logs)
    run = processes.start("run", args, {**os.environ, "CLUSTER_JOB_SECRET_FILE": str(secret)})
    run.wait_for_output("2/2 registered", 30)
    processes.start(
        "standby",
        [
            *(PYTHON, "-m", "cluster", "scheduler", "--host", "127.0.0.2", "--port", str(port)),
            *("--worker-num", "2", "--state-url", url, "--lease", LEASE),
        ],
        job_env(
            2,
            port,
            MS_SCHED_HOST="127.0.0.1,127.0.0.2",
            MS_NODE_TIMEOUT=NODE_TIMEOUT,
            CLUSTER_JOB_SECRET_FILE=str(secret),
        ),
    )
    first, second = f"127.0.0.1:{port}", f"127.0.0.2:{port}"

    def status_says(text: str) -> bool:
        answer = mscluster("status", "--addr", f"{first},{second}", secret_file=secret)
        return text in answer.stdout

    wait_until(lambda: status_says(f"standbys: {second}"), 30, "the standby known to the leader")
    # Given both schedulers, a follow of the events moves to the standby once it leads.
    followed = processes.start(
        "events",
        [*MSCLUSTER, "events", "--addr", f"{first},{second}", "--follow"],
        reader_env(secret),
    )
    wait_until(lambda: "formed" in followed.output, 30, "the followed events up to formed")
    os.kill(launched(logs, "scheduler"), signal.SIGTERM)
    wait_until(lambda: status_says(f"leader {second}"), 30, "the standby leading")
    os.kill(launched(logs, "worker_1"), signal.SIGKILL)
    run.wait_for_output("restart 1 of 1", 20)
    assert run.wait(90) == 0, run.output
    assert "not restarting" not in run.output
    assert followed.wait(30) == 0, followed.output  # the job finished
    assert f"following the leader at {second}" in followed.output
    assert " finished " in followed.output.splitlines()[-1] + " "
