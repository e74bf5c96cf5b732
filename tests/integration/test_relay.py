"""A host's relay (`mscluster relay`, CLUSTER_RELAY): its workers' calls reach the scheduler over
one connection, each with its own proof, and a worker without its relay goes direct."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol.config import Limits
from cluster.protocol.environment import from_env
from cluster.protocol.errors import (
    AccessDeniedError,
    CapacityError,
    CollectiveMismatchError,
    PeerFailedError,
)
from cluster.scheduler import JobSettings, SchedulerServer
from cluster.scheduler.machine.state import NodeState
from cluster.testing import Process, free_port
from cluster.tools.relay import Relay, RelaySettings
from cluster.transport import channel, stub, table_file
from cluster.transport.relay import stamp as relay_stamp
from cluster.transport.upstreams import Upstreams
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import peer_table
from cluster.worker.agent import WorkerAgent
from cluster.worker.identity import NodeIdentity, new_incarnation
from tests import tmpfs
from tests.aio import eventually
from tests.procs import MSCLUSTER, ROOT, Procs, job_env
from tests.sockets import connections_by_owner, established

EXAMPLE = [str(ROOT / "examples" / "allgather_check.py")]
LINE = re.compile(r"^allgather rank=(\d+) size=(\d+) result=(\[.*\])$", re.MULTILINE)


def settings(n: int) -> JobSettings:
    return JobSettings(
        worker_num=n,
        server_num=0,
        node_timeout_s=30.0,
        topo_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        limits=Limits(kv_max_bytes=64, kv_max_keys=10),
    )


def make_agent(port: int, n: int, node_id: str, said: list[str], **env: str) -> WorkerAgent:
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
    return WorkerAgent(config, identity, say=said.append, on_fatal=lambda _: None)


async def test_a_relay_passes_each_workers_calls_and_refusals_unchanged(short_dir: Path) -> None:
    """Registration, the event stream, heartbeats, calls and their refusals (status, message and
    kind) all go through the relay as they would direct; a worker speaking for another with its
    own credential is refused as it would be direct: the relay speaks for nobody."""
    async with SchedulerServer(settings(2)) as srv:
        address = f"unix:{short_dir / 'r.sock'}"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 2, 30.0))
        assert await relay.start() == address
        try:
            said: list[str] = []
            a = make_agent(srv.port, 2, "a", said, CLUSTER_RELAY=address)
            b = make_agent(srv.port, 2, "b", said, CLUSTER_RELAY=address)
            assert a._link.route.relay == address
            tops = await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
            assert [t.size for t in tops] == [2, 2]
            assert {p.node_id for p in tops[0].peers} == {"a", "b"}
            with pytest.raises(CapacityError, match=r"CLUSTER_KV_MAX_BYTES=64"):
                await a.kv_set("big", b"x" * 100)
            await a.kv_set("small", b"x")
            assert await b.kv_get(["small"]) == ([b"x"], [])
            assert await b.kv_wait(["small"], 1.0) == [b"x"]  # a call with a deadline
            assert await asyncio.wait_for(
                asyncio.gather(a.exchange("allgather", b"1"), b.exchange("allgather", b"2")), 10
            ) == [[b"1", b"2"], [b"1", b"2"]]
            await _told_a_mismatch(a, b)
            a._metadata = (a._metadata[0], a._metadata[1], b._metadata[2])
            with pytest.raises(AccessDeniedError, match="does not carry its credential"):
                await a.kv_get(["small"])
            assert srv.core.state.members["a"].state is NodeState.ALIVE
            assert said == []
            await asyncio.gather(a.close(), b.close())
        finally:
            await relay.stop()


async def _told_a_mismatch(a: WorkerAgent, b: WorkerAgent) -> None:
    """`a` and `b` call different collectives as the same one: the second to reach the scheduler
    is told so by its refusal's reason (binary trailing metadata), as direct."""
    calls = {
        asyncio.ensure_future(a.exchange("barrier", b"")),
        asyncio.ensure_future(b.exchange("broadcast", b"x")),
    }
    done, pending = await asyncio.wait(calls, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1
    with pytest.raises(CollectiveMismatchError, match="same collectives in the same order"):
        done.pop().result()
    pending.pop().cancel()


async def test_a_worker_whose_relay_does_not_answer_goes_direct(short_dir: Path) -> None:
    async with SchedulerServer(settings(1)) as srv:
        said: list[str] = []
        absent = f"unix:{short_dir / 'none.sock'}"
        agent = make_agent(srv.port, 1, "a", said, CLUSTER_RELAY=absent)
        topology = await asyncio.wait_for(agent.start(), 20)
        assert agent._link.route.relay is None
        assert topology.size == 1
        assert said == [
            f"no relay answers at {absent} (nothing takes connections there: No such file or "
            "directory): this node talks to the scheduler directly"
        ]
        await agent.close()


def slots(relay: Relay) -> int:
    """The workers' streams a relay carries now, over all its links."""
    links = relay._forwarder.links._links.values()  # type: ignore[attr-defined]
    return sum(len(link.slots) for link in links)


async def back_direct_from_a_stopped_relay(
    srv: SchedulerServer, address: str, said: list[str]
) -> list[WorkerAgent]:
    """Two workers ("a", "b") formed through a relay at `address` that then stopped: returned
    once both are back with the scheduler directly, alive, in a later generation (recovery on)."""
    relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 2, 30.0))
    await relay.start()
    agents = [make_agent(srv.port, 2, n, said, CLUSTER_RELAY=address) for n in "ab"]
    await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 20)
    await relay.stop()
    state = srv.core.state

    def back_direct() -> bool:
        held = {a.topology.generation if a.topology else 0 for a in agents}
        alive = all(m.state is NodeState.ALIVE for m in state.members.values())
        return alive and held == {state.generation} and state.generation > 1

    await eventually(back_direct, "both workers back directly, in a later generation", 20)
    return agents


