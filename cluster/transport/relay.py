"""A host's relay: the scheduler's service served to the host's workers on a local socket (the
local hop, `cluster.transport.hop`: frames, not gRPC), over one channel (one connection) to the
scheduler.

The relay is transport, not authority. A worker's call metadata (its credential or call proof,
`cluster.transport.membership`) and request go upstream as they came, so the scheduler admits
every call as it would a direct one, and a relay cannot speak for a worker it does not hold.
What comes back (the answer or the events, the status code, its details and trailing metadata
such as `cluster-error`) goes back to the worker as it came. Most calls are forwarded call by
call, byte for byte, parsing nothing. Four are not, so that the scheduler's work grows with the
hosts, not the workers:

- `Watch`: each worker's stream ends here and is attached as a slot to the relay's one
  `HostWatch` call (`HostLinks`): the worker's request and metadata go up in the attach, the
  scheduler runs the slot as the Watch call it stands for, and its events come down serialized
  once for all the host's slots they are for (the relay reads only that envelope: which slots,
  and how each ends). A worker whose process or connection dies cancels its call here, which
  detaches its slot at once: the scheduler sees that worker's stream end as it would a direct
  one. A relay that dies ends the link, and with it every slot: the scheduler sees its host's
  workers fail, and they go to the scheduler directly (`cluster.worker.scheduler_link.Route`).
- `Finish`: each worker's call ends here too, and goes up as a finish slot of the same link,
  which ends with the status and the answer the scheduler gave it (a job's end is N finishes at
  once: on the link they are messages of one stream, not N calls).
- `Heartbeat`: each worker's call ends here, and the beats heard go up batched on one
  `HostBeats` stream (`HostBeats`). The scheduler takes a batched beat only for a node whose
  admitted Watch slot is on the relay's connection: the relay beats only for the workers it
  holds, and only when their own beats came.
- `PeerTable`, a whole peer table by its digest (the same bytes for every node of the job, named
  only in a member's event stream): the first of the host's workers to ask for a digest has its
  call forwarded; the others that ask meanwhile or later get the same answer (`TableAnswers`),
  so a formation brings the table to the host once, not once per worker. A worker that asks
  for it (`shared`) is answered instead with the host's one copy (`SharedTables`), parsed once
  here and mapped by every worker of the host, which reads only the rows it needs.

With several schedulers (standbys on etcd), the relay sends every call to the one it takes for
the leader (`cluster.transport.upstreams`), by the rules the workers follow
(`cluster.protocol.leader_search`): it reads only what a call came back with, the trailing
metadata of a standby (`cluster-leader`) and a call cut off, and moves; the worker, told the
same, asks again, and its call goes where the relay went. A refusal moves it nowhere (a worker
with a stale record is refused as another job's by the job's own leader): a worker refused as
another job's through it asks directly (`cluster.worker.machine.joining`). A named leader of
another job than the one its workers were accepted into is not followed, and reaches the
workers unnamed (`Upstreams.may_follow`).

Upstream calls are made without waiting for a connection that is down: a worker whose scheduler
cannot be reached hears UNAVAILABLE at once, as it would from its own channel, and checks the
scheduler itself (its probes go direct).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from cluster.protocol import version
from cluster.protocol.errors import (
    BadRequestError,
    CapacityError,
    ClusterError,
    MissedTableChange,
    NotLeaderError,
)
from cluster.transport import edge, failures, stub, table_file
from cluster.transport.shared_answers import SharedAnswers
from cluster.transport.stub import methods
from cluster.transport.upstreams import Upstreams, cut_off

# Headers that belong to one hop (gRPC's, HTTP/2's), not to the call: gRPC sets its own.
_HOP_PREFIXES = (":", "grpc-")
_HOP_HEADERS = frozenset({"user-agent", "te", "content-type", "host"})
Metadatum = tuple[str, "str | bytes"]


class Context(Protocol):
    """What the relay's handlers use of a call's context: a gRPC servicer context's, or the
    local hop's (`cluster.transport.hop.HopContext`)."""

    def invocation_metadata(self) -> Any: ...
    def time_remaining(self) -> float | None: ...
    def set_trailing_metadata(self, trailing_metadata: Any) -> None: ...
    def set_code(self, code: grpc.StatusCode) -> None: ...
    def set_details(self, details: str) -> None: ...


