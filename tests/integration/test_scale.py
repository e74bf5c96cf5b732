"""Scale: many real worker processes on one machine, a scheduler made slow on purpose, and the
peer table after a rejoin (a delta to the nodes that hold it, the whole table to the others)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from cluster.protocol.environment import from_env
from cluster.protocol.records import NodeRole, PeerInfo
from cluster.scheduler import CoreSettings, JobStore, SchedulerServer, convert
from cluster.testing import free_port, wait_until
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from cluster.worker.agent import WorkerAgent
from cluster.worker.identity import NodeIdentity, new_incarnation
from tests.procs import Procs, job_env

from .test_launch import EXAMPLE, LINE

# The scheduler is stopped for at least STALL_S: longer than every deadline of a node's
# registration (an attempt to connect, gRPC's connect timeout, the scheduler's handshake
# timeout), and shorter than MS_NODE_TIMEOUT (its default): a scheduler that is slow, not dead.
STALL_S = 7.0
NODE_TIMEOUT_S = 30
GUARD_S = 3


def registered(port: int) -> int:
    """How many nodes the scheduler at `port` has (0 while it does not answer)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            status = pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError:
            return 0
    return len(status.nodes)


def check_gathered(workers: list, n: int) -> None:
    lines = [m for w in workers for m in LINE.findall(w.output)]
    assert sorted(int(rank) for rank, _, _ in lines) == list(range(n)), lines
    assert {(size, res) for _, size, res in lines} == {(str(n), str(list(range(n))))}


@pytest.mark.slow
@pytest.mark.timeout(300)  # 23-29 s measured on 2 cores; 64 Python start-ups on a busy machine
def test_64_real_workers_form_gather_and_exit_zero(processes: Procs) -> None:
    n = 64
    base = job_env(n, free_port())
    started = time.monotonic()
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, base)
    workers = [processes.start_role(f"w{i}", "MS_WORKER", EXAMPLE, base) for i in range(n)]
    for w in workers:
        assert w.wait(240) == 0, w.output
    assert sched.wait(60) == 0, sched.output
    check_gathered(workers, n)
    took = time.monotonic() - started
    print(f"{n} real worker processes formed, gathered and exited in {took:.1f} s")


