"""Who may speak for a node, and who may join the job: credentials, job-secret proofs, replays.

Pure: hashing and HMAC over bytes, no I/O.

- The node credential: every worker process draws 32 random bytes per incarnation and sends them
  with its registration; the scheduler keeps only their SHA-256 (in memory and in its saved
  state) and every later call of that node carries the credential itself (call metadata), which
  the scheduler hashes and compares. Nothing secret ever travels from the scheduler to a node, so
  a registration whose answer was lost is simply sent again.
- The job secret (CLUSTER_JOB_SECRET[_FILE]): a registration carries a fresh nonce and an
  HMAC-SHA256 under the secret over every field of the registration (the credential's hash
  included), so that the secret never travels and a proof fits one registration only. The
  scheduler remembers the nonces it has seen (a bounded cache) and refuses one seen before.
- With a job secret nothing captured replays and nothing captured speaks:
  - the proof binds the scheduler's challenge (`ChallengeIssuer`: a value the scheduler makes
    and checks itself, under a key drawn at its start, valid for `CHALLENGE_TTL_S`, every one
    its own) and the job's id, so a captured registration fails after the scheduler restarts,
    in another job with the same secret, and (with the nonce cache, which need only span the
    challenge's life) in this one;
  - the credential travels wrapped (`wrap`: XOR with a pad derived from the secret and both
    nonces), so a listener on the path never learns it;
  - later calls carry no credential but a MAC (`call_mac`) under a key derived from the secret
    and the credential's hash, over the method, the node, a per-node sequence number and the
    request's hash (a value call's head's, which names the value's SHA-256, so that it is
    checked on the call's first message: `cluster.transport.edge.head`); the scheduler
    refuses a number it has seen or one below the window (`CallWindow`), and the number the
    node had when it last registered;
  - an operator's read (Status, WatchEvents) carries `read_proof` over a challenge and the
    method, which the scheduler takes once: it remembers each proof it accepted (a
    `ReplayCache`) for as long as the proof's challenge is good.
  Without a secret and without TLS the job is open to whoever reaches the port
  (docs/design/security.md); with TLS alone the channel protects the credential.
"""

from __future__ import annotations

import collections
import math
import os
from dataclasses import field

from cluster.protocol.value import frozen

CREDENTIAL_BYTES = 32
NONCE_BYTES = 16
DIGEST_BYTES = 32  # SHA-256's
# What a proof is computed over starts with this, so that it can mean nothing else.
_DOMAIN = b"cluster.v1.register"
# Nonces remembered against replays. A registration is a few hundred bytes on the wire, so this
# many is far more than a job makes (every node, every retry) between restarts of the scheduler.
REPLAY_CACHE_SIZE = 65_536


def new_credential() -> bytes:
    return os.urandom(CREDENTIAL_BYTES)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def credential_digest(credential: bytes) -> bytes:
    """What the scheduler keeps of a node's credential."""
    return sha256(credential)


def sha256(data: bytes) -> bytes:
    """SHA-256 of `data`. (`hashlib` is imported on first use: its import builds a constructor
    for each of OpenSSL's algorithms, 1-4 ms, and a worker without a job secret hashes nothing
    at its start.)"""
    import hashlib  # noqa: PLC0415 - see above

    return hashlib.sha256(data).digest()


