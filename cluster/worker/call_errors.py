"""What a call refused by the scheduler means to the user: a status code, and the kind the
scheduler names in the trailing metadata (see `cluster.scheduler.servicer`), to a ClusterError."""

from __future__ import annotations

from typing import Any

import grpc

from cluster.protocol.errors import (
    AccessDeniedError,
    CapacityError,
    ClusterError,
    CollectiveError,
    JobFailedError,
    PeerFailedError,
)

ERROR_KIND_KEY = "cluster-error"


def _error_kind(exc: grpc.aio.AioRpcError) -> str:
    """The scheduler's name for the error, when it sent one (see servicer.ERROR_KIND_KEY)."""
    metadata: Any = exc.trailing_metadata() or ()  # (key, value) pairs; the stubs disagree
    for key, value in metadata:
        if key == ERROR_KIND_KEY:
            return str(value)
    return ""


def call_error(what: str, exc: grpc.aio.AioRpcError) -> ClusterError | None:
    """The error a refused call raises for the user; None for a call cut off by the scheduler
    going away (CANCELLED, UNAVAILABLE), which the caller handles."""
    code, kind = exc.code(), _error_kind(exc)
    details = exc.details() or code.name
    if kind == PeerFailedError.__name__:
        return PeerFailedError(details or what)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND) or kind in (
        AccessDeniedError.__name__,
        "EvictedError",
    ):
        return AccessDeniedError(f"{what} refused by the scheduler: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(f"{what} refused by the scheduler: {details}")
    if code == grpc.StatusCode.ABORTED:
        return JobFailedError(f"{what} failed: {details}")
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
        return None
    return CollectiveError(f"{what} failed: {details}")
