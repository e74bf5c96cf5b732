"""A node's credential on the wire: the call metadata every call of a member carries.

The worker draws its credential (see `cluster.protocol.auth`) and sends it in its registration;
every later call carries the node id, the incarnation and the credential (hex) as metadata. The
scheduler reads them with `caller`, which keeps only the credential's hash.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cluster.protocol import auth
from cluster.protocol.parse import is_decimal

NODE_ID_KEY = "cluster-node-id"
INCARNATION_KEY = "cluster-incarnation"
CREDENTIAL_KEY = "cluster-credential"
# A credential is 32 bytes (64 hex digits); anything much longer is not one, and is not hashed.
_MAX_CREDENTIAL_HEX = 256

Metadata = tuple[tuple[str, str], ...]


def call_metadata(node_id: str, incarnation: int, credential: bytes) -> Metadata:
    return (
        (NODE_ID_KEY, node_id),
        (INCARNATION_KEY, str(incarnation)),
        (CREDENTIAL_KEY, credential.hex()),
    )


@dataclass(frozen=True)
class Caller:
    """Who a call says it comes from: empty fields when it did not say."""

    node_id: str = ""
    incarnation: int | None = None
    credential_digest: bytes = field(default=b"", repr=False)


def caller(metadata: Iterable[tuple[str, Any]] | None) -> Caller:
    """The caller named by a call's invocation metadata."""
    values = {str(key): value for key, value in metadata or ()}
    incarnation: int | None = None
    raw_incarnation = str(values.get(INCARNATION_KEY, ""))
    if is_decimal(raw_incarnation) and len(raw_incarnation) <= 20:
        incarnation = int(raw_incarnation)
    digest = b""
    raw = str(values.get(CREDENTIAL_KEY, ""))
    if raw and len(raw) <= _MAX_CREDENTIAL_HEX:
        try:
            digest = auth.credential_digest(bytes.fromhex(raw))
        except ValueError:
            digest = b""
    return Caller(str(values.get(NODE_ID_KEY, ""))[:200], incarnation, digest)
