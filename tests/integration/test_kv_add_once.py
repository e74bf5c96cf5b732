"""A counter add whose save landed but whose answer was lost is counted once: the worker makes
the same add again at the scheduler that comes next (restarted on the recovery directory, or a
standby that took the job over from etcd) and gets the first answer, the counter +1 once.
Torch's store counts ranks with these adds for its barriers and rendezvous."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import grpc

from cluster.storage.kv_log import FILE_NAME, KvLog
from cluster.testing import free_port, wait_until
from cluster.tools.status import scheduler_role
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.integration.test_standby import HOSTS, LEASE_S, kv_call, register
from tests.procs import PYTHON, ROOT, Procs, job_env
from tests.proxy import Proxy
from tests.servers.etcd import EtcdCluster

WORKER = [str(ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py")]


def saved_counter(directory: Path) -> bytes | None:
    """What the key-value log in `directory` holds for `n` (None: nothing yet)."""
    try:
        header = (directory / FILE_NAME).read_bytes().split(b"\n", 1)[0]
    except FileNotFoundError:
        return None
    log = KvLog(directory)
    try:
        return log.load(header.split(b" ")[-1].decode()).get("n")
    finally:
        log.close()


def test_an_add_saved_by_a_scheduler_killed_before_it_answered_is_counted_once(
    processes: Procs, tmp_path: Path
) -> None:
    """The scheduler saves the add (its fsync done) and is SIGKILLed before its answer gets
    out (a proxy drops what it sends the worker); the worker makes the add again at the
    scheduler started again on the directory, and is answered 1, as the first time."""
    port = free_port()
    proxy = Proxy(("127.0.0.1", port))
    state_dir, go, release = tmp_path / "recovery", tmp_path / "go", tmp_path / "release"
    env = job_env(
        1, port, MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(state_dir), MS_NODE_TIMEOUT="5"
    )
    args = [*WORKER, "--go", str(go), "--add", "--release", str(release)]
    try:
        sched = processes.start_role("scheduler", "MS_SCHED", args, env)
        sched.wait_for_output("listening on", 20)
        worker_env = {**env, "MS_NODE_ID": "0", "MS_SCHED_PORT": str(proxy.port)}
        worker = processes.start_role("worker0", "MS_WORKER", args, worker_env)
        worker.wait_for_output("ready rank=0", 30)
        proxy.hold_replies()
        go.touch()
        wait_until(lambda: saved_counter(state_dir) == b"1", 20, "the add saved")
        sched.popen.send_signal(signal.SIGKILL)
        sched.wait(10)
        proxy.cut()  # the worker never heard the answer
        restarted = processes.start_role("scheduler-2", "MS_SCHED", args, env)
        worker.wait_for_output("holds n=", 40)
        assert "added value=1\n" in worker.output, worker.output
        assert "holds n=1\n" in worker.output, worker.output
        release.touch()
        assert worker.wait(40) == 0, worker.output
        assert restarted.wait(30) == 0, restarted.output
        assert saved_counter(state_dir) == b"1"
    finally:
        proxy.close()


def add(address: str, number: int) -> int:
    """A node's add of 1 to `n`, numbered `number` in its process."""
    answer = kv_call(address, "KvAdd", pb.KvAddRequest(key="n", amount=1, add_id=number))
    assert isinstance(answer, pb.KvAddResponse)
    return answer.value


def refused_add(address: str, number: int, outcome: list[object]) -> None:
    try:
        outcome.append(add(address, number))
    except grpc.RpcError as exc:
        outcome.append(exc)


def leads(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            status = pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return scheduler_role(status.leadership) == "leader"


def test_an_add_whose_etcd_answer_was_lost_is_counted_once_by_the_next_leader(
    processes: Procs, etcd_cluster: EtcdCluster
) -> None:
    """The leader reaches etcd through a proxy that drops etcd's answers from some moment on:
    its transaction of the add lands, but it never hears so, loses its lease and steps down;
    its caller is told "not the leader" and makes the same add again at the new leader, which
    answers what the add made of the counter the first time."""
    host, etcd_port = etcd_cluster.endpoints[0].split(":")
    proxy = Proxy((host, int(etcd_port)))
    port = free_port()
    prefix = etcd_cluster.prefix.strip("/")
    urls = {
        HOSTS[0]: f"etcd://127.0.0.1:{proxy.port}/{prefix}",
        HOSTS[1]: etcd_cluster.state_url(),
    }

    def start(host: str) -> None:
        args = ["--host", host, "--port", str(port), "--worker-num", "2", "--node-timeout", "5"]
        args += ["--state-url", urls[host], "--lease", str(LEASE_S)]
        scheduler = processes.start(
            f"scheduler-{host}", [PYTHON, "-m", "cluster", "scheduler", *args], job_env(2, port)
        )
        scheduler.wait_for_output("listening on", 20)

    first, second = (f"{host}:{port}" for host in HOSTS)
    try:
        start(HOSTS[0])
        wait_until(lambda: leads(first), 30, "the first scheduler to lead")
        start(HOSTS[1])
        register(first, "0")
        register(first, "1")
        assert add(first, 1) == 1
        proxy.hold_replies()
        outcome: list[object] = []
        caller = threading.Thread(target=refused_add, args=(first, 2, outcome), daemon=True)
        caller.start()
        caller.join(30)
        assert outcome, "the leader cut off from etcd's answers never answered the add"
        refused = outcome[0]
        assert isinstance(refused, grpc.RpcError), refused
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        # The add landed in etcd all the same.
        stored = etcd_cluster.etcdctl("get", "--print-value-only", f"/{prefix}/kv/n")
        assert stored.rstrip("\n").endswith("2"), stored
        wait_until(lambda: leads(second), 30, "the second scheduler to lead")
        assert add(second, 2) == 2  # made again: the first answer, counted once
        assert add(second, 3) == 3
    finally:
        proxy.close()
