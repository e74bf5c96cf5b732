"""Real processes for tests: start a job's processes, wait on what they print, never orphan.

Every wait here is bounded and polls an observable (a process's exit, a line in its output);
none sleeps to synchronize.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
POLL_S = 0.02


def free_port() -> int:
    """A port free right now, for MS_SCHED_PORT (the launch contract fixes it in advance)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)  # sleep-ok: polls an observable, bounded by timeout_s


def job_env(worker_num: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    env.update(
        MS_WORKER_NUM=str(worker_num),
        MS_SCHED_HOST="127.0.0.1",
        MS_SCHED_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def private_copy(tmp_path: Path, source: Path = ROOT / "examples" / "allgather_check.py") -> Path:
    """The script under a path unique to this test, to find every process of the job by it."""
    target = tmp_path / "job" / source.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)
    return target


def processes_running(marker: str) -> list[int]:
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


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {timeout_s} s; its output:\n{self.output}"
            ) from None

    def wait_for_output(self, text: str, timeout_s: float) -> None:
        wait_until(lambda: text in self.output, timeout_s, f"{text!r} in {self.name}'s output")


@dataclass
class Procs:
    """Processes started by one test; all are killed when the test ends."""

    tmp: Path
    started: list[Proc] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: Mapping[str, str], cwd: Path = ROOT) -> Proc:
        log = self.tmp / f"{name}.log"
        handle = log.open("wb")
        popen = subprocess.Popen(
            args,
            env=dict(env),
            cwd=cwd,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        handle.close()
        proc = Proc(name, popen, log)
        self.started.append(proc)
        return proc

    def start_role(self, name: str, role: str, script: list[str], env: Mapping[str, str]) -> Proc:
        return self.start(name, [PYTHON, *script], {**env, "MS_ROLE": role})

    def kill_all(self) -> None:
        for proc in self.started:
            if proc.popen.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.popen.wait(10)


@contextmanager
def procs(tmp: Path) -> Iterator[Procs]:
    group = Procs(tmp)
    try:
        yield group
    finally:
        group.kill_all()
