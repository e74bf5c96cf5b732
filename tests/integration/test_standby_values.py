"""A standby scheduler and the value calls (KvSet, Exchange) that reach it: real `mscluster
scheduler` processes on a real 3-member etcd (`test_standby.Schedulers`), the calls made by a
plain gRPC client as a flood would make them.

A standby knows no member of the job, so it cannot tell a worker's value from anyone's: it
refuses every member's call at its start, naming the leader, and reads none of it
(`ServicerEdge.named`). Reading each value to its end first (up to 64 MiB a call, as many calls
as anyone opened) grew its peak by 330 MiB under 64 of them.
"""

from __future__ import annotations

import os
import signal

import grpc

from cluster.testing import wait_until
from cluster.transport import edge
from cluster.transport.failures import LEADER_KEY
from cluster.transport.membership import call_metadata
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.integration.test_hostile import peak_rss_kb
from tests.integration.test_standby import (
    CREDENTIALS,
    HOSTS,
    LEASE_S,
    Schedulers,
    kv_call,
    register,
)
from tests.procs import Procs
from tests.servers.etcd import EtcdCluster

MIB = 1024 * 1024
CALLS, CONNECTIONS = 64, 8


def refusals_of_a_flood(address: str) -> list[grpc.RpcError]:
    """What `CALLS` key-value sets of `edge.MAX_VALUE_BYTES` at once, in pieces as a worker
    sends them, over `CONNECTIONS` connections, end with at `address`."""
    request = pb.KvSetRequest(key="flood", value=b"x" * edge.MAX_VALUE_BYTES)
    metadata = call_metadata("0", 1, CREDENTIALS["0"])
    channels = [grpc.insecure_channel(address) for _ in range(CONNECTIONS)]
    try:
        stubs = [pb_grpc.SchedulerStub(channel) for channel in channels]
        calls = [
            stubs[i % CONNECTIONS].KvSet.future(edge.pieces(request), metadata=metadata, timeout=60)
            for i in range(CALLS)
        ]
        errors = [call.exception() for call in calls]
    finally:
        for channel in channels:
            channel.close()
    assert all(isinstance(error, grpc.RpcError) for error in errors), errors
    return errors  # type: ignore[return-value]


def test_a_standby_refuses_a_flood_of_large_values_unread_naming_the_leader(
    processes: Procs, etcd_cluster: EtcdCluster
) -> None:
    """64 sets of 64 MiB at once at a standby: each is refused at its start as not led there,
    naming the leader (UNAVAILABLE, the leader in the trailing metadata: a worker asks the
    leader); the standby's peak grows by less than one value, and it goes on: it still stands
    by, and takes the job over, with the key set on the leader, when the leader is killed."""
    schedulers = Schedulers(processes, etcd_cluster)
    leader = schedulers.leader()
    standby = next(host for host in HOSTS if host != leader)
    here, there = schedulers.address(leader), schedulers.address(standby)
    for node_id in ("0", "1"):
        assert register(here, node_id).HasField("accepted")
    kv_call(here, "KvSet", pb.KvSetRequest(key="plan", value=b"v" * (2 * edge.PIECE_BYTES)))
    pid = schedulers.procs[standby].pid
    before = peak_rss_kb(pid)

    errors = refusals_of_a_flood(there)

    grown_mib = (peak_rss_kb(pid) - before) / 1024
    assert {error.code() for error in errors} == {grpc.StatusCode.UNAVAILABLE}  # type: ignore[attr-defined]
    for error in errors:
        assert (LEADER_KEY, here) in tuple(error.trailing_metadata() or ())  # type: ignore[attr-defined]
        assert f"not the leader: the leader is at {here}" in (error.details() or "")  # type: ignore[attr-defined]
    assert grown_mib < 32, f"the standby's peak grew by {grown_mib:.0f} MiB"

    assert schedulers.role(standby) == "standby"
    os.kill(schedulers.procs[leader].pid, signal.SIGKILL)
    wait_until(lambda: schedulers.role(standby) == "leader", LEASE_S + 10, "the standby to lead")
    answer = kv_call(there, "KvGet", pb.KvGetRequest(keys=["plan", "flood"]))
    assert list(answer.values) == [b"v" * (2 * edge.PIECE_BYTES)]  # type: ignore[attr-defined]
    assert list(answer.missing) == ["flood"]  # type: ignore[attr-defined]
    assert "Traceback" not in schedulers.procs[standby].output
