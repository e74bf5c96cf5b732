"""The worker's end of the local hop (`cluster.transport.hop`): a channel to its host's relay
that makes the Scheduler service's calls as a grpc.aio channel makes them, as frames on one
unix stream connection.

The agent cannot tell the two apart: a call is awaited, read, written and cancelled alike; it
ends with an `AioRpcError` of the status the scheduler (or the relay) gave it, or
`asyncio.CancelledError` once cancelled here (by `cancel()`, by the channel's close, or by
cancelling the task that awaits it); `get_state()` says whether the connection is up. The
connection is made at the first call and again at the first call after it was lost; a call
with `wait_for_ready` waits for it (backing off from RECONNECT_FIRST_S to RECONNECT_MOST_S
between attempts) until its deadline, one without fails at once when the relay does not answer
(UNAVAILABLE). A connection lost ends every call on it with UNAVAILABLE, which the agent reads
as its relay gone (`cluster.worker.scheduler_link.Route`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cluster.protocol.backoff import Backoff
from cluster.transport import stub
from cluster.transport.channel import keepalive_ms
from cluster.transport.hop import frame, read_frame

_PING = stub.hop_ping()
RECONNECT_FIRST_S = 0.05
RECONNECT_MOST_S = 1.0
_EMPTY = grpc.aio.Metadata()
_UNARY_REQUEST = ("unary_unary", "unary_stream")
_CANCELLED = "Locally cancelled by application!"


def _same(value: Any) -> Any:
    return value


def ping(address: str, within_s: float) -> str:
    """Why the relay at `address` (unix:PATH) does not answer a ping within `within_s`, on a
    connection of its own (closed after); "" when it does. A connection taken is no answer: a
    stopped relay's socket still takes connections (the kernel does, up to its backlog).
    Blocks up to `within_s`."""
    deadline = time.monotonic() + within_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.settimeout(within_s)
            sock.connect(address.removeprefix("unix:"))
        except OSError as exc:
            return f"nothing takes connections there: {exc.strerror or exc}"
        try:
            sock.sendall(frame(_PING))
            got = b""
            while len(got) < 4 or len(got) < 4 + int.from_bytes(got[:4], "big"):
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                if not (chunk := sock.recv(64)):
                    return "it took a connection and closed it without answering a ping"
                got += chunk
        except TimeoutError:
            why = f"it takes connections, but answered no ping within {within_s:g} s"
            return f"{why}: stopped or hung?"
        except OSError as exc:
            return f"its connection broke before it answered a ping ({exc.strerror or exc})"
    with contextlib.suppress(DecodeError):
        if stub.hop_down(got[4 : 4 + int.from_bytes(got[:4], "big")]) == (0, None, None):
            return ""
    return "it answered a ping with something else than a pong"


class HopCall(
    grpc.aio.UnaryUnaryCall[Any, Any],
    grpc.aio.UnaryStreamCall[Any, Any],
    grpc.aio.StreamUnaryCall[Any, Any],
):
    """One call of `method` on a `HopChannel`, as grpc.aio's call of its kind behaves."""

    def __init__(
        self,
        channel: HopChannel,
        method: Method,
        request: Any,
        metadata: Iterable[tuple[str, Any]] | None,
        timeout: float | None,
        wait_for_ready: bool,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._channel, self._method = channel, method.path
        self.number = channel.next_number()
        self.wait_for_ready = wait_for_ready
        self._serialize = method.serialize or _same
        self._deserialize = method.deserialize or _same
        self._metadata = tuple(metadata or ())
        self._request = self._serialize(request) if method.kind in _UNARY_REQUEST else None
        self._deadline = None if timeout is None else self._loop.time() + timeout
        self._messages: deque[bytes] = deque()
        self._arrived: asyncio.Future[None] | None = None
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._status: tuple[grpc.StatusCode, str, stub.HopMetadata] | None = None
        self._response: bytes | None = None
        self._locally_cancelled = False
        self._callbacks: list[Callable[[Any], None]] = []
        self._queued: list[bytes] | None = []  # frames sent before the call started
        self._timer = None if timeout is None else self._loop.call_later(timeout, self._expire)

    # -- what the channel does with it ----------------------------------------------------------

    def start_frames(self) -> list[bytes]:
        """The call's first frame, then what it sent meanwhile; from now on it sends at once."""
        remaining = None if self._deadline is None else max(self._deadline - self._loop.time(), 0)
        start = stub.hop_start(
            self.number,
            self._method,
            self._metadata,
            remaining,
            self._request,
            self._channel.schedulers,
        )
        queued, self._queued = self._queued or [], None
        return [start, *queued]

    def arrived(self, message: bytes) -> None:
        self._messages.append(message)
        self._wake()

    def ended(self, code: grpc.StatusCode, details: str, trailing: stub.HopMetadata) -> None:
        self._end(code, details, trailing)

    def answered(self, response: bytes | None) -> None:
        self._response = response

    # -- grpc.aio's call ------------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, Any]:
        try:
            yield from asyncio.shield(self._done).__await__()
        except asyncio.CancelledError:
            self.cancel()
            raise
        self._raise_for_status()
        return self._deserialize(self._response or b"")

    async def read(self) -> Any:
        while not self._messages:
            if self._done.done():
                self._raise_for_status()
                return grpc.aio.EOF  # type: ignore[attr-defined]  # missing from the stubs
            self._arrived = self._loop.create_future()
            try:
                await self._arrived
            except asyncio.CancelledError:
                self.cancel()
                raise
        return self._deserialize(self._messages.popleft())

    async def _responses(self) -> AsyncIterator[Any]:
        while (message := await self.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            yield message

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def write(self, request: Any) -> None:
        if self._done.done():
            self._raise_for_status()
            raise asyncio.InvalidStateError("RPC already finished.")
        self._send(stub.hop_request(self.number, self._serialize(request)))

    async def done_writing(self) -> None:
        if not self._done.done():
            self._send(stub.hop_done_writing(self.number))

    def cancel(self) -> bool:
        if self._done.done():
            return False
        self._locally_cancelled = True
        if self._queued is None:
            self._send(stub.hop_cancel(self.number))
        self._end(grpc.StatusCode.CANCELLED, _CANCELLED, ())
        return True

    def cancelled(self) -> bool:
        return self._status is not None and self._status[0] == grpc.StatusCode.CANCELLED

    def done(self) -> bool:
        return self._done.done()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._done.done():
            self._loop.call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - self._loop.time(), 0.0)

    async def code(self) -> grpc.StatusCode:
        await asyncio.shield(self._done)
        assert self._status is not None
        return self._status[0]

    async def details(self) -> str:
        await asyncio.shield(self._done)
        assert self._status is not None
        return self._status[1]

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return _EMPTY

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        await asyncio.shield(self._done)
        assert self._status is not None
        return grpc.aio.Metadata(*self._status[2])

    async def wait_for_connection(self) -> None:
        while self._queued is not None and not self._done.done():
            await self._channel.wait_for_state_change(self._channel.get_state())

    # -- its end --------------------------------------------------------------------------------

    def _send(self, payload: bytes) -> None:
        if self._queued is None:
            self._channel.send(payload)
        else:
            self._queued.append(payload)

    def _expire(self) -> None:
        if not self._done.done():
            if self._queued is None:
                self._send(stub.hop_cancel(self.number))
            self._end(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ())

    def _end(self, code: grpc.StatusCode, details: str, trailing: stub.HopMetadata) -> None:
        if self._done.done():
            return
        self._status = (code, details, trailing)
        if self._timer is not None:
            self._timer.cancel()
        self._done.set_result(None)
        self._wake()
        self._channel.forget(self)
        for callback in self._callbacks:
            self._loop.call_soon(callback, self)
        self._callbacks.clear()

    def _wake(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    def _raise_for_status(self) -> None:
        assert self._status is not None
        code, details, trailing = self._status
        if self._locally_cancelled:
            raise asyncio.CancelledError()
        if code != grpc.StatusCode.OK:
            raise grpc.aio.AioRpcError(code, _EMPTY, grpc.aio.Metadata(*trailing), details, None)


class Method:
    """One method of the service on a `HopChannel`, called as grpc.aio's multi-callables are."""

    def __init__(
        self,
        channel: HopChannel,
        kind: str,
        path: str,
        codec: tuple[Callable[[Any], bytes] | None, Callable[[bytes], Any] | None],
    ) -> None:
        self._channel, self.kind, self.path = channel, kind, path
        self.serialize, self.deserialize = codec

    def __call__(
        self,
        request: Any = None,
        *,
        timeout: float | None = None,
        metadata: Iterable[tuple[str, Any]] | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> HopCall:
        if self.kind == "stream_unary" and request is not None:
            raise TypeError("on the local hop a client stream is written, not given")
        call = HopCall(self._channel, self, request, metadata, timeout, bool(wait_for_ready))
        self._channel.begin(call)
        return call


class HopChannel(grpc.aio.Channel):
    """The channel to the relay at `address` (unix:PATH). With `silence_s` (MS_NODE_TIMEOUT),
    the relay is pinged as gRPC pings the scheduler (`channel.keepalive_options`): every
    `silence_s` / 3 at most, and a relay that sends nothing for `silence_s` and the slack (a
    stopped process) is taken for gone: the connection is dropped, its calls end UNAVAILABLE.
    Each call's start names `schedulers`, those the worker is for (HOST:PORT each): a relay
    that forwards to none of them refuses the call (`cluster.transport.hop.HopServer`)."""

    def __init__(
        self, address: str, silence_s: float | None = None, schedulers: Sequence[str] = ()
    ) -> None:
        self.address = address
        self.schedulers = tuple(schedulers)
        # (ping every, answered within) in seconds; None: no pings.
        self._keepalive: tuple[float, ...] | None = None
        if silence_s is not None:
            self._keepalive = tuple(ms / 1000 for ms in keepalive_ms(silence_s))
        self._heard = 0.0
        self._pinging: asyncio.TimerHandle | None = None
        self._why_lost: str | None = None
        self._path = address.removeprefix("unix:")
        self._state = grpc.ChannelConnectivity.IDLE
        self._changed: asyncio.Event | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._connecting: asyncio.Task[None] | None = None
        self._calls: dict[int, HopCall] = {}  # started on the connection
        self._waiting: list[HopCall] = []  # waiting for a connection
        self._numbers = itertools.count(1)
        self._reconnect = Backoff(RECONNECT_FIRST_S, RECONNECT_MOST_S)
        self._closed = False

    def next_number(self) -> int:
        return next(self._numbers)

    # -- calls ----------------------------------------------------------------------------------

    def begin(self, call: HopCall) -> None:
        if self._closed:
            raise grpc.aio.UsageError("Channel is closed.")
        if self._state is grpc.ChannelConnectivity.READY:
            self._start(call)
        else:
            self._waiting.append(call)
            self._connect_soon()

    def _start(self, call: HopCall) -> None:
        self._calls[call.number] = call
        for payload in call.start_frames():
            self.send(payload)

    def send(self, payload: bytes) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame(payload))

    def forget(self, call: HopCall) -> None:
        self._calls.pop(call.number, None)
        with contextlib.suppress(ValueError):
            self._waiting.remove(call)

    # -- the connection -------------------------------------------------------------------------

    def _set_state(self, state: grpc.ChannelConnectivity) -> None:
        self._state = state
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _spawn(self, coroutine: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _connect_soon(self) -> None:
        if not self._closed and (self._connecting is None or self._connecting.done()):
            self._connecting = self._spawn(self._connect())

    async def _connect(self) -> None:
        while not self._closed:
            self._set_state(grpc.ChannelConnectivity.CONNECTING)
            try:
                reader, writer = await asyncio.open_unix_connection(self._path)
            except OSError as exc:
                self._set_state(grpc.ChannelConnectivity.TRANSIENT_FAILURE)
                why = f"the relay at {self.address} does not answer ({exc.strerror or exc})"
                for call in [c for c in self._waiting if not c.wait_for_ready]:
                    call.ended(grpc.StatusCode.UNAVAILABLE, why, ())
                if not self._waiting:
                    return
                await asyncio.sleep(self._reconnect.next_s())
                continue
            self._reconnect.reset()
            self._writer = writer
            self._heard = asyncio.get_running_loop().time()
            self._ping_later()
            self._set_state(grpc.ChannelConnectivity.READY)
            self._spawn(self._read(reader, writer))
            waiting, self._waiting = self._waiting, []
            for call in waiting:
                self._start(call)
            return

    def quiet_s(self) -> float | None:
        """How long the relay has gone unheard on this channel's connection (a pong, or any
        other frame); None while no connection is up."""
        if self._writer is None or self._state is not grpc.ChannelConnectivity.READY:
            return None
        return asyncio.get_running_loop().time() - self._heard

    def answering(self, slack_s: float) -> bool:
        """Whether the relay answers on this channel: its connection is up and it was heard
        within a ping's interval and `slack_s`, as a running relay is (it answers each ping at
        once); without pings, whether its connection is up."""
        quiet_s = self.quiet_s()
        if quiet_s is None or self._keepalive is None:
            return quiet_s is not None
        return quiet_s <= self._keepalive[0] + slack_s

    def _ping_later(self) -> None:
        if self._keepalive is not None:
            every_s = self._keepalive[0]
            self._pinging = asyncio.get_running_loop().call_later(every_s, self._ping)

    def _ping(self) -> None:
        writer, keepalive = self._writer, self._keepalive
        if writer is None or keepalive is None or self._closed:
            return
        quiet_s = asyncio.get_running_loop().time() - self._heard
        if quiet_s > keepalive[1]:
            self._why_lost = f"the relay at {self.address} did not answer for {quiet_s:.1f} s"
            writer.transport.abort()
            return
        self.send(_PING)
        self._ping_later()

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        why = f"the relay at {self.address} closed the connection"
        loop = asyncio.get_running_loop()
        try:
            while (raw := await read_frame(reader)) is not None:
                self._heard = loop.time()
                number, message, end = stub.hop_down(raw)
                call = self._calls.get(number)
                if call is None:
                    continue  # a call that ended here meanwhile
                if end is None:
                    assert message is not None
                    call.arrived(message)
                    continue
                code, details, trailing, response = end
                call.answered(response)
                call.ended(code, details, trailing)
        except (OSError, ValueError, DecodeError, asyncio.IncompleteReadError) as exc:
            why = f"the relay at {self.address} broke the connection ({exc})"
        finally:
            writer.transport.abort()
            if self._writer is writer:
                self._writer = None
                why, self._why_lost = self._why_lost or why, None
                if self._pinging is not None:
                    self._pinging.cancel()
                if not self._closed:
                    self._set_state(grpc.ChannelConnectivity.TRANSIENT_FAILURE)
                for call in list(self._calls.values()):
                    call.ended(grpc.StatusCode.UNAVAILABLE, why, ())

    # -- grpc.aio's channel ---------------------------------------------------------------------

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        idle = (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
        if try_to_connect and self._state in idle:
            self._connect_soon()
        return self._state

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        while self._state is last_observed_state:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    async def channel_ready(self) -> None:
        while (state := self.get_state(try_to_connect=True)) is not grpc.ChannelConnectivity.READY:
            await self.wait_for_state_change(state)

    def unary_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool = False,
    ) -> Any:
        return Method(self, "unary_unary", method, (request_serializer, response_deserializer))

    def unary_stream(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool = False,
    ) -> Any:
        return Method(self, "unary_stream", method, (request_serializer, response_deserializer))

    def stream_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool = False,
    ) -> Any:
        return Method(self, "stream_unary", method, (request_serializer, response_deserializer))

    def stream_stream(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool = False,
    ) -> Any:
        raise TypeError(f"the local hop carries no bidirectional call ({method})")

    async def close(self, grace: float | None = None) -> None:
        """Close once the calls end (`grace` seconds at most; None: now): those still open are
        cancelled."""
        if grace:
            pending = [call for call in (*self._calls.values(), *self._waiting) if not call.done()]
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(c.code() for c in pending)), grace)
        self._closed = True
        self._set_state(grpc.ChannelConnectivity.SHUTDOWN)
        if self._pinging is not None:
            self._pinging.cancel()
        for call in [*self._calls.values(), *self._waiting]:
            call.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._writer is not None:
            self._writer.transport.abort()
            self._writer = None

    async def __aenter__(self) -> HopChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(None)
