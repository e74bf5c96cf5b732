"""The local hop: how a worker's calls reach its host's relay, without gRPC.

A worker behind a relay makes the Scheduler service's calls as it would to the scheduler, on a
channel (`cluster.transport.hop_channel.HopChannel`) that carries them as frames on one unix
stream connection to the relay: each frame a 4-byte big-endian length and one HopUp (worker to
relay) or HopDown (relay to worker), `protos/cluster/v1/scheduler.proto`. A call is numbered by
the worker; it starts with its method, metadata, what is left of its deadline, (unary
requests) its request and the schedulers the worker is for (a relay forwards for its own job's
workers only: `HopServer`); the relay answers with its response messages and one end, the status
the scheduler (or the relay) gave it. A worker that cancels its call says so; a worker whose
connection closes has cancelled every call on it, as a gRPC client's would.

Why not gRPC on this hop: both ends are on one host, in processes of one user, and HTTP/2 with
gRPC's threads cost more than the rest of the relay's work for a worker. Measured with 4 client
processes of 1,024 connections each on 2 cores, one call answered with two messages each: gRPC
over a unix socket 380 µs of the client's CPU and 300 µs of the server's a connection, these
frames 57 µs and 60 µs. What gRPC gives that the hop keeps: deadlines, cancellation, metadata,
status codes and details, the end of every call when the connection goes. What it does not need
here: TLS (a socket only this user can reach), flow control (a worker's calls are few and
small; a worker that stops reading is dropped once MAX_UNREAD_BYTES wait for it), name
resolution and load balancing.

This module is the relay's end (`HopServer`); the framing is shared with the worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import struct
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from cluster.protocol import endpoints
from cluster.protocol.errors import ConfigError
from cluster.transport import edge, failures, names, stub

_LENGTH = struct.Struct(">I")
# A frame holds one message of the service (at most 64 MiB, as gRPC's limit here) and its
# framing.
MAX_FRAME_BYTES = 64 * 1024 * 1024 + 64 * 1024
# Calls a worker may hold open at once on its connection (a Watch stream, a Heartbeat stream,
# and its own calls); more are refused (RESOURCE_EXHAUSTED), as a scheduler refuses them.
MAX_CALLS = 64
# Request messages of a client-streaming call read ahead of its handler: a value's pieces (its
# beats come seconds apart), each at most a message the scheduler takes. A worker that writes
# more, or a longer one, has its connection closed: at most about one value's bytes wait.
READ_AHEAD = edge.MAX_VALUE_BYTES // edge.PIECE_BYTES + 16
# What the relay holds for a worker that does not read its answers, at most: then the worker's
# connection is closed (its calls end as cancelled by it).
MAX_UNREAD_BYTES = 2 * MAX_FRAME_BYTES
# Connections waiting to be accepted (a host's workers start at once; a benchmark's thousand).
BACKLOG = 4096
_PONG = stub.hop_pong()
# How long a relay that stops waits for its connections' ends, and for its socket's.
_STOP_S = 1.0
# How a call refused for another job's schedulers ends: a ConfigError, the relay's own refusal.
_ELSEWHERE = (
    (failures.ERROR_KIND_KEY, ConfigError.__name__),
    (failures.RELAY_KEY, failures.RELAY_ELSEWHERE),
)
# Lists of schedulers refused that the relay says, at most (each once).
SAID_ELSEWHERE = 16
# Lists of schedulers accepted that the relay remembers, at most (the next call of each is
# accepted without comparing them again).
KEPT_ACCEPTED = 64


class Verdict(enum.Enum):
    """What `HopServer.refusal` cannot say yet: a name's addresses decide it (`checked`)."""

    LOOK_UP = "look up"


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload; None at the end of the stream. ValueError for a frame longer
    than MAX_FRAME_BYTES; asyncio.IncompleteReadError for a stream cut in a frame."""
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return await reader.readexactly(length)


class HopContext:
    """What a relay's handler learns of a call and sets of its end, as a gRPC servicer context
    does (the part of it the relay uses)."""

    def __init__(self, metadata: stub.HopMetadata, timeout_s: float | None) -> None:
        self._metadata = metadata
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailing: stub.HopMetadata = ()

    def invocation_metadata(self) -> stub.HopMetadata:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def set_trailing_metadata(self, metadata: stub.HopMetadata) -> None:
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


# A method's kind ("unary_unary", "unary_stream", "stream_unary") and its handler: called with
# the request (or an async iterator of them) and the context; it returns the response (None
# with a code set) or, for a server stream, yields them.
Answer: TypeAlias = Callable[[Any, HopContext], Any]
Handlers: TypeAlias = Mapping[str, tuple[str, Answer]]


async def _requests(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while (message := await queue.get()) is not None:
        yield message


class _Connection:
    """One worker's connection: its calls, each a task running its handler once the relay is
    found the worker's (`HopServer.refusal`; a call whose verdict waits on a name's lookup
    waits in its task, `HopServer.checked`)."""

    def __init__(
        self,
        handlers: Handlers,
        server: HopServer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self._handlers = handlers
        self._server = server
        self._reader, self._writer = reader, writer
        self._calls: dict[int, tuple[asyncio.Task[None], asyncio.Queue[bytes | None] | None]] = {}
        self._cancelled: set[int] = set()  # calls the worker cancelled, until they end

    def send(self, payload: bytes) -> None:
        if self._writer.is_closing():
            return
        self._writer.write(frame(payload))
        if self._writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            self._writer.transport.abort()  # the worker reads nothing: its calls end here

    def close(self) -> None:
        self._writer.transport.abort()

    async def serve(self) -> None:
        """Read the worker's frames until its connection ends (or sends what is no frame)."""
        try:
            while (raw := await read_frame(self._reader)) is not None:
                self._take(stub.hop_up(raw))
        except (OSError, ValueError, DecodeError, asyncio.IncompleteReadError):
            pass  # not a worker of ours, or one that went: its calls end with it
        finally:
            for task, _ in list(self._calls.values()):
                task.cancel()
            self.close()

    def _take(self, up: stub.HopUpFrame) -> None:
        number, kind, carried = up
        if kind == "ping":
            self.send(_PONG)
            return
        if kind == "start":
            assert isinstance(carried, tuple)
            self._start(number, *carried)
            return
        held = self._calls.get(number)
        if held is None:
            return  # a call that ended meanwhile
        task, requests = held
        if kind == "cancel":
            self._cancelled.add(number)
            task.cancel()
        elif requests is not None:
            message = carried if isinstance(carried, bytes) else None
            if message is not None and len(message) > edge.MAX_REQUEST_BYTES:
                raise ValueError(f"call {number} wrote a message of {len(message):,} bytes")
            try:
                requests.put_nowait(message)
            except asyncio.QueueFull:
                raise ValueError(f"call {number} wrote {READ_AHEAD} messages ahead") from None

    def _start(
        self,
        number: int,
        method: str,
        metadata: stub.HopMetadata,
        timeout_s: float | None,
        message: bytes | None,
        schedulers: tuple[str, ...],
    ) -> None:
        if number in self._calls:
            raise ValueError(f"call {number} started twice")
        refused = self._server.refusal(schedulers)
        if isinstance(refused, str):
            self._refuse(number, refused)
            return
        found = self._handlers.get(method)
        if found is None:
            self.send(stub.hop_end(number, grpc.StatusCode.UNIMPLEMENTED, "Method not found!", ()))
            return
        if len(self._calls) >= MAX_CALLS:
            why = f"a worker may hold {MAX_CALLS} calls open at once on its relay"
            self.send(stub.hop_end(number, grpc.StatusCode.RESOURCE_EXHAUSTED, why, ()))
            return
        kind, answer = found
        requests: asyncio.Queue[bytes | None] | None = None
        if kind == "stream_unary":
            requests = asyncio.Queue(READ_AHEAD)
            request: Any = _requests(requests)
            if message is not None:  # called as unary, as on gRPC's wire: one message, the end
                requests.put_nowait(message)
                requests.put_nowait(None)
                requests = None  # nothing more comes
        else:
            request = message or b""
        context = HopContext(metadata, timeout_s)
        checking = None if refused is None else schedulers
        task = asyncio.ensure_future(self._run(number, kind, answer, request, context, checking))
        self._calls[number] = (task, requests)
        task.add_done_callback(lambda _: self._forget(number))

    def _refuse(self, number: int, why: str) -> None:
        self.send(stub.hop_end(number, grpc.StatusCode.FAILED_PRECONDITION, why, _ELSEWHERE))

    def _forget(self, number: int) -> None:
        self._calls.pop(number, None)
        self._cancelled.discard(number)

    async def _run(
        self,
        number: int,
        kind: str,
        answer: Answer,
        request: Any,
        context: HopContext,
        checking: tuple[str, ...] | None,
    ) -> None:
        """Run the call's handler; first, with `checking`, the verdict on those schedulers."""
        response: bytes | None = None
        try:
            if checking is not None and (refused := await self._server.checked(checking)):
                self._refuse(number, refused)
                return
            if kind == "unary_stream":
                async for message in answer(request, context):
                    self.send(stub.hop_response(number, message))
                    if self._writer.is_closing():
                        return  # the worker went, or was dropped for reading nothing
            else:
                response = await answer(request, context)
        except asyncio.CancelledError:
            if number in self._cancelled or self._writer.is_closing():
                return  # the worker cancelled it, or went: nothing to tell
            # What the handler awaited was cancelled under it (the relay closed the channel of
            # its call upstream): the call ends as cut off, and the worker makes it again.
            details = "the relay's call upstream was cancelled: call again"
            self.send(stub.hop_end(number, grpc.StatusCode.UNAVAILABLE, details, ()))
            return
        except Exception as exc:  # a handler's fault ends its call, as in gRPC
            details = f"Unexpected error in the relay: {type(exc).__name__}: {exc}"
            self.send(stub.hop_end(number, grpc.StatusCode.UNKNOWN, details, ()))
            return
        ok = context.code == grpc.StatusCode.OK
        message = (response or b"") if ok and kind != "unary_stream" else None
        self.send(stub.hop_end(number, context.code, context.details, context.trailing, message))


