"""The processes of this machine, found by what they run and by their environment (Linux's
/proc): for the tests and benchmarks that signal one process of a job."""

from __future__ import annotations

from pathlib import Path


def processes_running(marker: str) -> list[int]:
    """The live processes (not zombies) whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def worker_pid(marker: str, node_id: str) -> int | None:
    """The live worker process (`MS_ROLE=MS_WORKER`) of node `node_id` whose command line holds
    `marker` (its script, say); None when there is none."""
    wanted = (f"MS_NODE_ID={node_id}\0".encode(), b"MS_ROLE=MS_WORKER\0")
    for pid in processes_running(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if all(item in environ for item in wanted):
            return pid
    return None
