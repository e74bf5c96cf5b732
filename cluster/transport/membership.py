"""A node's credential on the wire: the call metadata every call of a member carries.

The worker draws its credential (see `cluster.protocol.auth`) and sends it in its registration;
every later call carries the node id and the incarnation as metadata, and either the credential
(hex; a job without a secret) or, with a job secret, a call proof (`cluster-call`: "SEQ.MAC",
`signed_metadata`) that never shows the credential. The scheduler reads them with `caller`,
which keeps only the credential's hash or the proof, for the state machine to check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import field
from typing import Any

from cluster.protocol import auth
from cluster.protocol.parse import is_decimal
from cluster.protocol.value import frozen

NODE_ID_KEY = "cluster-node-id"
INCARNATION_KEY = "cluster-incarnation"
CREDENTIAL_KEY = "cluster-credential"
CALL_KEY = "cluster-call"
READ_KEY = "cluster-read"
# A credential is 32 bytes (64 hex digits); anything much longer is not one, and is not hashed.
_MAX_CREDENTIAL_HEX = 256

Metadata = tuple[tuple[str, str], ...]


def call_metadata(node_id: str, incarnation: int, credential: bytes) -> Metadata:
    return (
        (NODE_ID_KEY, node_id),
        (INCARNATION_KEY, str(incarnation)),
        (CREDENTIAL_KEY, credential.hex()),
    )


class CallSigner:
    """A node's call proofs under the job secret: each call numbered, its request hashed."""

    def __init__(self, secret: bytes, node_id: str, incarnation: int, credential: bytes) -> None:
        self._key = auth.call_key(secret, auth.credential_digest(credential))
        self._node_id = node_id
        self._incarnation = incarnation
        self.seq = 0  # the last number used
        self._open: dict[int, None] = {}  # numbers of calls made and not yet answered

    @property
    def floor(self) -> int:
        """What a registration says: calls go above it. Below the calls still in flight, which
        may reach the scheduler after the registration (a queued call on a reconnected channel)
        and must not be refused for it."""
        return min(self._open, default=self.seq + 1) - 1

    def hold(self, seqs: range) -> None:
        """Calls numbered `seqs` are in flight."""
        self._open.update(dict.fromkeys(seqs))

    def release(self, seqs: range) -> None:
        """Calls numbered `seqs` are answered (or given up)."""
        for seq in seqs:
            self._open.pop(seq, None)

    def metadata(self, method: str, body: bytes) -> Metadata:
        self.seq += 1
        call = (method, self._node_id, self._incarnation, self.seq, auth.body_digest(body))
        mac = auth.call_mac(self._key, call)
        return (
            (NODE_ID_KEY, self._node_id),
            (INCARNATION_KEY, str(self._incarnation)),
            (CALL_KEY, f"{self.seq}.{mac.hex()}"),
        )


def signer(secret: bytes | None, identity: Any) -> CallSigner | None:
    """The call signer of a node (its `NodeIdentity`) in a job with `secret` (None without)."""
    if secret is None:
        return None
    return CallSigner(secret, identity.node_id, identity.incarnation, identity.credential)


@frozen
class Caller:
    """Who a call says it comes from: empty fields when it did not say."""

    node_id: str = ""
    incarnation: int | None = None
    presented: auth.Presented = field(default_factory=auth.Presented, repr=False)


def caller(
    metadata: Iterable[tuple[str, Any]] | None,
    method: str = "",
    body: Callable[[], bytes] = bytes,
) -> Caller:
    """The caller named by a call's invocation metadata; `body()`: the request as the caller
    serialized it (hashed only for a call proof)."""
    values = {str(key): value for key, value in metadata or ()}
    node_id, incarnation = _named(values)
    call = _call_proof(str(values.get(CALL_KEY, "")), method, body)
    if call is not None:
        return Caller(node_id, incarnation, auth.Presented(call=call))
    digest = b""
    raw = str(values.get(CREDENTIAL_KEY, ""))
    if raw and len(raw) <= _MAX_CREDENTIAL_HEX:
        try:
            digest = auth.credential_digest(bytes.fromhex(raw))
        except ValueError:
            digest = b""
    return Caller(node_id, incarnation, auth.Presented(digest=digest))


def named(metadata: Iterable[tuple[str, Any]] | None) -> Caller:
    """The node a call's invocation metadata names (its id and incarnation), without what it
    presents: what can be known of the caller before its request is read."""
    return Caller(*_named({str(key): value for key, value in metadata or ()}))


def _named(values: dict[str, Any]) -> tuple[str, int | None]:
    incarnation: int | None = None
    raw_incarnation = str(values.get(INCARNATION_KEY, ""))
    if is_decimal(raw_incarnation) and len(raw_incarnation) <= 20:
        incarnation = int(raw_incarnation)
    return str(values.get(NODE_ID_KEY, ""))[:200], incarnation


def _call_proof(raw: str, method: str, body: Callable[[], bytes]) -> auth.CallProof | None:
    seq, _, mac = raw.partition(".")
    if not (is_decimal(seq) and len(seq) <= 20 and len(mac) == 2 * auth.DIGEST_BYTES):
        return None
    try:
        return auth.CallProof(method, int(seq), bytes.fromhex(mac), auth.body_digest(body()))
    except ValueError:
        return None


def read_metadata(secret: bytes, challenge: bytes, method: str) -> Metadata:
    """An operator's proof of the job secret for reading the job (Status, WatchEvents)."""
    proof = auth.read_proof(secret, challenge, method)
    return ((READ_KEY, f"{challenge.hex()}.{proof.hex()}"),)


# What a reader without the job's proof is told to do (the scheduler, and `mscluster status`).
READ_FIX = (
    "this job has a job secret: pass --secret-file <log-dir>/job.secret or set "
    "CLUSTER_JOB_SECRET_FILE"
)


def read_refusal(method: str, problem: str) -> str:
    """The scheduler's answer to a read (Status, WatchEvents) that did not prove the secret."""
    return f"a {method} call refused: {problem}; {READ_FIX}"


def read_replayed(details: str) -> bool:
    """Whether the scheduler's refusal of a read (`read_refusal`) took its proof as a replay:
    the secret was right, the proof had been used before."""
    return auth.READ_REPLAYED in details


def read_proof(metadata: Iterable[tuple[str, Any]] | None) -> tuple[bytes, bytes] | None:
    """The (challenge, proof) of an operator's read, None when the call carries none."""
    raw = next((str(v) for k, v in metadata or () if k == READ_KEY), "")
    challenge, _, proof = raw.partition(".")
    if len(challenge) != 2 * auth.CHALLENGE_BYTES or len(proof) != 2 * auth.DIGEST_BYTES:
        return None
    try:
        return bytes.fromhex(challenge), bytes.fromhex(proof)
    except ValueError:
        return None
