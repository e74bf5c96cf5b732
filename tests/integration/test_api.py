"""The public API in real worker processes, and the protocol against a real in-process server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import cluster
from cluster.protocol import version
from cluster.protocol.config import Limits
from cluster.protocol.environment import from_env
from cluster.protocol.errors import (
    AccessDeniedError,
    CapacityError,
    ClusterError,
    JobFailedError,
    RegistrationRefused,
)
from cluster.scheduler import JobSettings, SchedulerServer
from cluster.scheduler.machine.state import NodeState, Phase
from cluster.testing import free_port
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from cluster.worker.agent import WorkerAgent
from cluster.worker.identity import NodeIdentity, new_incarnation
from tests.procs import PYTHON, ROOT, Procs, job_env

PROBE = [str(ROOT / "tests" / "integration" / "scripts" / "api_probe.py")]


def test_public_api_in_real_workers(processes: Procs) -> None:
    port = free_port()
    base = job_env(3, port)
    sched = processes.start_role("scheduler", "MS_SCHED", PROBE, base)
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", PROBE, {**base, "MS_NODE_ID": f"n{i}"})
        for i in range(3)
    ]
    for w in workers:
        assert w.wait(30) == 0, w.output
    assert sched.wait(30) == 0, sched.output
    seen = [json.loads(w.output.strip().splitlines()[-2]) for w in workers]
    # The signal the agent ends the process with is the library's during the job only.
    assert all(w.output.strip().splitlines()[-1].endswith("default: True") for w in workers)
    assert all(s["sigusr2_taken"] for s in seen)
    seen.sort(key=lambda s: s["rank"])
    assert [s["rank"] for s in seen] == [0, 1, 2]
    # Same host for all: ranks by node id, local ranks equal ranks, local size 3.
    assert [s["node_id"] for s in seen] == ["n0", "n1", "n2"]
    assert all(s["local_rank"] == s["rank"] and s["local_size"] == 3 for s in seen)
    assert all(s["size"] == 3 and s["generation"] == 1 and s["rejoin"] is False for s in seen)
    assert all(s["peers"] == seen[0]["peers"] for s in seen)
    assert [p[:2] for p in seen[0]["peers"]] == [[0, "n0"], [1, "n1"], [2, "n2"]]
    assert sorted(s["counted"] for s in seen) == [1, 2, 3]
    assert all(s["final_count"] == 3 for s in seen)
    assert all(s["addresses"] == [f"10.0.0.{r}:{r + 1000}" for r in range(3)] for s in seen)
    assert all(s["seed"] == {"seed": 1236} for s in seen)
    assert all(s["gathered"] == [{"rank": r, "peers": 3} for r in range(3)] for s in seen)
    assert all(s["missing"] == "KeyError" for s in seen)
    assert all("still missing 'never-set'" in s["wait_timeout"] for s in seen)
    assert all(s["one_key"] == ["yes"] for s in seen)
    assert all(s["longest"] == ["yes"] for s in seen)
    # A wrong argument is refused at once, in the caller, naming it; the counter is untouched.
    assert seen[0]["refused"] == {
        "set": "CollectiveError: kv_store().set: value=5 is of type int; it must be bytes or "
        "str (encode other values: str(n))",
        "add": "CollectiveError: kv_store().add: amount=1.5 is of type float; it must be an "
        "int (counters are 64-bit integers)",
        "add_big": f"CollectiveError: kv_store().add: amount={2**63} is outside "
        f"[{-(2**63)}, {2**63 - 1}]: counters are 64-bit integers",
        "get": "CollectiveError: kv_store().get: key=3 is of type int; it must be a str",
        "wait": "CollectiveError: kv_store().wait: key=3 is of type int; it must be a str",
        "wait_timeout": "CollectiveError: kv_store().wait: timeout_s='30' is of type str; it "
        "must be a number of seconds",
        # Refused before the call: a deadline past what gRPC holds failed it at once.
        **{
            name: f"CollectiveError: kv_store().wait: timeout_s={shown} is outside [0, 1e+09]: "
            "it must be a finite number of seconds (at most about 31 years, what the call's "
            "deadline can hold)"
            for name, shown in (
                ("wait_inf", "inf"),
                ("wait_nan", "nan"),
                ("wait_huge", "1e+300"),
                ("wait_negative", "-1"),
            )
        },
    }


@pytest.mark.parametrize(
    "call",
    [
        cluster.get_rank,
        cluster.get_group_size,
        cluster.get_local_rank,
        cluster.get_local_size,
        cluster.get_peers,
        cluster.barrier,
        lambda: cluster.allgather_object(1),
        lambda: cluster.broadcast_object(1),
        cluster.kv_store,
    ],
)
def test_calls_before_init_say_to_call_init(call: object) -> None:
    with pytest.raises(cluster.NotInitializedError, match=r"call cluster\.init\(\) first"):
        call()  # type: ignore[operator]


def test_uncaught_cluster_error_is_one_line_without_traceback() -> None:
    result = subprocess.run(
        [PYTHON, "-c", "import cluster; cluster.get_rank()"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "cluster: NotInitializedError: this needs the job to be formed: call cluster.init() "
        "first (in every worker)"
    ]


# -- the protocol against a real in-process scheduler ----------------------------------------


def settings(n: int, **kw: float) -> JobSettings:
    values = {"node_timeout_s": 30.0, "topo_timeout_s": 60.0, "heartbeat_interval_s": 0.5}
    values.update(kw)
    return JobSettings(worker_num=n, server_num=0, **values)  # type: ignore[arg-type]


@pytest.fixture
async def server() -> AsyncIterator[SchedulerServer]:
    async with SchedulerServer(settings(2)) as srv:
        yield srv


def make_agent(port: int, n: int, node_id: str, **env: str) -> WorkerAgent:
    config = from_env(
        {
            "MS_ROLE": "MS_WORKER",
            "MS_WORKER_NUM": str(n),
            "MS_SCHED_HOST": "127.0.0.1",
            "MS_SCHED_PORT": str(port),
            "MS_TOPO_TIMEOUT": "20",
            **env,
        }
    )
    identity = NodeIdentity(node_id, new_incarnation(), "127.0.0.1", 40000)
    return WorkerAgent(config, identity, say=lambda _: None, on_fatal=lambda _: None)


async def test_two_agents_form_a_job_and_gather(server: SchedulerServer) -> None:
    a, b = make_agent(server.port, 2, "a"), make_agent(server.port, 2, "b")
    ta, tb = await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
    assert (ta.rank, tb.rank) == (0, 1)
    assert ta.peers == tb.peers
    got = await asyncio.wait_for(
        asyncio.gather(a.exchange("allgather", b"A"), b.exchange("allgather", b"B")), 10
    )
    assert got == [[b"A", b"B"], [b"A", b"B"]]
    await asyncio.gather(a.finish(), b.finish())
    assert await asyncio.wait_for(server.wait_done(), 10) is True
    await asyncio.gather(a.close(), b.close())


async def test_mismatched_collectives_are_reported_not_deadlocked(server: SchedulerServer) -> None:
    a, b = make_agent(server.port, 2, "a"), make_agent(server.port, 2, "b")
    await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
    calls = {
        asyncio.create_task(a.exchange("barrier", b"")),
        asyncio.create_task(b.exchange("allgather", b"x")),
    }
    # Whichever call reaches the scheduler second is the one told about the mismatch, by the
    # reason of its refusal (the words are for people).
    done, pending = await asyncio.wait(calls, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1
    with pytest.raises(cluster.CollectiveMismatchError, match="same collectives in the same order"):
        done.pop().result()
    pending.pop().cancel()
    await asyncio.gather(a.close(), b.close())


async def test_second_process_with_a_live_node_id_is_refused(server: SchedulerServer) -> None:
    a = make_agent(server.port, 2, "a")
    start = asyncio.create_task(a.start())
    stub = pb_grpc.SchedulerStub(grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))
    request = pb.RegisterRequest(
        node_id="a",
        role=pb.ROLE_WORKER,
        host="127.0.0.1",
        port=1,
        incarnation=7,
        worker_num=2,
        credential=b"c" * 32,
        protocol_revision=version.PROTOCOL_REVISION,
    )
    # Wait until "a" is in (observable through Status), then try to take its id.
    for _ in range(500):
        status = await stub.Status(pb.StatusRequest(), timeout=5)
        if status.nodes:
            break
        await asyncio.sleep(0.01)  # sleep-ok: polls Status, at most 500 rounds
    response = await stub.Register(request, timeout=5)
    assert response.refused.reason == pb.REFUSAL_NODE_ALIVE
    assert "MS_NODE_TIMEOUT" in response.refused.message
    assert 29 < response.refused.retry_after_s <= 30
    start.cancel()
    await a.close()


async def test_worker_num_mismatch_is_refused_clearly(server: SchedulerServer) -> None:
    agent = make_agent(server.port, 3, "a")
    with pytest.raises(RegistrationRefused, match=r"MS_WORKER_NUM=3.*MS_WORKER_NUM=2"):
        await asyncio.wait_for(agent.start(), 20)
    await agent.close()


async def test_one_node_too_many_is_refused(server: SchedulerServer) -> None:
    agents = [make_agent(server.port, 2, name) for name in ("a", "b")]
    await asyncio.wait_for(asyncio.gather(*(x.start() for x in agents)), 20)
    extra = make_agent(server.port, 2, "c")
    with pytest.raises(RegistrationRefused, match="already has all 2 workers"):
        await asyncio.wait_for(extra.start(), 20)
    for x in [*agents, extra]:
        await x.close()


async def test_status_and_health(server: SchedulerServer) -> None:
    a, b = make_agent(server.port, 2, "a"), make_agent(server.port, 2, "b")
    await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        status = await pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=5)
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="cluster.v1.Scheduler"), timeout=5
        )
    assert status.phase == pb.PHASE_READY
    assert status.generation == 1
    assert [(n.rank, n.node_id, n.state, n.connected) for n in status.nodes] == [
        (0, "a", pb.NODE_STATE_ALIVE, True),
        (1, "b", pb.NODE_STATE_ALIVE, True),
    ]
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    await asyncio.gather(a.close(), b.close())


async def test_a_dead_peer_fails_a_waiting_collective() -> None:
    async with SchedulerServer(settings(2)) as srv:
        a, b = make_agent(srv.port, 2, "a"), make_agent(srv.port, 2, "b")
        await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
        waiting = asyncio.create_task(a.exchange("barrier", b""))
        await b.close()  # b's stream breaks: b is dead to the scheduler
        with pytest.raises(JobFailedError, match="rank 1"):
            await asyncio.wait_for(waiting, 10)
        assert await asyncio.wait_for(srv.wait_done(), 10) is False
        await a.close()


def watched_agent(
    port: int, node_id: str, failures: asyncio.Queue[ClusterError], **env: str
) -> WorkerAgent:
    return WorkerAgent(
        make_agent(port, 2, node_id, **env).config,
        NodeIdentity(node_id, new_incarnation(), "127.0.0.1", 40000),
        say=lambda _: None,
        on_fatal=failures.put_nowait,
    )


async def test_heartbeats_keep_nodes_in() -> None:
    async with SchedulerServer(settings(2, node_timeout_s=1.0, heartbeat_interval_s=0.2)) as srv:
        failures: asyncio.Queue[ClusterError] = asyncio.Queue()
        a, b = (watched_agent(srv.port, n, failures) for n in "ab")
        await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
        # Over twice MS_NODE_TIMEOUT: only the nodes' heartbeats keep them in.
        await asyncio.sleep(2.5)  # sleep-ok: showing that nothing happens takes the time
        assert failures.empty(), failures.get_nowait()
        assert srv.core.state.phase is Phase.READY
        for member in srv.core.state.members.values():
            assert member.state is NodeState.ALIVE
            assert time.monotonic() - member.last_seen < 1.0
        await asyncio.gather(a.finish(), b.finish())
        await asyncio.gather(a.close(), b.close())


async def test_a_node_without_heartbeats_is_failed_after_the_node_timeout() -> None:
    async with SchedulerServer(settings(2, node_timeout_s=1.0, heartbeat_interval_s=0.2)) as srv:
        failures: asyncio.Queue[ClusterError] = asyncio.Queue()
        a = watched_agent(srv.port, "a", failures)
        b = watched_agent(srv.port, "b", failures, MS_DISABLE_HEARTBEAT="1")
        await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
        failure = await asyncio.wait_for(failures.get(), 10)
        assert "'b'" in str(failure), failure
        assert "no heartbeat for" in str(failure), failure
        await asyncio.gather(a.close(), b.close())


async def test_refusals_reach_the_caller_as_clear_errors() -> None:
    """UNAUTHENTICATED and RESOURCE_EXHAUSTED become AccessDeniedError and CapacityError, with
    the scheduler's message."""
    limits = Limits(kv_max_bytes=64, kv_max_keys=10)
    async with SchedulerServer(dataclasses.replace(settings(2), limits=limits)) as srv:
        a, b = make_agent(srv.port, 2, "a"), make_agent(srv.port, 2, "b")
        await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
        with pytest.raises(
            CapacityError, match=r"kv set refused by the scheduler: .*CLUSTER_KV_MAX_BYTES=64"
        ):
            await a.kv_set("big", b"x" * 100)
        await a.kv_set("small", b"x")
        # Speaking for "a" with b's credential: refused, and "a" is untouched.
        a._metadata = (a._metadata[0], a._metadata[1], b._metadata[2])
        with pytest.raises(AccessDeniedError, match="does not carry its credential"):
            await a.kv_get(["small"])
        with pytest.raises(AccessDeniedError, match="does not carry its credential"):
            await a.exchange("barrier", b"")
        assert srv.core.state.members["a"].state is NodeState.ALIVE
        await asyncio.gather(a.close(), b.close())
