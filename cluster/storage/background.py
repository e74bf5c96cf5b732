"""A background writer: jobs run one at a time, in order, on a thread that exists only while
there is work.

The thread is started by the first job and ends when the queue is empty, so an idle writer
leaves no thread behind, and it is not a daemon: a program that returns from its last `save`
and exits still gets that checkpoint on disk (the interpreter waits for the thread before it
runs its exit handlers). A job's error is kept, and raised by the next `submit` or `flush`, in
the caller's thread; later jobs still run (each writes its own file).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

_log = logging.getLogger(__name__)
_WAIT_WARNING_S = 30.0


class BackgroundWriter:
    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: deque[Callable[[], None]] = deque()
        self._changed = threading.Condition()
        self._running = False  # a thread is running jobs (or about to)
        self._error: BaseException | None = None
        self.done = 0  # jobs finished without an error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; first raise the error of an earlier job, if one failed."""
        with self._changed:
            self._raise_kept()
            self._jobs.append(job)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name=self._name).start()

    def flush(self) -> None:
        """Wait until every job submitted has run; raise the error of one that failed."""
        with self._changed:
            self._wait_idle()
            self._raise_kept()

    def wait(self) -> None:
        """Wait until every job submitted has run, without raising (the error is kept)."""
        with self._changed:
            self._wait_idle()

    @property
    def busy(self) -> bool:
        with self._changed:
            return self._running

    def _wait_idle(self) -> None:
        start = time.monotonic()
        while self._running:
            if not self._changed.wait(_WAIT_WARNING_S):
                _log.warning(
                    "%s: still writing after %.0f s (a slow or stuck disk?)",
                    self._name,
                    time.monotonic() - start,
                )

    def _raise_kept(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            with self._changed:
                if not self._jobs:
                    self._running = False
                    self._changed.notify_all()
                    return
                job = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # kept for the caller's thread, never lost here
                with self._changed:
                    if self._error is None:
                        self._error = exc
                    else:
                        _log.warning("%s: a later job failed too: %s", self._name, exc)
            else:
                with self._changed:
                    self.done += 1
