"""Ready/Advance: what the scheduler's decisions let the engine do now, and what must wait.

The rule the whole recovery design rests on: no node hears of a state that is not saved
(write-ahead). A node told "rank 3 is 10.0.0.7" or "roll back to step 40" by a scheduler that
then dies must find the same answer in the saved state of the one that comes back. raft puts
this ordering in its core's output (`Ready` says what to persist before which messages may go,
`Advance` says what was persisted); so does this module, without I/O, for the scheduler:

- `Outbox.step(revision, effects)`: the state machine decided `effects`, which follow from its
  state at `revision`. The `Ready` it returns says which revision to save (`save`) and what may
  be told now (`tell`): nothing while an earlier effect waits or `revision` is not saved. An
  effect may also be a `FailRounds` of the engine's own (a rank finished while others were in
  a collective): it tells of the change at `revision` as an event does, so it waits as one.
- `Outbox.advance(saved)`: the saver says that the state up to `saved` is stored; the `Ready`
  releases, in order, what waited for it.
- `Outbox.fence()`: another scheduler holds the job; nothing held or decided later is told.

Each released effect comes with what it does to the rounds in progress (collectives and their
waits, `FailRounds`): a new generation fails every open round; a failed node fails them with
`PeerFailedError` when the job recovers and `JobFailedError` when it ends; the job's end fails
them with `JobFailedError`; a `FailRounds` stepped in is released as it was given. The engine
only carries it out.

Without recovery (`write_ahead=False`) nothing is saved and everything is told at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from cluster.protocol.errors import ClusterError, JobFailedError, PeerFailedError
from cluster.protocol.records import (
    Effect,
    Evict,
    NodeFailedEvent,
    ShutdownEvent,
    TopologyReadyEvent,
)
from cluster.protocol.value import frozen


@frozen
class FailRounds:
    """Every round in progress ends with `error(reason)`; `keep_answer`: the round completed
    last stays answerable (`Rounds.fail_all`)."""

    reason: str
    error: type[ClusterError]
    keep_answer: bool = False


@frozen
class Tell:
    """`effect` goes out now (an event to every stream, an eviction to one; None: nothing
    but `fail`); then `fail`."""

    effect: Effect | None
    revision: int  # the state it follows from (saved, with write-ahead)
    fail: FailRounds | None = None


@frozen
class Ready:
    # Save the state up to this revision (None: nothing new to save).
    save: int | None = None
    tell: tuple[Tell, ...] = ()


# What the engine steps: the state machine's effects, and its own failures of the rounds.
Decision = Effect | FailRounds


def rounds_failed(effect: Effect, recovery: bool) -> FailRounds | None:
    """What telling `effect` does to the rounds in progress."""
    if isinstance(effect, TopologyReadyEvent) and effect.generation > 1:
        return FailRounds(
            f"the job moved to generation {effect.generation} (a failed node rejoined) during "
            "this collective",
            PeerFailedError,
        )
    if isinstance(effect, NodeFailedEvent):
        return FailRounds(
            f"rank {effect.rank} (node {effect.node_id!r}) died: {effect.reason}",
            PeerFailedError if recovery else JobFailedError,
        )
    if isinstance(effect, ShutdownEvent):
        return FailRounds(effect.reason, JobFailedError)
    return None


class Outbox:
    """The write-ahead order between the state machine, the saver and the nodes."""

    def __init__(self, *, write_ahead: bool, saved: int, recovery: bool) -> None:
        self.write_ahead = write_ahead
        self.recovery = recovery
        self.saved = saved  # the newest revision the saver said is stored
        self.requested = saved  # the newest revision asked of the saver
        # What waits for a save, oldest first: the revision each follows from.
        self.held: deque[tuple[int, tuple[Decision, ...]]] = deque()
        self.fenced = False

    def step(self, revision: int, effects: Sequence[Decision]) -> Ready:
        """The state machine decided `effects` at `revision` (a revision that did not change:
        the state they follow from is the one already decided)."""
        if self.fenced:
            return Ready()
        if not self.write_ahead:
            return Ready(tell=self._tells(revision, effects))
        if not self.held and revision <= self.saved:
            return Ready(tell=self._tells(revision, effects))
        self.held.append((revision, tuple(effects)))
        if revision <= self.requested:
            return Ready()
        self.requested = revision
        return Ready(save=revision)

    def advance(self, saved: int) -> Ready:
        """The saver stored the state up to `saved`: what waited for it, in order."""
        self.saved = max(self.saved, saved)
        self.requested = max(self.requested, self.saved)
        if self.fenced:
            return Ready()
        tell: list[Tell] = []
        while self.held and self.held[0][0] <= self.saved:
            revision, effects = self.held.popleft()
            tell.extend(self._tells(revision, effects))
        return Ready(tell=tuple(tell))

    def fence(self) -> None:
        """Another scheduler holds the job: drop what waits, and tell nothing more."""
        self.fenced = True
        self.held.clear()

    @property
    def waiting(self) -> int:
        """How many decisions wait for a save."""
        return len(self.held)

    def _tells(self, revision: int, effects: Sequence[Decision]) -> tuple[Tell, ...]:
        return tuple(self._tell(revision, e) for e in effects)

    def _tell(self, revision: int, effect: Decision) -> Tell:
        if isinstance(effect, FailRounds):
            return Tell(None, revision, effect)
        fail = None if isinstance(effect, Evict) else rounds_failed(effect, self.recovery)
        return Tell(effect, revision, fail)