async def test_workers_whose_relay_comes_back_move_their_streams_back_to_it(
    short_dir: Path,
) -> None:
    """Recovery on: the relay stops, and its two workers go to the scheduler directly (their
    streams broke: each rejoins, a generation each). A relay started again on the same socket
    takes their streams back: each registers again through it, with its own incarnation, and
    its direct stream ends superseded, which is no failure (the generation stays); the job goes
    on."""
    async with SchedulerServer(dataclasses.replace(settings(2), recovery=True)) as srv:
        address = f"unix:{short_dir / 'r.sock'}"
        said: list[str] = []
        agents = await back_direct_from_a_stopped_relay(srv, address, said)
        state = srv.core.state
        generation = state.generation
        lost = f"lost the relay at {address}: this node talks to the scheduler directly"
        assert said.count(lost) == 2, said
        again = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 2, 30.0))
        await again.start()
        try:
            await eventually(lambda: slots(again) == 2, "both streams through the relay again", 20)
            port = f":{srv.port}"
            to_scheduler = lambda: sum(r.endswith(port) for _, r in established(os.getpid()))  # noqa: E731
            await eventually(lambda: to_scheduler() == 1, "the relay's the one connection", 20)
            back = f"the relay at {address} answers again: this node talks through it"
            assert said.count(back) == 2, said
            assert state.generation == generation  # the move failed nobody
            assert all(m.state is NodeState.ALIVE for m in state.members.values())
            gathers = (a.exchange("allgather", n.encode()) for a, n in zip(agents, "ab"))
            done = await asyncio.wait_for(asyncio.gather(*gathers), 10)
            assert done == [[b"a", b"b"]] * 2
            await asyncio.gather(*(a.close() for a in agents))
        finally:
            await again.stop()


def start_relayed_job(
    processes: Procs, sock: Path, n: int, hold_s: float = 60.0, **env: str
) -> tuple[Process, Process, list[Process]]:
    """A scheduler, `mscluster relay` (once it serves), and `n` workers through it, holding
    `hold_s` after their allgather (0: they finish at once); with MS_ENABLE_RECOVERY in `env`,
    worker i is node "i"."""
    base = job_env(n, free_port(), **env)
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, base)
    relay = processes.start("relay", [*MSCLUSTER, "relay", "--socket", f"unix:{sock}"], base)
    relay.wait_for_output("mscluster relay: serving", 30)
    relayed = {**base, "CLUSTER_RELAY": f"unix:{sock}"}
    args = [*EXAMPLE, "--hold", str(hold_s)]
    ids = [{"MS_NODE_ID": str(i)} if "MS_ENABLE_RECOVERY" in env else {} for i in range(n)]
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", args, {**relayed, **ids[i]}) for i in range(n)
    ]
    return sched, relay, workers


