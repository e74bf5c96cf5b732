"""Failures on the wire, both ways: the one table from ClusterError to gRPC status and back.

The scheduler ends a refused call with `status_of(error)`: a status code, and the error's class
name in the trailing metadata (`cluster-error`), so that a worker tells an evicted node from a
failed job, or a failed peer from a misuse, without reading messages; a standby scheduler adds
where the leader is (`cluster-leader`). A client turns what came back into a `CallFailure` with
`failure_of`: the error class to raise, or `cut_off` when the call was not answered at all (the
scheduler or the connection went away), which only the caller knows how to handle.

A call refused without a kind (by gRPC itself, by the TLS certificate check) is classified by
its code alone.

A refused Exchange may say why beside its kind: `EXCHANGE_REFUSAL_KEY` holds a serialized
`ExchangeRefusal` (its reason), which the converters write and read (`cluster.scheduler.convert`,
`cluster.worker.convert`). An error told so goes with its base's kind (`_TOLD_BY_REASON`): a
worker that reads no reason (an older one) raises that base, as it always did.
"""

from __future__ import annotations

from typing import Any

import grpc

from cluster.protocol.errors import (
    AccessDeniedError,
    BadRequestError,
    CapacityError,
    ClusterError,
    CollectiveError,
    CollectiveMismatchError,
    ConfigError,
    CrowdedError,
    EvictedError,
    FellBehindError,
    JobFailedError,
    NotAuthenticatedError,
    NotLeaderError,
    PeerFailedError,
    PeerFinishedError,
    RegistrationPendingError,
    RegistrationRefused,
    UnknownNodeError,
)
from cluster.protocol.value import frozen

ERROR_KIND_KEY = "cluster-error"
LEADER_KEY = "cluster-leader"
# Set by a host's relay on a worker's call it ends cut off (UNAVAILABLE with no kind): the relay
# could not reach the scheduler, or lost it under the call. The relay waits for the scheduler's
# port for its host, so its worker asks it again instead of probing the scheduler itself.
RELAY_KEY, RELAY_CUT_OFF = "cluster-relay", "cut-off"
# Set by a relay on a worker's call it refuses itself, forwarding to none of the schedulers the
# worker is for (another job's relay): the worker's error is the relay's line as it is.
RELAY_ELSEWHERE = "elsewhere"
# A refused Exchange's reason, a serialized `ExchangeRefusal` (binary metadata: "-bin").
EXCHANGE_REFUSAL_KEY = "cluster-exchange-refusal-bin"
Metadata = tuple[tuple[str, str], ...]

