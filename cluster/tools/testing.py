"""Test your training job under faults: start it locally, then kill, stop, restart its processes.

    from cluster.tools.testing import LocalJob

    with LocalJob("train.py", ["--steps", "100"], workers=4, node_timeout_s=3) as job:
        job.wait_formed()
        job.kill_worker(2)          # SIGKILL; returns once the scheduler has marked it failed
        job.restart_worker(2)       # same node id; returns once it is back (a new generation)
        job.kill_scheduler()
        job.restart_scheduler()     # returns once every worker is back
        assert job.wait() == 0      # every process exited 0

Network faults (as root, with iproute2): `LocalJob(..., network=NetworkLab(workers))` starts each
worker in its own network namespace, joined to this host by a veth pair, with the scheduler on an
address of this host; `job.partition(i)` cuts worker i's link (link down), `job.heal(i)` brings
it back, `job.impair(i, delay_ms=..., loss_percent=...)` adds delay and loss (tc netem). The
namespaces, links and address are always removed.

Every action waits for what it should cause to be visible (the node marked failed, the new
generation, the nodes back), with a bound, never for a fixed time. The job runs with recovery
on, on a free port, with its recovery path and logs in a temporary directory (or `workdir`).
pytest users get the `local_job` fixture from `cluster.testing` (add
`pytest_plugins = ["cluster.tools.testing"]` to a conftest.py), which closes every job it made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from cluster.protocol.errors import ClusterError, JobTimeoutError, NetemUnavailableError
from cluster.protocol.state import Phase
from cluster.tools.secret import write_job_secret
from cluster.worker import identity

POLL_S = 0.02
DEFAULT_TIMEOUT_S = 60.0


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
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, IndexError):
            return False

    def kill_group(self) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


class NetworkLab:
    """Worker i in namespace `ns(i)` at 10.T.i.2, linked by a veth pair to this host's 10.T.i.1;
    the scheduler at 10.T.250.1 on this host's loopback. Needs root and iproute2."""

    _made_labs = 0  # in this process: each lab its own names

    def __init__(self, workers: int) -> None:
        self.workers = workers
        NetworkLab._made_labs += 1
        tag = (os.getpid() % 10_000) * 10 + NetworkLab._made_labs % 10
        self._tag = tag
        self._net = 100 + tag % 100
        self.scheduler_ip = f"10.{self._net}.250.1"
        self._made: list[Callable[[], None]] = []

    @staticmethod
    def why_not_available() -> str | None:
        """Why network faults cannot run here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "iproute2 (`ip`, `tc`) is not installed"
        return None

    def namespace(self, i: int) -> str:
        return f"cluster-{self._tag}-w{i}"

    def host_link(self, i: int) -> str:
        return f"cl{self._tag}h{i}"

    def worker_ip(self, i: int) -> str:
        return f"10.{self._net}.{i}.2"

    def command(self, i: int, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(i), *args]

    def setup(self) -> None:
        why = self.why_not_available()
        if why:
            raise ClusterError(f"network faults are not available: {why}")
        try:
            _ip("addr", "add", f"{self.scheduler_ip}/32", "dev", "lo")
            self._made.append(lambda: _ip("addr", "del", f"{self.scheduler_ip}/32", "dev", "lo"))
            for i in range(self.workers):
                self._link(i)
        except BaseException:
            self.teardown()
            raise

    def _link(self, i: int) -> None:
        ns, host, peer = self.namespace(i), self.host_link(i), f"cl{self._tag}p{i}"
        _ip("netns", "add", ns)
        # Deleting the namespace deletes its end of the veth pair, and so the pair.
        self._made.append(lambda: _ip("netns", "delete", ns))
        _ip("link", "add", host, "type", "veth", "peer", "name", peer)
        # Deleted explicitly too: a namespace's links go away only when the kernel gets to it.
        self._made.append(lambda: _run(["ip", "link", "del", host], check=False))
        _ip("link", "set", peer, "netns", ns)
        _ip("addr", "add", f"10.{self._net}.{i}.1/24", "dev", host)
        _ip("link", "set", host, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{self.worker_ip(i)}/24", "dev", peer)
        _ip("-n", ns, "link", "set", peer, "up")
        _ip("-n", ns, "route", "add", "default", "via", f"10.{self._net}.{i}.1")

    def teardown(self) -> None:
        while self._made:
            with contextlib.suppress(ClusterError, OSError):
                self._made.pop()()

    def cut(self, i: int) -> None:
        _ip("link", "set", self.host_link(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.host_link(i), "up")

    def impair(self, i: int, *, delay_ms: float = 0.0, loss_percent: float = 0.0) -> None:
        """Delay and lose the packets this host sends to worker i (tc netem); 0, 0 clears."""
        link = self.host_link(i)
        _run(["tc", "qdisc", "del", "dev", link, "root"], check=False)  # none there is fine
        if delay_ms or loss_percent:
            netem = ["delay", f"{delay_ms:g}ms", "loss", f"{loss_percent:g}%"]
            try:
                _run(["tc", "qdisc", "add", "dev", link, "root", "netem", *netem])
            except ClusterError as exc:
                if "unknown" in str(exc):
                    raise NetemUnavailableError(
                        "tc netem is not available in this kernel (module sch_netem): delay "
                        "and loss cannot be injected here; cutting links still works"
                    ) from None
                raise


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(args: list[str], *, check: bool = True) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(args)} failed: {result.stderr.strip()}")


class LocalJob:
    """A scheduler and `workers` workers of `script` on this machine, recovery on."""

    def __init__(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        workers: int = 2,
        node_timeout_s: float = 5.0,
        recovery: bool = True,
        workdir: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        network: NetworkLab | None = None,
        spares: int = 0,
    ) -> None:
        """`env`: extra environment for every process; `timeout_s`: the bound of each wait;
        `network`: put each worker in its own network namespace (set up by `start`); `spares`:
        spare workers (CLUSTER_SPARE=1, node ids spare-<i>, logs spare_<i>.log)."""
        if workers < 1:
            raise ClusterError(f"LocalJob workers={workers} must be >= 1")
        self.script = Path(script)
        self.args = list(args)
        self.worker_num = workers
        self.node_timeout_s = node_timeout_s
        self.timeout_s = timeout_s
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="cluster-")
        self.workdir = Path(workdir) if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network = network
        host = "127.0.0.1" if network is None else network.scheduler_ip
        self.port = free_port()
        self.address = f"{host}:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
        self.env.update(
            MS_WORKER_NUM=str(workers),
            MS_SCHED_HOST=host,
            MS_SCHED_PORT=str(self.port),
            MS_NODE_TIMEOUT=f"{node_timeout_s:g}",
            PYTHONUNBUFFERED="1",
        )
        if recovery:
            self.env.update(MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(self.workdir / "state"))
        # Closed to outsiders, as a launched job is (unless `env` gives the secret).
        self.env["CLUSTER_JOB_SECRET_FILE"] = str(write_job_secret(self.workdir))
        self.env.update(env or {})
        self.python = python
        self.scheduler: Process | None = None
        self.workers: list[Process | None] = [None] * workers
        self.restarts = [0] * workers
        self.spare_num = spares
        self.spares: list[Process] = []
        self._status: StatusClient | None = None

    # -- starting ------------------------------------------------------------------------------

    def start(self) -> LocalJob:
        """Start the scheduler and every worker (they form the job in the background)."""
        if self.network is not None:
            self.network.setup()
        self.scheduler = self._spawn("scheduler", "MS_SCHED", None)
        for i in range(self.worker_num):
            self.workers[i] = self._spawn(f"worker_{i}", "MS_WORKER", str(i))
        for i in range(self.spare_num):
            spare = self._spawn(f"spare_{i}", "MS_WORKER", f"spare-{i}")
            self.spares.append(spare)
        return self

    def _spawn(self, name: str, role: str, node_id: str | None) -> Process:
        env = {**self.env, "MS_ROLE": role}
        if node_id is not None:
            env["MS_NODE_ID"] = node_id
        if name.startswith("spare_"):
            env["CLUSTER_SPARE"] = "1"
        args = [self.python, str(self.script.resolve()), *self.args]
        if self.network is not None and node_id is not None:
            args = self.network.command(int(node_id), args)
        return Process(name, args, env, self.workdir / f"{name}.log")

    def worker(self, i: int) -> Process:
        proc = self.workers[i]
        if proc is None:
            raise ClusterError(f"worker {i} has not been started")
        return proc

    def log(self, i: int | None = None) -> str:
        """Worker i's output (all its incarnations), or the scheduler's with None."""
        name = "scheduler" if i is None else f"worker_{i}"
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- what the scheduler sees ---------------------------------------------------------------

    def status(self) -> Any:
        """The scheduler's view (`cluster.status.JobView`), or None when it does not answer."""
        if self._status is None:
            self._status = StatusClient(self.address)
        return self._status.fetch()

    def wait_status(self, predicate: Callable[[Any], bool], what: str) -> Any:
        """Poll the status until `predicate(view)` holds; the view."""
        seen: list[Any] = []

        def check() -> bool:
            view = self.status()
            if view is not None and predicate(view):
                seen.append(view)
                return True
            return False

        wait_until(check, self.timeout_s, what)
        return seen[0]

    def wait_formed(self) -> Any:
        """Wait until every worker is in the job, alive and connected."""
        return self.wait_status(self.everyone_back, f"all {self.worker_num} workers in the job")

    def everyone_back(self, view: Any) -> bool:
        """In `view` (a status), every worker alive and connected, the job ready."""
        alive = [n for n in view.nodes if n.state == "alive" and n.connected and not n.spare]
        return view.phase is Phase.READY and len(alive) == self.worker_num

    def node(self, view: Any, i: int) -> Any:
        """Worker i's row of `view` (a status), or None."""
        return next((n for n in view.nodes if n.node_id == str(i)), None)

    # -- faults --------------------------------------------------------------------------------

    def kill_worker(self, i: int, signum: int = signal.SIGKILL) -> float:
        """Kill worker i (SIGKILL by default); once the scheduler marks it failed, the seconds
        that took."""
        proc = self.worker(i)
        proc.signal(signum)
        sent = time.monotonic()
        proc.popen.wait(self.timeout_s)
        self.wait_status(
            lambda v: getattr(self.node(v, i), "state", "") == "failed",
            f"worker {i} marked failed",
        )
        return time.monotonic() - sent

    def terminate_worker(self, i: int) -> float:
        """SIGTERM worker i; as kill_worker."""
        return self.kill_worker(i, signal.SIGTERM)

    def stop_worker(self, i: int) -> None:
        """SIGSTOP worker i (a hung process); returns once it is stopped."""
        proc = self.worker(i)
        proc.signal(signal.SIGSTOP)
        wait_until(proc.stopped, self.timeout_s, f"worker {i} stopped")

    def continue_worker(self, i: int) -> None:
        """SIGCONT worker i; returns once it runs again."""
        proc = self.worker(i)
        proc.signal(signal.SIGCONT)
        wait_until(lambda: not proc.stopped(), self.timeout_s, f"worker {i} running")

    def restart_worker(self, i: int, *, wait: bool = True) -> float:
        """Start worker i again with the same node id; with `wait`, once it is back in a new
        generation (after the guard), the seconds that took."""
        before = self.status()
        generation = before.generation if before is not None else 0
        self.restarts[i] += 1
        self.workers[i] = self._spawn(f"worker_{i}", "MS_WORKER", str(i))
        started = time.monotonic()
        if wait:
            self.wait_status(
                lambda v: v.generation > generation and self.everyone_back(v),
                f"worker {i} back in a new generation",
            )
        return time.monotonic() - started

    def partition(self, i: int) -> None:
        """Cut worker i off the network (needs `network`)."""
        self._lab().cut(i)

    def heal(self, i: int) -> None:
        """Give worker i its network back."""
        self._lab().heal(i)

    def impair(self, i: int, *, delay_ms: float = 0.0, loss_percent: float = 0.0) -> None:
        """Delay and lose worker i's traffic from this host; impair(i) clears it."""
        self._lab().impair(i, delay_ms=delay_ms, loss_percent=loss_percent)

    def _lab(self) -> NetworkLab:
        if self.network is None:
            raise ClusterError("network faults need LocalJob(..., network=NetworkLab(workers))")
        return self.network

    def kill_scheduler(self) -> None:
        """SIGKILL the scheduler; returns once it is gone."""
        if self.scheduler is not None:
            self.scheduler.signal(signal.SIGKILL)
            self.scheduler.popen.wait(self.timeout_s)

    def restart_scheduler(self, *, wait: bool = True) -> float:
        """Start the scheduler again; with `wait`, once every worker is back, the seconds."""
        self.scheduler = self._spawn("scheduler", "MS_SCHED", None)
        started = time.monotonic()
        if wait:
            self.wait_formed()
        return time.monotonic() - started

    # -- the end -------------------------------------------------------------------------------

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for every process to exit; 0 when all exited 0, else the first other code."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        codes = []
        for proc in [self.scheduler, *self.workers, *self.spares]:
            if proc is None:
                continue
            try:
                codes.append(proc.popen.wait(max(deadline - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                raise JobTimeoutError(
                    f"{proc.name} did not exit within {timeout_s or self.timeout_s:g} s"
                ) from None
        return next((code for code in codes if code != 0), 0)

    def close(self) -> None:
        """Kill whatever is still running (every process group) and clean up."""
        for proc in [self.scheduler, *self.workers, *self.spares]:
            if proc is not None:
                proc.kill_group()
        if self._status is not None:
            self._status.close()
            self._status = None
        if self.network is not None:
            self.network.teardown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalJob:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class StatusClient:
    """Status calls from synchronous code: a grpc.aio channel on a background loop, which
    reconnects every `reconnect_ms` while the scheduler is down."""

    def __init__(self, address: str, *, reconnect_ms: int = 50) -> None:
        from cluster.transport import channel  # noqa: PLC0415 - grpc only for those who ask
        from cluster.worker.session import BackgroundLoop  # noqa: PLC0415

        self.address = address
        self._loop = BackgroundLoop("cluster-testing-status")
        # Reconnect often while the scheduler is down, so that the status after a restart is
        # seen at once (grpc's default backoff reaches seconds).
        options = channel.reconnect_options(reconnect_ms, reconnect_ms)

        async def make() -> Any:
            return channel.open_channel(address, None, options)

        self._channel = self._loop.run(make())

    def fetch(self) -> Any:
        from cluster.tools import status  # noqa: PLC0415

        try:
            return self._loop.run(status.fetch(self._channel, self.address, 1.0))
        except ClusterError:
            return None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.run(self._channel.close(), timeout_s=5.0)
        self._loop.stop()


# -- pytest --------------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pytest is for tests only
    pass
else:

    @pytest.fixture
    def local_job() -> Iterator[Callable[..., LocalJob]]:
        """A factory of started LocalJobs (same arguments); each is closed after the test."""
        jobs: list[LocalJob] = []

        def make(*args: Any, **kwargs: Any) -> LocalJob:
            job = LocalJob(*args, **kwargs)
            jobs.append(job)
            return job.start()

        yield make
        for job in jobs:
            job.close()