def test_workers_through_a_relay_hold_one_connection_and_fail_with_it(
    processes: Procs, short_dir: Path
) -> None:
    """Four real workers through `mscluster relay`: the scheduler holds one connection, the
    relay's, and none of a worker. SIGKILL of the relay (recovery off) is its workers failing:
    every process of the job exits non-zero, none hangs."""
    sched, relay, workers = start_relayed_job(
        processes, short_dir / "r.sock", 4, MS_NODE_TIMEOUT="10"
    )
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    ranks = sorted(int(LINE.search(w.output)[1]) for w in workers)  # type: ignore[index]
    assert ranks == [0, 1, 2, 3]
    pids = [relay.pid, *(w.pid for w in workers)]
    owners = connections_by_owner(sched.pid, pids)
    assert owners == {relay.pid: 1}, owners
    relay.popen.send_signal(signal.SIGKILL)
    # Within MS_NODE_TIMEOUT: the workers, back directly, hear that the job failed.
    for proc in [sched, *workers]:
        assert proc.wait(30) != 0, proc.output
        assert "Traceback" not in proc.output
    assert "died" in sched.output, sched.output
    for w in workers:
        assert "lost the relay at unix:" in w.output, w.output
        # Back in before the job failed: told on its stream; after: refused, the job over;
        # after the scheduler's drain (a loaded machine): it finds no scheduler, and gives up
        # after MS_NODE_TIMEOUT.
        told = "JobFailedError: job failed: rank" in w.output
        refused = "is over (failed: rank" in w.output
        assert told or refused or "is unreachable" in w.output, w.output


def test_a_hung_worker_behind_a_relay_is_found_by_its_silence(
    processes: Procs, short_dir: Path
) -> None:
    """Detection is unchanged: a stopped worker's connection to the relay stays open, and so
    does the relay's stream for it, but its heartbeats stop: the scheduler fails the job
    naming it, and every other process exits."""
    sched, relay, workers = start_relayed_job(
        processes, short_dir / "r.sock", 3, MS_NODE_TIMEOUT="2"
    )
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    victim = workers[0]
    victim.popen.send_signal(signal.SIGSTOP)
    try:
        for proc in [workers[1], workers[2], sched]:
            assert proc.wait(20) != 0, proc.output
            assert "no heartbeat" in proc.output, proc.output
        assert relay.running
    finally:
        victim.popen.send_signal(signal.SIGKILL)


async def gather_rolling_back(agents: list[WorkerAgent]) -> list[list[bytes]]:
    """Every agent's allgather of its node id, in one generation: a round of a generation the
    job has left (the scheduler found the nodes silent before they were back, and they rejoined
    in a new one) fails with PeerFailedError, and the agents gather again in the new one, as
    a training loop rolls back and goes on."""
    while True:
        topology = agents[0].topology
        assert topology is not None
        gathers = [
            a.exchange("allgather", a.identity.node_id.encode(), generation=topology.generation)
            for a in agents
        ]
        gathered = await asyncio.gather(*gathers, return_exceptions=True)
        failed = [answer for answer in gathered if isinstance(answer, BaseException)]
        if not failed:
            return [answer for answer in gathered if isinstance(answer, list)]
        if not all(isinstance(error, PeerFailedError) for error in failed):
            raise failed[0]
        await asyncio.gather(*(a.wait_generation(topology.generation) for a in agents))


async def test_a_port_wait_tells_a_refusal_from_a_connection_and_from_no_answer() -> None:
    """A worker's wait (`await_listening`) says why while refused and stops at what it cannot
    tell (no address); a relay's (`await_taken`) goes on through both until the port listens."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = held.getsockname()[1]
        assert "connection refused" in await channel.await_listening("127.0.0.1", port, 0.05, 0.01)
        assert await channel.await_taken("127.0.0.1", port, 0.05, 0.01) is False
        held.listen()
        assert await channel.await_listening("127.0.0.1", port, 1.0, 0.01) == ""
        assert await channel.await_taken("127.0.0.1", port, 1.0, 0.01) is True
    assert await channel.await_listening("nowhere.invalid", port, 2.0, 0.01) == ""
    assert await channel.await_taken("nowhere.invalid", port, 0.2, 0.01) is False


async def test_waits_for_a_port_keep_their_pace_however_short_each_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waits shorter than their pace, one after another (the end of a worker's quick first
    second; a relay's waits in a job of 65,536 nodes, whose pace is longer than the wait),
    try a refusing port once per pace, not as fast as the loop turns."""
    tries: list[float] = []
    real_try = channel._try_addresses

    async def counted(*args: Any) -> bool | None:
        tries.append(asyncio.get_running_loop().time())
        return await real_try(*args)

    monkeypatch.setattr(channel, "_try_addresses", counted)
    loop = asyncio.get_running_loop()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = held.getsockname()[1]
        every_s, began = 0.2, loop.time()
        while loop.time() - began < 1.0:
            assert "refused" in await channel.await_listening("127.0.0.1", port, 0.05, every_s)
            assert await channel.await_taken("127.0.0.1", port, 0.05, every_s) is False
    spent = loop.time() - began
    assert len(tries) <= spent / every_s + 1, tries
    assert all(b - a >= every_s * 0.99 for a, b in itertools.pairwise(tries)), tries


