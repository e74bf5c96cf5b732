"""Limits at the edge: what the scheduler takes from anyone who reaches its port, in one table.

Every field a caller sends has a bound here, checked before the state machine, the journal or a
log sees the value: a request larger than its method's limit is not even parsed (`capped`), one
that does not parse as its method's message is refused as such (`Malformed`), and a
registration whose fields are out of bounds (`registration_problem`) is refused with a message
that quotes at most a short, escaped prefix of what was sent. Such refusals are counted and
journaled at a bounded rate by the scheduler (`cluster.scheduler.refusals`), never with the raw
value. `Exchange` and `KvSet` carry a member's data: their value comes in pieces of at most
`PIECE_BYTES` (`pieces`; the scheduler joins them, `cluster.scheduler.servicer_edge.joined`), and
its bounds are the job's caps (CLUSTER_COLLECTIVE_MAX_BYTES, CLUSTER_KV_MAX_BYTES, at most
`MAX_VALUE_BYTES`), applied after the call is admitted as a member's. So no message of any
method is over `MAX_REQUEST_BYTES`, which is gRPC's own limit on the scheduler's port: gRPC
refuses a longer message from its length, before it reads it, whoever sent it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.message import DecodeError

from cluster.protocol import auth, version
from cluster.protocol.config import valid_node_id
from cluster.protocol.display import safe
from cluster.protocol.value import frozen, mutable

_KIB = 1024
# The largest value a member's call carries (a collective contribution or a key-value set).
MAX_VALUE_BYTES = 64 * 1024 * _KIB
# The most bytes of a value one message carries: a larger value goes in pieces (`pieces`). A
# message's limit is what each of a stranger's calls can make the scheduler hold (gRPC reads a
# message whole, up to it), and each piece costs a value a step of Python at both ends: the
# size weighs the one against the other (benchmarks/RESULTS.md measures both).
PIECE_BYTES = 1024 * _KIB
# Each method's largest request, in bytes. A registration is a few hundred bytes; a checkpoint
# report names at most 1,024 steps (`admission.MAX_REPORTED_CHECKPOINTS`, 10 bytes each).
MESSAGE_LIMITS: dict[str, int] = {
    "Challenge": 64,
    "Register": 4 * _KIB,
    "Watch": 4 * _KIB,
    "Heartbeat": 1 * _KIB,
    "Finish": 1 * _KIB,
    "ReportCheckpoints": 16 * _KIB,
    "Status": 64,
    "WatchEvents": 64,
    "KvGet": 256 * _KIB,
    "PeerTable": 64,
    "HostBeats": 256 * _KIB,
    "HostWatch": 64 * _KIB,  # a batch of attaches (each at most HOST_ATTACH_BYTES)
    "KvWait": 256 * _KIB,
    "KvAdd": 4 * _KIB,
    "KvSet": PIECE_BYTES + 4 * _KIB,  # a piece of the value, and its key in the first
    "Exchange": PIECE_BYTES + 4 * _KIB,  # a piece of the value, and the round's fields
}
# The largest message of any method: gRPC refuses a longer one unread (`serving`).
MAX_REQUEST_BYTES = max(MESSAGE_LIMITS.values())
# The health service's requests (`grpc.health.v1.Health`, open to anyone): a service's name.
HEALTH_LIMITS: dict[str, int] = {"Health.Check": 256, "Health.Watch": 256, "Health.List": 64}
_LIMITS = {**MESSAGE_LIMITS, **HEALTH_LIMITS}
# The methods whose value comes in pieces.
VALUE_METHODS = ("Exchange", "KvSet")
# How long a call may take to send its request after it started (HTTP/2 headers first, then the
# message): a stream that never sends it is cut then, not held. A member's value gets time for
# 64 MiB on a slow link, for its first piece and again for the rest (`VALUE_WITHIN_S`);
# everything else is a few KiB.
FIRST_MESSAGE_S = 5.0
FIRST_LARGE_MESSAGE_S = 60.0
VALUE_WITHIN_S = 60.0
# Calls waiting for their request at once, from one peer address and in all; past either a new
# call is turned away at once (UNAVAILABLE: a real node tries again), so a peer's stalled streams
# cost a bounded amount. A job's nodes register at once (up to thousands from one host in a
# test): their requests follow their headers at once, so few of them wait here.
ARRIVALS_PER_PEER = 512
ARRIVALS_TOTAL = 8192
# A relay's host calls (HostBeats, HostWatch) open at once from one peer address while their
# connection carries no admitted Watch stream: a relay's own before its first worker is admitted
# or after its last left (one of each, and one more of each while it reconnects), for the few
# relays one address may hold. Past it a new one is turned away (UNAVAILABLE: a relay tries
# again); a call on a member's connection never is.
HOST_CALLS_PER_PEER = 16
# Watch streams one host link (a relay's HostWatch call) carries at once: a host's workers, and
# the simulated thousands of a benchmark's relay. Past it an attach ends at once.
HOST_SLOTS = 8192
# One attach or finish of a host link: a worker's Watch request (4 KiB) and its call metadata; and
# how many a batch of them may hold (a relay's sends: `cluster.transport.relay.HOST_BATCH`).
HOST_ATTACH_BYTES = 8 * _KIB
HOST_BATCH_UPS = 256
# A registration's fields.
MAX_HOST_CHARS = 253  # a DNS name's limit
MAX_JOB_ID_CHARS = 64
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
# How much of a refused value a message quotes, escaped.
QUOTED_CHARS = 40


def first_message_s(method: str) -> float:
    """How long a call of `method` may take to send its request."""
    return FIRST_LARGE_MESSAGE_S if method in VALUE_METHODS else FIRST_MESSAGE_S


def pieces(request: Any, size: int = PIECE_BYTES) -> Iterator[Any]:
    """`request` (an Exchange's or a KvSet's) as the messages of its call: itself when its
    `value` fits one message, else a copy with the value's first `size` bytes and its whole
    length (`value_bytes`), then a message of its type with only the next piece of the value,
    each."""
    value = request.value
    if len(value) <= size:
        yield request
        return
    fields = {field.name: kept for field, kept in request.ListFields() if field.name != "value"}
    yield type(request)(**fields, value=value[:size], value_bytes=len(value))
    for start in range(size, len(value), size):
        yield type(request)(value=value[start : start + size])


# The fields of a value call's request that its head leaves out (`head`).
_NOT_IN_HEAD = ("value", "value_bytes")


def head(request: Any) -> bytes:
    """What the call proof of a value call covers (`VALUE_METHODS`): its request's fields but
    the value, with the value's whole length (`value_bytes`: as a first piece names it, else
    the value's own) and its SHA-256 (`value_sha256`) as sent. So the proof is checked as the
    first message comes, whatever pieces follow, and the value against its SHA-256 once whole
    (`cluster.scheduler.servicer_edge`)."""
    whole = request.value_bytes or len(request.value)
    fields = {f.name: kept for f, kept in request.ListFields() if f.name not in _NOT_IN_HEAD}
    return bytes(type(request)(**fields, value_bytes=whole).SerializeToString(deterministic=True))


def signed_body(method: str, request: Any) -> bytes:
    """What the call proof of `method`'s `request` covers: a value call's head (`head`), with
    its value's SHA-256 set on `request` first (its first message carries it); any other
    request whole."""
    if method not in VALUE_METHODS:
        return bytes(request.SerializeToString())
    if not request.value_sha256:
        request.value_sha256 = auth.sha256(request.value)
    return head(request)


@frozen
class Refusal:
    """Why a request is refused at the edge: `reason` as refusals are counted (`oversized`,
    `malformed`), `problem` the sentence its caller is told."""

    reason: str
    problem: str


@mutable
class Joining:
    """The rules of a value call's messages (`pieces`), without I/O: `opened` takes the first
    message, `add` each later one, `end` the call's end. A value of one message is whole at once
    (`left` is 0 and `add` refuses any more); a longer one names its whole length in the first
    message (`value_bytes`, at most `MAX_VALUE_BYTES`), and each later message carries only the
    next piece of it, until the pieces make exactly that length. Whatever breaks a rule is a
    `Refusal` and the value is not used. The messages are the call's own: `add` takes each
    one's value out, and `end` gives the first message back holding the whole value, as the
    caller signed it (a call proof covers the whole request)."""

    method: str
    first: Any
    left: int
    parts: list[bytes]
    pieced: bool  # the first message named the whole length: more messages follow it

    @classmethod
    def opened(cls, method: str, first: Any) -> Joining | Refusal:
        """The joining of a call whose first message is `first`; a Refusal for a length named
        over `MAX_VALUE_BYTES` (refused before another byte of it is read)."""
        whole = first.value_bytes
        if whole > MAX_VALUE_BYTES:
            problem = f"a {method} value of {whole:,} bytes (at most {MAX_VALUE_BYTES:,})"
            return Refusal("oversized", problem)
        part = first.value
        if len(part) > whole > 0:
            return Refusal("malformed", f"a {method} value longer than the length it named")
        first.ClearField("value_bytes")  # the request its proof covers
        return cls(method, first, whole - len(part) if whole else 0, [part], pieced=whole > 0)

    @property
    def whole(self) -> int:
        """The bytes of the whole value: what the first message named, or its own."""
        return self.left + sum(len(part) for part in self.parts)

    def add(self, message: Any) -> Refusal | None:
        """Take the next message of the call: a piece of at least a byte and at most the length
        still to come, and nothing else."""
        method = self.method
        if not self.pieced:
            return Refusal("malformed", f"a {method} of one message followed by another")
        part = message.value
        message.ClearField("value")
        if message.ByteSize():
            return Refusal("malformed", f"a later message of a {method} carries more than a piece")
        if not part:  # a call held open by empty messages: each costs the scheduler a step
            return Refusal("malformed", f"a later message of a {method} carries no piece")
        if len(part) > self.left:
            return Refusal("malformed", f"a {method} value longer than the length it named")
        self.left -= len(part)
        self.parts.append(part)
        return None

    def end(self) -> tuple[Any, bytes] | Refusal:
        """The call's request, holding its whole value, and that value; a Refusal when the
        pieces came short of the length the first message named."""
        if self.left:
            problem = f"a {self.method} value {self.left:,} bytes short of the length it named"
            return Refusal("malformed", problem)
        if len(self.parts) == 1:
            return self.first, self.parts[0]
        value = b"".join(self.parts)
        self.first.value = value
        return self.first, value


def quoted(value: str | bytes) -> str:
    """A value from the wire as a message may quote it: escaped, at most a short prefix."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return safe(text, limit=QUOTED_CHARS)


