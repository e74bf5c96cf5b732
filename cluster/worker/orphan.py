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

A process has one watch, however many jobs it joins: a worker's session points it at its own
ending while it is open (`watch_launcher`) and back at `terminate` when it closes (`unwatch`),
so that a program that finalized and went on still ends with its launcher, and the watch holds
nothing of the closed session.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from cluster.protocol.errors import ClusterError, JobFailedError
from cluster.protocol.parse import is_decimal

ENV = "CLUSTER_LAUNCHER_PID"
CHECK_EVERY_S = 0.5
GRACE_S = 5.0
EXIT_CODE = 1


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


Ender = Callable[[ClusterError], None]
_lock = threading.Lock()
# The process's one watch (None before the first), and whom it tells that the launcher is gone.
_thread: threading.Thread | None = None
_end: Ender = terminate


def _watch(launcher_pid: int) -> None:
    while os.getppid() == launcher_pid:
        time.sleep(CHECK_EVERY_S)
    with _lock:
        end = _end
    end(JobFailedError(f"the launcher (pid {launcher_pid}) is gone; stopping this process"))


def watch_launcher(end: Ender = terminate) -> bool:
    """Watch the launcher named in the environment, calling `end` (from the watching thread)
    with the error once it is gone, at once when it is gone already. One watch a process: a
    later call, while it runs, only makes `end` the one it tells. False: nothing to watch (no
    launcher, or it runs and is not the parent)."""
    global _thread, _end
    value = os.environ.get(ENV, "")
    if not is_decimal(value):
        return False
    launcher_pid = int(value)
    if launcher_pid != os.getppid() and not launcher_gone(launcher_pid):
        return False  # a grandchild of a running launcher: its parent is watched
    with _lock:
        _end = end
        if _thread is not None and _thread.is_alive():
            return True
        _thread = threading.Thread(
            target=_watch, args=(launcher_pid,), name="cluster-launcher-watch", daemon=True
        )
        _thread.start()
    return True


def unwatch(end: Ender) -> None:
    """`end` is not to be told any more (its session closed): the watch, which goes on, ends
    the process as the launcher would have (`terminate`) from now on."""
    global _end
    with _lock:
        if _end == end:
            _end = terminate