def forwarded(metadata: Iterable[Any] | None) -> tuple[Metadatum, ...]:
    """The call metadata a worker sent, without the headers of its hop to the relay."""
    return tuple(
        (str(key), value)
        for key, value in metadata or ()
        if not str(key).startswith(_HOP_PREFIXES) and str(key) not in _HOP_HEADERS
    )


def relayed(code: grpc.StatusCode, trailing: tuple[Metadatum, ...]) -> tuple[Metadatum, ...]:
    """The trailing metadata of a worker's call that ended with `code` upstream: the
    scheduler's, and `failures.RELAY_KEY` when the call was cut off (UNAVAILABLE with no kind,
    as `Upstreams.answered` takes it): the worker then asks this relay again, which waits for
    the scheduler's port for its host, rather than probing the scheduler itself."""
    keys = {key for key, _ in trailing}
    if not cut_off(code, keys) or failures.RELAY_KEY in keys:
        return trailing
    return (*trailing, (failures.RELAY_KEY, failures.RELAY_CUT_OFF))


def _timeout(context: Context) -> float | None:
    """What is left of the worker's deadline, for the upstream call (None: it set none)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else max(remaining, 0.0)


def _refuse(context: Context, error: ClusterError) -> None:
    """End the worker's call here, refused with `error` as the scheduler would refuse it."""
    code, trailing = failures.status_of(error)
    context.set_trailing_metadata(trailing)
    context.set_code(code)
    context.set_details(str(error))


def _answer_with(context: Context, error: grpc.aio.AioRpcError, trailing: Any) -> None:
    """End the worker's call as the scheduler (or the way to it) ended the upstream one, with
    `trailing` (its trailing metadata as `Upstreams.settled` passes it on)."""
    context.set_trailing_metadata(relayed(error.code(), forwarded(trailing)))
    context.set_code(error.code())
    context.set_details(error.details() or "")


def _one_answer(
    upstreams: Upstreams, kind: str, path: str
) -> Callable[[Any, Context], Awaitable[bytes | None]]:
    """A call answered once: its request is one message (unary) or a stream of them (client
    streaming), passed upstream as it came."""

    async def forward(request: Any, context: Context) -> bytes | None:
        address, method = upstreams.method(kind, path)
        call = method(
            request, metadata=forwarded(context.invocation_metadata()), timeout=_timeout(context)
        )
        try:
            return bytes(await call)
        except grpc.aio.AioRpcError as exc:
            trailing = await upstreams.settled(address, exc.code(), exc.trailing_metadata())
            _answer_with(context, exc, trailing)
            return None
        finally:
            call.cancel()  # the worker went away (this task cancelled): so does the call

    return forward


def _server_stream(
    upstreams: Upstreams, kind: str, path: str
) -> Callable[[bytes, Context], AsyncIterator[bytes]]:
    async def forward(request: bytes, context: Context) -> AsyncIterator[bytes]:
        address, method = upstreams.method(kind, path)
        call = method(
            request, metadata=forwarded(context.invocation_metadata()), timeout=_timeout(context)
        )
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from stubs
                    break
                yield message
            # A standby's refusal of a registration ends its stream naming the leader.
            trailing = await call.trailing_metadata()
            trailing = await upstreams.settled(address, grpc.StatusCode.OK, trailing)
            context.set_trailing_metadata(forwarded(trailing))
        except grpc.aio.AioRpcError as exc:
            trailing = await upstreams.settled(address, exc.code(), exc.trailing_metadata())
            _answer_with(context, exc, trailing)
        finally:
            call.cancel()

    return forward


