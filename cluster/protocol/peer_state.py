"""State from a live peer: who serves, what a request is, and how it proves membership. Pure.

Every worker with recovery on runs a state server (`cluster.worker.state_server`) and publishes
where it is in the job's key-value store, which only members can read: key
`cluster/peer-state/<node id>`, value `Published` (host, port, a random serving token drawn per
process). A requester proves that it read the token (so that it is a member) without sending
it: an HMAC-SHA256 under the token over a fresh nonce and every field of the request, so that a
captured request fits that request once (the server remembers the nonces it has seen) and
nothing else, and a token of an earlier process of the node proves nothing to the new one.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from cluster.protocol import auth
from cluster.protocol.errors import ClusterError

KEY_PREFIX = "cluster/peer-state/"
TOKEN_BYTES = 32
NONCE_BYTES = auth.NONCE_BYTES
# A checkpoint prefix: what CheckpointManager accepts (the file names are made of it).
PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
# The largest step a request may name: far past any training run, small enough for a file name.
MAX_STEP = 10**15
# What a request's proof is computed over starts with this.
_DOMAIN = b"cluster.v1.PeerState/Fetch"


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def key(node_id: str) -> str:
    """The key-value store's key of a node's state server."""
    return KEY_PREFIX + node_id


@dataclass(frozen=True)
class Published:
    """Where a worker's state server is, and its serving token."""

    host: str
    port: int
    token: bytes

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def encode(self) -> bytes:
        value = {"host": self.host, "port": self.port, "token": self.token.hex()}
        return json.dumps(value, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, node_id: str) -> Published:
        """ClusterError naming the key when the value is not a state server's."""
        try:
            value = json.loads(data)
            host, port, token = value["host"], value["port"], bytes.fromhex(value["token"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ClusterError(
                f"the key-value store's {key(node_id)!r} is not a state server's address"
            ) from None
        if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
            raise ClusterError(f"the key-value store's {key(node_id)!r} names no valid address")
        return cls(host, port, token)


@dataclass(frozen=True)
class Request:
    """What a requester asks for (the fields of a FetchRequest but the nonce and proof)."""

    prefix: str
    rank: int
    step: int
    any_rank: bool

    def fields(self, nonce: bytes) -> bytes:
        return auth.canonical(
            (_DOMAIN, self.prefix, self.rank, self.step, int(self.any_rank), nonce)
        )

    def prove(self, token: bytes, nonce: bytes) -> bytes:
        return auth.prove(token, self.fields(nonce))

    def problem(self, worker_num: int, nonce: bytes) -> str | None:
        """What makes this request invalid in a job of `worker_num` workers, or None."""
        if not PREFIX_RE.match(self.prefix):
            return (
                f"prefix {self.prefix[:140]!r} is not a checkpoint prefix (1-128 letters, "
                "digits and . _ -)"
            )
        if not 0 <= self.rank < worker_num:
            return f"rank {self.rank} is out of range: the job has {worker_num} workers"
        if not 1 <= self.step <= MAX_STEP:
            return f"step {self.step} is out of range: a checkpoint step is 1 to {MAX_STEP}"
        if len(nonce) != NONCE_BYTES:
            return f"the nonce has {len(nonce)} bytes, not {NONCE_BYTES}"
        return None


def proven(token: bytes, request: Request, nonce: bytes, proof: bytes) -> bool:
    """Whether `proof` was made with `token` for this request and nonce (constant time)."""
    return auth.proven(token, request.fields(nonce), proof)
