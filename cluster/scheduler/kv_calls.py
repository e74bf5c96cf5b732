"""The members' key-value calls on the scheduler's loop: each admitted, then carried out on the
job's `KvStore`.

Only members use the store: every call is admitted first by the job's state machine (its
membership and its credential), and a refused one raises the ClusterError of its refusal and
changes nothing. Keys
are counted to the member that set them last (its share of the caps, `machine.kv`).

With recovery (`persister`, the one write-ahead saver of `cluster.scheduler.persist`), a set or
an add is staged, saved, and only then committed and answered: no node reads, or is told, a
value that a crash could forget. Without it, a set is visible at once.
"""

from __future__ import annotations

from cluster.scheduler.kv import KvStore
from cluster.scheduler.machine.state import Denied, SchedulerState
from cluster.scheduler.persist import WriteAheadSaver
from cluster.transport.membership import Caller


class KvCalls:
    def __init__(
        self,
        kv: KvStore,
        job: SchedulerState,
        persister: WriteAheadSaver | None = None,
    ) -> None:
        """`job`: who its members are; `persister`: what saves the store (None: nothing is
        saved)."""
        self.kv = kv
        self._job = job
        self.persister = persister

    def store_for(self, caller: Caller) -> KvStore:
        """The key-value store, for a member (only members use it)."""
        verdict = self._job.admission.admit(caller.node_id, caller.incarnation, caller.presented)
        if isinstance(verdict, Denied):
            raise verdict.error()
        return self.kv

    async def set(self, caller: Caller, key: str, value: bytes) -> None:
        """Set a key (counted to the caller's share); with recovery, answered (and visible)
        once it is saved."""
        kv = self.store_for(caller)
        if self.persister is None:
            kv.set(key, value, caller.node_id)
            return
        kv.stage(key, value, caller.node_id)
        await self.persister.write_kv(key, value)

    async def add(self, caller: Caller, key: str, amount: int) -> int:
        """Add to a counter; with recovery, answered (and visible) once it is saved."""
        kv = self.store_for(caller)
        if self.persister is None:
            return kv.add(key, amount, caller.node_id)
        number = kv.stage_add(key, amount, caller.node_id)
        await self.persister.write_kv(key, str(number).encode("ascii"))
        return number

    async def wait(self, caller: Caller, keys: list[str], timeout_s: float) -> list[bytes]:
        """Wait for keys, within the caller's share of the pending waits."""
        return await self.store_for(caller).wait(keys, timeout_s, caller.node_id)
