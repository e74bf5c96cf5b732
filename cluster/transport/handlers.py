"""Rebuilding a gRPC method handler with other parts: the behaviour wrapped (a check run before
every call, `server_tls`), another request deserializer (a size cap, `edge.capped`) or another
response serializer (events serialized once, the scheduler's Watch). gRPC has a constructor
per kind of call; this picks the handler's own.

`Arrivals` gives a call a bounded time to send its (first) request. gRPC reads a unary request
before it runs the handler, and holds a stream whose headers came but whose message never does
for as long as the peer answers pings: thousands of them held the scheduler's memory and
descriptors. So the server takes each unary-request method as a streaming one (the wire is the
same: one message, then the end of the stream) and reads that message itself, within its time,
then closes gRPC's reader of it (which would hold the request past the call); a
streaming-request method's handler is given its requests once the first has come in time.
The scheduler and a worker's state server (`cluster.worker.state_server`) both take their calls
so, each with its own bounds.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # generic in grpc-stubs only
    Handler = grpc.RpcMethodHandler[Any, Any]
    Context = grpc.aio.ServicerContext[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    Context = grpc.aio.ServicerContext
# Ends a call refused before its request: (context, method, reason, problem).
Refuse = Callable[[Context, str, str, str], Awaitable[None]]

_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def rebuilt(
    handler: Handler,
    *,
    wrap: Callable[[Any], Any] | None = None,
    request_deserializer: Callable[[bytes], Any] | None = None,
    response_serializer: Callable[[Any], bytes] | None = None,
) -> Handler:
    """`handler` with its behaviour passed through `wrap` and the serializers given replacing
    its own (those not given are kept)."""
    for attribute, make in _KINDS:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return make(
                behavior if wrap is None else wrap(behavior),
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=response_serializer or handler.response_serializer,
            )
    return handler


def peer_host(peer: str) -> str:
    """gRPC's peer ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") without its port."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer[:100]


class Arrivals:
    """Calls whose request has not arrived yet: each has `deadline_s(method)` to send it, and at
    most `per_peer` from one peer (`peer_of(context)`) and `total` in all wait at once; past
    either a new call is turned away at once. `refuse` ends a call (reason "stalled", "empty"
    or "crowded"); `server` names the server in the "crowded" message."""

    def __init__(
        self,
        *,
        per_peer: int,
        total: int,
        deadline_s: Callable[[str], float],
        peer_of: Callable[[Context], str],
        refuse: Refuse,
        server: str = "the scheduler",
    ) -> None:
        self.per_peer = per_peer
        self.total = total
        self.server = server
        self._deadline_s = deadline_s
        self._peer_of = peer_of
        self._refuse = refuse
        self._waiting: collections.Counter[str] = collections.Counter()

    @property
    def waiting(self) -> int:
        """Calls waiting for their request now."""
        return self._waiting.total()

    async def request(self, requests: AsyncIterator[Any], context: Context, method: str) -> Any:
        """The call's one request, or None once the call was refused."""
        peer = self._peer_of(context)
        if self._waiting[peer] >= self.per_peer or self.waiting >= self.total:
            await self._refuse(
                context,
                method,
                "crowded",
                f"{self._waiting[peer]} calls from {peer} ({self.waiting} in all) wait for their "
                f"request already, the most {self.server} holds ({self.per_peer} a peer, "
                f"{self.total} in all); try again",
            )
            return None
        self._waiting[peer] += 1
        deadline = self._deadline_s(method)
        try:
            return await asyncio.wait_for(anext(requests), deadline)
        except asyncio.TimeoutError:  # not builtin TimeoutError before 3.11
            await self._refuse(
                context, method, "stalled", f"no request within {deadline:g} s of the call's start"
            )
        except StopAsyncIteration:
            await self._refuse(context, method, "empty", "the call ended without a request")
        finally:
            self._waiting[peer] -= 1
            if self._waiting[peer] <= 0:
                del self._waiting[peer]
        return None

    def wrap(self, method: str, handler: Handler) -> Handler:
        """`handler` as a streaming-request one that runs once its first request came in time:
        a unary-request handler is given that request, a streaming-request one the requests
        from that one on. The answers are the handler's own, one or a stream."""
        behavior: Any = (  # async under grpc.aio; grpc-stubs type them sync
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        if behavior is None:
            return handler
        unary_request = handler.unary_unary is not None or handler.unary_stream is not None
        streams = handler.unary_stream is not None or handler.stream_stream is not None

        async def taken(requests: AsyncIterator[Any], context: Context) -> Any:
            """What the handler takes (None once the call was refused)."""
            first = await self.request(requests, context, method)
            if first is None or unary_request:
                await done_reading(requests)
                return first
            return beginning_with(first, requests)

        async def answer(requests: AsyncIterator[Any], context: Context) -> Any:
            request = await taken(requests, context)
            return None if request is None else await behavior(request, context)

        async def answers(requests: AsyncIterator[Any], context: Context) -> Any:
            request = await taken(requests, context)
            if request is None:
                return
            result = behavior(request, context)
            if inspect.isasyncgen(result):
                async for response in result:
                    yield response
            else:
                await result  # a handler that writes with context.write

        if streams:
            return grpc.stream_stream_rpc_method_handler(
                answers,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_unary_rpc_method_handler(
            answer,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def done_reading(requests: AsyncIterator[Any]) -> None:
    """Close gRPC's reader of a call's requests. Until it is closed it holds the last request it
    handed over, and it sits in a reference cycle with its call: left open, a call's request
    outlives the call until the garbage collector runs, which counts objects, not the bytes
    they hold (a member's sets of 2 MiB, one at a time, keep some 40 of them alive)."""
    close = getattr(aiter(requests), "aclose", None)
    if close is not None:
        await close()


async def beginning_with(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first`, then the requests of `rest`; closed, it closes `rest` (`done_reading`)."""
    try:
        yield first
        async for request in rest:
            yield request
    finally:
        await done_reading(rest)
