"""The scheduler's client stub, made method by method as the agent first uses each one.

The generated `SchedulerStub` registers all of the service's methods with the channel when it is
made, a C call each. A worker uses three of them in most of its life, and a benchmark process
that simulates hundreds of workers paid for the rest at every start. This stub reads once per
process what each method is (path, kind, serializers) from the service's descriptor, as the
generated stub has it (a test holds the two equal), and makes a method's multicallable on first
use. The generated gRPC module is the servicer's and the tools': a worker does not import it
(half a millisecond of every start, its version check included).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cluster.protocol import auth
from cluster.protocol.errors import MissedTableChange
from cluster.v1 import scheduler_pb2 as pb

# A compressed table inflates to at most this (a gRPC message's limit here: 2.6 million nodes
# at 24 bytes each); more is refused, not allocated.
MAX_TABLE_BYTES = 64 * 1024 * 1024

# The calls a worker holds open, as the agent's timers see them.
WatchCall = grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.Event]
BeatsCall = grpc.aio.StreamUnaryCall[pb.HeartbeatRequest, pb.HeartbeatResponse]
Beat = pb.HeartbeatRequest


@functools.cache
def methods() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Attribute name -> (channel method, path, options), as the generated stub makes them."""
    service = pb.DESCRIPTOR.services_by_name["Scheduler"]
    made = {}
    for method in service.methods:
        kind = "_".join(
            "stream" if streaming else "unary"
            for streaming in (method.client_streaming, method.server_streaming)
        )
        options = {
            "request_serializer": getattr(pb, method.input_type.name).SerializeToString,
            "response_deserializer": getattr(pb, method.output_type.name).FromString,
            "_registered_method": True,
        }
        made[method.name] = (kind, f"/{service.full_name}/{method.name}", options)
    return made


