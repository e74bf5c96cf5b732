"""Descriptors held in reserve for the job's members: which connections to shed, and when.

Each connection holds a file descriptor, and a scheduler out of descriptors accepts nobody, the
job's own nodes included. Outsiders' connections are bounded in time (a handshake within 5 s, a
first message within 5 s, closed after 10 s idle: `cluster.transport.edge`), but a flood that
opens them faster than that holds every descriptor. So the scheduler looks at its descriptors
once a second (`cluster.scheduler.descriptors`); when fewer than `reserve` are left below its
limit, it shuts down connections that carry no member's stream, so that the nodes still to come
(and the members that reconnect) find room.

Which ones: enough to leave twice the reserve free (so the next look does not shed again at
once); first from the addresses that hold the most connections (a flood's source before a lone
newcomer), the oldest first within an address: a node registers within a second of connecting,
so a connection that has stayed open without a member's stream is the likelier flood.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from cluster.protocol.value import frozen

# Descriptors kept free beside those of the nodes still to connect: grpc's own, the state files,
# the logs, the launcher's and `mscluster status`'s connections.
RESERVE_BASE = 64


@frozen
class Connection:
    """A connected socket of the scheduler: its descriptor and its peer ("10.0.0.5:41234",
    "[fe80::1]:41234"), as `peer_address` writes it."""

    fd: int
    peer: str
    inode: int = 0  # the socket's, to check that `fd` still is it (0: unknown)
    age_s: float = 0.0  # how long it has been seen open (0: first seen now)

    @property
    def host(self) -> str:
        return self.peer.rpartition(":")[0]


def reserve(expected: int, members: int) -> int:
    """Descriptors to keep free: the base, and one for each node not yet connected (`members`:
    the nodes whose stream is open)."""
    return RESERVE_BASE + max(expected - members, 0)


def peer_address(grpc_peer: str) -> str:
    """gRPC's name of a peer ("ipv4:10.0.0.5:41234", "ipv6:[::1]:41234") as `Connection.peer`
    writes it; "" for anything else (a Unix socket)."""
    kind, _, rest = grpc_peer.partition(":")
    return rest if kind in ("ipv4", "ipv6") else ""


def to_shed(
    open_fds: int,
    limit: int,
    keep_free: int,
    connections: Sequence[Connection],
    members: Collection[str],
    still_to_come: int = 0,
) -> list[Connection]:
    """The connections to shut down (none while more than `keep_free` descriptors are free
    below `limit`): none of `members`' peers, enough to leave `2 * keep_free` free, and never
    the last `still_to_come` of the others: that many may be the connections of the nodes not
    yet in (connected, their registration on its way), which the reserve is kept for. A job's
    formation is no flood: 16,384 nodes connecting at once under a limit of 20,000 had the
    connections of those not yet registered shed, and again when they came back."""
    if open_fds + keep_free <= limit:
        return []
    excess = open_fds + 2 * keep_free - limit
    others = [c for c in connections if c.peer not in members]
    per_host = Counter(c.host for c in others)
    others.sort(key=lambda c: (-per_host[c.host], -c.age_s, c.fd))
    return others[: min(excess, max(len(others) - still_to_come, 0))]