async def test_a_relay_reconnects_once_the_schedulers_port_takes_connections() -> None:
    """A relay's channel cut off from its scheduler waits out gRPC's pause between connection
    attempts (here 60 s, a minute in a job of 65,536 nodes): the relay waits for the port
    itself, and its next call after the scheduler listens goes through at once."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # the scheduler's port, refusing connections for now
        port = held.getsockname()[1]
        address = f"127.0.0.1:{port}"
        pause = [("grpc.initial_reconnect_backoff_ms", 60_000)]
        pause += [("grpc.min_reconnect_backoff_ms", 60_000)]
        said: list[str] = []
        upstreams = Upstreams(
            [address],
            lambda at: grpc.aio.insecure_channel(at, options=pause),
            said.append,
            pause_s=60.0,
        )
        status_path = stub.methods()["Status"][1]

        async def status() -> grpc.StatusCode:
            where, method = upstreams.method("unary_unary", status_path)
            try:
                await method(b"", timeout=5)
            except grpc.aio.AioRpcError as exc:
                upstreams.answered(where, exc.code(), exc.trailing_metadata())
                return exc.code()
            return grpc.StatusCode.OK

        try:
            assert await status() == grpc.StatusCode.UNAVAILABLE  # refused: the channel pauses
            held.close()
            async with SchedulerServer(settings(2), port=port):
                back = f"the scheduler at {address} takes connections again"
                await eventually(lambda: said == [back], "the relay finding the port", 10)
                assert await status() == grpc.StatusCode.OK
        finally:
            await upstreams.close()


async def test_a_stopped_relay_is_left_by_its_workers(processes: Procs, short_dir: Path) -> None:
    """`mscluster relay` stopped (SIGSTOP: its socket still takes connections, its process
    answers nothing), recovery on: its workers' streams fall silent, and a silent stream behind
    a relay (or the local hop's pings unanswered) is the relay lost. They go to the scheduler
    directly, as when it dies, and are back in the job."""
    job = dataclasses.replace(settings(2), recovery=True, node_timeout_s=2.0)
    async with SchedulerServer(job) as srv:
        sock = short_dir / "r.sock"
        command = [*MSCLUSTER, "relay", "--socket", f"unix:{sock}"]
        relay = processes.start("relay", command, job_env(2, srv.port, MS_NODE_TIMEOUT="2"))
        await asyncio.to_thread(relay.wait_for_output, "mscluster relay: serving", 30)
        said: list[str] = []
        address = f"unix:{sock}"
        env = {"CLUSTER_RELAY": address, "MS_NODE_TIMEOUT": "2", "MS_ENABLE_RECOVERY": "1"}
        env["MS_RECOVERY_PATH"] = str(short_dir)
        agents = [make_agent(srv.port, 2, n, said, MS_NODE_ID=n, **env) for n in "ab"]
        state = srv.core.state
        try:
            await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 20)
            relay.popen.send_signal(signal.SIGSTOP)
            lost = f"lost the relay at {address}: this node talks to the scheduler directly"
            await eventually(lambda: said.count(lost) == 2, "both workers off the relay", 30)
            # Back with the scheduler directly: the relay is stopped, so a collective that
            # completes went direct.
            assert await asyncio.wait_for(gather_rolling_back(agents), 30) == [[b"a", b"b"]] * 2
            assert all(m.state is NodeState.ALIVE for m in state.members.values())
        finally:
            await asyncio.gather(*(a.close() for a in agents))
            relay.popen.send_signal(signal.SIGKILL)


@dataclasses.dataclass
class RelayedJob:
    """A scheduler process (recovery on), the host's relay process, and two workers' agents
    (not started) that reach the scheduler through it."""

    port: int
    scheduler_env: dict[str, str]
    sched: Process
    relay: Process
    agents: list[WorkerAgent]
    said: list[str]

    def kill_scheduler(self) -> None:
        self.sched.popen.send_signal(signal.SIGKILL)
        self.sched.popen.wait(10)

    async def relay_cannot_reach(self) -> None:
        """Until the workers said, twice in all, that their relay cannot reach the scheduler."""
        cannot = f"waiting for the scheduler at 127.0.0.1:{self.port}: the relay cannot reach it"
        await eventually(
            lambda: sum(line.startswith(cannot) for line in self.said) >= 2, "the relay's word", 30
        )


async def relayed_job(processes: Procs, short_dir: Path, **more: str) -> RelayedJob:
    """`more`: variables of every process's environment (MS_NODE_TIMEOUT, say)."""
    port = free_port()
    recovery = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(short_dir / "state")}
    env = job_env(2, port, **recovery, **more)
    scheduler_env = {**env, "MS_ROLE": "MS_SCHED"}
    sched = processes.start("sched", [*MSCLUSTER, "scheduler"], scheduler_env)
    sock = short_dir / "r.sock"
    relay = processes.start("relay", [*MSCLUSTER, "relay", "--socket", f"unix:{sock}"], env)
    await asyncio.to_thread(relay.wait_for_output, "mscluster relay: serving", 30)
    said: list[str] = []
    extra = {"CLUSTER_RELAY": f"unix:{sock}", "MS_ENABLE_RECOVERY": "1", **more}
    extra["MS_RECOVERY_PATH"] = str(short_dir / "workers")
    agents = [make_agent(port, 2, n, said, MS_NODE_ID=n, **extra) for n in "ab"]
    return RelayedJob(port, scheduler_env, sched, relay, agents, said)


