"""Processes started by `mscluster run` end when the launcher does, even when it is SIGKILLed.

The launcher sets CLUSTER_LAUNCHER_PID in every child's environment. A child whose parent is
that launcher watches it from a daemon thread; when the launcher is gone (the child has been
re-parented), the child does what the launcher would have done: SIGTERM to itself, and a hard
exit if that did not end it. Processes not started by the launcher are unaffected.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from cluster.protocol.config import is_decimal

ENV = "CLUSTER_LAUNCHER_PID"
CHECK_EVERY_S = 0.5
GRACE_S = 5.0
EXIT_CODE = 1


def _watch(launcher_pid: int, stop: threading.Event) -> None:
    while not stop.wait(CHECK_EVERY_S):
        if os.getppid() != launcher_pid:
            print(
                f"cluster: the launcher (pid {launcher_pid}) is gone; stopping this process",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGTERM)
            if not stop.wait(GRACE_S):
                os._exit(EXIT_CODE)
            return


def watch_launcher() -> threading.Event | None:
    """Start watching the launcher named in the environment; set the returned event to stop."""
    value = os.environ.get(ENV, "")
    if not is_decimal(value) or int(value) != os.getppid():
        return None
    stop = threading.Event()
    threading.Thread(
        target=_watch, args=(int(value), stop), name="cluster-launcher-watch", daemon=True
    ).start()
    return stop
