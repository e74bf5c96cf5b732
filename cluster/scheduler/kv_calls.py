"""The members' key-value calls on the scheduler's loop: each admitted, then carried out on the
job's `KvStore`.

Only members use the store: every call is admitted first by the job's state machine (its
membership and its credential), and a refused one raises the ClusterError of its refusal and
changes nothing. Keys
are counted to the member that set them last (its share of the caps, `machine.kv`).

With recovery (`persister`, the one write-ahead saver of `cluster.scheduler.persist`), a set or
an add is staged, saved, and only then committed and answered: no node reads, or is told, a
value that a crash could forget. Without it, a set is visible at once.

An add that carries its number (`add_id`, from 1 in each process, the same when the worker makes
the call again) is counted once: its record is saved after its counter, and the add made again,
at this scheduler or at one that took over from the store, is answered as it was, once that
record is saved (`machine.adds`).
"""

from __future__ import annotations

from cluster.scheduler.kv import KvStore
from cluster.scheduler.machine.adds import Add
from cluster.scheduler.machine.state import Denied, Member, SchedulerState
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

    def _member(self, caller: Caller) -> Member:
        verdict = self._job.admission.admit(caller.node_id, caller.incarnation, caller.presented)
        if isinstance(verdict, Denied):
            raise verdict.error()
        return verdict

    def store_for(self, caller: Caller) -> KvStore:
        """The key-value store, for a member (only members use it)."""
        self._member(caller)
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

    async def add(self, caller: Caller, key: str, amount: int, add_id: int = 0) -> int:
        """Add to a counter; with recovery, answered (and visible) once it is saved. `add_id`:
        the add's number in the caller's process (0: none, counted each time it is made)."""
        member = self._member(caller)
        kv, persister = self.kv, self.persister
        if not add_id:
            if persister is None:
                return kv.add(key, amount, caller.node_id)
            number = kv.stage_add(key, amount, caller.node_id)
            await persister.write_kv(key, str(number).encode("ascii"))
            return number
        add = Add(member.node_id, member.incarnation, add_id)
        added = kv.add_once(key, amount, caller.node_id, add, _Present(self._job))
        value = str(added.value).encode("ascii")
        if persister is None:
            if added.record is not None:
                kv.commit(key, value)
        elif added.record is None:
            await persister.kv_saved()  # made again: answered once its record is saved
        else:
            await persister.write_kv(key, value, record=added.record)
        return added.value

    async def wait(self, caller: Caller, keys: list[str], timeout_s: float) -> list[bytes]:
        """Wait for keys, within the caller's share of the pending waits."""
        return await self.store_for(caller).wait(keys, timeout_s, caller.node_id)


class _Present:
    """The job's members and spares now, by canonical node id (`machine.adds.Members`)."""

    def __init__(self, job: SchedulerState) -> None:
        self._job = job

    def __contains__(self, node_id: object, /) -> bool:
        return isinstance(node_id, str) and self._job.find(node_id) is not None

    def __len__(self) -> int:
        return len(self._job.members) + len(self._job.spares)