async def test_workers_behind_a_relay_wait_through_it_for_a_restarted_scheduler(
    processes: Procs, short_dir: Path
) -> None:
    """The scheduler SIGKILLed and started again (recovery on): its workers behind a relay hear
    from the relay that it cannot reach the scheduler, and ask it again rather than probing the
    scheduler themselves (the relay waits for its port for the host; 65,536 workers probing it
    10 times a second each would be 655,000 tries a second). They are back through the relay."""
    job = await relayed_job(processes, short_dir)
    try:
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in job.agents)), 30)
        job.kill_scheduler()
        await job.relay_cannot_reach()
        processes.start("sched-again", [*MSCLUSTER, "scheduler"], job.scheduler_env)
        assert await asyncio.wait_for(gather_rolling_back(job.agents), 60) == [[b"a", b"b"]] * 2
        probed = [line for line in job.said if "nothing took the connection" in line]
        assert not probed, job.said  # no probe of its own found the scheduler's port refusing
    finally:
        await asyncio.gather(*(a.close() for a in job.agents))


async def test_a_call_cut_off_behind_a_relay_is_made_again_at_its_pace(
    processes: Procs, short_dir: Path
) -> None:
    """A worker in a collective when the scheduler dies (recovery on) makes its call again
    until the scheduler is back; behind a relay, which answers at once that it cannot reach
    the scheduler, each attempt ends at once, and the worker must pause between them (the
    core's `RetryCall`) rather than call its relay as fast as the two can turn."""
    job = await relayed_job(processes, short_dir)
    agents, relay = job.agents, job.relay
    waiting: asyncio.Future[list[bytes]] | None = None
    try:
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 30)

        # A wait given up on (a timeout) leaves nothing behind.
        def event_waits() -> int:
            return sum(t.get_coro().__qualname__ == "Event.wait" for t in asyncio.all_tasks())

        before = event_waits()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(agents[1].wait_generation(99), 0.05)
        await eventually(lambda: event_waits() == before, "the wait's task ended", 5)
        waiting = asyncio.ensure_future(agents[0].exchange("barrier", b""))  # b never joins
        job.kill_scheduler()
        cpu_before, wall_before = relay.cpu_s(), time.monotonic()
        await job.relay_cannot_reach()
        cpu_s, wall_s = relay.cpu_s() - cpu_before, time.monotonic() - wall_before
        assert not waiting.done()
        # Paced, the relay answers two workers' attempts every 0.05-0.1 s: a few percent of a
        # core. Unpaced it answered one worker's call again and again: most of a core.
        assert cpu_s < 0.25 * wall_s, (cpu_s, wall_s)
    finally:
        if waiting is not None:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        await asyncio.gather(*(a.close() for a in agents))


