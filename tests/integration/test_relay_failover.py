"""A host's relay follows the leader: two `mscluster scheduler` processes on a real 3-member
etcd (127.0.0.1 and 127.0.0.2, one port), one `mscluster relay` that knows both, and WORKERS
workers of examples/train_mlp.py behind it with recovery on. The leader is SIGKILLed mid-run:
the relay finds the new leader by the workers' own rules, the workers' calls go there through
it, and the job ends with the parameters of a run without faults, the new leader holding one
connection of this host, the relay's. With a standby of another job (a mistyped prefix) in
turn, the workers refused through the relay pass it over directly, and the job goes on."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest

from cluster.testing import Process, free_port, wait_until
from cluster.tools.status import scheduler_role
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.integration.test_standby import BesideATypo
from tests.procs import MSCLUSTER, PYTHON, ROOT, Procs, job_env
from tests.servers.etcd import EtcdCluster
from tests.sockets import connections_by_owner
from tests.training_job import WORKERS, TrainingJob, steps_done, train_args

TRAIN = ROOT / "examples" / "train_mlp.py"
LEASE_S = 2
HOSTS = ("127.0.0.1", "127.0.0.2")


def role(host: str, port: int) -> str:
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            status = pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=1)
        except grpc.RpcError:
            return ""
    return scheduler_role(status.leadership)


def wait_leader(port: int) -> str:
    found: list[str] = []

    def one_leads() -> bool:
        found[:] = [host for host in HOSTS if role(host, port) == "leader"]
        return len(found) == 1

    wait_until(one_leads, 30, "one scheduler leading")
    return found[0]


def start_schedulers(processes: Procs, etcd: EtcdCluster, port: int) -> dict[str, Process]:
    args = ["--port", str(port), "--worker-num", str(WORKERS), "--node-timeout", "2"]
    args += ["--state-url", etcd.state_url(), "--lease", str(LEASE_S)]
    return {
        host: processes.start(
            f"scheduler-{host}",
            [PYTHON, "-m", "cluster", "scheduler", "--host", host, *args],
            job_env(WORKERS, port),
        )
        for host in HOSTS
    }


def test_the_relay_follows_the_new_leader_and_its_workers_go_on(
    processes: Procs, tmp_path: Path, short_dir: Path, etcd_cluster: EtcdCluster
) -> None:
    pytest.importorskip("numpy")
    fault_free = TrainingJob(processes, tmp_path, "clean", TRAIN).final_hash()
    port = free_port()
    schedulers = start_schedulers(processes, etcd_cluster, port)
    leader = wait_leader(port)
    standby = next(host for host in HOSTS if host != leader)
    env = job_env(
        WORKERS,
        port,
        MS_SCHED_HOST=",".join(HOSTS),
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        MS_NODE_TIMEOUT="2",
    )
    sock = f"unix:{short_dir / 'r.sock'}"
    relay = processes.start("relay", [*MSCLUSTER, "relay", "--socket", sock], env)
    relay.wait_for_output("mscluster relay: serving", 30)
    out = tmp_path / "relayed"
    args = [str(TRAIN), *train_args(out), "--step-delay", "0.1"]
    relayed = {**env, "CLUSTER_RELAY": sock}
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", args, {**relayed, "MS_NODE_ID": str(i)})
        for i in range(WORKERS)
    ]
    wait_until(lambda: steps_done(workers[0]) >= 17, 90, "step 17")
    candidates = [relay.pid, *(w.pid for w in workers)]
    owners = connections_by_owner(schedulers[leader].pid, candidates)
    assert owners.get(relay.pid) == 1, owners
    assert not any(owners.get(w.pid) for w in workers), owners
    schedulers[leader].popen.send_signal(signal.SIGKILL)
    wait_until(lambda: role(standby, port) == "leader", LEASE_S + 10, "the standby to lead")
    at_kill = steps_done(workers[0])
    wait_until(lambda: steps_done(workers[0]) >= at_kill + 5, 90, "steps under the new leader")
    # The new leader holds this host's one connection, the relay's (none of a worker).
    owners = connections_by_owner(schedulers[standby].pid, candidates)
    assert owners.get(relay.pid) == 1, owners
    assert not any(owners.get(w.pid) for w in workers), owners
    for w in workers:
        assert w.wait(120) == 0, w.output
        assert "lost the relay" not in w.output, w.output
    assert (out / "final.sha256").read_text().strip() == fault_free
    assert f"following the leader at {standby}:{port}" in relay.output, relay.output
    # The old leader's loss was no end of the job; its end is: the relay exits with it.
    assert relay.wait(30) == 0, relay.output
    assert "the job finished: " in relay.output, relay.output
    # The new leader ends the relay's host calls before its server stops: nothing cancelled.
    assert schedulers[standby].wait(30) == 0, schedulers[standby].output
    assert "Traceback" not in schedulers[standby].output, schedulers[standby].output


def test_the_relay_follows_a_leader_named_outside_its_list_and_its_workers_stay_behind_it(
    processes: Procs, tmp_path: Path, short_dir: Path, etcd_cluster: EtcdCluster
) -> None:
    """The relay and its workers know only the standby's address (the leader is a scheduler
    added since, or one listed under another name than it advertises: a pod's IP behind a DNS
    name). The standby names the leader: the relay follows it, as each worker does, and the
    workers' calls go there through it. (The relay followed only a listed leader, and its
    workers went to the leader directly, one connection each: what a relay is there to spare
    the scheduler of a large job.)"""
    port = free_port()
    schedulers = start_schedulers(processes, etcd_cluster, port)
    leader = wait_leader(port)
    standby = next(host for host in HOSTS if host != leader)
    env = job_env(WORKERS, port, MS_SCHED_HOST=standby, MS_NODE_TIMEOUT="2")
    sock = f"unix:{short_dir / 'r.sock'}"
    relay = processes.start("relay", [*MSCLUSTER, "relay", "--socket", sock], env)
    relay.wait_for_output("mscluster relay: serving", 30)
    relayed = {**env, "CLUSTER_RELAY": sock}
    script = [str(ROOT / "examples" / "allgather_check.py"), "--hold", "3"]
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", script, {**relayed, "MS_NODE_ID": str(i)})
        for i in range(WORKERS)
    ]
    for worker in workers:
        worker.wait_for_output("allgather rank=", 60)
    owners = connections_by_owner(schedulers[leader].pid, [relay.pid, *(w.pid for w in workers)])
    assert owners.get(relay.pid) == 1, owners
    assert not any(owners.get(w.pid) for w in workers), owners
    assert f"following the leader at {leader}:{port}" in relay.output, relay.output
    for worker in workers:
        assert worker.wait(60) == 0, worker.output
        assert "directly" not in worker.output, worker.output
    assert relay.wait(30) == 0, relay.output
    assert schedulers[leader].wait(30) == 0, schedulers[leader].output


def test_workers_behind_a_relay_pass_over_a_standby_given_another_prefix_and_keep_the_job(
    processes: Procs, tmp_path: Path, short_dir: Path, etcd_cluster: EtcdCluster
) -> None:
    """A host's relay and its two workers know three schedulers: the leader, a standby started
    with a mistyped prefix (it leads a job of its own), and the right standby. The leader is
    killed: the relay moves to the wrong one (the next in turn), which refuses the workers as
    nodes of another job. Each worker leaves the relay for the direct route, passes the wrong
    scheduler over there, and gets back with the right standby, which ends the job well.
    (They were refused through the relay whatever address they asked, and the job was lost.)"""
    job = BesideATypo(processes, etcd_cluster, tmp_path)
    sock = f"unix:{short_dir / 'r.sock'}"
    relay = processes.start("relay", [*MSCLUSTER, "relay", "--socket", sock], job.env)
    relay.wait_for_output("mscluster relay: serving", 30)
    workers = job.start_workers(processes, CLUSTER_RELAY=sock)
    job.lose_the_leader(workers)
    for worker in workers:
        # Left once, for its scheduler's refusal (not lost); the wrong one passed over directly.
        assert worker.output.count("leaves the relay at ") == 1, worker.output
        assert "lost the relay" not in worker.output, worker.output
        passed = f"the scheduler at {job.wrong_address} runs another job"
        assert worker.output.count(passed) == 1, worker.output
    job.ends_well(workers)
    assert "Traceback" not in relay.output, relay.output