@frozen
class Oversized:
    """What a capped deserializer hands the handler instead of a request over its limit."""

    method: str
    size: int
    reason = "oversized"

    @property
    def limit(self) -> int:
        return _LIMITS[self.method]

    def message(self) -> str:
        return (
            f"a {self.method} request of {self.size:,} bytes; the scheduler takes at most "
            f"{self.limit:,} (is the caller a node of this version of cluster?)"
        )


@frozen
class Malformed:
    """What a capped deserializer hands the handler instead of bytes that are not a request of
    its method (random bytes, a cut message, a string that is not UTF-8): without it, gRPC
    answers UNKNOWN with the parser's exception, a call no refusal counts."""

    method: str
    size: int
    reason = "malformed"

    def message(self) -> str:
        return (
            f"a {self.method} request of {self.size:,} bytes that is not one "
            "(is the caller a node of this version of cluster?)"
        )


# What a capped deserializer hands over instead of a request: refused at the edge.
Unparsed = Oversized | Malformed


def capped(method: str, deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserializer`, which hands over an `Oversized` for a request over the method's limit,
    and a `Malformed` for bytes it cannot parse."""
    limit = _LIMITS[method]

    def deserialize(data: bytes) -> Any:
        if len(data) > limit:
            return Oversized(method, len(data))
        try:
            return deserializer(data)
        except DecodeError:
            return Malformed(method, len(data))

    return deserialize


def valid_host(host: str) -> bool:
    """A host name (RFC 1123 labels) or an IP address literal, at most 253 characters."""
    if not host or len(host) > MAX_HOST_CHARS:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return all(_HOST_LABEL.match(label) for label in host.removesuffix(".").split("."))


def registration_problem(
    node_id: str,
    host: str,
    port: int,
    job_ids: tuple[str, ...],
    blobs: dict[str, tuple[bytes, int]],
    release: str = "",
) -> str | None:
    """What is out of bounds in a registration, None when nothing is. `blobs`: name -> (value,
    the most bytes it may have); `release`: the cluster version the node says it runs."""
    if not valid_node_id(node_id):
        return (
            f"node id {quoted(node_id)} ({len(node_id)} characters) is not valid: use 1-128 "
            "characters of letters, digits and . _ : @ -, starting with a letter or digit"
        )
    if not valid_host(host):
        return (
            f"host {quoted(host)} ({len(host)} characters) is not a host name or an IP address "
            f"of at most {MAX_HOST_CHARS} characters"
        )
    if not 1 <= port <= 65535:
        return f"port {port} is not a port (1-65535)"
    for job_id in job_ids:
        if len(job_id) > MAX_JOB_ID_CHARS or not job_id.isprintable():
            return f"job id {quoted(job_id)} is not one this scheduler could have made"
    return _blob_problem(blobs) or _release_problem(release)


def _blob_problem(blobs: dict[str, tuple[bytes, int]]) -> str | None:
    for name, (value, most) in blobs.items():
        if len(value) > most:
            return f"{name} of {len(value)} bytes (at most {most})"
    return None


def _release_problem(release: str) -> str | None:
    if len(release) <= version.MAX_VERSION_CHARS and release.isprintable():
        return None
    return (
        f"cluster version {quoted(release)} ({len(release)} characters) is not a release's: "
        f"at most {version.MAX_VERSION_CHARS} printable characters"
    )


# The most bytes of each opaque field of a registration.
REGISTRATION_BLOBS = {
    "credential": auth.CREDENTIAL_BYTES,
    "nonce": 64,
    "proof": auth.DIGEST_BYTES,
    "challenge": auth.CHALLENGE_BYTES,
}
