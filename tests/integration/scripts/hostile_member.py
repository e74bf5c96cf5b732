"""A member that floods the scheduler, for test_hostile.py's caps: rank 0 makes the calls a
runaway or hostile member would, with its own (valid) credential; the caps must refuse them
with a clear error, and the job must go on.

--kv N: rank 0 sets N distinct keys of 4 MiB each through cluster.kv_store().
--gather-mib G: every rank calls allgather_object with G MiB (past the collective cap).
--rounds K --round-mib M: then rank 0 opens K collective rounds at once (as itself, with its
  own credential, sequence numbers no rank will use), M MiB each, each call cut off after 5 s.
Then it prints `flooded`, waits for the file GO, and checks the job still works.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
from hostile_target import WAIT_S  # this script's folder is on sys.path

import cluster
from cluster.api import runtime
from cluster.testing import wait_until
from cluster.transport import edge
from cluster.v1 import scheduler_pb2 as pb

MIB = 1024 * 1024


def kv_flood(count: int) -> None:
    store = cluster.kv_store()
    accepted, refusals = 0, []
    for i in range(count):
        try:
            store.set(f"flood/{i:04d}", i.to_bytes(4, "big") * MIB)
            accepted += 1
        except cluster.CapacityError as exc:
            refusals.append(str(exc))
    print(f"kv accepted={accepted} refused={len(refusals)}", flush=True)
    if refusals:
        print(f"kv refusal: {refusals[0]}", flush=True)


async def _open_rounds(count: int, mib: int) -> list[object]:
    agent = runtime.session().agent
    payload = b"r" * (mib * MIB)
    calls = [
        agent._link.stub.Exchange(
            edge.pieces(
                pb.ExchangeRequest(
                    node_id=agent.identity.node_id,
                    generation=agent.topology.generation,
                    seq=100_000 + i,
                    op=pb.EXCHANGE_ALLGATHER,
                    value=payload,
                )
            ),
            timeout=5.0,
            metadata=agent._metadata,
        )
        for i in range(count)
    ]
    return list(await asyncio.gather(*calls, return_exceptions=True))


def rounds_flood(count: int, mib: int) -> None:
    results = runtime.session().call(_open_rounds(count, mib))
    codes = [r.code().name if isinstance(r, grpc.aio.AioRpcError) else "OK" for r in results]
    exhausted = [
        r
        for r in results
        if isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ]
    print(f"rounds refused={len(exhausted)} codes={sorted(set(codes))}", flush=True)
    if exhausted:
        print(f"rounds refusal: {exhausted[0].details()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("go", type=Path)
    parser.add_argument("--kv", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--round-mib", type=int, default=32)
    parser.add_argument("--gather-mib", type=int, default=0)
    args = parser.parse_args()
    cluster.init()
    rank = cluster.get_rank()
    if rank == 0 and args.kv:
        kv_flood(args.kv)
    if args.gather_mib:
        try:
            cluster.allgather_object(b"g" * (args.gather_mib * MIB))
            print("big gather went through", flush=True)
        except cluster.CapacityError as exc:
            print(f"big gather refused: {exc}", flush=True)
    if rank == 0 and args.rounds:
        rounds_flood(args.rounds, args.round_mib)
    print(f"flooded rank={rank}", flush=True)
    wait_until(args.go.exists, WAIT_S, f"{args.go} to appear")
    # The job goes on: the store, a collective and a barrier work.
    cluster.kv_store().set(f"after/{rank}", b"ok")
    assert cluster.kv_store().get(f"after/{rank}") == b"ok"
    result = cluster.allgather_object(rank)
    cluster.barrier()
    print(f"done rank={rank} result={result} generation={cluster.get_generation()}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
