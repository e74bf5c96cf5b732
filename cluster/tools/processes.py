"""The processes a tool started, found through what started them (Linux's /proc): for the tools,
tests and benchmarks that signal one process of a job.

A process to signal is found through the process that started it, never by its name on the
whole machine (another job may run the same script with the same node ids):

- `launched_pid(log_dir, name)`: `mscluster run` writes the pid of each process it started to
  `<log-dir>/pids` (`PIDS_FILE`); this reads one and checks that it is still that launcher's
  child (a pid that exited, or was given to someone else since, is None);
- `descendants(root)` and `worker_pid(root, node_id)`: the processes below `root` (a launcher,
  an `sbatch` or a shell the caller started), the worker of a node among them only;
- `signal_group(pgid, ...)`, `groups_running(pgids)` and `group_states(pgids)`: a process
  started in a session of its own and what it started, which stays in its group after it
  exited (a worker's helper), to stop them all at the end.

`processes_running(marker)` scans the whole machine, for checks that nothing of a job is left
(a process that escaped its parent is no one's descendant): give it a marker of this run only
(the private copy of a script in a temporary directory), and never signal what it finds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from pathlib import Path

from cluster.worker.orphan import proc_stat

# The launcher's list of what it started: one `<name> <pid>` line each (`launcher` itself,
# `scheduler`, `relay`, and each worker and spare by its log's name: `worker_<rank or index>`,
# `spare_<its node id less spare->`), the newest incarnation of each.
PIDS_FILE = "pids"


def parent_of(pid: int) -> int | None:
    """The parent of live process `pid` (not a zombie), or None."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] in "ZX" else int(stat[1])


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    return parent_of(pid) is not None


def group_states(pgids: Collection[int]) -> dict[int, list[str]]:
    """The states (/proc's letters: R, S, T for stopped, ...) of the live processes (not
    zombies) of each of process groups `pgids` that has any: one look."""
    wanted = {str(pgid) for pgid in pgids}
    found: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(entry.name)
            if stat is not None and stat[0] not in "ZX" and stat[2] in wanted:
                found.setdefault(int(stat[2]), []).append(stat[0])
    return found


def groups_running(pgids: Collection[int]) -> set[int]:
    """Those of process groups `pgids` that a live process (not a zombie) is in: one look."""
    return set(group_states(pgids))


def group_is_ours(pgid: int, *, leader_reaped: bool) -> bool:
    """Whether process group `pgid` can still be that of a process this tool started in a
    session of its own (its pid is the group's): while that leader runs, and once it was reaped
    (`leader_reaped`) while no process has its pid, since one that has it was given the number
    since and the group is empty (the kernel gives out no number a group still uses)."""
    return not leader_reaped or proc_stat(pgid) is None


def signal_group(pgid: int, signum: int, *, leader_reaped: bool) -> None:
    """Send `signum` to process group `pgid`, which a process this tool started leads (or led:
    what it started stays in its group when it exits), while it is ours (`group_is_ours`). An
    empty group is no error."""
    if group_is_ours(pgid, leader_reaped=leader_reaped):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)


def descendants(root: int) -> list[int]:
    """The live processes below `root` (children, their children, ...), in no set order."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        below = children.get(todo.pop(), [])
        found.extend(below)
        todo.extend(below)
    return found


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def worker_pid(root: int, node_id: str, marker: str = "") -> int | None:
    """The live worker process (`MS_ROLE=MS_WORKER`) of node `node_id` below `root` (the
    launcher or whatever else this caller started), whose command line holds `marker` (its
    script, say); None when there is none."""
    wanted = (f"MS_NODE_ID={node_id}\0".encode(), b"MS_ROLE=MS_WORKER\0")
    for pid in descendants(root):
        if marker in _cmdline(pid) and all(item in _environ(pid) for item in wanted):
            return pid
    return None


def launched_pids(log_dir: Path) -> dict[str, int]:
    """What `<log_dir>/pids` of `mscluster run` lists: name -> pid ({} without the file)."""
    try:
        text = (log_dir / PIDS_FILE).read_text()
    except OSError:
        return {}
    pids = {}
    for line in text.splitlines():
        name, _, pid = line.partition(" ")
        if pid.strip().isdigit():
            pids[name] = int(pid)
    return pids


def launched_pid(log_dir: Path, name: str) -> int | None:
    """The pid of the process `name` (`worker_2`, `scheduler`) that the launcher whose log
    directory is `log_dir` started, while it runs as that launcher's child; else None."""
    pids = launched_pids(log_dir)
    launcher, pid = pids.get("launcher"), pids.get(name)
    if launcher is None or pid is None or parent_of(pid) != launcher:
        return None
    return pid


def write_pids(log_dir: Path, pids: dict[str, int]) -> None:
    """Replace `<log_dir>/pids` with `pids` (the launcher's own first), at once (a reader sees
    the old list or the new one)."""
    lines = [f"launcher {os.getpid()}", *(f"{name} {pid}" for name, pid in pids.items())]
    path = log_dir / PIDS_FILE
    temporary = path.with_name(f".{PIDS_FILE}.{os.getpid()}.tmp")
    temporary.write_text("\n".join(lines) + "\n")
    os.replace(temporary, path)


def processes_running(marker: str) -> list[int]:
    """The live processes (not zombies) of the whole machine whose command line holds `marker`:
    to check that none of a run is left, with a marker of that run only. Never signal them."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and marker in _cmdline(int(entry.name)) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found