def _mac(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA256 of `message` under `key`. (`hmac` is imported on first use, here and in
    `_equal`: a worker without a job secret makes no MAC, and the import is a millisecond of
    every worker's start.)"""
    import hmac  # noqa: PLC0415 - see above

    return hmac.new(key, message, "sha256").digest()


def _equal(a: bytes, b: bytes) -> bool:
    """Constant-time comparison."""
    import hmac  # noqa: PLC0415 - see _mac

    return hmac.compare_digest(a, b)


def same_digest(held: bytes, presented: bytes) -> bool:
    """Constant-time comparison; an empty held digest matches nothing."""
    return bool(held) and _equal(held, presented)


def canonical(fields: tuple[str | int | bytes, ...]) -> bytes:
    """An unambiguous encoding of `fields`: each one length-prefixed, after a domain tag."""
    parts = [_DOMAIN]
    for value in fields:
        if isinstance(value, bytes):
            parts.append(b"b" + value)
        elif isinstance(value, int):
            parts.append(b"i" + str(value).encode("ascii"))
        else:
            parts.append(b"s" + value.encode("utf-8"))
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def prove(secret: bytes, message: bytes) -> bytes:
    return _mac(secret, message)


def proven(secret: bytes, message: bytes, proof: bytes) -> bool:
    return _equal(prove(secret, message), proof)


def trust_fingerprint(secret: bytes | None) -> str:
    """What a job's saved state records of its secret, so that a scheduler of another job
    (another secret) is told apart from one of this job: an HMAC of a fixed label under the
    secret, never the secret itself; '' for a job without one."""
    if secret is None:
        return ""
    return _mac(secret, _TRUST)[:_FINGERPRINT_BYTES].hex()


# How long a challenge of the scheduler stays good: a node registers within it of asking for one.
CHALLENGE_TTL_S = 60.0
_START_ID_BYTES = 8
_DRAW_BYTES = 8
_TIME_BYTES = 8
_TAG_BYTES = 16
_BODY_BYTES = _START_ID_BYTES + _DRAW_BYTES + _TIME_BYTES
CHALLENGE_BYTES = _BODY_BYTES + _TAG_BYTES
# Call sequence numbers a scheduler takes out of order (calls made at once arrive in any order).
CALL_WINDOW = 1024
_WRAP = b"cluster.v1.wrap"
_CALL_KEY = b"cluster.v1.call-key"
_CALL = b"cluster.v1.call"
_READ = b"cluster.v1.read"
_TRUST = b"cluster.v1.state-trust"
_FINGERPRINT_BYTES = 16
# What the scheduler says of a read proof it took before (a reader's tool tells it apart).
READ_REPLAYED = "its proof was used before (a replay)"


class ChallengeIssuer:
    """The scheduler's challenges: start id, a random draw, issue time, and a tag over them
    under a key of this process (`CHALLENGE_BYTES` in all).

    Pure: the key and the start id are drawn once (at the scheduler's start), the clock is the
    caller's. Nothing is remembered per challenge, so asking for them grows nothing. The draw
    (8 random bytes) makes every challenge its own, two asked in the same millisecond
    included: readers answering them never make the same proof (`read_proof`), so the replay
    cache of read proofs refuses only a proof sent again.
    """

    def __init__(self, key: bytes | None = None, start_id: bytes | None = None) -> None:
        self._key = key if key is not None else os.urandom(32)
        self.start_id = start_id if start_id is not None else os.urandom(_START_ID_BYTES)

    def _tag(self, body: bytes) -> bytes:
        return _mac(self._key, body)[:_TAG_BYTES]

    def issue(self, now_s: float) -> bytes:
        issued_ms = max(int(now_s * 1000), 0)
        body = self.start_id + os.urandom(_DRAW_BYTES) + issued_ms.to_bytes(_TIME_BYTES, "big")
        return body + self._tag(body)

    def problem(self, challenge: bytes, now_s: float) -> str | None:
        """Why `challenge` is not one of this scheduler's good ones, None when it is."""
        if len(challenge) != CHALLENGE_BYTES:
            return "it carries no challenge of this scheduler (ask for one with Challenge)"
        body = challenge[:_BODY_BYTES]
        if body[:_START_ID_BYTES] != self.start_id or not _equal(
            challenge[_BODY_BYTES:], self._tag(body)
        ):
            return "its challenge is not this scheduler's (another job, or before a restart)"
        issued_ms = int.from_bytes(body[-_TIME_BYTES:], "big")
        age_s = now_s - issued_ms / 1000
        if not -1.0 <= age_s <= CHALLENGE_TTL_S:
            return f"its challenge is {age_s:.0f} s old (good for {CHALLENGE_TTL_S:g} s)"
        return None


def _pad(secret: bytes, challenge: bytes, nonce: bytes) -> bytes:
    return _mac(secret, canonical((_WRAP, challenge, nonce)))


def wrap(secret: bytes, challenge: bytes, nonce: bytes, credential: bytes) -> bytes:
    """The credential as a registration carries it under a job secret (and `unwrap` again)."""
    pad = _pad(secret, challenge, nonce)
    if len(credential) != len(pad):
        return b""
    return bytes(a ^ b for a, b in zip(credential, pad, strict=True))


unwrap = wrap


def call_key(secret: bytes, digest: bytes) -> bytes:
    """The key of a node's call MACs: only the node and the scheduler (holding the secret and
    the credential's hash) can make it; the saved hash alone is not enough."""
    return _mac(secret, canonical((_CALL_KEY, digest)))


def call_mac(key: bytes, call: tuple[str, str, int, int, bytes]) -> bytes:
    """The MAC of a call: (method, node id, incarnation, call number, request hash)."""
    return prove(key, canonical((_CALL, *call)))


def body_digest(body: bytes) -> bytes:
    return sha256(body)


def read_proof(secret: bytes, challenge: bytes, method: str) -> bytes:
    """An operator's proof of the job secret for reading the job (Status, WatchEvents)."""
    return prove(secret, canonical((_READ, challenge, method)))


@frozen
class CallProof:
    """What a call of a node carries under a job secret instead of its credential."""

    method: str
    seq: int
    mac: bytes = field(repr=False)
    body_digest: bytes = field(repr=False)


@frozen
class Presented:
    """What a call presents for the node it speaks for: the hash of the credential it carried
    (a job without a secret), or its call proof (a job with one); empty when it presented
    nothing. `vouched`: the scheduler admitted it already, as the call's first message came
    (a value call's: `cluster.scheduler.servicer_edge`); never read from the wire."""

    digest: bytes = field(default=b"", repr=False)
    call: CallProof | None = None
    vouched: bool = False


class CallWindow:
    """The call numbers of one node seen lately (an anti-replay window, as IPsec's): a number
    is taken once, above the floor (its number when it registered) and at most `size` below
    the highest seen."""

    def __init__(self, floor: int, size: int = CALL_WINDOW) -> None:
        self.floor = floor
        self.highest = floor
        self._seen = 0  # bit i: highest - i was seen
        self._size = size

    def take(self, seq: int) -> str | None:
        """Record `seq`; why it is refused, None when it is new."""
        if seq <= self.floor:
            return f"call number {seq} is not above {self.floor}, the node's at its registration"
        if seq > self.highest:
            shift = seq - self.highest
            self._seen = ((self._seen << shift) | 1) & ((1 << self._size) - 1)
            self.highest = seq
            return None
        back = self.highest - seq
        if back >= self._size:
            return f"call number {seq} is too far behind {self.highest} (a replay?)"
        if self._seen >> back & 1:
            return f"call number {seq} was seen before (a replay)"
        self._seen |= 1 << back
        return None


class ReplayCache:
    """The values seen lately (nonces, read proofs), oldest forgotten first: past `size` of
    them, and each one given an end (`until_s`) once the caller's clock passes it. Ends are
    looked at from the oldest on, so a cache whose ends follow the order of arrival (one clock,
    one life) holds only the values still alive."""

    def __init__(self, size: int = REPLAY_CACHE_SIZE) -> None:
        self._size = size
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def first_time(self, value: bytes, *, now_s: float = 0.0, until_s: float = math.inf) -> bool:
        """Remember `value` until `until_s`; False when it is remembered already."""
        while self._seen:
            oldest, end = next(iter(self._seen.items()))
            if end > now_s:
                break
            del self._seen[oldest]
        if value in self._seen:
            return False
        self._seen[value] = until_s
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return True
