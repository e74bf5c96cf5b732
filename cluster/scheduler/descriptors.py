"""The scheduler's descriptors, looked at once a second: shed outsiders' connections when few
are left (the decision is `cluster.scheduler.machine.reserve`'s).

Linux only (/proc). The look at the scheduler's own sockets takes no descriptor: at the limit
none is left, and gRPC's accept thread takes every one freed, so one set aside for the look
would be taken between its release and the look (the look then saw nothing and shed nothing).
The open descriptors are listed from /proc/self/fd when a descriptor is free to list them, and
otherwise tried one by one below the limit (fstat and getpeername take none); another process's
sockets (the benchmarks') are found by inode in /proc/PID/net/tcp and tcp6. A connection is shut
down in place (gRPC then sees it end and closes the descriptor), after checking that the
descriptor still is the listed socket: it may have been closed and reused since.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import resource
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from cluster.scheduler.machine.reserve import Connection, reserve, to_shed

log = logging.getLogger("cluster.scheduler")

PERIOD_S = 1.0
# How often a shedding is told (each one is counted): a flood sheds every second.
TELL_EVERY_S = 30.0
_FD_DIR = Path("/proc/self/fd")
_LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp: listening


def open_descriptors() -> int | None:
    """How many descriptors this process has open; None when it cannot tell: listing them
    takes one, and none is left (gRPC's accept took the last)."""
    try:
        return len(os.listdir(_FD_DIR))
    except OSError:
        return None


def connections(
    first_seen: dict[int, float] | None = None,
    now: float = 0.0,
    pid: int | None = None,
    limit: int | None = None,
) -> list[Connection]:
    """This process's (or process `pid`'s) connected TCP sockets (not its listeners) and their
    peers. `first_seen`: when each socket (by inode) was first seen, kept from one call to the
    next for their ages (updated here: sockets gone are dropped, new ones noted at `now`).
    `limit`: this process's open-files limit (its soft limit when None), below which its
    descriptors are tried when none is free to list them."""
    sockets = list(_own_sockets(limit) if pid is None else _sockets_of(pid))
    found = []
    seen = {} if first_seen is None else first_seen
    for fd, inode, peer in sockets:
        since = seen.setdefault(inode, now)
        found.append(Connection(fd, peer, inode, now - since))
    if first_seen is not None:
        for gone in first_seen.keys() - {c.inode for c in found}:
            del first_seen[gone]
    return found


def _own_sockets(limit: int | None) -> Iterator[tuple[int, int, str]]:
    """(descriptor, inode, peer) of this process's connected TCP sockets, taking no descriptor."""
    try:
        fds: Iterable[int] = sorted(int(name) for name in os.listdir(_FD_DIR))
    except OSError:  # no descriptor free to list them: try each one below the limit
        fds = range(resource.getrlimit(resource.RLIMIT_NOFILE)[0] if limit is None else limit)
    for fd in fds:
        try:
            info = os.fstat(fd)
        except OSError:
            continue  # not open (or closed meanwhile)
        if stat.S_ISSOCK(info.st_mode):
            peer = _peer_of(fd)
            if peer is not None:
                yield fd, info.st_ino, peer


def _peer_of(fd: int) -> str | None:
    """The peer of TCP socket `fd` as `Connection.peer` writes it; None for another kind of
    socket, a listener, or a descriptor closed meanwhile. The descriptor stays its owner's."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        host, port = sock.getpeername()[:2]
    except OSError:
        return None  # a listener (not connected), or closed meanwhile
    finally:
        sock.detach()
    ip = ipaddress.ip_address(host.partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}"


def _sockets_of(pid: int) -> Iterator[tuple[int, int, str]]:
    """(descriptor, inode, peer) of process `pid`'s connected TCP sockets, from /proc."""
    fd_dir = Path(f"/proc/{pid}/fd")
    inodes: dict[int, int] = {}
    for name in _listing(fd_dir):
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes[int(target[8:-1])] = int(name)
    for inode, peer in _tcp_peers(str(pid)):
        fd = inodes.get(inode)
        if fd is not None:
            yield fd, inode, peer


def shut_down(connection: Connection) -> bool:
    """Shut down `connection`'s socket (both ways), in place: gRPC, which owns the descriptor,
    sees the connection end and closes it. False when the descriptor no longer is that socket
    (closed, or reused since it was listed). No descriptor is taken (none may be left)."""
    try:
        if connection.inode and os.fstat(connection.fd).st_ino != connection.inode:
            return False
        sock = socket.socket(fileno=connection.fd)
    except OSError:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()  # the descriptor stays gRPC's


class DescriptorReserve:
    """Once a second: when fewer than the reserve are free below `limit`, shed connections that
    carry no member's stream. `members()`: the peers of the connections that do, each with the
    number of members' streams it carries."""

    def __init__(
        self,
        limit: int,
        expected: int,
        members: Callable[[], Mapping[str, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.expected = expected
        self._members = members
        self._clock = clock
        self._told_at: float | None = None
        self._untold = 0
        self._first_seen: dict[int, float] = {}  # socket inode -> when first seen, under pressure
        self.available = _FD_DIR.is_dir()

    async def run(self, period_s: float = PERIOD_S) -> None:
        if not self.available:
            return  # not Linux: no /proc to look at, no reserve
        while True:
            await asyncio.sleep(period_s)
            self.look()

    def look(self) -> int:
        """One look: the connections shut down."""
        members = self._members()
        connected = sum(members.values())  # a relay's connection carries many nodes' streams
        keep = reserve(self.expected, connected)
        count = open_descriptors()
        if count is None:
            count = self.limit  # out of descriptors
        if count + keep <= self.limit:
            self._first_seen.clear()
            return 0
        found = connections(self._first_seen, self._clock(), limit=self.limit)
        shed = to_shed(count, self.limit, keep, found, members, self.expected - connected)
        done = sum(shut_down(c) for c in shed)
        self._tell(done, count, keep)
        return done

    def _tell(self, done: int, count: int, keep: int) -> None:
        self._untold += done
        now = self._clock()
        if self._untold and (self._told_at is None or now - self._told_at >= TELL_EVERY_S):
            log.warning(
                "open files %d of %d: shut down %d connections that carry no member's stream, "
                "to keep %d free for the job's nodes (a flood of connections, or the limit too "
                "low for the job: raise it with ulimit -Hn)",
                count,
                self.limit,
                self._untold,
                keep,
            )
            self._told_at, self._untold = now, 0


def _listing(fd_dir: Path = _FD_DIR) -> list[str]:
    try:
        return os.listdir(fd_dir)
    except OSError:
        return []


def tcp_sockets(pid: str = "self") -> Iterator[tuple[int, str, str, str]]:
    """(inode, state, local, peer) of every TCP socket of the network namespace of process
    `pid`, from /proc/PID/net/tcp and tcp6 (`state`: the table's hex code, "01" established,
    "0A" listening)."""
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 10:
                yield int(fields[9]), fields[3], _peer(fields[1]), _peer(fields[2])


def _tcp_peers(pid: str = "self") -> Iterator[tuple[int, str]]:
    """(inode, peer) of every TCP socket of the network namespace of process `pid` that is not
    listening."""
    for inode, state, _, peer in tcp_sockets(pid):
        if state != _LISTEN:
            yield inode, peer


def _peer(hex_address: str) -> str:
    """/proc/net/tcp's "0100007F:1F90" (each 32-bit word in host order) as "127.0.0.1:8080"; an
    IPv4 address mapped into IPv6 as IPv4, as gRPC names it."""
    address, _, port = hex_address.partition(":")
    raw = bytes.fromhex(address)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    host = str(ip) if ip.version == 4 else f"[{ip}]"
    return f"{host}:{int(port, 16)}"