PEER_TABLE = "PeerTable"
# Tables kept by digest (a table of 65,536 workers is about 300 KiB compressed, 3 MiB shared).
TABLES_KEPT = 4


class SharedTables:
    """The host's copy of each whole table its workers asked for (the last TABLES_KEPT), laid
    out to be read in place (`cluster.transport.table_file`) in a sealed memory file of this
    process, which a local worker maps as /proc/PID/fd/FD: the host parses a table once, and a
    worker forms in O(1) whatever the job's size. The files go with this process."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self._files: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._say = say
        self._failed = False

    def path(self, digest: bytes, answer: bytes) -> str | None:
        """Where the table of `digest` lies, from the scheduler's `answer` (a serialized
        PeerTableResponse); None when it cannot be shared (the worker gets the bytes)."""
        fd = self._files.get(digest)
        if fd is None:
            try:
                table = stub.checked_table(digest, stub.table_answer_of(answer))
                fd = table_file.create_shared(table, digest)
            except (OSError, ValueError, DecodeError, MissedTableChange) as exc:
                if not self._failed and self._say is not None:
                    self._say(f"cannot share peer tables with the workers ({exc}): they parse them")
                self._failed = True
                return None
            self._files[digest] = fd
            while len(self._files) > TABLES_KEPT:
                os.close(self._files.popitem(last=False)[1])  # mapped ones stay readable
        self._files.move_to_end(digest)
        return f"/proc/{os.getpid()}/fd/{fd}"

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


class TableAnswers:
    """The answers to `PeerTable` by digest: the first asker's call forwarded, its answer shared
    with the host's other workers (`SharedAnswers`), and to a worker that asks for it (`shared`)
    the host's shared copy instead (`SharedTables`). A call that fails leaves nothing behind:
    the workers that waited on it ask anew, one at a time."""

    def __init__(
        self,
        forward: Callable[[Any, Context], Awaitable[bytes | None]],
        shared: SharedTables | None,
    ) -> None:
        self._forward = forward
        self._shared = shared
        # None: the forwarded call ended with the scheduler's status (its worker's call has it).
        self._answers: SharedAnswers[bytes, bytes | None] = SharedAnswers(TABLES_KEPT)

    async def answer(self, request: bytes, context: Context) -> bytes | None:
        try:
            digest, wants_shared = stub.table_request_of(request)
        except DecodeError:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("a PeerTable request that is not one")
            return None
        # The worker's own request goes up as it came: its call proof covers those bytes.
        answer = await self._answers.get(digest, lambda: self._forward(request, context))
        if answer is None or not wants_shared or self._shared is None:
            return answer
        path = self._shared.path(digest, answer)
        return answer if path is None else stub.shared_table_answer(path)


HEARTBEAT, HOST_BEATS = "Heartbeat", "HostBeats"
# At most this many attaches, finishes and detaches go up in one message of the host's link, of
# at most this many bytes in all (the scheduler takes 256 of them and 64 KiB:
# `cluster.transport.edge`); a batch of beats goes up in messages of at most as many bytes (the
# scheduler takes 256 KiB: 8,192 workers of 128-character ids name 1.1 MiB). A formation's burst
# goes up in a few messages instead of one a worker: a write on the link costs the relay and the
# scheduler's read costs it about as much for a batch as for one.
HOST_BATCH = 128
HOST_BATCH_BYTES = 32 * 1024


class HostBeats:
    """The host's workers' beats, sent upstream in batches: each worker's Heartbeat call ends
    here, and every `every_s` the nodes heard from since the last batch go on one HostBeats
    stream to the scheduler the relay follows (made again when it ended, or moved), in messages
    of HOST_BATCH_BYTES at most, so that the scheduler takes every one whatever the host's
    workers and the length of their ids. How a stream ended is read as a forwarded call's end:
    a standby's refusal sends the relay to the leader, and a batch the scheduler refuses anyway
    (a relay of another version of cluster) is said once, with `say`."""

    def __init__(
        self, upstreams: Upstreams, every_s: float, say: Callable[[str], None] = lambda line: None
    ) -> None:
        self._upstreams = upstreams
        self._every_s = every_s
        self._say: Callable[[str], None] | None = say  # None once a refusal was said
        self._heard: dict[tuple[str, int], None] = {}
        self._sending: asyncio.Task[None] | None = None
        self._call: tuple[str, Any] | None = None
        self._stopped = False

    async def local(self, requests: AsyncIterator[bytes], context: Context) -> bytes | None:
        """A local worker's Heartbeat call: its beats join the next batch. A request the
        scheduler would refuse from the worker itself ends its call here, as the scheduler
        would end it, and goes into no batch."""
        limit = edge.MESSAGE_LIMITS[HEARTBEAT]
        async for raw in requests:
            if len(raw) > limit:
                oversized = edge.Oversized(HEARTBEAT, len(raw)).message()
                _refuse(context, CapacityError(f"{oversized}: refused"))
                return None
            try:
                self._heard[stub.beat_of(raw)] = None
            except DecodeError:
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details("a Heartbeat request that is not one")
                return None
            if self._sending is None or self._sending.done():
                self._sending = asyncio.ensure_future(self._send_soon())
        return b""  # HeartbeatResponse: empty

    async def _send_soon(self) -> None:
        while self._heard:
            await asyncio.sleep(self._every_s)
            heard, self._heard = self._heard, {}
            await self._send(heard)

    async def _send(self, heard: dict[tuple[str, int], None]) -> None:
        if self._call is not None and self._call[1].done():
            ended, self._call = self._call, None
            await self._ended(*ended)  # how it ended may move the relay: read before choosing
        address, method = self._upstreams.method("stream_unary", methods()[HOST_BEATS][1])
        if self._call is not None and self._call[0] != address:
            self._call[1].cancel()  # to a scheduler the relay left
            self._call = None
        if self._call is None:
            self._call = (address, method(metadata=stamp()))
        call = self._call[1]
        try:
            for batch in stub.host_beats(heard, HOST_BATCH_BYTES):
                await call.write(batch)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and self._stopped:
                raise
            # Ended (else cancelled with its channel, closed for a new one): the batch is lost,
            # and the next goes where the relay goes then.
            self._call = None
            await self._ended(address, call)

    async def _ended(self, address: str, call: Any) -> None:
        """Take in how the beats' `call` to `address` ended, as every forwarded call's end is
        taken: a standby's pointer to the leader or a call cut off moves the relay
        (`Upstreams.answered`), and a refusal is said (`_refused`)."""
        call.cancel()  # a no-op on a call that ended; one that had not ends now, read at once
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            await self._upstreams.settled(address, exc.code(), exc.trailing_metadata())
            self._refused(address, exc)
        except asyncio.CancelledError:
            if self._stopped:
                raise  # else: the call was cancelled, here or with its channel: no status

    def _refused(self, address: str, exc: grpc.aio.AioRpcError) -> None:
        """Say, once, that the scheduler refused a batch: not a call cut off (the next batch
        makes it again), nor a standby's refusal (the relay follows the leader)."""
        failure = failures.failure_of(exc)
        if self._say is None or failure.cut_off or failure.kind is NotLeaderError:
            return
        self._say(
            f"the scheduler at {address} refused this host's beats ({failure.code}: "
            f"{failure.details}): its workers here may be taken for silent and fail; run the "
            "relay and the workers of the scheduler's version of cluster (said once)"
        )
        self._say = None

    def stop(self) -> None:
        self._stopped = True
        if self._sending is not None:
            self._sending.cancel()
        if self._call is not None:
            self._call[1].cancel()


