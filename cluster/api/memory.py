"""The state of a training loop's last step boundary, kept in memory (one step, a copy).

A `TrainingLoop` keeps it so that when a worker fails between two steps (or its step is
abandoned), the survivors put that step back from memory and a newcomer fetches it from them,
instead of every worker rolling back to the newest checkpoint on disk (`cluster.protocol.resume`
decides which). It is a copy, not a reference: a step may change the state before its collective
fails. The copy is a `Snapshot` (`cluster.storage.snapshot`): the bytes of a checkpoint file of
this rank, copied in one pass into a buffer reused from step to step, so a steady loop allocates
nothing. At a step the manager saves, the manager's own snapshot of that step is held instead:
one copy, not two. Whatever is held is also what the checkpoint server hands a peer that asks
for this step (`CheckpointManager.serve_memory`).

`CheckpointConfig.memory_snapshot` bounds it: a state larger than that many bytes is not kept
(said once), and the job rolls back to disk as without it; 0 turns it off. Without recovery
nothing is kept (a failure ends the job).

With recovery the loop also keeps the state of step 0, as constructed (`InitialState`), for a
rollback to step 0: a host copy (pageable, also for CUDA tensors), which `StepMemory` holds as
its step 0 at the job's first start (one copy, not two). It is let go once the scheduler says
that every rank holds a checkpoint (`CheckpointManager.held_by_all`): from then on the
rollback step is 0 only if a rank's checkpoints are lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from cluster.storage import checkpoint_tree
from cluster.storage.snapshot import Snapshot, SnapshotPool

if TYPE_CHECKING:
    from cluster.api.checkpoint import CheckpointManager


class StepMemory:
    """One step's state in memory, for a `TrainingLoop`; see the module."""

    def __init__(self, checkpoints: CheckpointManager, say: Callable[[str], None]) -> None:
        self._checkpoints = checkpoints
        self._say = say
        # Without recovery a failure ends the job: nothing would ever resume from the copy.
        self.limit = checkpoints.config.memory_snapshot if checkpoints.recovery else 0
        self._pool = SnapshotPool(1)  # the loop's own buffer, for steps that are not saved
        self._held: Snapshot | None = None
        self._hold = contextlib.ExitStack()  # releases what is held
        self._over_said = False

    @property
    def step(self) -> int | None:
        """The step whose state is held; None when nothing is."""
        return None if self._held is None else self._held.step

    def keep(self, step: int, state: Mapping[str, Any], *, saved: bool) -> None:
        """Hold the state of `step` (the loop's boundary), instead of what was held. `saved`:
        the manager has just saved this very state as `step`, and its snapshot is shared."""
        if self.limit == 0:
            return
        self.drop()
        if saved:
            snapshot = self._hold.enter_context(self._checkpoints.latest_snapshot())
            if snapshot is None or snapshot.step != step or not self._fits(snapshot.nbytes):
                self.drop()
                return
        else:
            encoded = checkpoint_tree.encode(state)  # a bad state is refused here
            if not self._fits(encoded.data_bytes):
                return
            snapshot = self._pool.acquire()
            self._hold.callback(self._pool.release, snapshot)
            snapshot.fill(step, self._checkpoints.rank, self._checkpoints.prefix, encoded)
        self._held = snapshot
        self._serve(step, snapshot)

    def keep_initial(self, initial: InitialState) -> None:
        """Hold the state of step 0 that `initial` holds: that copy, not another one (nothing
        when it holds none)."""
        if self.limit == 0:
            return
        self.drop()
        snapshot = initial.snapshot
        if snapshot is not None and self._fits(snapshot.nbytes):
            self._held = snapshot
            self._serve(0, snapshot)

    def state(self) -> dict[str, Any]:
        """A decoded copy of the state held (the snapshot stays, to serve peers)."""
        assert self._held is not None, "StepMemory.state() with nothing held"
        return self._held.state()

    def drop(self) -> None:
        """Hold nothing: no longer serve it, and free it for reuse."""
        if self._held is not None:
            self._serve(self._held.step, None)
            self._held = None
        self._hold.close()

    def close(self) -> None:
        """Drop what is held and free the loop's own buffer."""
        self.drop()
        self._pool.clear()

    def _fits(self, nbytes: int) -> bool:
        if nbytes <= self.limit:
            return True
        if not self._over_said:
            self._over_said = True
            self._say(
                f"the state ({nbytes / 2**20:.1f} MiB) is larger than CheckpointConfig("
                f"memory_snapshot={self.limit}): no copy of the last step is kept in memory, "
                "and a failure rolls back to the newest checkpoint on disk"
            )
        return False

    def _serve(self, step: int, snapshot: Snapshot | None) -> None:
        # Step 0 is nobody's to fetch: every worker makes the state as constructed.
        self._checkpoints.serve_memory(step, snapshot if step > 0 else None)


class InitialState:
    """The state of step 0, a host copy of `state` (a `Snapshot` in pageable memory: a state on
    a GPU is not copied on the GPU), until `let_go`; see the module. Without recovery none is
    made (a failure ends the job: no rollback), so `state` is not looked at."""

    def __init__(self, checkpoints: CheckpointManager, state: Mapping[str, Any]) -> None:
        self.snapshot: Snapshot | None = None
        if checkpoints.recovery:
            encoded = checkpoint_tree.encode(state)  # a bad state is refused here
            self.snapshot = Snapshot(pin=False)
            self.snapshot.fill(0, checkpoints.rank, checkpoints.prefix, encoded)
        self.let_go_at = 0  # the step every rank held when it was let go (0: held, or no job)

    def state(self) -> dict[str, Any] | None:
        """A decoded copy of the state of step 0; None once it was let go."""
        return None if self.snapshot is None else self.snapshot.state()

    def let_go(self, held_by_all: int = 0) -> None:
        """Hold it no more (its memory is freed once `StepMemory` holds it no more either):
        every rank holds a checkpoint of `held_by_all`, or no rollback can come."""
        if self.snapshot is not None:
            self.snapshot = None
            self.let_go_at = held_by_all
