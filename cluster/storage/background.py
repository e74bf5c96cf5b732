"""A background writer: jobs run one at a time, in order, on one thread of their own.

The thread is a `concurrent.futures.ThreadPoolExecutor` worker: started by the first job and
reused (starting a thread per save would cost the loop most of a millisecond), gone when the
writer is closed or dropped, and waited for at interpreter exit after it has run every job
queued, so a program that returns from its last `save` and exits still gets that checkpoint on
disk. A job's error is logged (ERROR) when it happens, kept, and raised by the next `submit` or
`flush` in the caller's thread; later jobs still run (each writes its own file). `flush_all`
waits for every writer and raises an error none of them raised yet, even one of a writer already
dropped: `cluster.finalize()` (and the finalize at exit) ends a process whose last write failed
as a failure, not as a success.
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
    """Wait until every writer's jobs have run; raise the oldest error not raised yet. The
    others are dropped (each was logged when it happened)."""
    with _registry_lock:
        writers = [*_writers, *_kept]
    for writer in writers:
        writer.wait()
    with _registry_lock:
        errors = list(_kept.values())
        _kept.clear()
    if errors:
        raise errors[0]


class BackgroundWriter:
    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: concurrent.futures.Future[None] | None = None
        self.done = 0  # jobs finished without an error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; first raise the error of an earlier job, if one failed."""
        with self._lock:
            self._raise_kept()
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, self._name)
                with _registry_lock:
                    _writers.add(self)
            self._last = self._executor.submit(self._run, job)

    def flush(self) -> None:
        """Wait until every job submitted has run; raise the error of one that failed."""
        self.wait()
        with self._lock:
            self._raise_kept()

    def wait(self) -> None:
        """Wait until every job submitted has run, without raising (the error is kept)."""
        last = self._last
        if last is None:
            return
        start = time.monotonic()
        while not concurrent.futures.wait([last], WAIT_WARNING_S).done:
            _log.warning(
                "%s: still writing after %.0f s (a slow or stuck disk?)",
                self._name,
                time.monotonic() - start,
            )

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