def test_a_scheduler_stopped_while_nodes_wait_for_their_welcome_still_forms_the_job(
    processes: Procs,
) -> None:
    """Half the nodes are in and wait for the topology, half wait for the answer to their
    registration (their connections not even taken), while the scheduler's process is stopped
    for STALL_S: once it runs again, the job forms and every worker gathers and exits 0."""
    n, port = 6, free_port()
    base = job_env(n, port, MS_NODE_TIMEOUT=str(NODE_TIMEOUT_S))
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, base)
    sched.wait_for_output("listening on", 30)
    first = [processes.start_role(f"w{i}", "MS_WORKER", EXAMPLE, base) for i in range(n // 2)]
    wait_until(lambda: registered(port) == n // 2, 60, f"{n // 2} nodes registered")
    sched.popen.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        rest = [processes.start_role(f"w{i}", "MS_WORKER", EXAMPLE, base) for i in range(n // 2, n)]
        # The later nodes are visibly waiting for the scheduler (to connect, or to answer).
        for w in rest:
            w.wait_for_output(f"the scheduler at 127.0.0.1:{port}", 20)
        wait_until(lambda: time.monotonic() - stopped >= STALL_S, STALL_S + 1, "the stall")
    finally:
        sched.popen.send_signal(signal.SIGCONT)
    for w in [*first, *rest]:
        assert w.wait(60) == 0, w.output
    assert sched.wait(30) == 0, sched.output
    check_gathered([*first, *rest], n)
    assert "the scheduler did not run for" in sched.output, sched.output


async def test_a_scheduler_stopped_while_nodes_finish_hears_every_finish(processes: Procs) -> None:
    """The scheduler's process is stopped for STALL_S while every node of a formed job waits
    for the answer to its Finish (longer than a Finish attempt used to wait before it was made
    again): each node's one call is answered once it runs again, and the job ends finished."""
    n, port = 3, free_port()
    base = job_env(n, port, MS_NODE_TIMEOUT=str(NODE_TIMEOUT_S))
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, base)
    sched.wait_for_output("listening on", 30)
    env = {**base, "MS_ROLE": "MS_WORKER"}
    agents = [
        WorkerAgent(
            from_env({**env, "MS_NODE_ID": str(i)}),
            NodeIdentity(str(i), new_incarnation(), "127.0.0.1", 7000 + i),
            say=lambda _: None,
            on_fatal=lambda _: None,
        )
        for i in range(n)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 60)
        sched.popen.send_signal(signal.SIGSTOP)
        try:
            finishing = asyncio.gather(*(a.finish() for a in agents))
            answered, _ = await asyncio.wait([finishing], timeout=STALL_S)
        finally:
            sched.popen.send_signal(signal.SIGCONT)
        assert not answered  # nobody was answered, or gave up, while it was stopped
        assert await asyncio.wait_for(finishing, 60) == [True] * n
    finally:
        await asyncio.gather(*(a.close() for a in agents))
    assert sched.wait(30) == 0, sched.output
    assert f"all {n} nodes finished" in sched.output, sched.output


def agent_at(port: int, n: int, node_id: str, data_port: int, recovery: Path) -> WorkerAgent:
    """A worker of a recovering job of `n`, advertising `data_port`."""
    config = from_env(
        {
            "MS_ROLE": "MS_WORKER",
            "MS_WORKER_NUM": str(n),
            "MS_SCHED_HOST": "127.0.0.1",
            "MS_SCHED_PORT": str(port),
            "MS_TOPO_TIMEOUT": "30",
            "MS_NODE_ID": node_id,
            "MS_NODE_TIMEOUT": str(GUARD_S),
            "MS_ENABLE_RECOVERY": "1",
            "MS_RECOVERY_PATH": str(recovery / node_id),
        }
    )
    identity = NodeIdentity(node_id, new_incarnation(), "127.0.0.1", data_port)
    return WorkerAgent(config, identity, say=lambda _: None, on_fatal=lambda _: None)


async def test_after_a_rejoin_every_worker_holds_the_new_table(tmp_path: Path) -> None:
    """Rank 2 restarts on another port: the workers that stayed apply the one-row change to
    the table they hold, the restarted one gets the whole table, and all hold the same."""
    settings = CoreSettings(
        worker_num=3,
        server_num=0,
        node_timeout_s=GUARD_S,  # the restarted process is taken once the guard has passed
        topo_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        recovery=True,
    )
    async with SchedulerServer(settings, store=JobStore.directory(tmp_path)) as server:
        agents = [agent_at(server.port, 3, str(i), 7000 + i, tmp_path) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 30)
        assert [a.topology.ports for a in agents if a.topology] == [(7000, 7001, 7002)] * 3
        await agents[2].close()  # its stream breaks: rank 2 failed
        back = agent_at(server.port, 3, "2", 7102, tmp_path)
        topology = await asyncio.wait_for(back.start(), 30)
        assert back.core.rejoined
        assert topology.generation == 2
        stayed = [await asyncio.wait_for(a.wait_generation(1), 30) for a in agents[:2]]
        for held in [*stayed, topology]:
            assert held.generation == 2
            assert held.ports == (7000, 7001, 7102)
            assert held.node_ids == ("0", "1", "2")
        await asyncio.gather(*(a.finish() for a in [*agents[:2], back]))
        assert await asyncio.wait_for(server.wait_done(), 30) is True
        await asyncio.gather(*(a.close() for a in [*agents[:2], back]))


async def test_a_table_large_enough_to_travel_compressed_reaches_every_worker(
    tmp_path: Path,
) -> None:
    """256 workers: the whole table is over COMPRESS_TABLE_ABOVE, so it travels compressed;
    every worker holds all of it, and after a rejoin the one-row change applies to it."""
    n = 256
    settings = CoreSettings(
        worker_num=n,
        server_num=0,
        node_timeout_s=GUARD_S,
        topo_timeout_s=60.0,
        heartbeat_interval_s=2.0,
        recovery=True,
    )
    peers = tuple(
        PeerInfo(i, str(i), "127.0.0.1", 7000 + i, NodeRole.WORKER, i, n) for i in range(n)
    )
    assert convert.peer_table(peers).ByteSize() > convert.COMPRESS_TABLE_ABOVE
    async with SchedulerServer(settings, store=JobStore.directory(tmp_path)) as server:
        agents = [agent_at(server.port, n, str(i), 7000 + i, tmp_path) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 120)
        ports = tuple(range(7000, 7000 + n))
        assert {a.topology.ports for a in agents if a.topology} == {ports}
        await agents[7].close()
        back = agent_at(server.port, n, "7", 9007, tmp_path)
        topology = await asyncio.wait_for(back.start(), 60)
        stayed = [a for i, a in enumerate(agents) if i != 7]
        held = [await asyncio.wait_for(a.wait_generation(1), 60) for a in stayed]
        moved = (*ports[:7], 9007, *ports[8:])
        assert {t.ports for t in [*held, topology]} == {moved}
        await asyncio.gather(*(a.finish() for a in [*stayed, back]))
        assert await asyncio.wait_for(server.wait_done(), 60) is True
        await asyncio.gather(*(a.close() for a in [*stayed, back]))
