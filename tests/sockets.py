"""Who holds the other end of a process's TCP connections, from /proc (Linux): for tests that
count the scheduler's connections by the process they come from."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from cluster.scheduler.descriptors import tcp_sockets

_ESTABLISHED = "01"


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return set()
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def established(pid: int) -> Iterator[tuple[str, str]]:
    """(local, remote) of each established TCP connection process `pid` holds."""
    inodes = _socket_inodes(pid)
    for inode, state, local, remote in tcp_sockets(str(pid)):
        if state == _ESTABLISHED and inode in inodes:
            yield local, remote


def connections_by_owner(server: int, candidates: Iterable[int]) -> dict[int | None, int]:
    """How many of process `server`'s established connections each of `candidates` holds the
    other end of (None: a process not among them)."""
    owner = {local: pid for pid in candidates for local, _ in established(pid)}
    counts: dict[int | None, int] = {}
    for _, remote in established(server):
        who = owner.get(remote)
        counts[who] = counts.get(who, 0) + 1
    return counts
