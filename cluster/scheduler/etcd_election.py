"""Leadership among the schedulers of one job, on etcd: a lease per scheduler, one leader key.

Every scheduler process holds a lease of CLUSTER_LEASE_S seconds, kept alive while it runs, and
registers its address under `PREFIX/schedulers/` on it (so the leader can list its standbys).
The leader is the scheduler whose `PREFIX/leader` key, put on its lease, was created when no
such key existed (a transaction: create revision 0 -> put). That key's create revision is the
leader's fence: every write of the state store is a transaction conditioned on it, so once the
lease has ended (its process killed, its host down, cut off from etcd) and a standby has put a
new leader key, no write of the old leader can land.

The leader key says who put it: the address, the process (pid, host name, and its machine: the
kernel's boot id and its pid namespace) and, in etcd, its lease. A key that names this
scheduler's address is deleted as stale only when no process can lead by it: it is on this
process's own lease (it stepped down while etcd was away), or its process ran on this machine and
is gone (this one is it, started again). Two processes on two hosts that advertise one address
(`--host 0.0.0.0` and one host name) keep each other's keys.

What to do with these facts (lead, stand by, step down) is decided in
`cluster.protocol.leadership`; this module only talks to etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.protocol.errors import FencedError, StateFileError
from cluster.scheduler.etcd_client import EtcdConnection, within

# What etcd says of a request on a lease it no longer has.
LEASE_GONE = "requested lease not found"


@dataclass(frozen=True)
class LeaderKey:
    """Who leads, as the leader key says: its address and the key's create revision; and the
    process that put it (its pid, host name and machine) and the lease it is on."""

    address: str
    revision: int
    pid: int = 0
    host: str = ""
    machine: str = ""
    lease: int = 0


@dataclass(frozen=True)
class Peer:
    """A scheduler of the job, as registered under PREFIX/schedulers/."""

    address: str
    pid: int
    host: str


class EtcdElection:
    def __init__(self, connection: EtcdConnection, address: str, lease_s: int) -> None:
        """`address`: where this scheduler serves, as nodes reach it (host:port)."""
        self.connection = connection
        self.address = address
        self.lease_s = lease_s
        prefix = connection.url.prefix.encode()
        self.leader_key = prefix + b"leader"
        self.peers_prefix = prefix + b"schedulers/"
        self.lease_id: int | None = None
        # The create revision of our leader key while we hold it: the fence of every write.
        self.fence: int | None = None

    def _me(self) -> bytes:
        data = {
            "address": self.address,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "machine": _machine(),
        }
        return json.dumps(data, sort_keys=True).encode()

    def stale(self, found: LeaderKey) -> bool:
        """Whether leader key `found` names this scheduler but nobody can lead by it: put on
        this process's own lease (before it stepped down), or by a process of this machine that
        is gone (this scheduler started again). Another live process's key at the same address
        is not stale: that process leads."""
        if found.address != self.address:
            return False
        if found.lease != 0 and found.lease == self.lease_id:
            return True
        same_machine = bool(found.machine) and found.machine == _machine()
        return same_machine and found.pid != os.getpid() and not _alive(found.pid)

    async def ensure_lease(self) -> int:
        """This scheduler's lease (granted, and its registration put, when it has none). It
        has one only once registered: a grant whose registration failed is left to end (within
        its TTL), and the next call grants and registers again."""
        if self.lease_id is not None:
            return self.lease_id
        lease = await self.connection.call(lambda c: c.lease(self.lease_s), "grant a lease")
        granted = int(lease.id)
        key = self.peers_prefix + self.address.encode()
        await self.connection.call(
            lambda c: c.put(key, self._me(), lease=granted), "register this scheduler"
        )
        self.lease_id = granted
        return granted

    async def campaign(self) -> LeaderKey | None:
        """Become the leader if nobody is; None when we lead now, else who leads."""
        lease = await self.ensure_lease()

        async def attempt(client: Any) -> tuple[bool, list[Any]]:
            t = client.transactions
            return await client.transaction(  # type: ignore[no-any-return]
                compare=[t.create(self.leader_key) == 0],
                success=[t.put(self.leader_key, self._me(), lease=lease), t.get(self.leader_key)],
                failure=[t.get(self.leader_key)],
            )

        try:
            won, responses = await self.connection.call(attempt, "campaign for leadership")
        except StateFileError as exc:
            if LEASE_GONE in str(exc):  # it ended while etcd was away: a new one next time
                self.lease_id = None
            raise
        found = _leader_of(responses[-1])
        if won and found is not None:
            self.fence = found.revision
            return None
        if found is None:  # gone between the compare and the get: try again later
            return LeaderKey("", 0)
        return found

    async def keepalive(self) -> float:
        """Refresh the lease; the seconds etcd says it has left. FencedError when it has
        ended: the leader key, if we had it, is gone with it."""
        lease = self.lease_id
        if lease is None:
            raise FencedError("this scheduler has no lease")
        reply = await self.connection.call(lambda c: c.refresh_lease(lease), "refresh the lease")
        ttl = 0 if reply is None else int(reply.TTL)
        if ttl <= 0:
            self.lease_id = None
            self.fence = None
            raise FencedError(f"the lease of {self.address} in etcd has ended")
        return float(ttl)

    async def leader(self) -> LeaderKey | None:
        """Who leads now (None: nobody)."""
        got = await self.connection.call(lambda c: c.get(self.leader_key), "read the leader key")
        return None if got is None else _leader_key(got.value, got)

    async def wait_for_change(self, known: LeaderKey | None, timeout_s: float) -> None:
        """Return when the leader key may no longer be `known` (an event on it), or after
        `timeout_s` at most: the caller reads it again either way."""
        try:
            client = self.connection.client()
            watch = await within(client.watch(self.leader_key), timeout_s)
        except Exception:
            await asyncio.sleep(min(timeout_s, 0.2))
            return

        async def first_event() -> None:
            async for _ in watch:
                return

        try:
            current = await self.leader()  # changed between our read and the watch?
            if current != known:
                return
            await within(first_event(), timeout_s)
        except Exception:
            return
        finally:
            with contextlib.suppress(Exception):
                await within(watch.cancel(), 1.0)

    async def drop_stale(self, found: LeaderKey) -> None:
        """Delete the leader key `found`, which is `stale`: so that a leader is elected again
        instead of every scheduler standing by behind it."""

        async def attempt(client: Any) -> Any:
            t = client.transactions
            return await client.transaction(
                compare=[t.create(self.leader_key) == found.revision],
                success=[t.delete(self.leader_key)],
                failure=[],
            )

        await self.connection.call(attempt, "delete this scheduler's stale leader key")

    async def resign(self) -> None:
        """Delete our leader key if it is still ours (a standby may lead at once)."""
        fence, self.fence = self.fence, None
        if fence is None:
            return

        async def attempt(client: Any) -> Any:
            t = client.transactions
            return await client.transaction(
                compare=[t.create(self.leader_key) == fence],
                success=[t.delete(self.leader_key)],
                failure=[],
            )

        with contextlib.suppress(Exception):
            await self.connection.call(attempt, "resign the leadership")

    async def close(self) -> None:
        """Resign and revoke the lease (its registration goes with it)."""
        await self.resign()
        lease, self.lease_id = self.lease_id, None
        if lease is not None:
            with contextlib.suppress(Exception):
                await self.connection.call(lambda c: c.revoke_lease(lease), "revoke the lease")

    async def peers(self) -> list[Peer]:
        """Every scheduler registered for the job, the leader among them."""
        found = await self.connection.call(
            lambda c: c.get_prefix(self.peers_prefix), "list the schedulers"
        )
        peers = []
        for kv in found:
            try:
                data = json.loads(kv.value)
                peers.append(Peer(str(data["address"]), int(data["pid"]), str(data["host"])))
            except (ValueError, KeyError, TypeError):
                continue  # not ours: listed by nobody
        return sorted(peers, key=lambda p: p.address)


def _leader_of(response: Any) -> LeaderKey | None:
    """The leader key in a transaction's get response (a list of (value, meta) pairs)."""
    if not response:
        return None
    value, meta = response[0]
    return _leader_key(value, meta)


def _leader_key(value: bytes, meta: Any) -> LeaderKey:
    """The leader key holding `value`, its etcd metadata `meta` (a KeyValue)."""
    revision, lease = int(meta.create_revision), int(meta.lease)
    try:
        data = json.loads(value)
        address = str(data["address"])
    except (ValueError, KeyError, TypeError):
        return LeaderKey("", revision, lease=lease)  # not ours: it still fences the others out
    pid = data.get("pid")
    return LeaderKey(
        address,
        revision,
        pid=pid if isinstance(pid, int) else 0,
        host=str(data.get("host", "")),
        machine=str(data.get("machine", "")),
        lease=lease,
    )


@functools.cache
def _machine() -> str:
    """This kernel's boot id and this process's pid namespace: the processes that share both
    see each other's pids ("" where /proc does not say)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        space = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot} {space}"


def _alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (one of another user counts; a zombie, dead
    and not yet reaped by its parent, does not)."""
    if pid <= 0:
        return True  # unknown: not known to be gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :][:1] != "Z"
