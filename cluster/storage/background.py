"""A background writer: jobs run one at a time, in order, on one thread of their own.

The thread is a `concurrent.futures.ThreadPoolExecutor` worker: started by the first job and
reused (starting a thread per save would cost the loop most of a millisecond), gone when the
writer is closed or dropped, and waited for at interpreter exit after it has run every job
queued, so a program that returns from its last `save` and exits still gets that checkpoint on
disk. A job's error is logged (ERROR) when it happens, kept, and raised by the next `submit`,
`flush` or `raise_failed` in the caller's thread; later jobs still run (each writes its own
file). A writer made `newest_only` runs the newest job only: one posted while an earlier one
waits to start replaces it (a report of what is held now makes an older one moot); a job
posted once the interpreter exits (its executors take none) runs in the poster's thread.
`flush_all` waits until every writer is done, with the jobs that one writer's jobs posted to
another, and raises an error none of them raised yet, even one of a writer already dropped:
`cluster.finalize()` (and the finalize at exit) ends a process whose last write failed as a
failure, not as a success.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable

_log = logging.getLogger(__name__)
# A wait longer than this is logged (and goes on): a disk that stopped answering is not silent.
WAIT_WARNING_S = 30.0

_registry_lock = threading.Lock()
# Every writer that was given a job, for `flush_all`.
_writers: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()
# The first error of each writer not raised yet, in the order they happened; it keeps its
# writer alive until it is raised.
_kept: dict[BackgroundWriter, BaseException] = {}


def flush_all() -> None:
    """Wait until every writer's jobs have run, those that a job posted to another writer
    (made meanwhile, maybe) included; raise the oldest error not raised yet. The others are
    dropped (each was logged when it happened)."""
    while True:
        with _registry_lock:
            busy = [w for w in [*_writers, *_kept] if not w.idle()]
        if not busy:
            break
        for writer in sorted(busy, key=lambda w: w.newest_only):  # the posting ones first
            writer.wait()
    with _registry_lock:
        errors = list(_kept.values())
        _kept.clear()
    if errors:
        raise errors[0]


class BackgroundWriter:
    """`name` names its thread and its log lines; `newest_only`: see the module; `doing` says
    what a wait that lasts waits for, in the warning that says so."""

    def __init__(
        self,
        name: str,
        *,
        newest_only: bool = False,
        doing: str = "writing (a slow or stuck disk?)",
    ) -> None:
        self._name = name
        self.newest_only = newest_only
        self._doing = doing
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: concurrent.futures.Future[None] | None = None
        # `newest_only`: the job of the run queued and not started yet, which a newer replaces.
        self._waiting: list[Callable[[], None]] | None = None
        self.done = 0  # jobs finished without an error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; first raise the error of an earlier job, if one failed."""
        with self._lock:
            self._raise_kept()
            queued = self._queue(job)
        if not queued:
            self._run_here(job)

    def post(self, job: Callable[[], None]) -> None:
        """Queue `job`, without raising the error of an earlier one (another writer's thread
        posts; the error is its caller's)."""
        with self._lock:
            queued = self._queue(job)
        if not queued:
            self._run_here(job)

    def _queue(self, job: Callable[[], None]) -> bool:
        """Whether `job` is queued; False once the interpreter exits (its executors take no
        job while they finish the jobs queued: one of those posts a report, say)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, self._name)
            with _registry_lock:
                _writers.add(self)
        if self._waiting is not None:
            self._waiting[0] = job  # the job queued before never runs
            return True
        cell = [job]
        try:
            if self.newest_only:
                self._last = self._executor.submit(self._run_newest, cell)
                self._waiting = cell
            else:
                self._last = self._executor.submit(self._run, job)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            return False
        return True

    def _run_here(self, job: Callable[[], None]) -> None:
        """At interpreter exit: run `job` in the caller's thread, after the jobs queued."""
        self.wait()
        self._run(job)

    def flush(self) -> None:
        """Wait until every job submitted has run; raise the error of one that failed."""
        self.wait()
        self.raise_failed()

    def raise_failed(self) -> None:
        """Raise the error of a job that failed, once."""
        with self._lock:
            self._raise_kept()

    def idle(self) -> bool:
        """Whether every job submitted has run."""
        last = self._last
        return last is None or last.done()

    def wait(self) -> None:
        """Wait until every job submitted has run, without raising (the error is kept)."""
        last = self._last
        if last is None:
            return
        start = time.monotonic()
        while not concurrent.futures.wait([last], WAIT_WARNING_S).done:
            elapsed = time.monotonic() - start
            _log.warning("%s: still %s after %.0f s", self._name, self._doing, elapsed)

    def close(self) -> None:
        """Wait for the jobs, and end the thread (a later `submit` starts another)."""
        self.wait()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _raise_kept(self) -> None:
        with _registry_lock:
            error = _kept.pop(self, None)
        if error is not None:
            raise error

    def _run_newest(self, cell: list[Callable[[], None]]) -> None:
        """Run the newest job posted to `cell` (from now on, a newer one is queued anew)."""
        with self._lock:
            if self._waiting is cell:
                self._waiting = None
            job = cell[0]
        self._run(job)

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # kept for the caller's thread, never lost here
            with _registry_lock:
                first = _kept.setdefault(self, exc) is exc
            if first:
                _log.error("%s: %s", self._name, exc)
            else:
                _log.error("%s: a later job failed too: %s", self._name, exc)
        else:
            with self._lock:
                self.done += 1