async def test_a_host_fetches_a_large_table_once_through_its_relay(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table large enough to travel compressed comes to a worker behind a relay as its
    digest: the workers fetch it (each with a fetch of its own, as separate processes do), and
    the relay asks the scheduler once for all of them. Every worker holds the whole table."""
    n = 200  # over 4 KiB of table: compressed, so named by digest
    async with SchedulerServer(settings(n)) as srv:
        asked: list[bytes] = []
        answer = srv.core.peer_table

        def counted(caller: Any, digest: bytes) -> bytes:
            asked.append(digest)
            return answer(caller, digest)

        monkeypatch.setattr(srv.core, "peer_table", counted)
        address = f"unix:{short_dir / 'r.sock'}"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", n, 30.0))
        await relay.start()
        said: list[str] = []
        agents = [make_agent(srv.port, n, f"w{i}", said, CLUSTER_RELAY=address) for i in range(n)]
        for agent in agents:
            agent.tables = peer_table.FetchedTables()
        try:
            tops = await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 60)
            assert {t.size for t in tops} == {n}
            assert {p.node_id for p in tops[-1].peers} == {f"w{i}" for i in range(n)}
            assert [t.peer(t.rank).node_id for t in tops] == [a.identity.node_id for a in agents]
            assert len(asked) == 1, asked  # one fetch upstream for the host's 200 workers
            # Each maps the host's one copy, and reads only what it needs of it.
            assert all(isinstance(t.table, table_file.MappedTable) for t in tops)
            assert said == []
        finally:
            await asyncio.gather(*(a.close() for a in agents))
            await relay.stop()


async def test_workers_map_the_table_of_a_relay_process(processes: Procs, short_dir: Path) -> None:
    """`mscluster relay`, its own process, shares the host's copy of a large table: the workers
    (another process) map it from the relay's memory and read it in place."""
    n = 200
    async with SchedulerServer(settings(n)) as srv:
        sock = short_dir / "r.sock"
        scheduler = f"127.0.0.1:{srv.port}"
        command = [*MSCLUSTER, "relay", "--socket", f"unix:{sock}", "--scheduler", scheduler]
        relay = processes.start("relay", command, job_env(n, srv.port))
        await asyncio.to_thread(relay.wait_for_output, "mscluster relay: serving", 30)
        said: list[str] = []
        address = f"unix:{sock}"
        agents = [make_agent(srv.port, n, f"w{i}", said, CLUSTER_RELAY=address) for i in range(n)]
        fetched = peer_table.FetchedTables()  # not another test's table of the same digest
        for agent in agents:
            agent.tables = fetched
        try:
            tops = await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 60)
            assert [t.peer(t.rank).node_id for t in tops] == [a.identity.node_id for a in agents]
            assert isinstance(tops[0].table, table_file.MappedTable)
            assert {p.node_id for p in tops[0].peers} == {f"w{i}" for i in range(n)}
            assert said == []
        finally:
            await asyncio.gather(*(a.close() for a in agents))
        assert "cannot share" not in relay.output


