"""Rebuilding a gRPC method handler with other parts: the behaviour wrapped (a check run before
every call, `server_tls`), another request deserializer (a size cap, `edge.capped`) or another
response serializer (events serialized once, the scheduler's Watch). gRPC has a constructor
per kind of call; this picks the handler's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # generic in grpc-stubs only
    Handler = grpc.RpcMethodHandler[Any, Any]
else:
    Handler = grpc.RpcMethodHandler

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
