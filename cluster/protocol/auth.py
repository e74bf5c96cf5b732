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
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets

CREDENTIAL_BYTES = 32
NONCE_BYTES = 16
DIGEST_BYTES = hashlib.sha256().digest_size
# What a proof is computed over starts with this, so that it can mean nothing else.
_DOMAIN = b"cluster.v1.register"
# Nonces remembered against replays. A registration is a few hundred bytes on the wire, so this
# many is far more than a job makes (every node, every retry) between restarts of the scheduler.
REPLAY_CACHE_SIZE = 65_536


def new_credential() -> bytes:
    return secrets.token_bytes(CREDENTIAL_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def credential_digest(credential: bytes) -> bytes:
    """What the scheduler keeps of a node's credential."""
    return hashlib.sha256(credential).digest()


def same_digest(held: bytes, presented: bytes) -> bool:
    """Constant-time comparison; an empty held digest matches nothing."""
    return bool(held) and hmac.compare_digest(held, presented)


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
    return hmac.new(secret, message, hashlib.sha256).digest()


def proven(secret: bytes, message: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(prove(secret, message), proof)


class ReplayCache:
    """The nonces seen lately, oldest forgotten first."""

    def __init__(self, size: int = REPLAY_CACHE_SIZE) -> None:
        self._size = size
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def first_time(self, nonce: bytes) -> bool:
        """Remember `nonce`; False when it was seen before."""
        if nonce in self._seen:
            return False
        self._seen[nonce] = None
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return True
