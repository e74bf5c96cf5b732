"""An operator's reads of a job with a secret, many at once: ROUNDS times, WIDTH single reads
(each its own Challenge, then Status, no second try) and WIDTH `status.fetch` reads together,
proved with the secret of CLUSTER_JOB_SECRET_FILE. Prints one JSON line: the reads made and what
each refused one was told."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc

from cluster.protocol.errors import ClusterError
from cluster.tools import reading, status
from cluster.transport import channel as channel_module
from cluster.v1 import scheduler_pb2 as pb

CALL_S = 10.0


async def main(address: str, rounds: int, width: int) -> None:
    secret = reading.resolve(reading.FROM_ENV)
    assert secret is not None, "CLUSTER_JOB_SECRET_FILE is not set"
    refused: list[str] = []

    async with channel_module.open_channel(address, None) as channel:
        stub = status.pb_grpc.SchedulerStub(channel)

        async def single() -> None:
            metadata = await status.read_metadata(stub, "Status", secret, CALL_S)
            try:
                await stub.Status(pb.StatusRequest(), timeout=CALL_S, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                refused.append(f"single: {exc.details()}")

        async def fetched() -> None:
            async with channel_module.open_channel(address, None) as own:
                try:
                    await status.fetch(own, address, CALL_S, secret)
                except ClusterError as exc:
                    refused.append(f"fetch: {type(exc).__name__}: {exc}")

        for _ in range(rounds):
            await asyncio.gather(
                *(single() for _ in range(width)), *(fetched() for _ in range(width))
            )
    print(json.dumps({"reads": 2 * rounds * width, "refused": refused}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
