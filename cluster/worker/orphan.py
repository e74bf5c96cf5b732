"""Processes started by `mscluster run` end when the launcher does, even when it is SIGKILLed.

The launcher sets CLUSTER_LAUNCHER_PID in every child's environment. A child whose parent is
that launcher watches it from a daemon thread; when the launcher is gone (the child has been
re-parented), the child ends itself. A child that begins to watch after the launcher died (it
was re-parented while still importing its framework, before init()) ends at once: the launcher
is gone when no process has its pid, or the one that has it is a zombie or started after this
process did (the pid reused: the launcher ran before any of its children). A process whose
parent is not the launcher while the launcher runs (a grandchild) is not watched.

Ending: a worker's session raises a JobFailedError in its main thread (see `ending`); the
scheduler, whose main thread runs its event loop, gets the SIGTERM the launcher would have
sent. Either way with a hard exit if that did not end it within a grace. Processes not started
by the launcher are unaffected.
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
    while os.getppid() == launcher_pid:
        if stop.wait(CHECK_EVERY_S):
            return
    end(JobFailedError(f"the launcher (pid {launcher_pid}) is gone; stopping this process"))


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (the state first, then the parent
    pid); None when it cannot be read (no such process). The one reader of that file."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def launcher_gone(launcher_pid: int) -> bool:
    """Whether the launcher that started this process (or its parent) has exited: no process
    has its pid, or the one that has it is a zombie or started after this process did (its
    start time in clock ticks since boot, field 22 of /proc/PID/stat). Without /proc, whether a
    process has its pid."""
    own = proc_stat("self")
    if own is None:
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False  # another user's process: not ours to judge
        return False
    other = proc_stat(launcher_pid)
    if other is None or other[0] in ("Z", "X"):
        return True
    return int(other[19]) > int(own[19])


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
    """Start watching the launcher named in the environment, calling `end` (from the watching
    thread) with the error once it is gone, at once when it is gone already; set the returned
    event to stop. None: nothing to watch (no launcher, or it runs and is not the parent)."""
    value = os.environ.get(ENV, "")
    if not is_decimal(value):
        return None
    launcher_pid = int(value)
    if launcher_pid != os.getppid() and not launcher_gone(launcher_pid):
        return None  # a grandchild of a running launcher: its parent is watched
    stop = threading.Event()
    threading.Thread(
        target=_watch, args=(launcher_pid, stop, end), name="cluster-launcher-watch", daemon=True
    ).start()
    return stop