def stamp() -> tuple[tuple[str, str], ...]:
    """The call metadata of the relay's own calls (HostBeats, HostWatch): the protocol
    revision and release it runs, which the scheduler refuses when they are not its own."""
    return ((version.METADATA_KEY, version.stamp()),)


WATCH, FINISH, HOST_WATCH = "Watch", "Finish", "HostWatch"
# How a slot's stream ends, as the relay tells the worker: (code, details, trailing metadata).
_End = tuple[grpc.StatusCode, str, tuple[Metadatum, ...]]
# A worker's call on the host's link: the link, its slot, and the slot's mailbox.
_Slot: TypeAlias = "tuple[_Link, int, asyncio.Queue[bytes | stub.SlotEnd]]"


class _Link:
    """One HostWatch call to the scheduler at `address`: the slots it carries (a mailbox each),
    one writer of what goes up, one reader that hands each event to the slots it is for. When
    the call ends, every slot still open ends with the call's status, as a stream forwarded on
    its own would have."""

    def __init__(
        self, address: str, call: Any, heard: Callable[[bytes], None] = lambda event: None
    ) -> None:
        self.address = address
        self._call = call
        self._heard = heard  # every event that comes down, before it goes to its slots
        self.slots: dict[int, asyncio.Queue[bytes | stub.SlotEnd]] = {}
        self._up: asyncio.Queue[bytes] = asyncio.Queue()
        self.ended: _End | None = None
        self._closed = False
        self._tasks = (asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read()))

    def open(self, slot: int, attach: bytes) -> asyncio.Queue[bytes | stub.SlotEnd]:
        mailbox = self.slots[slot] = asyncio.Queue()
        self._up.put_nowait(attach)
        return mailbox

    def release(self, slot: int, *, detach: bool) -> None:
        """The slot's worker call is over; `detach`: before its end came (the worker went)."""
        if self.slots.pop(slot, None) is not None and detach and self.ended is None:
            self._up.put_nowait(stub.host_detach(slot))

    async def _write(self) -> None:
        """Send what goes up, in order: what queued while the last message was on its way goes
        as one batch (HOST_BATCH, HOST_BATCH_BYTES at most), not a message each."""
        carried: bytes | None = None
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while True:
                batch = [carried if carried is not None else await self._up.get()]
                carried, size = None, len(batch[0])
                while len(batch) < HOST_BATCH and not self._up.empty():
                    up = self._up.get_nowait()
                    if size + len(up) > HOST_BATCH_BYTES:
                        carried = up
                        break
                    batch.append(up)
                    size += len(up)
                await self._call.write(batch[0] if len(batch) == 1 else stub.host_batch(batch))
        # The reader tells the slots how the call ended.

    async def _read(self) -> None:
        try:
            while True:
                raw = await self._call.read()
                if raw is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from stubs
                    break
                slots, event, ended = stub.host_down(raw)
                if event:
                    self._heard(event)
                for slot in slots:
                    mailbox = self.slots.get(slot)
                    if mailbox is not None:
                        mailbox.put_nowait(event)
                for end in ended:
                    mailbox = self.slots.get(end[0])
                    if mailbox is not None:
                        mailbox.put_nowait(end)
            code = await self._call.code()
            details = await self._call.details() or ""
            trailing = forwarded(await self._call.trailing_metadata())
            if code == grpc.StatusCode.OK:
                code, details = grpc.StatusCode.UNAVAILABLE, "the scheduler ended the host's link"
            self._end(code, details, trailing)
        except grpc.aio.AioRpcError as exc:
            self._end(exc.code(), exc.details() or "", forwarded(exc.trailing_metadata()))
        except DecodeError:
            self._end(grpc.StatusCode.UNAVAILABLE, "the scheduler sent what is no HostDown", ())
        except asyncio.CancelledError:
            if self._closed:
                raise
            # The call was cancelled under it: its channel was closed for a new one.
            self._end(grpc.StatusCode.UNAVAILABLE, "the relay's link was cancelled", ())

    def _end(self, code: grpc.StatusCode, details: str, trailing: tuple[Metadatum, ...]) -> None:
        self.ended = (code, details, trailing)
        for slot, mailbox in self.slots.items():
            mailbox.put_nowait((slot, code, details, trailing, b""))

    def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        self._call.cancel()


