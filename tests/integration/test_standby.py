"""Standby schedulers on a real 3-member etcd: real `mscluster scheduler` processes with the
same --state-url, one leads, the others answer every call with the leader's address; SIGKILL of
the leader: a standby takes the lease, resumes the job as saved (its id, its generation, its
nodes awaiting their reconnection, its key-value store), and the old one comes back a standby.

Nodes are played here by raw gRPC calls, as a worker makes them (its registration, its
credential in the call metadata)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from cluster.protocol import version
from cluster.protocol.state_url import parse_state_url
from cluster.testing import Process, free_port, wait_until
from cluster.tools.status import scheduler_role
from cluster.transport import edge
from cluster.transport.failures import LEADER_KEY
from cluster.transport.membership import call_metadata
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.procs import PYTHON, ROOT, Procs, job_env
from tests.servers.etcd import EtcdCluster
from tests.sockets import connections_by_owner

LEASE_S = 2
HOSTS = ("127.0.0.1", "127.0.0.2")
CREDENTIALS = {"0": b"a" * 32, "1": b"b" * 32}


class Schedulers:
    """Two `mscluster scheduler` processes, one per loopback address, on one port, for a job of
    `workers` (and `more` options)."""

    def __init__(
        self, processes: Procs, etcd: EtcdCluster, workers: int = 2, more: tuple[str, ...] = ()
    ) -> None:
        self.processes = processes
        self.workers, self.more = workers, more
        self.url = etcd.state_url()
        self.port = free_port()
        self.metrics_ports = {host: free_port() for host in HOSTS}
        self.procs = {host: self.start(host) for host in HOSTS}

    def start(self, host: str) -> Process:
        args = ["--host", host, "--port", str(self.port), "--worker-num", str(self.workers)]
        args += ["--metrics-port", str(self.metrics_ports[host])]
        args += ["--node-timeout", "5", "--state-url", self.url, "--lease", str(LEASE_S)]
        return self.processes.start(
            f"scheduler-{host}",
            [PYTHON, "-m", "cluster", "scheduler", *args, *self.more],
            job_env(self.workers, self.port),
        )

    def address(self, host: str) -> str:
        return f"{host}:{self.port}"

    def status(self, host: str) -> pb.StatusResponse | None:
        with grpc.insecure_channel(self.address(host)) as channel:
            try:
                return pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=2)
            except grpc.RpcError:
                return None

    def metrics(self, host: str) -> str:
        url = f"http://{host}:{self.metrics_ports[host]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            return str(answer.read().decode())

    def role(self, host: str) -> str:
        status = self.status(host)
        return "" if status is None else scheduler_role(status.leadership)

    def leader(self) -> str:
        """The host that leads, once one leads and every scheduler names it."""
        found: list[str] = []

        def one_leads() -> bool:
            named = {host: self.status(host) for host in HOSTS}
            found[:] = [
                h for h, s in named.items() if s and scheduler_role(s.leadership) == "leader"
            ]
            everyone = sorted(self.address(host) for host in HOSTS)
            return len(found) == 1 and all(
                s is not None
                and s.leadership.leader == self.address(found[0])
                and sorted(s.leadership.schedulers) == everyone
                for s in named.values()
            )

        wait_until(one_leads, 30, "one scheduler leading, known to every scheduler")
        return found[0]


@pytest.fixture
def schedulers(processes: Procs, etcd_cluster: EtcdCluster) -> Schedulers:
    return Schedulers(processes, etcd_cluster)


def register(address: str, node_id: str, cluster_id: str = "") -> pb.RegisterResponse:
    request = pb.RegisterRequest(
        node_id=node_id,
        role=pb.ROLE_WORKER,
        host="127.0.0.1",
        port=6000 + int(node_id),
        incarnation=1,
        worker_num=2,
        credential=CREDENTIALS[node_id],
        cluster_id=cluster_id,
        protocol_revision=version.PROTOCOL_REVISION,
    )
    with grpc.insecure_channel(address) as channel:
        response = pb_grpc.SchedulerStub(channel).Register(request, timeout=10)
    assert isinstance(response, pb.RegisterResponse)
    return response


def kv_call(address: str, method: str, request: object) -> object:
    """`method` of `request` as node 0 (a KvSet's value in its pieces, as a worker sends it)."""
    metadata = call_metadata("0", 1, CREDENTIALS["0"])
    sent = edge.pieces(request) if method in edge.VALUE_METHODS else request
    with grpc.insecure_channel(address) as channel:
        return getattr(pb_grpc.SchedulerStub(channel), method)(sent, timeout=10, metadata=metadata)


def test_a_standby_names_the_leader_and_takes_the_job_over_when_the_leader_is_killed(
    schedulers: Schedulers,
) -> None:
    leader = schedulers.leader()
    standby = next(host for host in HOSTS if host != leader)
    here, there = schedulers.address(leader), schedulers.address(standby)

    # A standby refuses a registration with the leader's address, in a Refusal the worker
    # follows, and any other call with UNAVAILABLE and the address in the trailing metadata.
    refused = register(there, "0").refused
    assert (refused.reason, refused.leader) == (pb.REFUSAL_NOT_LEADER, here)
    with pytest.raises(grpc.RpcError) as raised:
        kv_call(there, "KvSet", pb.KvSetRequest(key="plan", value=b"v"))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (LEADER_KEY, here) in tuple(raised.value.trailing_metadata() or ())
    status = schedulers.status(standby)
    assert status is not None
    assert (status.leadership.leader, status.cluster_id) == (here, "")
    assert sorted(status.leadership.schedulers) == sorted([here, there])

    # The job forms on the leader, with a key set.
    accepted = [register(here, node_id).accepted for node_id in ("0", "1")]
    job = accepted[0].cluster_id
    assert job
    kv_call(here, "KvSet", pb.KvSetRequest(key="plan", value=b"v"))

    os.kill(schedulers.procs[leader].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: schedulers.role(standby) == "leader", LEASE_S + 10, "the standby to lead")
    took_over_s = time.monotonic() - killed_at
    shown = schedulers.metrics(standby)
    assert "\ncluster_leader 1.0" in shown
    assert "\ncluster_leader_changes_total 1.0" in shown
    status = schedulers.status(standby)
    assert status is not None
    assert (status.cluster_id, status.generation, status.leadership.leader) == (job, 1, there)
    assert {node.node_id for node in status.nodes} == {"0", "1"}
    answer = kv_call(there, "KvGet", pb.KvGetRequest(keys=["plan"]))
    assert list(answer.values) == [b"v"]  # type: ignore[attr-defined]
    # A node of the job comes back to the new leader, as a member of the same job.
    again = register(there, "1", cluster_id=job).accepted
    assert (again.cluster_id, again.generation) == (job, 1)  # reconnected, not a rejoin

    # The old leader, started again, stands by behind the new one.
    schedulers.procs[leader] = schedulers.start(leader)

    def names_the_new_leader() -> bool:
        status = schedulers.status(leader)
        return status is not None and status.leadership.leader == there

    wait_until(names_the_new_leader, 30, "the old leader to stand by behind the new one")
    assert schedulers.role(leader) == "standby"
    assert register(here, "0", cluster_id=job).refused.leader == there
    print(f"the standby led {took_over_s:.2f} s after the leader's SIGKILL (lease {LEASE_S} s)")


def test_workers_that_follow_a_new_leader_leave_the_old_one_no_connection(
    schedulers: Schedulers, processes: Procs, tmp_path: Path
) -> None:
    """Real workers try the standby first and follow the leader it names; the leader is then
    frozen (SIGSTOP) until the standby leads, and the workers follow it there. Each time they
    let go of their connection to the scheduler they left at once: grpc.aio keeps a closed
    channel's connection until its calls' objects are collected, which in an idle worker can be
    minutes away (a scheduler closes an idle connection only after 10 s, later than this waits),
    and the old leader, back as a standby, would hold every worker's."""
    first = schedulers.leader()
    second = next(host for host in HOSTS if host != first)
    env = job_env(
        2,
        schedulers.port,
        MS_SCHED_HOST=f"{second},{first}",
        MS_NODE_TIMEOUT="3",
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
    )
    script = ["examples/allgather_check.py", "--hold", "60"]
    workers = [
        processes.start_role(f"worker-{i}", "MS_WORKER", script, {**env, "MS_NODE_ID": str(i)})
        for i in range(2)
    ]
    for worker in workers:
        worker.wait_for_output("allgather rank=", 30)
    pids = [worker.pid for worker in workers]

    def holds(host: str) -> list[int]:
        counts = connections_by_owner(schedulers.procs[host].pid, pids)
        return [counts.get(pid, 0) for pid in pids]

    wait_until(lambda: holds(second) == [0, 0], 5, "the standby to hold no worker's connection")
    assert holds(first) == [1, 1]

    os.kill(schedulers.procs[first].pid, signal.SIGSTOP)
    try:
        wait_until(lambda: schedulers.role(second) == "leader", 30, "the standby to lead")
        wait_until(lambda: holds(second) == [1, 1], 30, "the workers to follow the new leader")
    finally:
        os.kill(schedulers.procs[first].pid, signal.SIGCONT)
    wait_until(lambda: holds(first) == [0, 0], 5, "the old leader to hold no worker's connection")
    assert all(worker.running for worker in workers)


def test_a_spare_that_waited_past_MS_TOPO_TIMEOUT_follows_the_leader_that_takes_over(
    processes: Procs, etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    """A spare waits longer than MS_TOPO_TIMEOUT, as it may; the leader hands the job over
    (SIGTERM): the spare registers again, as a spare, with the new leader, and is released
    with exit 0 when the job ends. (It kept the deadline of its start, and failed at once:
    `SchedulerUnreachableError: the scheduler at ... is unreachable: `.)"""
    schedulers = Schedulers(processes, etcd_cluster, workers=1, more=("--topo-timeout", "4"))
    leader = schedulers.leader()
    other = next(host for host in HOSTS if host != leader)
    env = job_env(
        1,
        schedulers.port,
        MS_SCHED_HOST=",".join(HOSTS),
        MS_NODE_TIMEOUT="5",
        MS_TOPO_TIMEOUT="4",
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
    )
    go = tmp_path / "go"
    script = [str(ROOT / "tests" / "integration" / "scripts" / "finish_on_cue.py"), str(go)]
    worker = processes.start_role("worker-0", "MS_WORKER", script, env | {"MS_NODE_ID": "0"})
    worker.wait_for_output("in rank=0", 30)
    spare_env = env | {"MS_NODE_ID": "s0", "CLUSTER_SPARE": "1"}
    spare = processes.start_role("spare", "MS_WORKER", script, spare_env)
    spare.wait_for_output("as a spare", 30)
    time.sleep(5)  # sleep-ok: the fault: the spare waits past its MS_TOPO_TIMEOUT (4 s)
    schedulers.procs[leader].popen.send_signal(signal.SIGTERM)
    assert schedulers.procs[leader].wait(20) == 0, schedulers.procs[leader].output
    back = f"accepted by the scheduler at {schedulers.address(other)} as a spare"
    wait_until(lambda: back in spare.output or not spare.running, 30, "the spare to follow")
    assert back in spare.output, spare.output
    go.touch()
    assert worker.wait(30) == 0, worker.output
    assert spare.wait(30) == 0, spare.output
    assert "the job finished while this node was a spare" in spare.output, spare.output


def status(addr: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "cluster", "status", "--addr", addr, *extra],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


def test_mscluster_status_names_the_leader_from_any_address(schedulers: Schedulers) -> None:
    leader = schedulers.leader()
    here = schedulers.address(leader)
    others = [schedulers.address(host) for host in HOSTS if host != leader]
    for host in HOSTS:
        result = status(schedulers.address(host), "--json")
        assert result.returncode == 0, result.stderr
        shown = json.loads(result.stdout)
        assert shown["address"] == here  # a standby's answer led to the leader
        assert shown["leadership"]["leader"] == here
        assert sorted(shown["leadership"]["schedulers"]) == sorted([here, *others])
    # Several addresses, the first with nobody behind it: the next answers.
    nobody = f"127.0.0.3:{free_port()}"
    result = status(f"{nobody},{others[0]}")
    assert result.returncode == 0, result.stderr
    assert f"leader {here} (lease {LEASE_S} s" in result.stdout
    assert f"standbys: {others[0]}" in result.stdout
    # Nobody anywhere: one line that says what each address answered.
    result = status(f"{nobody},127.0.0.4:{free_port()}")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "127.0.0.3" in result.stderr
    assert "127.0.0.4" in result.stderr


def kv_set_in_thread(address: str, value: bytes) -> tuple[threading.Thread, list[object]]:
    """A KvSet sent now, answered whenever the scheduler gets to it: (thread, [outcome])."""
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(kv_call(address, "KvSet", pb.KvSetRequest(key="plan", value=value)))
        except grpc.RpcError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, outcome


def test_a_leader_that_lost_its_lease_while_paused_answers_not_the_leader_and_writes_nothing(
    schedulers: Schedulers,
) -> None:
    """The leader is frozen (SIGSTOP: a long GC pause, a swapped-out host) with a key set on
    its way to it; its lease ends, the standby takes the job over and a node sets the key
    there; the old leader wakes up (SIGCONT) and finds the set: it answers "not the leader",
    names the new one, and its value is nowhere."""
    leader = schedulers.leader()
    standby = next(host for host in HOSTS if host != leader)
    here, there = schedulers.address(leader), schedulers.address(standby)
    job = register(here, "0").accepted.cluster_id
    register(here, "1")
    kv_call(here, "KvSet", pb.KvSetRequest(key="plan", value=b"v1"))

    old = schedulers.procs[leader]
    os.kill(old.pid, signal.SIGSTOP)
    try:
        thread, outcome = kv_set_in_thread(here, b"stale")
        wait_until(lambda: schedulers.role(standby) == "leader", 30, "the standby to lead")
        kv_call(there, "KvSet", pb.KvSetRequest(key="plan", value=b"v2"))
    finally:
        os.kill(old.pid, signal.SIGCONT)
    thread.join(20)
    assert outcome, "the paused leader never answered the set it found on waking"
    refused = outcome[0]
    assert isinstance(refused, grpc.RpcError), refused
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    assert "not the leader" in (refused.details() or "")
    wait_until(lambda: schedulers.role(leader) == "standby", 30, "the old leader to stand by")
    answer = kv_call(there, "KvGet", pb.KvGetRequest(keys=["plan"]))
    assert list(answer.values) == [b"v2"]  # type: ignore[attr-defined]
    status = schedulers.status(standby)
    assert status is not None
    assert (status.cluster_id, status.leadership.leader) == (job, there)
    # It says why it stepped down: it did not run, not that etcd was away.
    assert "stepping down: this scheduler did not run for" in old.output, old.output
    assert "etcd unreachable" not in old.output
    assert "Traceback" not in old.output


def test_etcd_down_the_leader_steps_down_within_its_lease_and_the_job_resumes_when_it_is_back(
    schedulers: Schedulers, etcd_cluster: EtcdCluster
) -> None:
    leader = schedulers.leader()
    here = schedulers.address(leader)
    job = register(here, "0").accepted.cluster_id
    register(here, "1")
    kv_call(here, "KvSet", pb.KvSetRequest(key="plan", value=b"v1"))

    for member in range(3):
        etcd_cluster.kill(member)
    down_at = time.monotonic()
    wait_until(lambda: schedulers.role(leader) != "leader", LEASE_S + 10, "the leader to step down")
    stepped_down_s = time.monotonic() - down_at
    refused = register(here, "0", cluster_id=job).refused
    assert refused.reason == pb.REFUSAL_NOT_LEADER  # no leader: the node tries again later
    assert refused.retry_after_s > 0

    etcd_cluster.start()
    found: list[str] = []

    def one_leads() -> bool:
        found[:] = [host for host in HOSTS if schedulers.role(host) == "leader"]
        return len(found) == 1

    wait_until(one_leads, 60, "a scheduler to lead once etcd is back")
    status = schedulers.status(found[0])
    assert status is not None
    assert (status.cluster_id, status.generation) == (job, 1)
    answer = kv_call(schedulers.address(found[0]), "KvGet", pb.KvGetRequest(keys=["plan"]))
    assert list(answer.values) == [b"v1"]  # type: ignore[attr-defined]
    for proc in schedulers.procs.values():
        assert "Traceback" not in proc.output
    print(f"the leader stepped down {stepped_down_s:.2f} s after etcd went (lease {LEASE_S} s)")


def test_etcd_without_quorum_is_named_and_the_job_resumes_when_quorum_is_back(
    schedulers: Schedulers, etcd_cluster: EtcdCluster
) -> None:
    """One etcd member of three killed (not etcd's leader, whose loss leaves etcd without a
    leader for its election, 1-2 s, which a 2 s lease may not outlast): the job's leader goes
    on and saves. A second one killed: etcd has no quorum, and its last member takes requests
    and answers none; the leader steps down within its lease, and the schedulers say that
    etcd may have lost its quorum, not only that no member answered (one runs). Quorum back:
    the job resumes as saved."""
    leader = schedulers.leader()
    here = schedulers.address(leader)
    job = register(here, "0").accepted.cluster_id
    register(here, "1")
    followers = [i for i in range(3) if i != etcd_cluster.leader()]
    etcd_cluster.kill(followers[0])
    kv_call(here, "KvSet", pb.KvSetRequest(key="plan", value=b"v2"))  # saved by two of three
    assert schedulers.role(leader) == "leader"

    etcd_cluster.kill(followers[1])
    wait_until(lambda: schedulers.role(leader) != "leader", LEASE_S + 10, "the leader to step down")

    def named() -> bool:
        return any("etcd has lost its quorum" in p.output for p in schedulers.procs.values())

    wait_until(named, 30, "a scheduler to name etcd's lost quorum")
    etcd_cluster.start()
    wait_until(lambda: any(schedulers.role(h) == "leader" for h in HOSTS), 60, "a leader again")
    (now,) = [h for h in HOSTS if schedulers.role(h) == "leader"]
    status = schedulers.status(now)
    assert status is not None
    assert (status.cluster_id, status.generation) == (job, 1)
    answer = kv_call(schedulers.address(now), "KvGet", pb.KvGetRequest(keys=["plan"]))
    assert list(answer.values) == [b"v2"]  # type: ignore[attr-defined]
    for proc in schedulers.procs.values():
        assert "Traceback" not in proc.output


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("etcd://127.0.0.1:{port}/job", "cannot be used: cannot read the leader key"),
        ("etcd://127.0.0.1/job", "without HOST:PORT"),
        ("etcds://127.0.0.1:{port}/job", "names no CA"),
    ],
)
def test_an_unreachable_or_misconfigured_etcd_is_one_line_at_start(url: str, said: str) -> None:
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "cluster",
            "scheduler",
            "--worker-num",
            "1",
            "--port",
            "0",
            "--state-url",
            url.format(port=free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=job_env(1, 1),
    )
    assert result.returncode != 0
    assert said in result.stderr
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if "mscluster:" in line]) == 1


