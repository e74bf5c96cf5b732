"""Processes started by `mscluster run` end when the launcher does, even when it is SIGKILLed.

The launcher sets CLUSTER_LAUNCHER_PID in every child's environment. A child whose parent is
that launcher watches it from a daemon thread; when the launcher is gone (the child has been
re-parented), the child ends itself: a worker's session raises a JobFailedError in its main
thread (see `ending`); the scheduler, whose main thread runs its event loop, gets the SIGTERM the
launcher would have sent. Either way with a hard exit if that did not end it within a grace.
Processes not started by the launcher are unaffected.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

from cluster.protocol.errors import ClusterError, JobFailedError
from cluster.protocol.parse import is_decimal

ENV = "CLUSTER_LAUNCHER_PID"
CHECK_EVERY_S = 0.5
GRACE_S = 5.0
EXIT_CODE = 1


def _watch(launcher_pid: int, stop: threading.Event, end: Callable[[ClusterError], None]) -> None:
    while not stop.wait(CHECK_EVERY_S):
        if os.getppid() != launcher_pid:
            end(JobFailedError(f"the launcher (pid {launcher_pid}) is gone; stopping this process"))
            return


def terminate(error: ClusterError) -> None:
    """What the launcher would have done: SIGTERM to this process (a server stops on it), and
    the hard exit if that did not end it within GRACE_S."""
    print(f"cluster: {error}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(GRACE_S)
    os._exit(EXIT_CODE)


def watch_launcher(
    end: Callable[[ClusterError], None] = terminate,
) -> threading.Event | None:
    """Start watching the launcher named in the environment, calling `end` with the error
    once it is gone; set the returned event to stop."""
    value = os.environ.get(ENV, "")
    if not is_decimal(value) or int(value) != os.getppid():
        return None
    stop = threading.Event()
    threading.Thread(
        target=_watch, args=(int(value), stop, end), name="cluster-launcher-watch", daemon=True
    ).start()
    return stop