class HostLinks:
    """The host's workers' Watch streams, each ended here and attached as a slot to the relay's
    one HostWatch call to the scheduler it follows (made again once that call ended, or when the
    relay moved). The worker's request and call metadata go up as they came; the events come
    back as the scheduler serialized them, and the end of the worker's call is the status the
    scheduler gave its slot.

    `done` is set while the host's part in the job is over: a scheduler told its workers that
    the job ended (a Shutdown event; `job_end` its ok and reason), or every node whose Watch the
    relay carried has had its Finish taken (`finished` of them: the job may go on elsewhere, with
    nothing left for this relay). A scheduler lost is neither."""

    def __init__(self, upstreams: Upstreams) -> None:
        self._upstreams = upstreams
        self._links: dict[str, _Link] = {}
        self._numbers = itertools.count(1)
        self.done = asyncio.Event()
        self.job_end: tuple[bool, str] | None = None
        self._carried: set[str] = set()  # the node ids of the Watch calls it carried
        self._finished: set[str] = set()  # those whose Finish (not a failure's) was taken

    @property
    def finished(self) -> int:
        return len(self._carried & self._finished)

    def _heard(self, event: bytes) -> None:
        self._upstreams.heard(event)
        if self.job_end is None and (end := stub.shutdown_of(event)) is not None:
            self.job_end = end
            self._settle()

    def _settle(self) -> None:
        if self.job_end is not None or (self._carried and self._carried <= self._finished):
            self.done.set()
        else:
            self.done.clear()

    def _carry(self, request: bytes) -> None:
        """A local worker's Watch `request` is carried: its node's Finish is waited for."""
        with contextlib.suppress(DecodeError):  # the scheduler refuses it in its words
            self._carried.add(stub.watcher_of(request))
            self._settle()

    def _took(self, request: bytes) -> None:
        """The scheduler took a local worker's Finish `request` (not a failure's)."""
        with contextlib.suppress(DecodeError):
            node, finished = stub.finisher_of(request)
            if finished:
                self._finished.add(node)
                self._settle()

    def _link(self) -> _Link:
        address, method = self._upstreams.method("stream_stream", methods()[HOST_WATCH][1])
        link = self._links.get(address)
        if link is None or link.ended is not None:
            if link is not None:
                link.close()
            link = self._links[address] = _Link(address, method(metadata=stamp()), self._heard)
        return link

    def _open(self, request: bytes, context: Context, *, finish: bool) -> _Slot | None:
        """A slot of the host's link for a local worker's call; None when its attach (request
        and call metadata) passes edge.HOST_ATTACH_BYTES: the scheduler would end the whole
        link for it, so the relay refuses that one call (INVALID_ARGUMENT) instead."""
        slot = next(self._numbers)
        metadata = forwarded(context.invocation_metadata())
        up, size = stub.host_attach_sized(slot, request, metadata, finish=finish)
        if size > edge.HOST_ATTACH_BYTES:
            error = BadRequestError(
                f"a {'Finish' if finish else 'Watch'} call of {size} bytes (request and call "
                f"metadata) through the host's relay: at most {edge.HOST_ATTACH_BYTES}; send "
                "less call metadata"
            )
            _refuse(context, error)
            return None
        link = self._link()
        return link, slot, link.open(slot, up)

    async def watch(self, request: bytes, context: Context) -> AsyncIterator[bytes]:
        """A local worker's Watch call, served from its slot of the host's link."""
        opened = self._open(request, context, finish=False)
        if opened is None:
            return
        link, slot, mailbox = opened
        self._carry(request)
        ended = False
        try:
            while True:
                item = await mailbox.get()
                if isinstance(item, bytes):
                    yield await self._upstreams.event(link.address, item)
                    continue
                ended = True
                await self._ended(link, item, context)
                return
        finally:
            self._release(link, slot, detach=not ended)

    async def finish(self, request: bytes, context: Context) -> bytes | None:
        """A local worker's Finish call, a slot of the host's link that ends with the answer."""
        opened = self._open(request, context, finish=True)
        if opened is None:
            return None
        link, slot, mailbox = opened
        ended = False
        try:
            while True:
                item = await mailbox.get()
                if not isinstance(item, bytes):  # (a finish slot has no events)
                    ended = True
                    if item[1] == grpc.StatusCode.OK:
                        self._took(request)
                    return await self._ended(link, item, context)
        finally:
            self._release(link, slot, detach=not ended)

    async def _ended(self, link: _Link, end: stub.SlotEnd, context: Context) -> bytes | None:
        """End the worker's call as the scheduler ended its slot; a finish slot's answer."""
        _, code, details, trailing, answer = end
        trailing = await self._upstreams.settled(link.address, code, trailing)
        context.set_trailing_metadata(relayed(code, trailing))
        if code != grpc.StatusCode.OK:
            context.set_code(code)
            context.set_details(details)
            return None
        return answer

    def _release(self, link: _Link, slot: int, *, detach: bool) -> None:
        link.release(slot, detach=detach)
        if not link.slots and link.address != self._upstreams.current:
            link.close()  # a scheduler left behind: its link goes with its last slot
            if self._links.get(link.address) is link:  # not a newer link to that address
                del self._links[link.address]

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the type stubs only
_HANDLERS: dict[str, tuple[Callable[[Upstreams, str, str], Any], Callable[..., Handler]]] = {
    "unary_unary": (_one_answer, grpc.unary_unary_rpc_method_handler),
    "unary_stream": (_server_stream, grpc.unary_stream_rpc_method_handler),
    "stream_unary": (_one_answer, grpc.stream_unary_rpc_method_handler),
}


