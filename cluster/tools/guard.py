"""A job's guard: its processes end when the process that owns the job is gone, however.

The owner is `mscluster run` (`launch_children.Children`) or a `LocalJob` (`testing`). The job's
processes watch their owner themselves (CLUSTER_LAUNCHER_PID, `cluster.worker.orphan`) and end
when it is gone; a process that is stopped (SIGSTOP: a chaos fault, an operator's Ctrl-Z, a
debugger) cannot, and one may ignore what it is told. The guard, a small process that the owner
starts in a session of its own (`start`), reads the job's process groups from a pipe whose
other end the owner alone holds: a line `PGID START` each (`note`), the leader's start time
(field 22 of /proc/PID/stat) telling its group from a later one with the same number. When the
pipe ends (the owner exited, even SIGKILLed, or `close`d it), it SIGKILLs at once each group
with a stopped process, gives the others GRACE_S to end by themselves, SIGKILLs what is left,
and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import IO

from cluster.tools.processes import group_states
from cluster.worker import orphan

# How long the job's processes get to end by themselves once the owner is gone: the time to
# notice it, and the grace that their own ending takes.
GRACE_S = orphan.CHECK_EVERY_S + orphan.GRACE_S + 1.0
LOOK_S = 0.05
# A leader whose start time could not be read (it was gone already).
UNKNOWN = "-"


def start(python: str = sys.executable) -> subprocess.Popen[bytes]:
    """The guard of a job this process owns; `note` each process the job starts to it."""
    return subprocess.Popen(
        [python, "-m", "cluster.tools.guard"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # neither a Ctrl-C to the owner's terminal nor its group's end
    )


def note(guard: subprocess.Popen[bytes] | None, pid: int) -> None:
    """Tell `guard` of a process started in a session of its own (its group's number is its
    pid); a guard that is gone is no error."""
    if guard is None or guard.stdin is None:
        return
    stat = orphan.proc_stat(pid)
    started = UNKNOWN if stat is None else stat[19]
    with contextlib.suppress(OSError, ValueError):
        guard.stdin.write(f"{pid} {started}\n".encode())
        guard.stdin.flush()


def close(guard: subprocess.Popen[bytes]) -> None:
    """Close the guard's pipe once the owner ended the job itself: the guard ends what is left
    of it, and exits (killed if it has not within its bound). Blocks up to GRACE_S + 15 s."""
    if guard.stdin is not None:
        with contextlib.suppress(OSError):
            guard.stdin.close()
    try:
        guard.wait(GRACE_S + 5.0)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait(10)


def main() -> int:
    groups = read_groups(sys.stdin.buffer)
    end(groups)
    return 0


def read_groups(source: IO[bytes]) -> dict[int, str]:
    """Each group noted until the pipe ends: its number, and its leader's start time."""
    groups = {}
    for line in source:
        pgid, _, started = line.decode(errors="replace").strip().partition(" ")
        if pgid.isdigit() and started:
            groups[int(pgid)] = started
    return groups


def end(groups: dict[int, str]) -> None:
    """End every process of `groups`: a stopped one's group at once, the rest after GRACE_S."""
    deadline = time.monotonic() + GRACE_S
    while True:
        running = group_states(ours(groups))
        if not running:
            return
        late = time.monotonic() >= deadline
        for pgid, states in running.items():
            if late or any(state in "Tt" for state in states):  # stopped: it cannot end itself
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        if late:
            return
        time.sleep(LOOK_S)


def ours(groups: dict[int, str]) -> list[int]:
    """The groups that are still the job's: those whose leader runs (the same start time), or
    whose number no process has (no group can take a number that one still uses)."""
    found = []
    for pgid, started in groups.items():
        stat = orphan.proc_stat(pgid)
        if stat is None or stat[19] == started:
            found.append(pgid)
    return found


if __name__ == "__main__":
    sys.exit(main())