class HopServer:
    """The relay's end of the local hop: serves `handlers` (method path -> kind, handler) on a
    unix socket, one `_Connection` a worker.

    With `schedulers` (the relay's, HOST:PORT each, standbys included), a call serves only a
    worker for one of them (`HopStart.schedulers`, its configuration's), however either list
    spells it (`cluster.protocol.endpoints`: `localhost:80` is `LOCALHOST.:0080`, and is
    `127.0.0.1:80` where localhost resolves to it; names looked up off the loop, `lookup`
    through `names.Names`). Another's (a worker of another job, its CLUSTER_RELAY pointed here)
    or one that names none ends FAILED_PRECONDITION with a line that names this relay, both
    lists as written and as resolved, and what to do, its kind a ConfigError marked
    `failures.RELAY_ELSEWHERE`, and goes nowhere. The relay says each list of schedulers it
    refused to `say`, once (the first SAID_ELSEWHERE lists)."""

    def __init__(
        self,
        handlers: Handlers,
        schedulers: Sequence[str] | None = None,
        say: Callable[[str], None] = lambda line: None,
        lookup: names.Lookup = names.addresses_of,
    ) -> None:
        self._handlers = handlers
        self._schedulers = None if schedulers is None else tuple(schedulers)
        self._ours = endpoints.endpoints(schedulers or ())
        self._names = names.Names(lookup)
        self._accepted: set[tuple[str, ...]] = set()
        self._say = say
        self._said: set[tuple[str, ...]] = set()
        self._address = "its socket"
        self._server: asyncio.Server | None = None
        self._connections: dict[_Connection, asyncio.Future[None]] = {}
        self._empty = asyncio.Event()  # set while no worker is connected
        self._empty.set()

    @property
    def connections(self) -> int:
        """How many workers are connected now."""
        return len(self._connections)

    async def emptied(self) -> None:
        """Return once no worker is connected (at once when none is)."""
        await self._empty.wait()

    async def start(self, path: str) -> None:
        """Listen at `path` (a socket only this user can reach)."""
        self._address = f"unix:{path}"
        self._names.start(endpoints.names(self._ours))  # the relay's own, looked up early
        previous = os.umask(0o077)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path, backlog=BACKLOG)
        finally:
            os.umask(previous)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Not cancelled, but ended by closing its connection: asyncio (3.11) takes a connection's
        # task that ends cancelled for one that failed.
        connection = _Connection(self._handlers, self, reader, writer)
        ended = asyncio.get_running_loop().create_future()
        self._connections[connection] = ended
        self._empty.clear()
        try:
            await connection.serve()
        finally:
            del self._connections[connection]
            ended.set_result(None)
            if not self._connections:
                self._empty.set()

    def refusal(self, schedulers: tuple[str, ...]) -> str | Verdict | None:
        """Why a call of a worker for `schedulers` is not this relay's to forward (None: it is,
        or this server forwards for anyone; LOOK_UP: `checked` says, once names are looked
        up)."""
        if self._schedulers is None or schedulers in self._accepted:
            return None
        theirs = endpoints.endpoints(schedulers)
        if endpoints.shared(self._ours, theirs, self._names.known):
            self._accept(schedulers)
            return None
        if set(endpoints.names(self._ours, theirs)).difference(self._names.known):
            return Verdict.LOOK_UP
        return self._refused(schedulers, self._names.known, {})

    async def checked(self, schedulers: tuple[str, ...]) -> str | None:
        """`refusal`, once the names of both lists are looked up (waiting a bounded while for
        them, `names.LOOKUP_S`)."""
        theirs = endpoints.endpoints(schedulers)
        resolved, failed = await self._names.resolve(endpoints.names(self._ours, theirs))
        known = {**self._names.known, **resolved}
        if endpoints.shared(self._ours, theirs, known):
            self._accept(schedulers)
            return None
        return self._refused(schedulers, known, failed)

    def _accept(self, schedulers: tuple[str, ...]) -> None:
        if len(self._accepted) < KEPT_ACCEPTED:
            self._accepted.add(schedulers)

    def _refused(
        self, schedulers: tuple[str, ...], resolved: endpoints.Resolved, failed: dict[str, str]
    ) -> str:
        """The line that refuses a worker for `schedulers`, said once in the relay's log."""
        ours = self._schedulers or ()
        hosts = endpoints.names(self._ours, endpoints.endpoints(schedulers))
        note = endpoints.described(hosts, resolved, failed)
        forwards = _named(ours) + (f" (resolved here: {note})" if note else "")
        relay = f"the relay at {self._address} (CLUSTER_RELAY)"
        if schedulers:
            why = (
                f"this worker is for {_named(schedulers)} (MS_SCHED_HOST and MS_SCHED_PORT, or "
                f"CLUSTER_SCHED_ADDRS), but {relay} forwards to {forwards}: it is another "
                "job's relay. Point CLUSTER_RELAY at this job's relay, or unset it to reach the "
                "scheduler directly"
            )
        else:
            why = (
                f"this caller does not say which scheduler it is for, and {relay} forwards to "
                f"{forwards} only (a worker of another version of cluster?): run the "
                "workers and their relay of one version"
            )
        if schedulers not in self._said and len(self._said) < SAID_ELSEWHERE:
            self._said.add(schedulers)
            theirs = _named(schedulers) if schedulers else "no scheduler named"
            self._say(f"refused a worker's calls ({theirs}): this relay forwards to {forwards}")
        return why

    async def stop(self) -> None:
        """Stop listening and end every worker's connection (its calls end as the workers'
        would when their relay dies)."""
        if self._server is not None:
            self._server.close()
        ending = list(self._connections.values())
        for connection in list(self._connections):
            connection.close()
        if ending:
            await asyncio.wait(ending, timeout=_STOP_S)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), _STOP_S)


def _named(addresses: Sequence[str]) -> str:
    many = len(addresses) > 1
    return f"the scheduler{'s' if many else ''} at {', '.join(addresses)}"
