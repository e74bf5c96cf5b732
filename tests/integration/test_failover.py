"""Issue #14's acceptance: a training job outlives its leading scheduler.

A real 3-member etcd, two `mscluster scheduler` processes on 127.0.0.1 and 127.0.0.2 (one port,
one --state-url), and 4 workers of examples/train_mlp.py that know both addresses
(MS_SCHED_HOST=127.0.0.1,127.0.0.2) with recovery on. The leader is SIGKILLed mid-run: the
standby leads within the lease and a second, the workers follow it, and the job ends with the
parameters of a run without faults. One etcd member killed under a running job goes unnoticed.
SIGTERM to the leader (a host stopped for maintenance) hands the job over: the standby leads at
once, well within the lease, and the stopped leader exits 0; SIGTERM to a standby changes nothing.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import grpc
import pytest

from cluster.testing import Process, free_port, wait_until
from cluster.tools.status import scheduler_role
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.procs import PYTHON, ROOT, Procs, job_env
from tests.servers.etcd import EtcdCluster
from tests.training_job import STEP_LINE, WORKERS, TrainingJob, steps_done, train_args

pytest.importorskip("numpy")

TRAIN = ROOT / "examples" / "train_mlp.py"
LEASE_S = 2
HOSTS = ("127.0.0.1", "127.0.0.2")


class HaJob:
    """Two schedulers on etcd and WORKERS workers of train_mlp.py that know both."""

    def __init__(
        self,
        processes: Procs,
        tmp: Path,
        etcd: EtcdCluster,
        lease_s: int = LEASE_S,
        scheduler_env: Mapping[str, str] | None = None,
    ) -> None:
        """`scheduler_env`: more variables for the schedulers (an etcd login)."""
        self.processes = processes
        self.lease_s = lease_s
        self.scheduler_env = dict(scheduler_env or {})
        self.port = free_port()
        self.url = etcd.state_url()
        self.out = tmp / "ha"
        self.schedulers = {host: self._scheduler(host) for host in HOSTS}
        self.first_leader = self.wait_leader()
        env = job_env(
            WORKERS,
            self.port,
            MS_SCHED_HOST=",".join(HOSTS),
            MS_ENABLE_RECOVERY="1",
            MS_RECOVERY_PATH=str(tmp / "ha-recovery"),
            MS_NODE_TIMEOUT="2",
        )
        # Slower steps than the fault-free run's (same steps, same result): the job still runs
        # when `mscluster status` asks the new leader.
        args = [str(TRAIN), *train_args(self.out), "--step-delay", "0.1"]
        self.workers = [
            processes.start_role(f"ha-w{i}", "MS_WORKER", args, {**env, "MS_NODE_ID": str(i)})
            for i in range(WORKERS)
        ]

    def _scheduler(self, host: str) -> Process:
        args = ["--host", host, "--port", str(self.port), "--worker-num", str(WORKERS)]
        args += ["--node-timeout", "2", "--state-url", self.url, "--lease", str(self.lease_s)]
        return self.processes.start(
            f"scheduler-{host}",
            [PYTHON, "-m", "cluster", "scheduler", *args],
            job_env(WORKERS, self.port, **self.scheduler_env),
        )

    def role(self, host: str) -> str:
        with grpc.insecure_channel(f"{host}:{self.port}") as channel:
            try:
                status = pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=1)
            except grpc.RpcError:
                return ""
        return scheduler_role(status.leadership)

    def wait_leader(self) -> str:
        found: list[str] = []

        def one_leads() -> bool:
            found[:] = [host for host in HOSTS if self.role(host) == "leader"]
            return len(found) == 1

        wait_until(one_leads, 30, "one scheduler leading")
        return found[0]

    def final_hash(self) -> str:
        for worker in self.workers:
            assert worker.wait(120) == 0, worker.output
        return (self.out / "final.sha256").read_text().strip()


@pytest.fixture
def fault_free_hash(processes: Procs, tmp_path: Path) -> str:
    job = TrainingJob(processes, tmp_path, "clean", TRAIN)
    return job.final_hash()


def test_the_leader_killed_mid_run_the_standby_leads_and_the_result_is_exact(
    processes: Procs, tmp_path: Path, etcd_cluster: EtcdCluster, fault_free_hash: str
) -> None:
    job = HaJob(processes, tmp_path, etcd_cluster)
    leader = job.first_leader
    standby = next(host for host in HOSTS if host != leader)
    addresses = ",".join(f"{host}:{job.port}" for host in HOSTS)
    watch = processes.start(
        "watch",
        [PYTHON, "-m", "cluster", "status", "--watch", "--addr", addresses, "--interval", "0.5"],
        job_env(WORKERS, job.port),
    )
    watch.wait_for_output("rank  node id", 30)  # the first table: it is watching the leader
    wait_until(lambda: steps_done(job.workers[0]) >= 17, 60, "step 17")
    job.schedulers[leader].popen.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    # Bounded, not timed: the take-over comes once the dead leader's lease runs out, 1.7-2.2 s
    # on a quiet machine (the README's figure, printed here), later when etcd itself is slow
    # (3.2 s in one CI run, etcd warning that its own heartbeats were 0.7 s late).
    wait_until(lambda: job.role(standby) == "leader", LEASE_S + 10, "the standby to lead")
    took_over_s = time.monotonic() - killed_at
    print(f"the standby led {took_over_s:.2f} s after the leader's SIGKILL (lease {LEASE_S} s)")
    # `mscluster status` against the survivor, while the job runs, names it the leader.
    shown = subprocess.run(
        [PYTHON, "-m", "cluster", "status", "--addr", f"{standby}:{job.port}"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"leader {standby}:{job.port}" in shown.stdout

    assert job.final_hash() == fault_free_hash
    assert all(len(STEP_LINE.findall(w.output)) >= 1 for w in job.workers)
    assert all(f"back with the scheduler at {standby}:{job.port}" in w.output for w in job.workers)
    # `mscluster status --watch` moved to the new leader, said so in one line, and saw the end.
    assert watch.wait(30) == 0, watch.output
    moved = f"following the leader at {standby}:{job.port} (the scheduler at {leader}:{job.port}"
    assert watch.output.count(moved) == 1, watch.output
    assert "the job finished" in watch.output


def test_one_etcd_member_killed_under_the_running_job_goes_unnoticed(
    processes: Procs, tmp_path: Path, etcd_cluster: EtcdCluster, fault_free_hash: str
) -> None:
    job = HaJob(processes, tmp_path, etcd_cluster)
    wait_until(lambda: steps_done(job.workers[0]) >= 17, 60, "step 17")
    follower = next(i for i in range(3) if i != etcd_cluster.leader())
    etcd_cluster.kill(follower)
    wait_until(lambda: steps_done(job.workers[0]) >= 30, 60, "step 30")
    assert job.role(job.first_leader) == "leader"  # no failover: nothing was noticed
    assert job.final_hash() == fault_free_hash
    assert not any("lost the scheduler" in w.output for w in job.workers)
    assert "job finished" in job.schedulers[job.first_leader].output


# A lease long enough that "at once" and "after the lease" cannot be mistaken for each other.
LONG_LEASE_S = 20


def test_sigterm_to_the_leader_hands_the_job_over_at_once_and_the_result_is_exact(
    processes: Procs, tmp_path: Path, etcd_cluster: EtcdCluster, fault_free_hash: str
) -> None:
    job = HaJob(processes, tmp_path, etcd_cluster, lease_s=LONG_LEASE_S)
    leader = job.first_leader
    standby = next(host for host in HOSTS if host != leader)
    wait_until(lambda: steps_done(job.workers[0]) >= 17, 60, "step 17")
    job.schedulers[leader].popen.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    wait_until(lambda: job.role(standby) == "leader", LONG_LEASE_S, "the standby to lead")
    took_over_s = time.monotonic() - sent
    print(
        f"the standby led {took_over_s:.2f} s after the leader's SIGTERM (lease {LONG_LEASE_S} s)"
    )
    assert took_over_s < LONG_LEASE_S / 2  # it did not wait for the lease to end
    stopped = job.schedulers[leader]
    assert stopped.wait(30) == 0, stopped.output
    assert "handing the job over (scheduler stopped by SIGTERM)" in stopped.output
    assert "everything decided is saved" in stopped.output
    assert job.final_hash() == fault_free_hash
    assert all(f"back with the scheduler at {standby}:{job.port}" in w.output for w in job.workers)
    assert "job finished" in job.schedulers[standby].output
    # Handed over as it was: no node was failed on the way, nobody rolled back.
    assert " failed: " not in stopped.output
    assert "rejoined" not in job.schedulers[standby].output
    assert not any("rolled back" in w.output for w in job.workers)


def test_sigterm_to_a_standby_ends_only_the_standby(
    processes: Procs, tmp_path: Path, etcd_cluster: EtcdCluster, fault_free_hash: str
) -> None:
    job = HaJob(processes, tmp_path, etcd_cluster, lease_s=LONG_LEASE_S)
    standby = next(host for host in HOSTS if host != job.first_leader)
    wait_until(lambda: steps_done(job.workers[0]) >= 10, 60, "step 10")
    job.schedulers[standby].popen.send_signal(signal.SIGTERM)
    assert job.schedulers[standby].wait(30) == 0, job.schedulers[standby].output
    assert job.role(job.first_leader) == "leader"
    assert job.final_hash() == fault_free_hash
    assert not any("lost the scheduler" in w.output for w in job.workers)
