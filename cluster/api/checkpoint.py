"""Per-rank training checkpoints: copied in memory, written in the background, reported when
complete.

`CheckpointManager.save(step, state)` copies the state into buffers the manager owns (a
`Snapshot`: the arrays' bytes, not pickled, in buffers reused from one save to the next) and
returns; a background thread then writes `<directory>/rank_<r>/<prefix>-<step:08d>.ckpt`
atomically (temporary file, fsync, rename, fsync of the directory: `cluster.storage.atomic`)
with an XXH3 checksum, keeps the newest `keep_checkpoint_max`, and only then has the scheduler
told which steps this rank holds: with recovery on, the job restarts from the newest step every
rank holds, so a step is never named before it is whole on disk. A thread of its own tells it,
the reporter, while the writer goes on (`cluster.api.checkpoint_writing`: what the two threads
do; `cluster.api.checkpoint_listing`: the rank's files, as listed and removed). A process
killed at any moment leaves complete checkpoints only. One manager at a time uses a rank's files
of a prefix (a lock file, `cluster.storage.checkpoint_lock`); a file found damaged when loaded
is moved aside and, in a job, fetched from a live peer.

At most two snapshots exist: one being written and one copied. A save that finds both held
waits for the writer (counted in `stats`), so a loop that saves faster than the disk writes is
slowed to the disk's pace instead of growing without bound. An error of the writer (a full
disk) or of the reporter (a report refused) is raised by the next `save` or `flush`. The file
format is `cluster.storage.checkpoint_files`; the state's encoding is `cluster.storage.
checkpoint_tree`; what to save and when, a `CheckpointConfig` (`cluster.api.checkpoint_config`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.api import runtime
from cluster.api.checkpoint_config import CheckpointConfig, CheckpointStats
from cluster.api.checkpoint_listing import RankFiles
from cluster.api.checkpoint_writing import SNAPSHOTS, Report, WriteBehind
from cluster.protocol.config import parse_bool
from cluster.protocol.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    NoPeerStateError,
)
from cluster.protocol.peer_state import PREFIX_RE
from cluster.protocol.put_back import put_back_by_discarding, saved_before_put_back
from cluster.storage import atomic, checkpoint_files, checkpoint_tree
from cluster.storage.checkpoint_lock import CheckpointLock, Seat
from cluster.storage.served import ServedCheckpoints
from cluster.storage.snapshot import Snapshot, SnapshotPool

# What a damaged checkpoint file is renamed to (`<name><DAMAGED>`): kept for a look, never listed.
DAMAGED = ".damaged"

if TYPE_CHECKING:
    from cluster.worker.state_fetch import Fetched

_log = logging.getLogger(__name__)


class CheckpointManager:
    """Saves, prunes, lists and loads the checkpoints of one rank under `directory/rank_<r>/`.

    One manager at a time uses a rank's checkpoints of a prefix: it holds the lock
    `rank_<r>/.<prefix>.lock` from the moment its rank is known (at once, or for one made before
    `cluster.init()` at its first use or when it is connected) until `close()` or the end of its
    process, and another is refused (`cluster.storage.checkpoint_lock`), unless the scheduler
    gave it the rank after the holder, in the same job: it goes on without the lock, and the
    holder writes nothing more there. `rank` defaults to `cluster.get_rank()`. Whether recovery
    is on is the job's, as it was launched (MS_ENABLE_RECOVERY with MS_RECOVERY_PATH, as
    `cluster.init()` took them): `recovery`, for a manager outside a job, is refused in one
    that runs otherwise (`_recovery_of`). `report` receives the steps held after each
    checkpoint written, on the reporter's thread (a list that a newer one overtook while a
    report was under way is skipped); the default tells the scheduler. A manager made before
    `cluster.init()` takes the job's rank, recovery and the scheduler's report when it is
    connected: by a `TrainingLoop`, or at its first save, load or listing in the job
    (`connect`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        prefix: str,
        config: CheckpointConfig,
        *,
        rank: int | None = None,
        recovery: bool | None = None,
        report: Report | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not PREFIX_RE.match(prefix):
            raise ConfigError(
                f"checkpoint prefix={prefix!r} is invalid: use 1-128 letters, digits and . _ -, "
                "starting with a letter or digit"
            )
        if not isinstance(config, CheckpointConfig):
            raise ConfigError(f"config={config!r} is not a CheckpointConfig")
        in_job = runtime.is_initialized()
        chosen = (runtime.get_rank() if in_job else 0) if rank is None else rank
        if isinstance(chosen, bool) or not isinstance(chosen, int) or chosen < 0:
            raise ConfigError(f"checkpoint rank={rank!r} is invalid: it must be an integer >= 0")
        # Made before cluster.init(): the job's rank (unless `rank` is given) and report are
        # taken by `connect`; `_used`: files were saved or read as `chosen` meanwhile.
        self._connecting = not in_job
        self._rank_given = rank is not None
        self._used = False
        self._recovery_given = recovery
        self.recovery = _recovery_of(recovery, config)  # the job's, once connected
        self.prefix = prefix
        self.config = config
        self.root = Path(directory)
        self.report: Report | None = report or (runtime.report_checkpoints if in_job else None)
        self._pool = SnapshotPool(SNAPSHOTS)
        self._saves = 0
        self._pause_s = 0.0
        self._offered = False
        self._lock: CheckpointLock | None = None
        self._holding = threading.Lock()  # `_hold`: the callers' thread, and the writer's
        self._said_displaced = False
        self._said_not_put_back = 0  # the generation last said to be saved in before put back
        self._writes = WriteBehind(self)  # its writer's and reporter's threads, and their jobs
        self._place(chosen)
        self._serve_peers()

    def _place(self, rank: int) -> None:
        """Be the manager of `rank`: its directory, its lock (once the rank is known), its
        writer, what it offers to peers that take a rank without its checkpoints."""
        self.rank = rank
        self._disk = RankFiles(self.root, self.prefix, rank, _tell)  # its files, listed
        self.directory = self._disk.directory
        self._writes.place(rank)
        _managers.add(self)
        runtime.on_finalize(_end_writers)
        self.served = ServedCheckpoints(self.root, self.prefix, rank)
        self._disk.make()
        if self._lock is not None:
            self._lock.release()
        self._lock = CheckpointLock(self.directory, self.prefix)
        if not self._connecting or self._rank_given:
            self._lock.acquire(seat=_seat(rank), say=_say())

    def connect(self) -> None:
        """After `cluster.init()`, a manager made before it takes the job's rank (unless `rank`
        was given) and recovery, reports to the scheduler (unless `report` was given) and, with
        recovery on, offers its checkpoints to peers, as one made after it does from the start
        (a peer may need this rank's step in memory before its first save); nothing otherwise.

        ConfigError when it saved or read checkpoints as rank 0 before `cluster.init()` and the
        job's rank is another: those were another rank's files; and when the `recovery` it was
        given is not the job's."""
        if not self._connecting or not runtime.is_initialized():
            return
        self.recovery = _recovery_of(self._recovery_given, self.config)
        job_rank = runtime.get_rank()
        if not self._rank_given and job_rank != self.rank:
            if self._used:
                raise ConfigError(
                    f"this CheckpointManager ({self.root}, prefix {self.prefix!r}) saved or read "
                    f"checkpoints as rank {self.rank} before cluster.init(), but this worker is "
                    f"rank {job_rank}: make the manager after cluster.init(), or pass rank="
                )
            self._place(job_rank)
        if self.report is None:
            self.report = runtime.report_checkpoints
        self._connecting = False
        self._hold()
        self._serve_peers()

    def _begin(self) -> None:
        """Before a save, load or listing: connected in a job; before it, this rank's files are
        in use."""
        if self._connecting:
            self.connect()
            self._used = self._connecting
        self._hold()

    def _hold(self) -> bool:
        """Hold this rank's lock (again, after `close`; behind an earlier holder of the rank
        in this job, try again to take it), in the rank's directory: one removed while the
        manager runs (by hand, with its files) is made again, and saves go on there (said);
        whether it was made again. Called by the writer too, for a directory removed under
        its write (`WriteBehind.persist`). Once the rank went to another process of the job
        (`_displaced`), nothing is made: no directory, no lock file."""
        assert self._lock is not None  # made by _place
        with self._holding:
            made = not self._displaced() and self._disk.make()
            if made:
                _tell(
                    f"the checkpoint directory {self.directory} was removed, with the checkpoints "
                    "in it, while this CheckpointManager used it: made it again; the steps saved "
                    "there are no longer held by this rank, and the next saves go there"
                )
            self._lock.acquire(seat=_seat(self.rank), say=_say())
        return made

    def path(self, step: int) -> Path:
        self.connect()
        return self.directory / checkpoint_files.file_name(self.prefix, _check_step(step))

    def should_save(self, step: int) -> bool:
        """Whether `step` (the number of completed training steps) is a saving step: never 0,
        where no step is done (a loop `for step in range(n)` asks for it too)."""
        every = self.config.save_checkpoint_steps
        return _check_step(step, least=0) > 0 and step % every == 0

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Copy `state` as the checkpoint of `step`, and have it written in the background; the
        path it will have. Returns once the state is copied: the caller may change it at once.

        Raises the error of an earlier background write first, if one failed. Checkpoints of
        this rank newer than `step` are removed when it is written: they belong to a run that
        was rolled back to an older step, and the job must not restart from them.
        """
        start = time.perf_counter()
        self._begin()
        self._serve_peers()
        self._check_put_back(step)
        path = self.path(step)
        encoded = checkpoint_tree.encode(state)  # a bad state is refused here, in the caller
        snapshot = self._pool.acquire()  # waits while one snapshot is written, one queued
        try:
            snapshot.fill(step, self.rank, self.prefix, encoded)
            self._pool.hold(snapshot)  # the writer's hold, released when it is on disk
            try:
                self._writes.reporter.raise_failed()
                self._writes.writer.submit(lambda: self._writes.persist(snapshot, path))
            except BaseException:
                self._pool.release(snapshot)
                raise
        except BaseException:
            self._pool.release(snapshot)
            raise
        self._pool.set_latest(snapshot)  # the acquire's hold becomes the latest's
        self._saves += 1
        self._pause_s += time.perf_counter() - start
        return path

    def _check_put_back(self, step: int) -> None:
        """Say once a generation that this worker saves `step` before it put back the
        generation's rollback step (a rollback by hand without `discard_newer`): the scheduler
        counts none of its steps past that step, so a failure rolls back to it again."""
        topology = runtime.session().topology if runtime.is_initialized() else None
        if topology is None:
            return
        generation, rollback_step = topology.generation, topology.rollback_step
        reported = runtime.report_generation()
        if self._said_not_put_back == generation or not saved_before_put_back(
            step, generation, rollback_step, reported
        ):
            return
        self._said_not_put_back = generation
        line = (
            f"saving step {step} of generation {generation}, whose rollback step is "
            f"{rollback_step}, before this rank put that step back: the scheduler counts none "
            f"of its steps past {rollback_step} until it does, so a failure rolls back to "
            f"{rollback_step} again; after loading the rollback step, call "
            f"discard_newer({rollback_step}) (TrainingLoop does)"
        )
        _tell(line)

    def flush(self) -> None:
        """Wait until every checkpoint saved so far is written and its steps reported (the
        scheduler answered); raise the error of one that could not be (a CheckpointError naming
        the file and the cause)."""
        self._writes.writer.wait()
        self._writes.reporter.wait()  # after the writer's: its last job posts the last report
        self._writes.writer.flush()
        self._writes.reporter.flush()

    def close(self) -> None:
        """Flush, then end the writer's and the reporter's threads, free the memory of the
        snapshots and let go of the lock (a later save, load or listing takes them again).
        When the flush raises (a write or a report failed), all of that is still done, and
        then its error is raised."""
        try:
            self.flush()
        finally:
            self._let_go()

    def _let_go(self) -> None:
        self._writes.writer.close()
        self._writes.reporter.close()
        if self._offered:
            from cluster.api import peer_state  # noqa: PLC0415 - imports grpc, in a job only

            peer_state.withdraw(self.prefix)
            self._offered = False
        self.served.set_memory(0, None)
        self._pool.set_latest(None)
        self._pool.clear()
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> CheckpointStats:
        pool = self._pool.stats
        return CheckpointStats(
            self._saves, self._pause_s, pool.waits, pool.wait_s, self._writes.writer.done
        )

    @property
    def held_by_all(self) -> int:
        """A step every rank holds, as the scheduler's last answer to this rank's reports that
        named one said (0: none heard yet); this rank keeps it and every newer step."""
        return self._writes.held_by_all

    @contextlib.contextmanager
    def latest_snapshot(self) -> Iterator[Snapshot | None]:
        """The newest step saved, as held in memory (None before the first save), kept from
        reuse until the block ends: to send it to a peer (`chunks()` are its file's bytes,
        `checksum()` its footer's) without reading the disk. `persisted` says whether its file
        is complete on disk yet."""
        snapshot = self._pool.hold_latest()
        try:
            yield snapshot
        finally:
            if snapshot is not None:
                self._pool.release(snapshot)

    def serve_memory(self, step: int, snapshot: Snapshot | None) -> None:
        """Offer `snapshot` to peers as this rank's checkpoint of `step` (held in memory, never
        written here), until the next call replaces it; None withdraws it.

        The caller must not change a snapshot while it is served: replace it (or withdraw it)
        first. Once this returns, the previous snapshot is the caller's again: a peer's
        transfer of it that is under way goes on from a copy made here (copy-on-replace).
        In a job with recovery on, a snapshot is offered at once (a manager made before
        `cluster.init()` is connected first: its rank is the job's).
        """
        if snapshot is not None:
            _check_step(step)
            self.connect()
        self.served.set_memory(step, snapshot)
        if snapshot is not None:
            self._serve_peers()

    def _displaced(self) -> bool:
        """Whether the scheduler gave this rank to another process of the job, which claimed
        its files (`CheckpointLock.displaced`): this process ends once it hears so, and writes,
        prunes and removes nothing there meanwhile (said once)."""
        holder = None if self._lock is None else self._lock.displaced()
        if holder is None:
            return False
        if not self._said_displaced:
            self._said_displaced = True
            line = (
                f"rank {self.rank}'s checkpoints of prefix {self.prefix!r} in {self.directory} "
                f"went to another process of this job ({holder}), which the scheduler gave the "
                "rank to: this one writes nothing more there, whatever happens to the lock file "
                "(its saves are dropped), and ends once it hears its rank went away; stop it if "
                "it trains on"
            )
            _tell(line)
        return True

    # -- what is on disk ---------------------------------------------------------------------

    def discard_newer(self, step: int, put_back: int | None = None) -> None:
        """Remove this rank's checkpoints newer than `step` and report what is left: after a
        rollback to `step` they belong to the abandoned run, and must not be named as a rollback
        step again before this rank's next save replaces them.

        `put_back` (in a job): the generation whose rollback step `step` is, put back now: once
        the newer steps are gone, and only then, this worker's reports say it
        (`runtime.resumed_in`), so the scheduler counts no list of the abandoned run's steps for
        that generation (`RollbackPlanner.holdings`); a `TrainingLoop` says which. None (the
        default: a rollback by hand) is the job's current generation when `step` is at or before
        its rollback step (`cluster.get_rollback_step()`), else none, as 0 is. The report is
        made, with nothing removed too, when the scheduler's reports so far say another
        generation than this worker reports from now. Nothing once the rank's files went to
        another process of the job (`_displaced`)."""
        self._begin()
        self._writes.writer.wait()
        # The reports under way go first, each saying the generation its list was taken in.
        self._writes.reporter.wait()
        if self._displaced():
            return
        removed = False
        for newer in self._disk.files():
            if newer > step:
                self._disk.remove(newer)
                removed = True
        if put_back is None and runtime.is_initialized():
            topology = runtime.topology()
            put_back = put_back_by_discarding(step, topology.generation, topology.rollback_step)
        if put_back:
            runtime.resumed_in(put_back)
        if removed or self._writes.told_another_generation():
            self._writes.report_now()

    def steps(self) -> list[int]:
        """The steps of this rank's complete checkpoints, ascending, once the saves made so far
        are written (a cheap check of each file: its preamble, size and footer; `load`
        verifies the checksum)."""
        self._begin()
        self._writes.writer.wait()
        return self._disk.complete_steps()

    def load(self, step: int) -> dict[str, Any]:
        """The state saved at `step`, read from its file and verified (after the saves made so
        far are written); CheckpointError when it is missing, torn or corrupt.

        In a job with recovery on, a file that is missing here (a spare that took this rank, a
        worker restarted on another host) is fetched from a live peer first (see `fetch`). A
        file that is damaged (its checksum, step or rank is wrong, or it is cut short) is moved
        aside to `<name>.damaged`, kept for a look but no longer listed or reported (the held
        steps are reported again), and then fetched as a missing one; without peers, the
        CheckpointError names it and where it went."""
        self._begin()
        self._writes.writer.wait()
        path = self.path(step)
        if not path.exists():
            if self._serve_peers():
                return self._fetch(step).state
            raise CheckpointError(
                f"there is no checkpoint of step {step} ({path}): rank {self.rank} holds steps "
                f"{self._disk.complete_steps()}"
            )
        try:
            # Replicas: a peer's file, fetched as this rank's, will do.
            rank = None if self.config.replicated else self.rank
            return checkpoint_files.read(path, step, rank=rank)
        except CorruptCheckpointError as exc:
            return self._replace_damaged(step, path, exc)

    def _replace_damaged(self, step: int, path: Path, damage: CheckpointError) -> dict[str, Any]:
        """`path` is damaged: move it aside, report what is held, and fetch `step` from a live
        peer; CheckpointError naming the file when there is none."""
        aside = path.with_name(path.name + DAMAGED)
        try:
            os.replace(path, aside)
            atomic.fsync_directory(path.parent)
        except OSError as exc:
            raise CheckpointError(
                f"{damage}; it cannot be moved aside to {aside.name} ({exc.strerror}): remove "
                "it by hand, or the rank reports it as held again"
            ) from None
        self._writes.report_now()
        moved = f"{damage}; it is moved aside to {aside.name}, kept for a look"
        if not self._serve_peers():
            raise CheckpointError(moved) from None
        runtime.session().say(f"{moved}; fetching step {step} from a live peer")
        try:
            return self._fetch(step).state
        except CheckpointError as exc:
            said = f"{moved}; no live peer gave step {step} either: {exc}"
            if isinstance(exc, NoPeerStateError):  # kept as such: a peer may have failed
                raise NoPeerStateError(exc.failures, said) from None
            raise CheckpointError(said) from None

    def fetch(self, step: int) -> Path:
        """Get this rank's checkpoint of `step` from a live peer of the job, verify it and
        store it as this rank's file (replacing one held here); its path.

        With `CheckpointConfig(replicated=True)` any live rank's state of `step` will do; with
        False, only this rank's own files (a peer that can read them: on its disk, or on
        storage shared with the rank's last holder). A peer that fails mid-transfer, or whose
        bytes do not verify, is left for the next; nothing half-written is left. Needs a job
        with recovery on; CheckpointError naming the rank, the step and the places looked at
        when no peer has it."""
        self._begin()
        self._writes.writer.wait()
        self._need_peers(step)
        self._fetch(step)
        return self.path(step)

    def fetch_state(self, step: int) -> dict[str, Any]:
        """The state of `step` from a live peer, verified as `fetch` verifies it, but not kept:
        nothing is stored as this rank's checkpoint, and nothing is reported.

        For a step between saving steps that the job resumes from its workers' memory
        (`TrainingLoop`): the other ranks hold it in memory only, and a file of it here would be
        reported as a step this rank alone holds, where the rollback step is the newest step
        every rank holds. The bytes pass through a temporary file beside the step's path,
        removed before this returns (after a kill, by this rank's next checkpoint write). Needs
        a job with recovery on; CheckpointError as `fetch`."""
        self._begin()
        self._writes.writer.wait()
        self._need_peers(step)
        return self._fetch(step, store=False).state

    def _need_peers(self, step: int) -> None:
        if not self._serve_peers():
            raise CheckpointError(
                f"cannot fetch the checkpoint of step {step} from peers: that needs "
                "cluster.init() in a job with recovery on (MS_ENABLE_RECOVERY=1)"
            )

    def _serve_peers(self) -> bool:
        """Whether peers are in play (a job with recovery on). The first time they are, this
        manager's checkpoints are offered to them: at once for a manager made in the job, when
        it is connected for one made before `cluster.init()` (`connect`), again at the next
        save or served step after `close`."""
        if not (self.recovery and runtime.is_initialized()):
            return False
        if not self._offered:
            from cluster.api import peer_state  # noqa: PLC0415 - imports grpc, in a job only

            self._offered = True
            peer_state.serve(self.served)
        return True

    def _fetch(self, step: int, *, store: bool = True) -> Fetched:
        """`step` from a live peer, stored as this rank's file and reported (`store`), or only
        read."""
        from cluster.api import peer_state  # noqa: PLC0415 - imports grpc, in a job only

        start = time.perf_counter()
        fetched = peer_state.fetch(
            self.served, step, self.path(step), replicated=self.config.replicated, store=store
        )
        kept = "" if store else " (the state only: not stored as a checkpoint of this rank)"
        runtime.session().say(
            f"fetched the checkpoint of step {step} ({fetched.nbytes} bytes) from "
            f"{fetched.holder} in {time.perf_counter() - start:.2f} s{kept}"
        )
        if store:
            self._writes.report_now()
        return fetched

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint that loads, as (step, state); None when there is none.

        A corrupt checkpoint is skipped with a warning naming the file, never loaded.
        """
        self._begin()
        self._writes.writer.wait()
        for step in sorted(self._disk.files(), reverse=True):
            try:
                return step, self.load(step)
            except CheckpointError as exc:
                _log.warning("skipping a checkpoint: %s", exc)
        return None


# The managers of this process: their writers' threads end at cluster.finalize().
_managers: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _end_writers() -> None:
    """At cluster.finalize(), once every write and report was waited for: end each manager's
    writer and reporter threads, so that none outlives the job (a later save starts another)."""
    for manager in list(_managers):
        manager._writes.writer.close()
        manager._writes.reporter.close()


def _check_step(step: int, *, least: int = 1) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < least:
        raise CheckpointError(
            f"step={step!r} is invalid: a step is the number of completed training steps, an "
            f"integer >= {least}"
        )
    return step


def _seat(rank: int) -> Seat | None:
    """This process's seat in its job (`checkpoint_lock.Seat`) when the scheduler gave it
    `rank`; None outside a job, and for the files of another rank (given as `rank=`)."""
    if not runtime.is_initialized():
        return None
    current = runtime.session()
    topology = current.topology
    if topology is None or topology.rank != rank or not current.agent.cluster_id:
        return None
    identity = current.identity
    return Seat(
        current.agent.cluster_id, identity.node_id, identity.incarnation, topology.generation
    )


def _say() -> Callable[[str], None] | None:
    """The worker's own lines (`cluster[rank r]: ...`) in a job; None outside one (the log)."""
    return runtime.session().say if runtime.is_initialized() else None


def _tell(line: str) -> None:
    """Say `line` as the worker's own in a job, else log it as a warning."""
    say = _say()
    if say is not None:
        say(line)
    else:
        _log.warning("%s", line)


def _recovery_of(given: bool | None, config: CheckpointConfig) -> bool:
    """Whether recovery is on for a manager given `recovery=given`: in a job, the job's, as it
    was launched (`cluster.init()`'s config: MS_ENABLE_RECOVERY with MS_RECOVERY_PATH), which
    `given` may not contradict (ConfigError); before `cluster.init()`, `given`, else
    MS_ENABLE_RECOVERY (taken again from the job when connected). With recovery on,
    `config` must keep at least 2 checkpoints."""
    if runtime.is_initialized():
        on = runtime.session().config.recovery is not None
        if given is not None and given != on:
            raise _recovery_contradicted(given)
    else:
        on = parse_bool("MS_ENABLE_RECOVERY", os.environ.get("MS_ENABLE_RECOVERY", "0"))
        on = on if given is None else given
    if on and config.keep_checkpoint_max < 2:
        raise ConfigError(
            f"CheckpointConfig keep_checkpoint_max={config.keep_checkpoint_max} is too small "
            "with recovery on: it must be >= 2, because the newest step every rank holds, "
            "where the job rolls back to, is often older than this rank's newest"
        )
    return on


def _recovery_contradicted(given: bool) -> ConfigError:
    """A manager's `recovery=given` in a job that runs otherwise."""
    if given:
        job = (
            "runs without recovery (MS_ENABLE_RECOVERY is off): a failed worker ends it, "
            "whatever a manager keeps"
        )
        fix = (
            "launch the job with MS_ENABLE_RECOVERY=1 and MS_RECOVERY_PATH (mscluster run "
            "--enable-recovery)"
        )
    else:
        job = (
            "runs with recovery (MS_ENABLE_RECOVERY=1): it rolls back to what this manager "
            "would not keep (the state of step 0, steps for peers, enough checkpoints)"
        )
        fix = "launch the job without MS_ENABLE_RECOVERY"
    return ConfigError(
        f"CheckpointManager(recovery={given}) contradicts this job, which {job}. Recovery is "
        f"the job's, set where it is launched: leave recovery= out (it is for a manager used "
        f"outside a job), or {fix}"
    )
