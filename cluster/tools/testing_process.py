"""One process of a test job (`Process`), and the bounded waits and probes every action uses.

`Process` starts a command in a session of its own with its output appended to its log, and
answers how it runs: its exit, its output, whether it is stopped, its CPU time. `wait_until`
polls a predicate with a bound, never for a fixed time; `accepts` tells whether a unix socket
takes connections. `LocalJob` (`cluster.tools.testing`) is made of these; they are public there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from cluster.protocol.errors import JobTimeoutError
from cluster.tools.processes import signal_group
from cluster.worker import identity
from cluster.worker.orphan import proc_stat

POLL_S = 0.02


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now, for MS_SCHED_PORT (the launch contract fixes it in
    advance; another process may still take it before the scheduler binds it)."""
    return identity.free_port(host)


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, *, poll_s: float = POLL_S
) -> None:
    """Poll `predicate` every `poll_s` until it holds; JobTimeoutError naming `what` after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise JobTimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


class Process:
    """One process of the job: its Popen, its log, and its start time."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        log: Path,
        *,
        cwd: Path | None = None,
    ) -> None:
        """Start `args` in a session of its own (so its group can be killed), its output
        appended to `log`."""
        self.name = name
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                args,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def exit_line(self) -> str:
        """How it ended, in one line: its exit code and the last line of its output (a
        traceback's is the error)."""
        last = self.output.strip().splitlines()[-1:] or ["(no output)"]
        return f"{self.name} exited {self.popen.returncode}: {last[0]}"

    def wait(self, timeout_s: float) -> int:
        """Its exit code; JobTimeoutError with its output when it runs past `timeout_s`."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise JobTimeoutError(
                f"{self.name} did not exit within {timeout_s:g} s; its output:\n{self.output}"
            ) from None

    def wait_for_output(self, text: str, timeout_s: float) -> None:
        """Until `text` is in its output; JobTimeoutError after `timeout_s`."""
        wait_until(lambda: text in self.output, timeout_s, f"{text!r} in {self.name}'s output")

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def stopped(self) -> bool:
        """True while the process is stopped (SIGSTOP), from /proc."""
        fields = proc_stat(self.pid)
        return fields is not None and fields[0] == "T"

    def cpu_s(self) -> float:
        """The user and system CPU seconds it has used so far (OSError once it is gone)."""
        return cpu_seconds(self.pid)

    def kill_group(self) -> None:
        """SIGKILL its process group, whether it still runs or not (what it started stays in
        its group: a helper it left behind), and reap it."""
        reaped = self.popen.poll() is not None
        signal_group(self.pid, signal.SIGKILL, leader_reaped=reaped)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


def cpu_seconds(pid: int) -> float:
    """The user and system CPU seconds process `pid` has used so far, from /proc (OSError once
    it is gone)."""
    fields = proc_stat(pid)
    if fields is None:
        raise ProcessLookupError(f"no process {pid}")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def accepts(path: Path) -> bool:
    """Whether something takes connections on the unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True
