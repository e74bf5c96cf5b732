"""What the servers share: child processes in their own session with their output in a log file,
free loopback ports, bounded waits that give up early when the server dies, and a loopback HTTP
client that never goes through a proxy.

Every wait polls an observable (a process's exit, an HTTP answer, a command's output) until a
deadline; none sleeps to synchronize.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack, suppress
from pathlib import Path

POLL_S = 0.05
TAIL_LINES = 60
STOP_TIMEOUT_S = 5.0
REAP_TIMEOUT_S = 10.0

# Loopback only, whatever http_proxy says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(AssertionError):
    """A test server did not start, or did not do what a helper waited for; the message carries
    the tails of its logs. An AssertionError, so that pytest shows it as a test failure."""


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free right now, for servers that cannot bind port 0 and
    report it (etcd, Prometheus, Slurm). Another process may take one before the server binds
    it: the servers' `start` retries with fresh ports when a bind fails."""
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def tail(path: Path, lines: int = TAIL_LINES, offset: int = 0) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    kept = text.splitlines()[-lines:]
    return "\n".join(kept) if kept else "(empty)"


class ServerProcess:
    """One daemon run in the foreground as a child in its own session (its pid is its process
    group), stdout and stderr appended to `log`; it can be started again after it stopped."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.args = args
        self.log = log
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None
        self.log_offset = 0  # where the latest start's output begins

    def start(self) -> None:
        if self.running:
            raise ServerError(f"{self.name} is already running (pid {self.pid})")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"--- {self.name}: {' '.join(self.args)}\n".encode())
            out.flush()
            self.log_offset = out.tell()
            self.popen = subprocess.Popen(
                self.args,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise ServerError(f"{self.name} was never started")
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def output(self) -> str:
        """What the latest start of this process wrote."""
        try:
            with self.log.open("rb") as handle:
                handle.seek(self.log_offset)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = TAIL_LINES) -> str:
        return tail(self.log, lines, self.log_offset)

    def signal_group(self, signum: int) -> None:
        if self.popen is not None:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signum)

    def kill(self) -> None:
        """SIGKILL to the whole process group; returns once the process is reaped."""
        if self.popen is None:
            return
        self.signal_group(signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.popen.wait(REAP_TIMEOUT_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the process group, SIGKILL if it has not exited within `timeout_s`; the
        group gets a SIGKILL either way, so that no child of the daemon outlives it."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout_s)
        self.kill()

    def describe(self) -> str:
        state = "running" if self.running else f"exited with {self.returncode}"
        return f"--- {self.name} ({state}), {self.log}:\n{self.tail()}"


def wait_for(
    check: Callable[[], bool],
    timeout_s: float,
    what: str,
    processes: Iterable[ServerProcess] = (),
) -> None:
    """Poll `check` until it holds. Raises ServerError, with the processes' log tails, after
    `timeout_s` or as soon as one of `processes` has exited."""
    watched = list(processes)
    deadline = time.monotonic() + timeout_s
    while not check():
        dead = [p for p in watched if not p.running]
        if dead:
            raise ServerError(
                f"{dead[0].name} exited (code {dead[0].returncode}) while waiting for {what}\n"
                + "\n".join(p.describe() for p in watched)
            )
        if time.monotonic() > deadline:
            raise ServerError(
                f"timed out after {timeout_s:g} s waiting for {what}\n"
                + "\n".join(p.describe() for p in watched)
            )
        time.sleep(POLL_S)  # sleep-ok: polls an observable, bounded by timeout_s


def bind_failed(process: ServerProcess) -> bool:
    """Whether `process` exited because its port was taken (a race with free_ports)."""
    text = process.output().lower()
    return not process.running and "address already in use" in text


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes] | None:
    """(status, body) of a loopback GET, or None when nothing answers."""
    try:
        with _OPENER.open(url, timeout=timeout_s) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (OSError, TimeoutError):
        return None


def http_post(url: str, timeout_s: float = 10.0) -> tuple[int, bytes] | None:
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (OSError, TimeoutError):
        return None


def pids_with_env(entry: str) -> list[int]:
    """Processes whose environment holds `entry` (e.g. `SLURM_CONF=/tmp/x/slurm.conf`): how the
    processes a daemon started outside its own process group are found (slurmstepd and the
    tasks it runs start sessions of their own)."""
    needle = entry.encode() + b"\0"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ or environ.endswith(needle[:-1]):
            found.append(int(proc.name))
    return found


def stop_all(processes: Iterable[ServerProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop several processes at once: SIGTERM to every group, a shared bounded wait, then
    SIGKILL to every group (see ServerProcess.stop)."""
    started = [p for p in processes if p.popen is not None]
    for process in started:
        if process.running:
            process.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in started:
        if process.popen is not None:
            with suppress(subprocess.TimeoutExpired):
                process.popen.wait(max(0.0, deadline - time.monotonic()))
    for process in started:
        process.kill()
