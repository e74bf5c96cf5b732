"""A member that runs away, for test_member_floods.py: rank 0 floods the scheduler for SECONDS
with its own (valid) credential while every rank passes barriers; then each prints what it saw
and the job ends.

--kv-threads T: T threads each set one of two keys to 2 MiB again and again through
  cluster.kv_store() (the public API; inside its key-value share).
--until-refused (with --kv-threads alone): past SECONDS, the threads go on until a set was
  refused with a CapacityError and one was taken (at most REFUSED_WAIT_S more): whether the
  threads' sets overlap enough at the scheduler in a given time depends on the machine's load.
--connections C (with --kv-threads T): T sets at once as above, over C connections of rank 0's
  own to the scheduler instead of its one channel (each signed as rank 0).
--value-mib M (with --connections): each of those sets' values is M MiB (default 2; past the
  4 MiB that cluster.kv_store() sends, as a script's own gRPC calls may be, up to the 64 MiB a
  value may have, in its pieces as a worker sends it).
--legit: before any flood, what a well-behaved member's large values take, each the median of
  3: an allgather_object of 16 MiB objects (every rank) and one KvSet of 63 MiB (rank 0's own
  call, as above: the store refuses a value over 4 MiB once it has read it).
--beats N: N Heartbeat streams of rank 0, each beating as fast as it can (signed as rank 0).
--reopens N: N loops of rank 0, each opening a Heartbeat stream, beating once, and opening
  another as soon as that one ends (superseded by another loop's, or refused), as fast as it can.
--reports N: N at once, checkpoint reports of 1,024 steps, alternately ascending and descending
  (each changes what rank 0 holds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc

import cluster
from cluster.api import runtime
from cluster.transport import edge
from cluster.v1 import scheduler_pb2 as pb

MIB = 1024 * 1024
BARRIERS = 20
REFUSED_WAIT_S = 60.0


class Seen:
    def __init__(self) -> None:
        self.codes: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    def error(self, kind: str, details: str) -> None:
        self.codes[kind] += 1
        self.first.setdefault(kind, details)


def kv_flood(threads: int, seconds: float, seen: Seen, *, until_refused: bool = False) -> None:
    store, end, value = cluster.kv_store(), time.monotonic() + seconds, b"v" * (2 * MIB)

    def going() -> bool:
        now = time.monotonic()
        if now < end:
            return True
        answered = seen.codes["CapacityError"] and seen.codes["OK"]
        return until_refused and not answered and now < end + REFUSED_WAIT_S

    def loop(i: int) -> None:
        while going():
            try:
                store.set(f"flood/{i % 2}", value)
                seen.codes["OK"] += 1
            except cluster.ClusterError as exc:
                seen.error(type(exc).__name__, str(exc))

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


async def _kv_connections(
    sets: int, connections: int, seconds: float, seen: Seen, value_mib: int
) -> None:
    agent, value = runtime.session().agent, b"v" * (value_mib * MIB)
    address = f"{os.environ['MS_SCHED_HOST']}:{os.environ['MS_SCHED_PORT']}"
    end = time.monotonic() + seconds
    # A channel argument of its own makes each channel open a connection of its own.
    channels = [
        grpc.aio.insecure_channel(address, options=[("cluster.flood.connection", i)])
        for i in range(connections)
    ]

    # Serialized once, as a call proof covers it (its head, its value's SHA-256 set) and in the
    # pieces a worker sends: the calls send the same bytes (this process holds each call's copy
    # only until it is sent), so that one process floods as fast as the network goes.
    wholes = [pb.KvSetRequest(key=f"flood/{i}", value=value) for i in (0, 1)]
    bodies = [edge.signed_body("KvSet", request) for request in wholes]
    pieces = [[piece.SerializeToString() for piece in edge.pieces(request)] for request in wholes]

    async def loop(i: int) -> None:
        kv_set = channels[i % connections].stream_unary(
            "/cluster.v1.Scheduler/KvSet", response_deserializer=pb.KvSetResponse.FromString
        )
        body = bodies[i % 2]
        while time.monotonic() < end:
            try:
                signer = agent._signer
                metadata = agent._metadata if signer is None else signer.metadata("KvSet", body)
                await kv_set(iter(pieces[i % 2]), metadata=metadata, timeout=seconds + 30)
                seen.codes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                seen.error(exc.code().name, exc.details() or "")

    try:
        await asyncio.gather(*(loop(i) for i in range(sets)))
    finally:
        for channel in channels:
            await channel.close()


async def _beats(count: int, seconds: float, seen: Seen) -> None:
    agent = runtime.session().agent
    beat = pb.HeartbeatRequest(
        node_id=agent.identity.node_id, incarnation=agent.identity.incarnation
    )
    end = time.monotonic() + seconds

    async def beats() -> AsyncIterator[pb.HeartbeatRequest]:
        while time.monotonic() < end:
            yield beat
            await asyncio.sleep(0)  # sleep-ok: a turn of the loop; the flood goes as fast as it can

    async def stream() -> None:
        while time.monotonic() < end:
            try:
                metadata = agent._signed("Heartbeat")
                await agent._link.stub.Heartbeat(beats(), metadata=metadata, timeout=seconds + 10)
                # Ended by the scheduler while it still beat: a newer stream superseded it.
                seen.codes["ended early" if time.monotonic() < end - 0.5 else "ended OK"] += 1
            except grpc.aio.AioRpcError as exc:
                seen.error(exc.code().name, exc.details() or "")

    await asyncio.gather(*(stream() for _ in range(count)))


async def _reopens(count: int, seconds: float, seen: Seen) -> None:
    agent = runtime.session().agent
    beat = pb.HeartbeatRequest(
        node_id=agent.identity.node_id, incarnation=agent.identity.incarnation
    )
    end = time.monotonic() + seconds

    async def one_beat(ended: asyncio.Event) -> AsyncIterator[pb.HeartbeatRequest]:
        yield beat
        # The stream stays open, as a node's does, until its call ends or the flood does.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ended.wait(), max(end - time.monotonic(), 0))

    async def loop() -> None:
        while time.monotonic() < end:
            ended = asyncio.Event()
            try:
                metadata = agent._signed("Heartbeat")
                await agent._link.stub.Heartbeat(
                    one_beat(ended), metadata=metadata, timeout=seconds + 10
                )
                seen.codes["superseded" if time.monotonic() < end - 0.5 else "ended OK"] += 1
            except grpc.aio.AioRpcError as exc:
                seen.error(exc.code().name, exc.details() or "")
            finally:
                ended.set()

    await asyncio.gather(*(loop() for _ in range(count)))


async def _reports(count: int, seconds: float, seen: Seen) -> None:
    agent = runtime.session().agent
    node_id, incarnation = agent.identity.node_id, agent.identity.incarnation
    end, made = time.monotonic() + seconds, [0]

    async def one() -> None:
        while time.monotonic() < end:
            made[0] += 1
            up = made[0] % 2
            steps = list(range(1, 1025)) if up else list(range(1024, 0, -1))
            steps[0] += made[0] % 7  # each differs from the last
            request = pb.ReportCheckpointsRequest(
                node_id=node_id, incarnation=incarnation, steps=steps
            )
            metadata = agent._signed("ReportCheckpoints", request)
            try:
                await agent._link.stub.ReportCheckpoints(request, metadata=metadata, timeout=30)
                seen.codes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                seen.error(exc.code().name, exc.details() or "")

    await asyncio.gather(*(one() for _ in range(count)))


async def _one_set(value: bytes) -> float:
    """Seconds one KvSet of `value` takes, answered (the store's refusal is an answer)."""
    agent = runtime.session().agent
    request = pb.KvSetRequest(key="legit", value=value)
    metadata = agent._signed("KvSet", request)
    start = time.perf_counter()
    with contextlib.suppress(grpc.aio.AioRpcError):
        await agent._link.stub.KvSet(edge.pieces(request), metadata=metadata, timeout=60)
    return time.perf_counter() - start


def legit(rank: int) -> None:
    """Time a well-behaved member's large values (see --legit) and print them."""
    gathers, sets, obj = [], [], b"x" * (16 * MIB)
    for _ in range(3):
        cluster.barrier()
        start = time.perf_counter()
        cluster.allgather_object(obj)
        gathers.append(time.perf_counter() - start)
        if rank == 0:
            sets.append(runtime.session().call(_one_set(b"v" * (63 * MIB))))
    gather_s, set_s = sorted(gathers)[1], sorted(sets)[1] if sets else 0.0
    print(f"legit allgather_16mib_s={gather_s:.3f} kvset_63mib_s={set_s:.3f}", flush=True)


def flood(args: Any, seen: Seen) -> None:
    if args.kv_threads and args.connections:
        runtime.session().call(
            _kv_connections(args.kv_threads, args.connections, args.seconds, seen, args.value_mib)
        )
    elif args.kv_threads:
        kv_flood(args.kv_threads, args.seconds, seen, until_refused=args.until_refused)
    elif args.beats:
        runtime.session().call(_beats(args.beats, args.seconds, seen))
    elif args.reopens:
        runtime.session().call(_reopens(args.reopens, args.seconds, seen))
    elif args.reports:
        runtime.session().call(_reports(args.reports, args.seconds, seen))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--kv-threads", type=int, default=0)
    parser.add_argument("--connections", type=int, default=0)
    parser.add_argument("--until-refused", action="store_true")
    parser.add_argument("--value-mib", type=int, default=2)
    parser.add_argument("--legit", action="store_true")
    parser.add_argument("--beats", type=int, default=0)
    parser.add_argument("--reopens", type=int, default=0)
    parser.add_argument("--reports", type=int, default=0)
    parser.add_argument("--go", help="rank 0 ends the job only once this file exists")
    args = parser.parse_args()
    cluster.init()
    rank = cluster.get_rank()
    if args.legit:
        legit(rank)
    seen = Seen()
    flooding = threading.Thread(target=flood, args=(args, seen)) if rank == 0 else None
    if flooding is not None:
        flooding.start()
    for _ in range(BARRIERS):
        cluster.barrier()
    print(f"barriers done rank={rank} n={BARRIERS}", flush=True)
    if flooding is not None:
        flooding.join()
        print(f"flood codes={dict(seen.codes)}", flush=True)
        for kind, details in seen.first.items():
            print(f"flood first {kind}: {details}", flush=True)
        if args.go:  # the test reads the scheduler's metrics before the job ends
            deadline = time.monotonic() + 60
            while not os.path.exists(args.go) and time.monotonic() < deadline:
                time.sleep(0.05)  # sleep-ok: a bounded wait for the test's file
    cluster.barrier()
    print(f"done rank={rank}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
