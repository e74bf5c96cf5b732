"""A host's relay: the scheduler's service served to the host's workers on a local socket and
forwarded, call by call and byte for byte, over one channel (one connection) to the scheduler.

The relay is transport, not authority. It parses no request and no answer: a worker's call
metadata (its credential or call proof, `cluster.transport.membership`) and body go upstream as
they came, so the scheduler admits every call as it would a direct one, and a relay cannot speak
for a worker it does not hold. What comes back (the answer or the stream, the status code, its
details and trailing metadata such as `cluster-error`) goes back to the worker as it came. A
worker whose process or connection dies cancels its calls here, which cancels them upstream at
once: the scheduler sees that worker's Watch stream end as it would a direct one. A relay that
dies ends every stream it carried: the scheduler sees its host's workers fail, and they go to
the scheduler directly (`cluster.worker.scheduler_link.Route`).

Upstream calls are made without waiting for a connection that is down: a worker whose scheduler
cannot be reached hears UNAVAILABLE at once, as it would from its own channel, and checks the
scheduler itself (its probes go direct).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeAlias

import grpc

from cluster.transport.stub import methods

# Headers that belong to one hop (gRPC's, HTTP/2's), not to the call: gRPC sets its own.
_HOP_PREFIXES = (":", "grpc-")
_HOP_HEADERS = frozenset({"user-agent", "te", "content-type", "host"})
Metadatum = tuple[str, "str | bytes"]
Context = grpc.aio.ServicerContext[Any, Any]


def forwarded(metadata: Iterable[Any] | None) -> tuple[Metadatum, ...]:
    """The call metadata a worker sent, without the headers of its hop to the relay."""
    return tuple(
        (str(key), value)
        for key, value in metadata or ()
        if not str(key).startswith(_HOP_PREFIXES) and str(key) not in _HOP_HEADERS
    )


def _timeout(context: Context) -> float | None:
    """What is left of the worker's deadline, for the upstream call (None: it set none)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else max(remaining, 0.0)


def _answer_with(context: Context, error: grpc.aio.AioRpcError) -> None:
    """End the worker's call as the scheduler (or the way to it) ended the upstream one."""
    trailing = error.trailing_metadata()
    context.set_trailing_metadata(forwarded(trailing))
    context.set_code(error.code())
    context.set_details(error.details() or "")


def _unary(method: Any) -> Callable[[bytes, Context], Awaitable[bytes | None]]:
    async def forward(request: bytes, context: Context) -> bytes | None:
        call = method(
            request, metadata=forwarded(context.invocation_metadata()), timeout=_timeout(context)
        )
        try:
            return bytes(await call)
        except grpc.aio.AioRpcError as exc:
            _answer_with(context, exc)
            return None
        finally:
            call.cancel()  # the worker went away (this task cancelled): so does the call

    return forward


def _server_stream(method: Any) -> Callable[[bytes, Context], AsyncIterator[bytes]]:
    async def forward(request: bytes, context: Context) -> AsyncIterator[bytes]:
        call = method(
            request, metadata=forwarded(context.invocation_metadata()), timeout=_timeout(context)
        )
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from stubs
                    return
                yield message
        except grpc.aio.AioRpcError as exc:
            _answer_with(context, exc)
        finally:
            call.cancel()

    return forward


def _client_stream(method: Any) -> Callable[[AsyncIterator[bytes], Context], Awaitable[Any]]:
    async def forward(requests: AsyncIterator[bytes], context: Context) -> bytes | None:
        call = method(
            requests, metadata=forwarded(context.invocation_metadata()), timeout=_timeout(context)
        )
        try:
            return bytes(await call)
        except grpc.aio.AioRpcError as exc:
            _answer_with(context, exc)
            return None
        finally:
            call.cancel()

    return forward


Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the type stubs only
_HANDLERS: dict[str, tuple[Callable[[Any], Any], Callable[..., Handler]]] = {
    "unary_unary": (_unary, grpc.unary_unary_rpc_method_handler),
    "unary_stream": (_server_stream, grpc.unary_stream_rpc_method_handler),
    "stream_unary": (_client_stream, grpc.stream_unary_rpc_method_handler),
}


class Forwarder(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in the stubs only
    """Every method of the scheduler's service, forwarded as bytes on `channel`; any other
    method is left to gRPC (UNIMPLEMENTED)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._handlers: dict[str, Handler] = {}
        for kind, path, _options in methods().values():
            if kind not in _HANDLERS:
                raise TypeError(f"the relay cannot forward {path}, a {kind} method")
            make, handler = _HANDLERS[kind]
            # No serializers: the bytes go through as they came.
            self._handlers[path] = handler(make(getattr(channel, kind)(path)))

    @property
    def paths(self) -> list[str]:
        return sorted(self._handlers)

    def service(self, details: grpc.HandlerCallDetails) -> Handler | None:
        return self._handlers.get(details.method)
