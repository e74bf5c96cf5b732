"""The scheduler's descriptors, looked at once a second: shed outsiders' connections when few
are left (the decision is `cluster.scheduler.machine.reserve`'s).

Linux only (/proc): the open descriptors are /proc/self/fd, a socket's peer is found by its
inode in /proc/self/net/tcp and tcp6. A connection is shut down in place (gRPC then sees it end
and closes the descriptor), after checking that the descriptor still is the listed socket: it
may have been closed and reused since. At the limit no descriptor is left to duplicate.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Iterator
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
    first_seen: dict[int, float] | None = None, now: float = 0.0, pid: int | None = None
) -> list[Connection]:
    """This process's (or process `pid`'s) connected TCP sockets (not its listeners) and their
    peers. `first_seen`: when each socket (by inode) was first seen, kept from one call to the
    next for their ages (updated here: sockets gone are dropped, new ones noted at `now`)."""
    fd_dir = _FD_DIR if pid is None else Path(f"/proc/{pid}/fd")
    inodes: dict[int, int] = {}
    for name in _listing(fd_dir):
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes[int(target[8:-1])] = int(name)
    found = []
    seen = {} if first_seen is None else first_seen
    for inode, peer in _tcp_peers("self" if pid is None else str(pid)):
        fd = inodes.get(inode)
        if fd is not None:
            since = seen.setdefault(inode, now)
            found.append(Connection(fd, peer, inode, now - since))
    if first_seen is not None:
        for gone in first_seen.keys() - {c.inode for c in found}:
            del first_seen[gone]
    return found


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
    carry no member's stream. `members()`: the peers of the connections that do."""

    def __init__(
        self,
        limit: int,
        expected: int,
        members: Callable[[], Collection[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.expected = expected
        self._members = members
        self._clock = clock
        self._told_at: float | None = None
        self._untold = 0
        self._first_seen: dict[int, float] = {}  # socket inode -> when first seen, under pressure
        # A descriptor held for the look itself: at the limit, reading /proc takes one, and gRPC
        # takes every one freed.
        self._spare = _open_spare()
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
        keep = reserve(self.expected, len(members))
        count = open_descriptors()
        if count is None:
            count = self.limit  # out of descriptors
        if count + keep <= self.limit:
            self._first_seen.clear()
            return 0
        if self._spare is not None:
            os.close(self._spare)
        try:
            found = connections(self._first_seen, self._clock())
        finally:
            self._spare = _open_spare()
        done = sum(shut_down(c) for c in to_shed(count, self.limit, keep, found, members))
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


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


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