class LazyStub:
    """`SchedulerStub(channel)`, each method made when it is first used."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._unary: dict[str, Any] = {}  # client-streaming methods called as unary (`unary`)

    def __getattr__(self, name: str) -> Any:
        try:
            kind, path, options = methods()[name]
        except KeyError:
            raise AttributeError(f"the Scheduler service has no method {name!r}") from None
        method = getattr(self._channel, kind)(path, **options)
        setattr(self, name, method)
        return method

    def unary(self, name: str) -> Any:
        """Method `name` called with one request as a unary call: a unary method's own; a
        client-streaming one's path as a unary call (on gRPC's wire, and the local hop's, the
        same: one message and the end, sent in one batch where a written stream takes one per
        message and one more for its end)."""
        kind, path, options = methods()[name]
        if kind == "unary_unary":
            return getattr(self, name)
        made = self._unary.get(name)
        if made is None:
            made = self._unary[name] = self._channel.unary_unary(path, **options)
        return made


def beat_of(raw: bytes) -> tuple[str, int]:
    """(node id, incarnation) of a serialized HeartbeatRequest (DecodeError if it is none)."""
    beat = pb.HeartbeatRequest.FromString(raw)
    return beat.node_id, beat.incarnation


def host_beats(nodes: Iterable[tuple[str, int]], most_bytes: int) -> list[bytes]:
    """Serialized HostBeatsRequests naming `nodes` ((node id, incarnation) each), in order, each
    of at most `most_bytes` (a node that passes it alone goes alone): the encoding of
    `HostBeatsRequest(nodes=[...])` (field 1, length-delimited) cut between its nodes."""
    batches: list[bytes] = []
    parts: list[bytes] = []
    size = 0
    for node_id, incarnation in nodes:
        hello = pb.Hello(node_id=node_id, incarnation=incarnation).SerializeToString()
        part = b"\x0a" + _varint(len(hello)) + hello
        if parts and size + len(part) > most_bytes:
            batches.append(b"".join(parts))
            parts, size = [], 0
        parts.append(part)
        size += len(part)
    if parts:
        batches.append(b"".join(parts))
    return batches


def metadata_pb(metadata: Iterable[tuple[str, Any]]) -> list[pb.Metadatum]:
    """Call metadata as the host link carries it: its text values (binary ones are dropped)."""
    return [pb.Metadatum(key=k, value=v) for k, v in metadata if isinstance(v, str)]


def metadata_of(carried: Iterable[pb.Metadatum]) -> tuple[tuple[str, str], ...]:
    """Call metadata from the host link, as gRPC gives it: (key, value) pairs."""
    return tuple((m.key, m.value) for m in carried)


# A slot's end as the relay reads it from HostDown: (slot, code, details, trailing metadata, a
# finish slot's answer).
SlotEnd = tuple[int, grpc.StatusCode, str, tuple[tuple[str, "str | bytes"], ...], bytes]
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def host_attach(
    slot: int, request: bytes, metadata: Iterable[tuple[str, Any]], *, finish: bool = False
) -> bytes:
    """A serialized HostUp attaching a worker's Watch call, or with `finish` its Finish call (its
    request and text metadata)."""
    return host_attach_sized(slot, request, metadata, finish=finish)[0]


def host_attach_sized(
    slot: int, request: bytes, metadata: Iterable[tuple[str, Any]], *, finish: bool = False
) -> tuple[bytes, int]:
    """`host_attach`, and the size of the HostAttach it holds: what the scheduler bounds by
    edge.HOST_ATTACH_BYTES."""
    attach = pb.HostAttach(slot=slot, request=request, metadata=metadata_pb(metadata))
    up = pb.HostUp(finish=attach) if finish else pb.HostUp(attach=attach)
    return up.SerializeToString(), attach.ByteSize()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def host_batch(ups: Iterable[bytes]) -> bytes:
    """A serialized HostUp holding the serialized HostUps `ups` as its batch, in order: the
    encoding of `HostUp(batch=HostUps(ups=[...]))` made from the bytes as they are (field 1 of
    HostUps and field 4 of HostUp, each length-delimited), nothing parsed again."""
    inner = b"".join(b"\x0a" + _varint(len(up)) + up for up in ups)
    return b"\x22" + _varint(len(inner)) + inner


def host_detach(slot: int) -> bytes:
    return pb.HostUp(detach=slot).SerializeToString()


def host_down(raw: bytes) -> tuple[list[int], bytes, list[SlotEnd]]:
    """A serialized HostDown: the slots its event is for, the event, then the slots that end
    (DecodeError if it is none)."""
    down = pb.HostDown.FromString(raw)
    ended: list[SlotEnd] = [
        (
            end.slot,
            _CODES.get(end.code, grpc.StatusCode.UNKNOWN),
            end.details,
            metadata_of(end.trailing),
            end.answer,
        )
        for end in down.ended
    ]
    return list(down.slots), down.event, ended


def watcher_of(raw: bytes) -> str:
    """The node id of a serialized WatchRequest (DecodeError if it is none)."""
    request = pb.WatchRequest.FromString(raw)
    said = request.register if request.WhichOneof("kind") == "register" else request.hello
    return said.node_id


def finisher_of(raw: bytes) -> tuple[str, bool]:
    """(node id, whether it finished: no failure) of a serialized FinishRequest (DecodeError if
    it is none)."""
    request = pb.FinishRequest.FromString(raw)
    return request.node_id, not request.failure


# The first byte of a serialized Event of a kind the relay reads (its one field, length-
# delimited): a Shutdown (4), a registration accepted (6) or refused (7).
_SHUTDOWN_TAG, _ACCEPTED_TAG, _REFUSED_TAG = b"\x22", b"\x32", b"\x3a"


def _event_of(event: bytes, tag: bytes, kind: str) -> pb.Event | None:
    """The serialized Event `event` parsed, when it is one of `kind`; only those bytes are
    parsed (their tag leads them)."""
    if not event.startswith(tag):
        return None
    try:
        parsed = pb.Event.FromString(event)
    except DecodeError:
        return None
    return parsed if parsed.WhichOneof("kind") == kind else None


def shutdown_of(event: bytes) -> tuple[bool, str] | None:
    """(ok, reason) of a serialized Event that is a Shutdown, the job's end as the scheduler
    tells it; None for any other event."""
    parsed = _event_of(event, _SHUTDOWN_TAG, "shutdown")
    return None if parsed is None else (parsed.shutdown.ok, parsed.shutdown.reason)


def accepted_job_of(event: bytes) -> str | None:
    """The job (cluster id) a serialized Event that accepts a registration names; None for any
    other event (only those bytes are parsed)."""
    parsed = _event_of(event, _ACCEPTED_TAG, "accepted")
    return None if parsed is None else parsed.accepted.cluster_id


def named_leader_of(event: bytes) -> str | None:
    """The leader a standby names in a serialized Event that refuses a registration; None for
    any other event, and for a standby that names none."""
    parsed = _event_of(event, _REFUSED_TAG, "refused")
    if parsed is None or parsed.refused.reason != pb.REFUSAL_NOT_LEADER:
        return None
    return parsed.refused.leader or None


def without_leader(event: bytes) -> bytes:
    """A standby's refusal of a registration (`named_leader_of`), naming no leader."""
    parsed = pb.Event.FromString(event)
    parsed.refused.leader = ""
    return parsed.SerializeToString()