class Forwarder(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in the stubs only
    """Every method of the scheduler's service, forwarded as bytes to the scheduler that
    `upstreams` takes for the leader; any other method is left to gRPC (UNIMPLEMENTED). What
    the relay has to say (a refusal of its beats) goes to `say`."""

    def __init__(
        self,
        upstreams: Upstreams,
        beats_every_s: float = 1.0,
        tables: SharedTables | None = None,
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self._handlers: dict[str, Handler] = {}
        # Method path -> (kind, handler): what the local hop serves (`cluster.transport.hop`).
        self.answers: dict[str, tuple[str, Any]] = {}
        self.tables = tables
        self.beats = HostBeats(upstreams, beats_every_s, say)
        self.links = HostLinks(upstreams)
        for kind, path, _options in methods().values():
            if path.endswith("/" + HOST_WATCH):
                continue  # the relay's own call upstream, not a worker's
            if kind not in _HANDLERS:
                raise TypeError(f"the relay cannot forward {path}, a {kind} method")
            make, handler = _HANDLERS[kind]
            answer = make(upstreams, kind, path)
            name = path.rpartition("/")[2]
            if name == PEER_TABLE:
                answer = TableAnswers(answer, self.tables).answer  # a coroutine function
            elif name == HEARTBEAT:
                answer = self.beats.local
            elif name == WATCH:
                answer = self.links.watch
            elif name == FINISH:
                answer = self.links.finish
            # No serializers: the bytes go through as they came.
            self._handlers[path] = handler(answer)
            self.answers[path] = (kind, answer)

    @property
    def paths(self) -> list[str]:
        return sorted(self._handlers)

    def stop(self) -> None:
        """End what the relay holds open upstream: the beats' stream and the host's links (and
        let go of the tables it shares)."""
        self.beats.stop()
        self.links.close()
        if self.tables is not None:
            self.tables.close()

    def service(self, details: grpc.HandlerCallDetails) -> Handler | None:
        return self._handlers.get(details.method)