async def test_a_worker_that_cannot_map_the_hosts_table_fetches_it(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay's shared copy cannot be opened (another process namespace, a /proc that hides
    it): the worker asks again for the bytes and parses them, and forms as before."""
    n = 200

    def hidden(path: str, digest: bytes) -> table_file.MappedTable:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(table_file, "open_shared", hidden)
    async with SchedulerServer(settings(n)) as srv:
        address = f"unix:{short_dir / 'r.sock'}"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", n, 30.0))
        await relay.start()
        said: list[str] = []
        agents = [make_agent(srv.port, n, f"w{i}", said, CLUSTER_RELAY=address) for i in range(n)]
        fetched = peer_table.FetchedTables()
        for agent in agents:
            agent.tables = fetched
        try:
            tops = await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 60)
            assert [t.peer(t.rank).node_id for t in tops] == [a.identity.node_id for a in agents]
            assert not isinstance(tops[0].table, table_file.MappedTable)
            assert said == []
        finally:
            await asyncio.gather(*(a.close() for a in agents))
            await relay.stop()


async def test_a_direct_worker_gets_the_table_in_its_stream() -> None:
    """Without a relay the compressed table comes in the stream, as before: no fetch."""
    async with SchedulerServer(settings(200)) as srv:
        said: list[str] = []
        agents = [make_agent(srv.port, 200, f"w{i}", said) for i in range(200)]
        fetched = peer_table.FetchedTables()
        for agent in agents:
            agent.tables = fetched
        try:
            tops = await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 60)
            assert {t.size for t in tops} == {200}
            assert not fetched._tables._answers  # nothing fetched
        finally:
            await asyncio.gather(*(a.close() for a in agents))


@contextlib.asynccontextmanager
async def one_member_job() -> AsyncIterator[tuple[SchedulerServer, WorkerAgent]]:
    """A scheduler of a one-worker job and its member "a", formed; closed on the way out."""
    async with SchedulerServer(settings(1)) as srv:
        said: list[str] = []
        member = make_agent(srv.port, 1, "a", said)
        await asyncio.wait_for(member.start(), 20)
        try:
            yield srv, member
        finally:
            await member.close()


async def test_an_unknown_digest_is_refused_to_an_outsider_and_a_member() -> None:
    async with one_member_job() as (_, agent):
        with pytest.raises(peer_table.MissedChange, match="holds no peer table"):
            await peer_table.ask(agent._link.stub, agent._signed, b"\0" * 32)
        with pytest.raises(peer_table.MissedChange, match=r"credential|not fetched"):
            await peer_table.ask(agent._link.stub, lambda method, request: (), b"\0" * 32)


async def test_batched_beats_count_only_for_streams_on_their_connection(short_dir: Path) -> None:
    """A relay's HostBeats stream beats for the workers whose streams it carries; the same
    beats from another connection (an outsider's, or a worker's own) change nothing."""
    quiet = JobSettings(  # the workers' own first beats come after a minute: none in the test
        worker_num=2,
        server_num=0,
        node_timeout_s=120.0,
        topo_timeout_s=60.0,
        heartbeat_interval_s=60.0,
    )
    async with SchedulerServer(quiet) as srv:
        address = f"unix:{short_dir / 'r.sock'}"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 2, 30.0))
        await relay.start()
        said: list[str] = []
        relayed = make_agent(srv.port, 2, "a", said, CLUSTER_RELAY=address)
        direct = make_agent(srv.port, 2, "b", said)
        try:
            await asyncio.wait_for(asyncio.gather(relayed.start(), direct.start()), 20)
            members = srv.core.state.members
            before = {n: members[n].last_seen for n in ("a", "b")}
            beats = pb.HostBeatsRequest(
                nodes=[
                    pb.Hello(node_id=n, incarnation=agent.identity.incarnation)
                    for n, agent in (("a", relayed), ("b", direct))
                ]
            )
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as outsider:
                send = outsider.stream_unary(
                    "/cluster.v1.Scheduler/HostBeats",
                    request_serializer=pb.HostBeatsRequest.SerializeToString,
                    response_deserializer=pb.HostBeatsResponse.FromString,
                )
                await asyncio.wait_for(send(iter([beats]), metadata=relay_stamp()), 10)
            assert {n: members[n].last_seen for n in ("a", "b")} == before
            # The relay's own batch, from the worker's beat: only "a", whose stream it carries.
            relay._forwarder.beats._heard[("a", relayed.identity.incarnation)] = None  # type: ignore[attr-defined]
            relay._forwarder.beats._heard[("b", direct.identity.incarnation)] = None  # type: ignore[attr-defined]
            await asyncio.wait_for(relay._forwarder.beats._send_soon(), 10)  # type: ignore[attr-defined]
            await eventually(lambda: members["a"].last_seen != before["a"], "a's batched beat")
            assert members["b"].last_seen == before["b"]
        finally:
            await asyncio.gather(relayed.close(), direct.close())
            await relay.stop()


def test_a_killed_worker_behind_a_relay_is_told_at_once(processes: Procs, short_dir: Path) -> None:
    """Its call to the relay ends with its process, and its slot on the host's link is detached
    at once: the scheduler fails the job naming it long before MS_NODE_TIMEOUT (60 s here)."""
    sched, relay, workers = start_relayed_job(
        processes, short_dir / "r.sock", 3, MS_NODE_TIMEOUT="60"
    )
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    workers[0].popen.send_signal(signal.SIGKILL)
    for proc in [sched, workers[1], workers[2]]:
        assert proc.wait(15) != 0, proc.output
    assert "connection to the scheduler broke" in sched.output, sched.output
    assert relay.wait(30) == 0, relay.output  # the job over, its workers gone: it ends
    assert "the job failed: rank" in relay.output, relay.output


async def host_link_call(port: int, ups: list[pb.HostUp], ends: int) -> list[pb.HostDown]:
    """An outsider's HostWatch (stamped with this release, as a relay's): `ups` sent, then what
    comes down until `ends` slots ended."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        link = channel.stream_stream(
            "/cluster.v1.Scheduler/HostWatch",
            request_serializer=pb.HostUp.SerializeToString,
            response_deserializer=pb.HostDown.FromString,
        )
        call = link(metadata=relay_stamp())
        for up in ups:
            await call.write(up)
        downs: list[pb.HostDown] = []
        while sum(len(down.ended) for down in downs) < ends:
            downs.append(await asyncio.wait_for(call.read(), 10))
        call.cancel()
        return downs


def attach(slot: int, request: pb.WatchRequest, **metadata: str) -> pb.HostUp:
    data = [pb.Metadatum(key=k.replace("_", "-"), value=v) for k, v in metadata.items()]
    raw = request.SerializeToString()
    return pb.HostUp(attach=pb.HostAttach(slot=slot, request=raw, metadata=data))