def challenge_job_of(raw: bytes) -> str:
    """The job a serialized ChallengeResponse names ("": a standby's, which runs none)."""
    return pb.ChallengeResponse.FromString(raw).job_id


# -- whole peer tables by digest (`cluster.worker.peer_table`, the relay's shared tables) -------


def parse_table_into(table: pb.PeerTable, compressed: bytes) -> None:
    """Parse the zlib-compressed PeerTable `compressed` into `table`; MissedTableChange when it
    does not inflate to one within MAX_TABLE_BYTES."""
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(compressed, MAX_TABLE_BYTES)
        if inflater.unconsumed_tail or not inflater.eof:
            raise MissedTableChange(
                f"the scheduler sent a compressed peer table that does not inflate whole within "
                f"{MAX_TABLE_BYTES} bytes"
            )
        table.ParseFromString(data)
    except (zlib.error, DecodeError) as exc:
        raise MissedTableChange(
            f"the scheduler sent a compressed peer table that is damaged ({exc})"
        ) from None


def checked_table(digest: bytes, compressed: bytes) -> pb.PeerTable:
    """The table of `digest` from its compressed bytes; MissedTableChange when they are not
    the bytes of `digest` or no table."""
    if auth.sha256(compressed) != digest:
        raise MissedTableChange(f"the peer table fetched for {digest.hex()[:16]} does not match it")
    table = pb.PeerTable()
    parse_table_into(table, compressed)
    return table


def table_request_of(raw: bytes) -> tuple[bytes, bool]:
    """(digest, shared) of a serialized PeerTableRequest (DecodeError if it is none)."""
    request = pb.PeerTableRequest.FromString(raw)
    return request.digest, request.shared


def table_answer_of(raw: bytes) -> bytes:
    """The compressed table of a serialized PeerTableResponse (DecodeError if it is none)."""
    return pb.PeerTableResponse.FromString(raw).peers_zlib


def shared_table_answer(path: str) -> bytes:
    """A serialized PeerTableResponse naming the shared table file at `path`."""
    return pb.PeerTableResponse(shared_path=path).SerializeToString()


# -- the local hop between a worker and its relay (`cluster.transport.hop`) --------------------

HopMetadata = tuple[tuple[str, "str | bytes"], ...]
# A HopUp as the relay reads it: (call, kind, what it carries). kind "start": `HopStartFrame`;
# "message": the request bytes; "done_writing", "cancel" and "ping": None.
HopUpFrame = tuple[int, str, "HopStartFrame | bytes | None"]
# A call's start: (method, metadata, timeout_s or None, the request or None, the schedulers the
# worker is for).
HopStartFrame = tuple[str, HopMetadata, "float | None", "bytes | None", tuple[str, ...]]
# A HopDown as the worker reads it: (call, a response message or None, its end or None), the end
# as (code, details, trailing metadata, the unary response or None); a pong is (0, None, None).
HopEndFrame = tuple[grpc.StatusCode, str, HopMetadata, "bytes | None"]
HopDownFrame = tuple[int, "bytes | None", "HopEndFrame | None"]


