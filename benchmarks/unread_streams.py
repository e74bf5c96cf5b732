"""Unread streams: what a bare grpc.aio server holds of requests that its handlers never read.

A server whose one method (a streaming-request one, as the scheduler takes every method:
`cluster.transport.handlers.Arrivals`) holds each call for `--hold` seconds without asking for
its request, and the same server whose handler reads it first (the floor is an idle server).
A client process opens `--calls` calls at once over `--connections` connections, each sending
one request of `--mib` MiB. Measured: the server's peak resident memory (VmHWM) once the
requests were sent, for each handler. It tells whether a request that nobody reads stays on
the wire (held back by HTTP/2 flow control: one stream window each) or is taken into the
server's memory anyway (gRPC's window, tuned by its bandwidth-delay probe while memory is not
under pressure, grows to the size of the requests).

Usage: python benchmarks/unread_streams.py [--calls 16] [--mib 32] [--connections 1,4]
       [--hold 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator

import grpc

MIB = 1024 * 1024
CLIENT = r"""
import asyncio, sys, grpc
port, calls, mib, connections, hold = (int(x) for x in sys.argv[1:6])
async def main():
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("bench.conn", i)])
                for i in range(connections)]
    body = b"v" * (mib << 20)
    async def one(i):
        async def request():
            yield body
        method = channels[i % connections].stream_unary("/bench.Unread/Hold")
        try:
            await method(request(), timeout=hold + 30)
        except grpc.aio.AioRpcError as exc:
            print("call ended:", exc.code(), flush=True)
    await asyncio.gather(*(one(i) for i in range(calls)))
asyncio.run(main())
"""


def reset_peak() -> None:
    """Start VmHWM afresh at the present resident memory (Linux 4.0 and later)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def peak_mib() -> float:
    for line in open(f"/proc/{os.getpid()}/status"):  # noqa: SIM115 - one line of /proc
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


async def measure(args: argparse.Namespace, connections: int, read: bool) -> tuple[float, float]:
    """The server's peak memory before and once `--calls` requests were sent to it."""

    async def hold(requests: AsyncIterator[bytes], context: object) -> bytes:
        if read:
            await anext(requests)
        await asyncio.sleep(args.hold)  # the call stays open, as a call waiting for its turn
        return b""

    handler = grpc.stream_unary_rpc_method_handler(hold)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 128 * MIB)])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Unread", {"Hold": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    reset_peak()
    before = peak_mib()
    argv = [str(v) for v in (port, args.calls, args.mib, connections, int(args.hold))]
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, *argv)
    try:
        await asyncio.wait_for(client.wait(), args.hold + 60)
    finally:
        after = peak_mib()
        await server.stop(0)
    return before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--connections", default="1,4")
    parser.add_argument("--hold", type=float, default=6.0)
    args = parser.parse_args()
    sent = args.calls * args.mib
    print(f"{args.calls} calls of {args.mib} MiB at once ({sent} MiB sent)")
    print(f"{'handler':24} {'connections':>11} {'peak before':>12} {'peak after':>11} {'grown':>9}")
    for connections in (int(c) for c in args.connections.split(",")):
        for read in (False, True):
            before, after = asyncio.run(measure(args, connections, read))
            label = "reads its request" if read else "never reads it"
            print(
                f"{label:24} {connections:>11} {before:10.1f}MB {after:9.1f}MB "
                f"{after - before:7.1f}MB"
            )


if __name__ == "__main__":
    main()
