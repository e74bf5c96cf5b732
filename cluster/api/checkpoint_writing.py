"""What a `CheckpointManager`'s threads do with a checkpoint once `save` has returned
(`cluster.api.checkpoint`): its writer writes the snapshot's file (`checkpoint_files.write`:
atomic, with its checksum), prunes the rank's older steps and hands the steps held to its
reporter, which tells the scheduler (`report`).

A thread of its own tells it, the reporter (the scheduler takes a rank's changing reports at most
once per 0.1 s): the writer goes on, and while a report is under way only the newest list waits
to follow it; a step is never named before it is whole on disk. The scheduler's answer is the
newest step every rank holds, which the rank keeps from then on (`held_by_all`); with recovery
on, until one was heard, the writer waits for each answer and keeps `UNHEARD_KEEP` steps (see
there). An error of the writer (a full disk) or of the reporter (a report refused) is kept by its
thread and raised by the manager's next `save` or `flush`.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.api import runtime
from cluster.protocol.errors import CheckpointError, ClusterError
from cluster.storage import checkpoint_files
from cluster.storage.background import BackgroundWriter
from cluster.storage.snapshot import Snapshot

if TYPE_CHECKING:
    from cluster.api.checkpoint import CheckpointManager

# One snapshot being written, one being copied (or waiting for the writer).
SNAPSHOTS = 2
# The fewest steps a rank keeps, with recovery on, until a report is answered with a step every
# rank holds (`_prune`). Until then the writer waits for each report's answer (`_report`), so a
# rank's writer is at most SNAPSHOTS saves behind its loop (a save waits until the one two
# saves before is written and reported), and its loop at most one save behind another rank's
# (each step's collectives): its newest step reported is at most SNAPSHOTS + 1 saves older than
# the step another rank writes, so among that rank's newest SNAPSHOTS + 2 the ranks hold a step
# in common. Once answered with a step h, a rank keeps h and every newer step, and every rank's
# reports name every step it saved from the h it heard (at most the newest h told) to its newest
# reported: the newest step told is among every rank's reports, however far behind the rank's
# writer they are, and the reports need not be waited for.
UNHEARD_KEEP = SNAPSHOTS + 2

# Reports the steps a rank holds; may answer a step every rank holds, which it then keeps.
Report = Callable[[list[int]], int | None]


class WriteBehind:
    """The writer and the reporter of `manager`, a part it owns, and their jobs (see the module
    docstring). They are made again for each rank the manager takes (`place`); the step every
    rank holds, as last heard, is kept for the manager's life."""

    def __init__(self, manager: CheckpointManager) -> None:
        # Weakly: no cycle holds a manager dropped without close(), whose lock goes with it.
        self._owner = weakref.ref(manager)
        # A step every rank holds, as the scheduler last answered a report (0: none heard).
        self.held_by_all = 0
        # The generation the scheduler's last report sent said (`_listed`; None: none sent).
        self.told: int | None = None
        self.writer: BackgroundWriter
        self.reporter: BackgroundWriter

    @property
    def _manager(self) -> CheckpointManager:
        manager = self._owner()
        assert manager is not None  # its caller is the manager, or a writer's job holding it
        return manager

    def place(self, rank: int) -> None:
        """New threads for the files of `rank`."""
        prefix = self._manager.prefix
        self.writer = BackgroundWriter(f"checkpoint-writer-{prefix}-rank{rank}")
        self.reporter = BackgroundWriter(
            f"checkpoint-reporter-{prefix}-rank{rank}",
            newest_only=True,
            doing="reporting (a scheduler that does not answer?)",
        )

    def persist(self, snapshot: Snapshot, path: Path) -> None:
        """The writer's job: the file, pruning, the report; then the snapshot is free again.
        Nothing once the rank's files went to another process of the job
        (`CheckpointManager._displaced`)."""
        manager = self._manager
        try:
            if manager._displaced():
                return
            self._write(manager, snapshot, path)
            manager._disk.wrote(snapshot.step)
            snapshot.persisted = True
            try:
                if not manager._displaced():  # claimed while this file was written: no pruning
                    self._prune(snapshot.step)
            finally:  # the file is whole: reported even when an older one could not be removed
                manager._disk.settle()
                self._report(path, snapshot.step)
        finally:
            manager._pool.release(snapshot)

    @staticmethod
    def _write(manager: CheckpointManager, snapshot: Snapshot, path: Path) -> None:
        """Write the file of `snapshot` at `path`, the writer's view of the directory up to
        date first; once more where the rank's directory was removed under the write (by
        hand, with its files): made again and locked there (`CheckpointManager._hold`, by this
        thread or the manager's caller), the step is written there."""
        for last in (False, True):
            # Behind: the earlier holder may write here (a temporary, a file): listed each time.
            manager._disk.look(sweep=not (manager._lock is not None and manager._lock.behind))
            began = manager._disk.identity()
            try:
                checkpoint_files.write(path, snapshot.step, snapshot.chunks())
                return
            except CheckpointError:
                if last or not (manager._hold() or manager._disk.identity() != began):
                    raise

    def _report(self, path: Path, step: int) -> None:
        """The writer's: have the steps held now, `step` at `path` written last, reported by the
        reporter, in place of a report that waits for it. With recovery on, until a report was
        answered with a step every rank holds, wait for the answer (see `UNHEARD_KEEP`)."""
        send = self._listed()
        if send is None:
            return
        # The job holds the manager, as the writer's does: one dropped meanwhile keeps its lock
        # until the report is sent.
        manager = self._manager
        self.reporter.post(lambda: self._send_report(send, path, step, manager))
        if self._manager.recovery and not self.held_by_all:
            self.reporter.wait()

    def report_now(self) -> None:
        """Report the steps held now, after the reports under way (a report overtakes none:
        the scheduler takes a process's newest), and keep the answer; its error is raised."""
        if self._manager.report is not None:
            self.reporter.wait()
            self._manager._disk.look(sweep=False)  # the manager's own changes: listed
            send = self._listed()
            assert send is not None  # a report is made
            self._heard(send())

    def told_another_generation(self) -> bool:
        """Whether the scheduler's reports sent so far say another generation than one listed
        now would (this worker has put back a newer generation's rollback step since)."""
        return self._tells_scheduler() and self.told != runtime.report_generation()

    def _listed(self) -> Callable[[], int | None] | None:
        """The steps held now, as a report to send now or on the reporter's thread; None when
        no report is made. The scheduler's report (`runtime.report_checkpoints`) says the
        generation this worker reports from as the steps are listed, not as they are sent: a
        list taken before it put back a newer generation's rollback step (a rollback) and sent
        after says what it is, and the scheduler does not take it for one of the new
        generation (`RollbackPlanner.report`)."""
        report = self._manager.report
        if report is None:
            return None
        steps = self._reported()
        if not self._tells_scheduler():
            return lambda: report(steps)
        generation = runtime.report_generation()

        def send() -> int:
            answer = runtime.report_checkpoints(steps, generation)
            self.told = generation
            return answer

        return send

    def _tells_scheduler(self) -> bool:
        """Whether the manager's report is the scheduler's (the default, given or not)."""
        return self._manager.report is runtime.report_checkpoints

    def _send_report(
        self, send: Callable[[], int | None], path: Path, step: int, _held: CheckpointManager
    ) -> None:
        """The reporter's job: `send` the steps held once `step` was written at `path` (by the
        manager `_held`, kept until then)."""
        try:
            self._heard(send())
        except ClusterError as exc:
            raise CheckpointError(
                f"the checkpoint of step {step} is saved ({path}), but the steps held could "
                f"not be reported: {exc}"
            ) from None
        except Exception as exc:  # a session closed under the writer: its call cancelled, ...
            raise CheckpointError(
                f"the checkpoint of step {step} is saved ({path}), but the steps held could "
                f"not be reported ({type(exc).__name__}: {exc}): save and flush checkpoints "
                "between cluster.init() and cluster.finalize()"
            ) from exc

    def _reported(self) -> list[int]:
        """The steps a report names: the newest of this rank's complete steps (as the writer's
        view holds them), at most as many as the scheduler takes (`runtime.newest_reported`)."""
        return runtime.newest_reported(self._manager._disk.held())

    def _heard(self, held_by_all: int | None) -> None:
        """The scheduler's answer to a report: a step every rank holds, kept from now on."""
        if held_by_all:
            self.held_by_all = held_by_all

    def _prune(self, step: int) -> None:
        """Keep the newest `keep_checkpoint_max` complete steps up to `step`, and every step from
        the one every rank holds (as last heard) on: this rank's writer runs ahead of the other
        ranks' reports, and the newest step they all hold is where the job rolls back to.

        With recovery on, until a report has been answered with such a step (at the start: the
        scheduler answers 0 while a rank holds none, and the same answer for a second), the
        newest `UNHEARD_KEEP` at least: a slower rank's newest step is among them (see there).
        The others are removed, and so are the steps past `step` and the files read and found
        not complete (one that cannot be read is left: `RankFiles.incomplete`): found by their
        place among the writer's view's steps (`RankFiles.held`), so that a save costs the same
        however many steps are kept.
        """
        disk = self._manager._disk
        complete = disk.held()
        count = self._manager.config.keep_checkpoint_max
        if self._manager.recovery and self._manager.report is not None and not self.held_by_all:
            count = max(count, UNHEARD_KEEP)
        upto = bisect.bisect_right(complete, step)
        kept_from = max(upto - count, 0)
        if self.held_by_all > 0:
            kept_from = min(kept_from, bisect.bisect_left(complete, self.held_by_all))
        for old_step in [*complete[:kept_from], *complete[upto:], *disk.incomplete()]:
            disk.remove(old_step)