def finish_of(slot: int, node_id: str, incarnation: int, **metadata: str) -> pb.HostUp:
    data = [pb.Metadatum(key=k.replace("_", "-"), value=v) for k, v in metadata.items()]
    data.append(pb.Metadatum(key="cluster-node-id", value=node_id))
    raw = pb.FinishRequest(node_id=node_id, incarnation=incarnation).SerializeToString()
    return pb.HostUp(finish=pb.HostAttach(slot=slot, request=raw, metadata=data))


async def test_an_outsiders_host_link_speaks_for_nobody() -> None:
    """A HostWatch from anyone who reaches the port: each attach is a Watch call of its own,
    refused as one would be (a forged hello, a malformed request, one that is neither a
    registration nor a hello, a Finish without the node's proof), and the member's stream, its
    state and the job go on."""
    async with one_member_job() as (srv, member):
        before = srv.core.state.members["a"]
        hello = pb.WatchRequest(
            hello=pb.Hello(node_id="a", incarnation=member.identity.incarnation)
        )
        ups = [
            attach(1, hello, cluster_node_id="a", cluster_credential="00" * 32),
            pb.HostUp(attach=pb.HostAttach(slot=2, request=b"\xff\xff")),
            attach(3, pb.WatchRequest(), cluster_node_id="z"),
            attach(4, hello),
            finish_of(5, "a", member.identity.incarnation, cluster_credential="00" * 32),
        ]
        expected = {
            1: grpc.StatusCode.UNAUTHENTICATED,
            2: grpc.StatusCode.INVALID_ARGUMENT,
            3: grpc.StatusCode.INVALID_ARGUMENT,
            4: grpc.StatusCode.UNAUTHENTICATED,
            5: grpc.StatusCode.UNAUTHENTICATED,  # a finish for the member, without its proof
        }
        # One by one, and as one batch (as a relay sends a burst): each part as it is.
        batch = pb.HostUp(batch=pb.HostUps(ups=ups))
        for sent in (ups, [batch]):
            downs = await host_link_call(srv.port, sent, 5)
            assert not any(down.event for down in downs)
            assert ended_codes(downs) == expected
        assert srv.core.state.members["a"] == before
        assert srv.core.open_streams == 1  # the member's own


def ended_codes(downs: list[pb.HostDown]) -> dict[int, grpc.StatusCode]:
    codes = {code.value[0]: code for code in grpc.StatusCode}
    return {end.slot: codes[end.code] for down in downs for end in down.ended}


async def test_a_host_link_batch_out_of_bounds_ends_the_link_and_nothing_else() -> None:
    """A batch inside a batch, a batch of too many, or an attach past its own limit (which a
    batch could otherwise carry past the message's): the link ends INVALID_ARGUMENT, saying
    which, and the member's stream and the job go on."""
    async with one_member_job() as (srv, _):
        before = srv.core.state.members["a"]
        one = attach(1, pb.WatchRequest(), cluster_node_id="z")
        big = pb.HostUp(
            attach=pb.HostAttach(slot=2, metadata=[pb.Metadatum(key="x-pad", value="p" * 9000)])
        )
        cases = [
            (
                pb.HostUp(batch=pb.HostUps(ups=[pb.HostUp(batch=pb.HostUps(ups=[one]))])),
                "holds",
            ),
            (pb.HostUp(batch=pb.HostUps(ups=[one] * 257)), "batch of 257: at most 256"),
            (pb.HostUp(batch=pb.HostUps(ups=[big])), "attach of 90.. bytes: at most 8192"),
            (big, "attach of 90.. bytes"),
        ]
        for up, why in cases:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await host_link_call(srv.port, [up], 1)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(why, refused.value.details() or ""), refused.value.details()
        assert srv.core.state.members["a"] == before
        assert srv.core.open_streams == 1


def relay_at(socket_path: str) -> subprocess.CompletedProcess[str]:
    """`mscluster relay --socket unix:PATH` of a job whose scheduler is not up (yet)."""
    return subprocess.run(
        [*MSCLUSTER, "relay", "--socket", f"unix:{socket_path}"],
        env=job_env(2, free_port()),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_socket_in_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    where = tmp_path / "missing" / "r.sock"
    done = relay_at(str(where))
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"mscluster: ConfigError: --socket '{where}': cannot listen there")
    assert "No such file or directory" in line


def test_a_socket_on_a_read_only_disk_is_one_line() -> None:
    with tmpfs.mounted(read_only=True) as disk:
        done = relay_at(str(disk / "r.sock"))
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "Read-only file system" in line, line
