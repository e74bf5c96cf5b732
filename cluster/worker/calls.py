"""How a worker makes a call for the user (`WorkerAgent`'s collectives, key-value calls and
checkpoint reports): signed, with the proof's number held while the call is in flight
(`membership.CallSigner`), raced against the job's failure (`racing`), made again where the
worker core says so (the scheduler went away during it, with recovery on) or on the new
channel when a new leader was followed during it, and its failure turned into the error the
caller raises."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from cluster.protocol.errors import CapacityError, ClusterError, CollectiveError, NotLeaderError
from cluster.transport import edge, failures, membership
from cluster.worker.link import Link
from cluster.worker.machine import steps
from cluster.worker.machine.core import WorkerCore
from cluster.worker.racing import unless_failed

T = TypeVar("T")
# What a method's failed call says beside its kind (its refusal's reason): the failure read so.
ReadFailure = Callable[[grpc.aio.AioRpcError, failures.CallFailure], failures.CallFailure]


def _none() -> None:
    pass


def _as_it_is(exc: grpc.aio.AioRpcError, failure: failures.CallFailure) -> failures.CallFailure:
    return failure


def refused_by_grpc(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a call failed on gRPC's own limit of a message's size (this side's, as it sends,
    or the scheduler's, as it receives), not by the scheduler's decision: RESOURCE_EXHAUSTED
    without the kind of error the scheduler names on each of its refusals."""
    exhausted = exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    return exhausted and failures.ERROR_KIND_KEY not in _named(exc)


def refused_at_the_edge(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the scheduler refused a call before taking it up for the caller's certificate
    (revoked, expired: `server_tls.PeerCertificateCheck`, on every call): UNAUTHENTICATED or
    PERMISSION_DENIED without the kind of error the scheduler names on its own refusals."""
    refusals = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    return exc.code() in refusals and failures.ERROR_KIND_KEY not in _named(exc)


def _named(exc: grpc.aio.AioRpcError) -> set[str]:
    """The keys of a failed call's trailing metadata."""
    pairs: Any = exc.trailing_metadata() or ()  # (key, value) pairs; the stubs disagree
    return {str(key) for key, _ in pairs}


class Calls:
    """The user's calls of one worker over its `link`. `signed(method, request)`: a call's
    metadata; `failed`: settled with the job's failure; `core`: the worker's, whose decision on
    a call the scheduler did not answer (`steps.CallCutOff`) `run` carries out."""

    def __init__(
        self,
        link: Link,
        signer: membership.CallSigner | None,
        signed: Callable[[str, Any], membership.Metadata],
        failed: asyncio.Future[ClusterError],
        core: WorkerCore,
        run: Callable[[list[steps.Action]], Awaitable[object]],
    ) -> None:
        self._link, self._signer, self._signed = link, signer, signed
        self._failed, self._core, self._run = failed, core, run

    async def call(
        self,
        what: str,
        rpc: Callable[[], Awaitable[T]],
        unsent: Callable[[], None] = _none,
        read: ReadFailure = _as_it_is,
    ) -> T:
        """Make the call `rpc()` makes; again if the core says so (the scheduler died during it,
        with recovery on). `unsent()` is called when gRPC refused the call's message, here or
        at the scheduler, before the scheduler took it (`refused_by_grpc`); `read` reads what
        else a failure of this call's method says (`convert.exchange_failure`)."""
        while True:
            channel, signer = self._link.channel, self._signer
            first = 0 if signer is None else signer.seq
            call = rpc()  # signs it, synchronously: the numbers taken since `first` are its own
            taken = range(0) if signer is None else range(first + 1, signer.seq + 1)
            if signer is not None:
                signer.hold(taken)
            try:
                return await unless_failed(call, self._failed)
            except asyncio.CancelledError:
                if self._cancelled_by_leader_change(channel):
                    continue  # on the channel closed for a new leader: made again on the new one
                raise
            except grpc.aio.AioRpcError as exc:
                failure = read(exc, failures.failure_of(exc))
                if refused_by_grpc(exc):
                    unsent()
                    raise CapacityError(
                        f"{what} was refused by gRPC before the scheduler took it "
                        f"({failure.details}): send less per call"
                    ) from None
                away = self._core.away() if failure.timed_out else ""
                if away:  # the call's own deadline passed while the scheduler was away
                    error = f"{what}: no answer before its deadline, as {away}"
                    raise CollectiveError(error) from None
                # A scheduler that does not lead (yet) answers for nothing: as one cut off.
                if not failure.cut_off and failure.kind is not NotLeaderError:
                    raise failure.error(what) from None
                then = await self._run(self._core.step(steps.CallCutOff()))
                if isinstance(then, steps.RetryCall):
                    await asyncio.sleep(then.pause_s)
                    continue
                raise failure.error(what) from None
            finally:
                if signer is not None:
                    signer.release(taken)

    async def request(
        self,
        what: str,
        method: str,
        request: Any,
        *,
        unsent: Callable[[], None] = _none,
        read: ReadFailure = _as_it_is,
        **options: Any,
    ) -> Any:
        """The call `method` of `request` for the user, signed (`call`), on the link's stub at
        each try (a new leader's). A value's call (`edge.VALUE_METHODS`) whose value passes one
        message is signed as the whole request and written in pieces (`edge.pieces`: the
        scheduler takes no longer message); a value past `edge.MAX_VALUE_BYTES` is refused here,
        unsent. Any other request is one message: a unary call."""
        size = len(request.value) if method in edge.VALUE_METHODS else 0
        if size <= edge.PIECE_BYTES:
            return await self.call(
                what,
                lambda: self._link.stub.unary(method)(
                    request, wait_for_ready=True, metadata=self._signed(method, request), **options
                ),
                unsent,
                read,
            )
        if size > edge.MAX_VALUE_BYTES:
            unsent()
            raise CapacityError(
                f"{what} carries {size:,} bytes, and a call carries at most "
                f"{edge.MAX_VALUE_BYTES:,} (64 MiB): send less per call"
            )

        def in_pieces() -> Awaitable[Any]:
            metadata = self._signed(method, request)  # signs it now, as `call` needs
            opened = getattr(self._link.stub, method)(
                metadata=metadata, wait_for_ready=True, **options
            )
            return _written(opened, request)

        return await self.call(what, in_pieces, unsent, read)

    def _cancelled_by_leader_change(self, channel: grpc.aio.Channel) -> bool:
        """Whether a call cancelled on `channel` was cut off by following a new leader (the
        channel was closed for another), not by cancelling this task."""
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11 on
        return channel is not self._link.channel and not (cancelling is not None and cancelling())


async def _written(call: Any, request: Any) -> Any:
    """The answer of a client-streaming `call` (or what it ended with) once `request` is written
    on it in pieces. The writes run beside the wait for the answer: gRPC's write waits for the
    call's start, which a call that fails first (its channel closed for a new leader, its
    connection gone) never makes, and the answer says how it ended. Both end with this."""
    writer = asyncio.ensure_future(_write_pieces(call, request))
    try:
        return await call
    finally:
        writer.cancel()
        if not call.done():
            call.cancel()


async def _write_pieces(call: Any, request: Any) -> None:
    with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):  # `call` says
        for piece in edge.pieces(request):
            await call.write(piece)
        await call.done_writing()