def test_a_scheduler_whose_worker_count_differs_from_the_saved_job_is_one_line_at_start(
    schedulers: Schedulers, processes: Procs
) -> None:
    """Not a campaign that fails and is made again for ever: the job on that prefix (2
    workers, still running after its leader's SIGKILL) is not this scheduler's (4)."""
    leader = schedulers.leader()
    register(schedulers.address(leader), "0")
    for proc in schedulers.procs.values():
        proc.popen.send_signal(signal.SIGKILL)
        proc.wait(10)
    args = ["--host", "127.0.0.1", "--port", str(free_port()), "--worker-num", "4"]
    done = subprocess.run(
        [PYTHON, "-m", "cluster", "scheduler", *args, "--state-url", schedulers.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=job_env(4, schedulers.port),
    )
    assert done.returncode == 2, done.stderr
    said = done.stderr.strip().splitlines()[-1]
    assert f"CLUSTER_STATE_URL={schedulers.url.rstrip('/')!r} cannot be used" in said
    assert "MS_WORKER_NUM=2" in said
    assert "MS_WORKER_NUM=4" in said
    assert "Traceback" not in done.stderr


def test_another_jobs_scheduler_on_the_prefix_is_refused_at_start_not_left_to_stand_by(
    schedulers: Schedulers,
) -> None:
    """Another job's scheduler (its own job secret, the same worker count) started on this
    job's prefix by mistake, while the job's leader runs: one line at start, never a standby
    that would take the job over and refuse every one of its nodes."""
    leader = schedulers.leader()
    job = register(schedulers.address(leader), "0").accepted.cluster_id
    args = ["--host", "127.0.0.1", "--port", str(free_port()), "--worker-num", "2"]
    env = job_env(2, schedulers.port, CLUSTER_JOB_SECRET="c" * 64)
    done = subprocess.run(
        [PYTHON, "-m", "cluster", "scheduler", *args, "--state-url", schedulers.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    said = done.stderr.strip().splitlines()[-1]
    assert f"CLUSTER_STATE_URL={schedulers.url.rstrip('/')!r} cannot be used" in said
    assert f"it holds job {job}, which has no job secret, but this scheduler has one" in said
    assert "to start a new job, give it a prefix of its own in CLUSTER_STATE_URL" in said
    assert "move away the workers' records, worker-<id>.json" in said
    assert "Traceback" not in done.stderr
    status = schedulers.status(leader)
    assert status is not None
    assert (status.cluster_id, scheduler_role(status.leadership)) == (job, "leader")


def test_a_new_leader_removes_the_chunks_that_no_key_names(
    processes: Procs, etcd_cluster: EtcdCluster
) -> None:
    """Chunks a leader wrote and never named (it died between writing and naming them) go when
    the next leader starts leading: etcd does not grow with every such save."""
    prefix = parse_state_url(etcd_cluster.state_url()).prefix
    for orphan in ("stateblob/orphan/000000", "kvblob/orphan/000000"):
        etcd_cluster.etcdctl("put", f"{prefix}{orphan}", "a chunk")
    schedulers = Schedulers(processes, etcd_cluster)
    schedulers.leader()

    def orphans() -> str:
        return etcd_cluster.etcdctl("get", "--prefix", "--keys-only", f"{prefix}stateblob/") + (
            etcd_cluster.etcdctl("get", "--prefix", "--keys-only", f"{prefix}kvblob/")
        )

    wait_until(lambda: "orphan" not in orphans(), 30, "the unnamed chunks removed")


def start_with_a_typo(processes: Procs, etcd_cluster: EtcdCluster) -> tuple[Process, str, int]:
    """A scheduler meant to stand by for the test's job, started at 127.0.0.3 with a mistyped
    prefix, once it leads a job of its own: the process, its state URL and its port."""
    typo = etcd_cluster.state_url(etcd_cluster.prefix.rstrip("/") + "-typo/")
    port = free_port()
    args = ["--host", "127.0.0.3", "--port", str(port), "--worker-num", "2"]
    args += ["--state-url", typo, "--lease", str(LEASE_S)]
    wrong = processes.start(
        "scheduler-typo", [PYTHON, "-m", "cluster", "scheduler", *args], job_env(2, port)
    )
    wrong.wait_for_output("starting a new job", 30)
    return wrong, typo, port


def test_a_standby_given_another_prefix_says_it_leads_a_new_job_and_why_it_refuses_nodes(
    processes: Procs, etcd_cluster: EtcdCluster
) -> None:
    """A scheduler meant to stand by for a running job, started with a mistyped prefix, leads
    a job of its own on it (it cannot know): it says so at once, and when the job's nodes come
    to it (their leader gone) its refusal names its CLUSTER_STATE_URL as the likely cause, not
    the nodes' records, which are right."""
    schedulers = Schedulers(processes, etcd_cluster)
    leader = schedulers.leader()
    job = register(schedulers.address(leader), "0").accepted.cluster_id
    wrong, typo, port = start_with_a_typo(processes, etcd_cluster)
    (line,) = [line for line in wrong.output.splitlines() if "starting a new job" in line]
    assert f"nothing is saved under {typo.rstrip('/')}" in line
    assert "a scheduler meant to stand by for a running job names that job's prefix" in line

    refused = register(f"127.0.0.3:{port}", "0", cluster_id=job).refused
    assert refused.reason == pb.REFUSAL_FOREIGN_JOB
    said = refused.message
    assert said.startswith(f"node '0' belongs to job {job}, but this scheduler runs job ")
    assert f"which it started anew under {typo.rstrip('/')}, where nothing was saved" in said
    assert "this scheduler was started with the wrong CLUSTER_STATE_URL" in said
    assert "keep the node's record; otherwise: the node's process was in that job" in said
    assert "Traceback" not in wrong.output


class BesideATypo:
    """A job's leader and standby (`Schedulers`), and a scheduler started with a mistyped
    prefix (`start_with_a_typo`), `wrong`, at `wrong_address`: the workers' environment `env`
    names it in turn after the leader; `script` is a worker that finishes once `go` exists."""

    def __init__(self, processes: Procs, etcd_cluster: EtcdCluster, tmp_path: Path) -> None:
        self.schedulers = Schedulers(processes, etcd_cluster)
        self.leader = self.schedulers.leader()
        self.standby = next(host for host in HOSTS if host != self.leader)
        self.wrong, _, port = start_with_a_typo(processes, etcd_cluster)
        self.wrong_address = f"127.0.0.3:{port}"
        addrs = [self.address(self.leader), self.wrong_address, self.address(self.standby)]
        self.env = job_env(
            2,
            self.schedulers.port,
            CLUSTER_SCHED_ADDRS=",".join(addrs),
            MS_NODE_TIMEOUT="5",
            MS_ENABLE_RECOVERY="1",
            MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        )
        self.go = tmp_path / "go"
        self.script = [str(ROOT / "tests" / "integration" / "scripts" / "finish_on_cue.py")]
        self.script.append(str(self.go))

    def address(self, host: str) -> str:
        return self.schedulers.address(host)

    def start_workers(self, processes: Procs, **more: str) -> list[Process]:
        """The job's two workers (`more`: their environment beside `env`), once in the job."""
        workers = [
            processes.start_role(
                f"worker-{i}", "MS_WORKER", self.script, self.env | more | {"MS_NODE_ID": f"{i}"}
            )
            for i in range(2)
        ]
        for worker in workers:
            worker.wait_for_output("in rank=", 30)
        return workers

    def lose_the_leader(self, workers: list[Process]) -> None:
        """SIGKILL the leader; every worker comes back with the standby."""
        os.kill(self.schedulers.procs[self.leader].pid, signal.SIGKILL)
        back = f"back with the scheduler at {self.address(self.standby)}"
        for worker in workers:
            wait_until(
                lambda w=worker: back in w.output or not w.running, 60, "back on the standby"
            )
            assert back in worker.output, worker.output

    def ends_well(self, workers: list[Process]) -> None:
        """The workers finish on cue, and the job with them on the standby; the wrong one runs."""
        self.go.touch()
        for worker in workers:
            assert worker.wait(30) == 0, worker.output
        standby = self.schedulers.procs[self.standby]
        assert standby.wait(30) == 0, standby.output
        assert self.wrong.running
        assert "Traceback" not in self.wrong.output


def test_workers_pass_over_a_standby_given_another_prefix_and_keep_the_job(
    processes: Procs, etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    """A job's workers know three schedulers: the leader, a standby started with a mistyped
    prefix (it leads a job of its own), and the right standby. The leader is killed; the
    workers come to the wrong one first, which refuses them as nodes of another job: they say
    so once, pass it over, and get back with the right standby, which takes the job over and
    ends it well. (They exited at its refusal, and the job was lost.)"""
    job = BesideATypo(processes, etcd_cluster, tmp_path)
    workers = job.start_workers(processes)
    job.lose_the_leader(workers)
    for worker in workers:
        said = [line for line in worker.output.splitlines() if "127.0.0.3" in line]
        assert len(said) == 1, said
        assert "runs another job" in said[0], said[0]
        assert "wrong CLUSTER_STATE_URL" in said[0], said[0]
    job.ends_well(workers)