def _hop_metadata(metadata: Iterable[tuple[str, Any]]) -> list[pb.HopMetadatum]:
    return [
        pb.HopMetadatum(key=k, binary=v) if isinstance(v, bytes) else pb.HopMetadatum(key=k, text=v)
        for k, v in metadata
    ]


def _metadata_of_hop(carried: Iterable[pb.HopMetadatum]) -> HopMetadata:
    return tuple(
        (m.key, m.binary if m.WhichOneof("value") == "binary" else m.text) for m in carried
    )


def hop_start(
    call: int,
    method: str,
    metadata: Iterable[tuple[str, Any]],
    timeout_s: float | None,
    message: bytes | None,
    schedulers: Iterable[str] = (),
) -> bytes:
    """A serialized HopUp starting `call` (with the request of a unary-request call) of a
    worker for `schedulers` (HOST:PORT each)."""
    start = pb.HopStart(
        method=method,
        metadata=_hop_metadata(metadata),
        timeout_s=timeout_s or 0,
        schedulers=schedulers,
    )
    if message is not None:
        start.message = message
    return pb.HopUp(call=call, start=start).SerializeToString()


def hop_request(call: int, message: bytes) -> bytes:
    return pb.HopUp(call=call, message=message).SerializeToString()


def hop_done_writing(call: int) -> bytes:
    return pb.HopUp(call=call, done_writing=True).SerializeToString()


def hop_cancel(call: int) -> bytes:
    return pb.HopUp(call=call, cancel=True).SerializeToString()


def hop_ping() -> bytes:
    return pb.HopUp(ping=True).SerializeToString()


def hop_pong() -> bytes:
    return pb.HopDown(pong=True).SerializeToString()


def hop_up(raw: bytes) -> HopUpFrame:
    """A serialized HopUp (DecodeError if it is none, or it carries nothing)."""
    up = pb.HopUp.FromString(raw)
    kind = up.WhichOneof("kind")
    if kind == "start":
        start = up.start
        timeout_s = start.timeout_s if start.timeout_s > 0 else None
        message = start.message if start.HasField("message") else None
        metadata = _metadata_of_hop(start.metadata)
        return up.call, kind, (start.method, metadata, timeout_s, message, tuple(start.schedulers))
    if kind == "message":
        return up.call, kind, up.message
    if kind is None:
        raise DecodeError("a HopUp that carries nothing")
    return up.call, kind, None


def hop_response(call: int, message: bytes) -> bytes:
    return pb.HopDown(call=call, message=message).SerializeToString()


def hop_end(
    call: int,
    code: grpc.StatusCode,
    details: str,
    trailing: Iterable[tuple[str, Any]],
    message: bytes | None = None,
) -> bytes:
    """A serialized HopDown ending `call` (with the response of a unary-response call)."""
    end = pb.HopEnd(code=code.value[0], details=details, trailing=_hop_metadata(trailing))
    if message is not None:
        end.message = message
    return pb.HopDown(call=call, end=end).SerializeToString()


def hop_down(raw: bytes) -> HopDownFrame:
    """A serialized HopDown (DecodeError if it is none)."""
    down = pb.HopDown.FromString(raw)
    kind = down.WhichOneof("kind")
    if kind == "message":
        return down.call, down.message, None
    if kind == "pong":
        return 0, None, None
    if kind != "end":
        raise DecodeError("a HopDown that carries nothing")
    end = down.end
    code = _CODES.get(end.code, grpc.StatusCode.UNKNOWN)
    message = end.message if end.HasField("message") else None
    return down.call, None, (code, end.details, _metadata_of_hop(end.trailing), message)
