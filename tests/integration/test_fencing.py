"""Fencing, with a real network partition: the leading scheduler runs in its own network
namespace (a host of its own, joined to this one by a veth pair), a real 3-member etcd and a
standby on this host. The link is cut: the leader is cut from etcd and from the nodes at once;
a key set is on its way to it; the standby takes the lease and the job, and a node sets the key
there. The link is healed: the old leader answers the set it finally receives with "not the
leader" naming the new one, stands by, and nothing it decided while cut off is anywhere.

Root only (network namespaces); CI runs as root."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest

from cluster.testing import Process, free_port, wait_until
from cluster.tools.status import scheduler_role
from cluster.tools.testing import NetworkLab
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.integration.test_standby import kv_call, kv_set_in_thread, register
from tests.procs import PYTHON, Procs, job_env
from tests.servers.etcd import EtcdCluster

LEASE_S = 2


@pytest.fixture
def lab() -> Iterator[NetworkLab]:
    why = NetworkLab.why_not_available()
    if why:
        pytest.skip(why)
    made = NetworkLab(1)
    made.setup()
    try:
        yield made
    finally:
        made.teardown()


def status(address: str) -> pb.StatusResponse:
    """The scheduler's Status; an empty one when it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            answer = pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=2)
        except grpc.RpcError:
            return pb.StatusResponse()
    assert isinstance(answer, pb.StatusResponse)
    return answer


def role(address: str) -> str:
    return scheduler_role(status(address).leadership)


def test_a_partitioned_leader_is_fenced_and_stands_by_once_healed(
    lab: NetworkLab, make_etcd_cluster: Callable[..., EtcdCluster], processes: Procs
) -> None:
    etcd = make_etcd_cluster(3, listen_any=True)
    prefix = f"/tests/{uuid.uuid4().hex[:12]}"
    gateway = f"10.{lab.worker_ip(0).split('.')[1]}.0.1"  # this host, seen from the namespace
    ports = [endpoint.rpartition(":")[2] for endpoint in etcd.endpoints]
    port = free_port()
    old_host, new_host = lab.worker_ip(0), "127.0.0.1"
    old, new = f"{old_host}:{port}", f"{new_host}:{port}"

    def scheduler(
        name: str, host: str, etcd_host: str, wrap: Callable[[list[str]], list[str]]
    ) -> Process:
        url = f"etcd://{','.join(f'{etcd_host}:{p}' for p in ports)}{prefix}"
        args = [PYTHON, "-m", "cluster", "scheduler", "--host", host, "--port", str(port)]
        args += ["--worker-num", "2", "--node-timeout", "5", "--state-url", url]
        return processes.start(name, wrap([*args, "--lease", str(LEASE_S)]), job_env(2, port))

    leader = scheduler("leader", old_host, gateway, lambda args: lab.command(0, args))
    wait_until(lambda: role(old) == "leader", 30, "the scheduler in the namespace to lead")
    scheduler("standby", new_host, "127.0.0.1", lambda args: args)
    wait_until(lambda: status(new).leadership.leader == old, 30, "standby")
    job = register(old, "0").accepted.cluster_id
    register(old, "1")
    kv_call(old, "KvSet", pb.KvSetRequest(key="plan", value=b"v1"))

    lab.cut(0)
    try:
        thread, outcome = kv_set_in_thread(old, b"stale")
        wait_until(lambda: role(new) == "leader", LEASE_S + 10, "the standby to lead")
        kv_call(new, "KvSet", pb.KvSetRequest(key="plan", value=b"v2"))
    finally:
        lab.heal(0)
    thread.join(40)
    assert outcome, "the old leader never answered the set once healed"
    refused = outcome[0]
    assert isinstance(refused, grpc.RpcError), refused
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    wait_until(lambda: status(old).leadership.leader == new, 30, "healed")
    assert role(old) == "standby"
    assert register(old, "0", cluster_id=job).refused.leader == new
    answer = kv_call(new, "KvGet", pb.KvGetRequest(keys=["plan"]))
    assert list(answer.values) == [b"v2"]  # type: ignore[attr-defined]
    found = status(new)
    assert (found.cluster_id, found.generation) == (job, 1)
    # What etcd holds is the new leader's: read it with etcd's own client.
    held = subprocess.run(
        [
            "etcdctl",
            f"--endpoints={etcd.endpoints[0]}",
            "get",
            f"{prefix}/leader",
            "--print-value-only",
        ],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )
    assert new in held.stdout
    assert "stepping down" in leader.output
    assert "Traceback" not in leader.output