# Each error's status code: the first row whose class it is an instance of.
_CODES: tuple[tuple[type[ClusterError], grpc.StatusCode], ...] = (
    (BadRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotAuthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (UnknownNodeError, grpc.StatusCode.NOT_FOUND),
    (EvictedError, grpc.StatusCode.ABORTED),
    (JobFailedError, grpc.StatusCode.ABORTED),
    # A standby: a client that does not know the kind retries, which is not wrong either.
    (NotLeaderError, grpc.StatusCode.UNAVAILABLE),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # Not answers: a node's caller takes them as cut off (made again once it registered, or
    # once the scheduler is less crowded).
    (RegistrationPendingError, grpc.StatusCode.UNAVAILABLE),
    (CrowdedError, grpc.StatusCode.UNAVAILABLE),
    (ClusterError, grpc.StatusCode.FAILED_PRECONDITION),
)
# The kinds a client knows by name: every class above, and those a refusal raises.
_KINDS: dict[str, type[ClusterError]] = {
    kind.__name__: kind
    for kind in (
        *(kind for kind, _ in _CODES if kind not in (RegistrationPendingError, CrowdedError)),
        AccessDeniedError,
        PeerFailedError,
        CollectiveError,
        FellBehindError,
        RegistrationRefused,  # a host's relay of another protocol revision, on its workers' Watch
    )
}
# The errors a refusal tells by its reason, not its kind: the kind they go with.
_TOLD_BY_REASON: dict[type[ClusterError], type[ClusterError]] = {
    CollectiveMismatchError: CollectiveError,
    PeerFinishedError: CollectiveError,
}
# A call refused without a kind.
_BY_CODE: dict[grpc.StatusCode, type[ClusterError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AccessDeniedError,
    grpc.StatusCode.NOT_FOUND: AccessDeniedError,
    grpc.StatusCode.PERMISSION_DENIED: AccessDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.ABORTED: JobFailedError,
}
# Not an answer: the scheduler or the connection went away under the call. (INTERNAL is
# "Internal error from Core", seen when a connection is torn down under a call.)
_CUT_OFF = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)


def status_of(error: ClusterError) -> tuple[grpc.StatusCode, Metadata]:
    """How the scheduler ends a call that failed with `error`: its code and trailing metadata."""
    code = next(code for kind, code in _CODES if isinstance(error, kind))
    named = _TOLD_BY_REASON.get(type(error), type(error))
    metadata: Metadata = ((ERROR_KIND_KEY, named.__name__),)
    if isinstance(error, NotLeaderError):
        metadata += ((LEADER_KEY, error.leader),)
    return code, metadata


@frozen
class CallFailure:
    """What a failed call means to its caller. `kind` None: cut off, not refused."""

    kind: type[ClusterError] | None
    details: str
    code: str  # the status code's name, for messages
    leader: str = ""
    relay_cut_off: bool = False  # a relay ended it: it cannot reach the scheduler (RELAY_KEY)
    relay_elsewhere: bool = False  # a relay refused it: not this worker's (RELAY_ELSEWHERE)

    @property
    def cut_off(self) -> bool:
        return self.kind is None

    @property
    def timed_out(self) -> bool:
        """The caller's own deadline passed (the scheduler may still do what was asked)."""
        return self.code == grpc.StatusCode.DEADLINE_EXCEEDED.name

    def error(self, what: str) -> ClusterError:
        """The error the call `what` raises for the user (a cut-off one: a CollectiveError)."""
        if self.relay_elsewhere:
            return ConfigError(self.details)  # the relay's line says it all
        kind = self.kind or CollectiveError
        if kind is NotLeaderError:
            return NotLeaderError(f"{what}: {self.details}", self.leader)
        if issubclass(kind, PeerFailedError):
            return kind(self.details)
        if issubclass(kind, AccessDeniedError | CapacityError):
            return kind(f"{what} refused by the scheduler: {self.details}")
        return kind(f"{what} failed: {self.details}")


# What gRPC says when a ping of the connection went unanswered (`channel.keepalive_options`),
# and what a user is told instead.
_PING_TIMEOUTS = ("ping timeout", "keepalive watchdog timeout")
PING_TIMEOUT_DETAILS = (
    "it stopped answering gRPC's pings of the connection for MS_NODE_TIMEOUT (stopped, hung or "
    "cut off?)"
)


def failure_of(exc: grpc.aio.AioRpcError) -> CallFailure:
    """The meaning of a failed call, from its status code and trailing metadata."""
    code, named = exc.code(), _metadata(exc)
    details = exc.details() or code.name
    if any(words in details.lower() for words in _PING_TIMEOUTS):
        details = PING_TIMEOUT_DETAILS
    kind = _KINDS.get(named.get(ERROR_KIND_KEY, ""))
    if kind is None and code not in _CUT_OFF:
        kind = _BY_CODE.get(code, CollectiveError)
    relay = named.get(RELAY_KEY)
    if relay == RELAY_ELSEWHERE:
        kind = ConfigError
    return CallFailure(
        kind,
        details,
        code.name,
        named.get(LEADER_KEY, ""),
        relay == RELAY_CUT_OFF,
        relay == RELAY_ELSEWHERE,
    )


def _metadata(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    pairs: Any = exc.trailing_metadata() or ()  # (key, value) pairs; the stubs disagree
    return {str(key): str(value) for key, value in pairs}
