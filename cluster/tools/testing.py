"""Test your training job under faults: start it locally, then kill, stop, restart its processes.

    from cluster.tools.testing import LocalJob

    with LocalJob("train.py", ["--steps", "100"], workers=4, node_timeout_s=3) as job:
        job.wait_formed()
        job.kill_worker(2)          # SIGKILL; returns once the scheduler has marked it failed
        job.restart_worker(2)       # same node id; returns once it is back (a new generation)
        job.kill_scheduler()
        job.restart_scheduler()     # returns once every worker is back
        assert job.wait() == 0      # every process exited 0

Network faults (as root, with iproute2): `LocalJob(..., options=LocalJobOptions(network=lab))`
with `lab = NetworkLab(workers)` starts each worker in its own network namespace, joined to this
host by a veth pair, with the scheduler on an address of this host; `job.partition(i)` cuts
worker i's link (link down), `job.heal(i)` brings it back, `job.impair(i, delay_ms=...,
loss_percent=...)` adds delay and loss (tc netem). The namespaces, links and address are always
removed.

Every action waits for what it should cause to be visible (the node marked failed, the new
generation, the nodes back), with a bound, never for a fixed time. The job ends with the
process that owns it (that started it), even SIGKILLed: its processes watch it as a launcher's
children watch theirs (CLUSTER_LAUNCHER_PID), and its guard (`guard`) ends those that
cannot. The job runs with recovery on, on a free port, with its recovery path and logs in a
temporary directory (or `workdir`).
pytest users get the `local_job` fixture from `cluster.testing` (add
`pytest_plugins = ["cluster.tools.testing"]` to a conftest.py), which closes every job it made.

`LocalJob` and that fixture are here; `Process` and the bounded waits are `testing_process`'s,
`LocalJobOptions` and what a job settles before it starts are `testing_setup`'s. Every public
name is importable from here (and from `cluster.testing`, `__all__`'s).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from cluster.protocol.environment import job_secret_from_env, read_job_secret
from cluster.protocol.errors import ClusterError, JobTimeoutError, NetemUnavailableError
from cluster.protocol.records import Phase
from cluster.tools import guard as job_guard
from cluster.tools.netlab import NetworkLab
from cluster.tools.processes import descendants, launched_pid, processes_running, worker_pid
from cluster.tools.secret import write_job_secret
from cluster.tools.status_client import StatusClient

# POLL_S and cpu_seconds are importable from here too, outside `__all__` (a benchmark reads a
# process's CPU time with cpu_seconds): the aliases re-export them.
from cluster.tools.testing_process import POLL_S as POLL_S  # noqa: PLC0414
from cluster.tools.testing_process import Process, accepts, free_port, wait_until
from cluster.tools.testing_process import cpu_seconds as cpu_seconds  # noqa: PLC0414
from cluster.tools.testing_setup import (
    LocalJobOptions,
    check_options,
    free_on,
    free_port_on,
    scheduler_hosts,
    tls_identity,
)
from cluster.worker import orphan

__all__ = [
    "JobTimeoutError",
    "LocalJob",
    "LocalJobOptions",
    "NetemUnavailableError",
    "NetworkLab",
    "Process",
    "StatusClient",
    "descendants",
    "free_port",
    "launched_pid",
    "processes_running",
    "wait_until",
    "worker_pid",
]

DEFAULT_TIMEOUT_S = 60.0

# What this process's environment may say of its TLS identity, passed on to the job's
# processes beside the ssl.json (`LocalJobOptions.tls_config`).
_TLS_VARIABLES = (
    "CLUSTER_TLS_SERVER_NAME",
    "CLUSTER_TLS_CLIENT_PASSWORD",
    "CLUSTER_TLS_CLIENT_PASSWORD_FILE",
    "CLUSTER_TLS_SERVER_PASSWORD",
    "CLUSTER_TLS_SERVER_PASSWORD_FILE",
)


class LocalJob:
    """A scheduler and `workers` workers of `script` on this machine, recovery on; with
    standbys (`LocalJobOptions`), as many more schedulers on one etcd state URL, the workers
    knowing them all."""

    def __init__(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        workers: int = 2,
        node_timeout_s: float = 5.0,
        workdir: str | os.PathLike[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        options: LocalJobOptions = LocalJobOptions(),  # noqa: B008 - frozen, so shared safely
    ) -> None:
        """`workdir`: the logs and recovery state (a temporary directory by default);
        `timeout_s`: the bound of each wait; `options`: the rest (`LocalJobOptions`)."""
        check_options(workers, node_timeout_s, options)
        self.hosts = scheduler_hosts(options.standbys, options.state_url, options.network)
        self.port = options.port or free_port_on(self.hosts)
        if options.port is not None and not free_on(self.hosts, options.port):
            raise ClusterError(f"LocalJob port {options.port} is not free on {self.hosts}")
        self._identity = None if options.tls_config is None else tls_identity(options.tls_config)
        self.script = Path(script)
        self.args = list(args)
        self.worker_num = workers
        self.node_timeout_s = node_timeout_s
        self.timeout_s = timeout_s
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="cluster-")
        self.workdir = Path(workdir) if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network = options.network
        self.addresses = [f"{host}:{self.port}" for host in self.hosts]
        self.address = self.addresses[0]
        self.env = self._environment(options)
        self.env.update(options.env)
        self.python = options.python
        self.schedulers: list[Process | None] = [None] * len(self.hosts)
        self.leader_index = 0  # the scheduler that led when last seen
        self.workers: list[Process | None] = [None] * workers
        self.restarts = [0] * workers
        self.spare_num = options.spares
        self.spares: list[Process] = []
        self.relay: Process | None = None
        self._relay_dir: Path | None = None
        self._relay_wanted = options.relay
        self._status: StatusClient | None = None
        self._started: list[Process] = []
        # Ends the job's processes once this process is gone, even SIGKILLed (`guard`).
        self._guard: subprocess.Popen[bytes] | None = None

    def _environment(self, options: LocalJobOptions) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
        env.update(
            MS_WORKER_NUM=str(self.worker_num),
            MS_SCHED_HOST=",".join(self.hosts),
            MS_SCHED_PORT=str(self.port),
            MS_NODE_TIMEOUT=f"{self.node_timeout_s:g}",
            PYTHONUNBUFFERED="1",
        )
        if options.recovery:
            env.update(MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(self.workdir / "state"))
        if options.state_url is not None:
            env.update(CLUSTER_STATE_URL=options.state_url, CLUSTER_LEASE_S=str(options.lease_s))
        if options.tls_config is not None:
            from cluster.transport import tls  # noqa: PLC0415 - cryptography, only with TLS

            env.update({k: v for k, v in os.environ.items() if k in _TLS_VARIABLES})
            env.update(tls.launch_environment(options.tls_config.resolve()))
        # Closed to outsiders, as a launched job is (unless `env` gives the secret).
        env["CLUSTER_JOB_SECRET_FILE"] = str(write_job_secret(self.workdir))
        return env

    @property
    def secret_file(self) -> Path | None:
        """The job secret's file (CLUSTER_JOB_SECRET_FILE of every process): `mscluster status`
        and `events` read the job with it."""
        named = self.env.get("CLUSTER_JOB_SECRET_FILE")
        return Path(named) if named else None

    @property
    def standby_num(self) -> int:
        return len(self.hosts) - 1

    @property
    def scheduler(self) -> Process | None:
        """The scheduler that leads (as last seen; the only one without standbys)."""
        return self.schedulers[self.leader_index]

    # -- starting ------------------------------------------------------------------------------

    def start(self) -> LocalJob:
        """Start the scheduler and every worker (they form the job in the background)."""
        if self._guard is None:
            self._guard = job_guard.start(self.python)
        if self.network is not None:
            self.network.setup()
        for k in range(len(self.hosts)):
            self.schedulers[k] = self._spawn_scheduler(k)
        if self._relay_wanted:
            self._start_relay()
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
        if self._relay_dir is not None:
            env["CLUSTER_RELAY"] = f"unix:{self._relay_dir / 'relay.sock'}"
        args = [self.python, str(self.script.resolve()), *self.args]
        if self.network is not None and node_id is not None:
            args = self.network.command(self._slot(node_id), args)
        return self._process(name, args, env)

    def _slot(self, node_id: str) -> int:
        """Node `node_id`'s network namespace: worker i's is i, spare i's follows the workers'."""
        if node_id.startswith("spare-"):
            return self.worker_num + int(node_id.removeprefix("spare-"))
        return int(node_id)

    def _start_relay(self) -> None:
        """The workers' relay, in a directory of this user's only; returns once it takes
        connections (a ClusterError with its last line if it exits first)."""
        self._relay_dir = Path(tempfile.mkdtemp(prefix="cluster-relay-"))
        path = self._relay_dir / "relay.sock"
        args = [self.python, "-m", "cluster", "relay", "--socket", f"unix:{path}"]
        relay = self.relay = self._process("relay", args, dict(self.env))

        def up() -> bool:
            if not relay.running:
                raise ClusterError(f"the relay did not start: {relay.exit_line()}")
            return accepts(path)

        wait_until(up, self.timeout_s, "the relay taking connections")

    def _spawn_scheduler(self, k: int) -> Process:
        env = {**self.env, "MS_ROLE": "MS_SCHED", "MS_SCHED_HOST": self.hosts[k]}
        args = [self.python, str(self.script.resolve()), *self.args]
        return self._process(scheduler_name(k), args, env)

    def _process(self, name: str, args: list[str], env: dict[str, str]) -> Process:
        """Start one process of the job, its output in `<workdir>/<name>.log`; each one started
        (every incarnation) is `close()`'s to end, and the guard's once this process is gone.
        It watches this process as a launcher's child watches its launcher."""
        env = {**env, orphan.ENV: str(os.getpid())}
        proc = Process(name, args, env, self.workdir / f"{name}.log")
        self._started.append(proc)
        job_guard.note(self._guard, proc.pid)
        return proc

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
            source = job_secret_from_env(
                self.env
            )  # a job with a secret shows itself to its holders
            secret = None if source is None else read_job_secret(source)
            self._status = StatusClient(self.addresses, secret=secret, identity=self._identity)
        view = self._status.fetch()
        if view is not None and view.address in self.addresses:
            self.leader_index = self.addresses.index(view.address)
        return view

    def wait_status(
        self, predicate: Callable[[Any], bool], what: str, *, every_worker: bool = False
    ) -> Any:
        """Poll the status until `predicate(view)` holds; the view. A JobTimeoutError after
        `timeout_s`, or as soon as the job has ended (`ended`) with the exit that ended it."""
        seen: list[Any] = []

        def check() -> bool:
            view = self.status()
            if view is not None and predicate(view):
                seen.append(view)
                return True
            gone = self.ended(every_worker=every_worker)
            if gone is not None:
                raise JobTimeoutError(f"the job ended before {what}: {gone.exit_line()}")
            return False

        wait_until(check, self.timeout_s, what)
        return seen[0]

    def wait_formed(self) -> Any:
        """Wait until every worker is in the job, alive and connected; a JobTimeoutError at
        once when a worker or every scheduler has exited (nothing starts it again meanwhile)."""
        what = f"all {self.worker_num} workers in the job"
        return self.wait_status(self.everyone_back, what, every_worker=True)

    def ended(self, *, every_worker: bool = False) -> Process | None:
        """None while a scheduler runs (and, with `every_worker`, every worker): the status can
        still change. Else the exit to blame: the first process that exited other than 0, else
        the first that exited."""
        schedulers = [p for p in self.schedulers if p is not None]
        workers = [p for p in self.workers if p is not None]
        worker_gone = every_worker and any(not w.running for w in workers)
        if not schedulers or (not worker_gone and any(s.running for s in schedulers)):
            return None
        exited = [p for p in [*schedulers, *workers] if not p.running]
        failed = [p for p in exited if p.popen.returncode != 0]
        return (failed or exited)[0]

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
            raise ClusterError(
                "network faults need LocalJob(..., options=LocalJobOptions(network=NetworkLab(n)))"
            )
        return self.network

    def leader(self) -> int:
        """The index of the scheduler that leads now (waits for one, bounded)."""
        self.wait_status(lambda view: True, "a scheduler leading the job")
        return self.leader_index

    def kill_scheduler(self, k: int | None = None) -> int:
        """SIGKILL scheduler k (by default the one that led when last seen); returns once it
        is gone, its index."""
        k = self.leader_index if k is None else k
        proc = self.schedulers[k]
        if proc is not None:
            proc.signal(signal.SIGKILL)
            proc.popen.wait(self.timeout_s)
        return k

    def restart_scheduler(self, k: int | None = None, *, wait: bool = True) -> float:
        """Start scheduler k (by default the one that led when last seen) again; with `wait`,
        once every worker is back, the seconds."""
        k = self.leader_index if k is None else k
        self.schedulers[k] = self._spawn_scheduler(k)
        started = time.monotonic()
        if wait:
            self.wait_formed()
        return time.monotonic() - started

    def wait_new_leader(self, killed: int) -> tuple[int, float]:
        """After the leader `killed` died: once another scheduler leads with every worker back
        on it, its index and the seconds that took."""
        started = time.monotonic()
        self.wait_status(
            lambda view: self.leader_index != killed and self.everyone_back(view),
            f"the job back on a scheduler other than {self.addresses[killed]}",
        )
        return self.leader_index, time.monotonic() - started

    # -- the end -------------------------------------------------------------------------------

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for every process to exit; 0 when all exited 0, else the first other code."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        codes = []
        for proc in [*self.schedulers, *self.workers, *self.spares]:
            if proc is None:
                continue
            try:
                codes.append(proc.popen.wait(max(deadline - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                raise JobTimeoutError(
                    f"{proc.name} did not exit within {timeout_s or self.timeout_s:g} s; "
                    f"{self._still_running()}"
                ) from None
        return next((code for code in codes if code != 0), 0)

    def _still_running(self) -> str:
        """The processes of the job that still run, each with the last lines of its log."""
        said = []
        for proc in [*self.schedulers, *self.workers, *self.spares]:
            if proc is not None and proc.popen.poll() is None:
                path = self.workdir / f"{proc.name}.log"
                lines = path.read_text(errors="replace").splitlines() if path.exists() else []
                said.append(f"{proc.name} still runs, its log ending: {' | '.join(lines[-4:])}")
        return "; ".join(said)

    def close(self) -> None:
        """Kill whatever is still running (the process group of every process it started, its
        leader's exit or not: the helpers a worker left) and clean up."""
        for proc in self._started:
            proc.kill_group()
        if self._guard is not None:
            job_guard.close(self._guard)
            self._guard = None
        if self._relay_dir is not None:
            shutil.rmtree(self._relay_dir, ignore_errors=True)
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


def scheduler_name(k: int) -> str:
    """Scheduler k's process and log name: "scheduler" for the first, as without standbys."""
    return "scheduler" if k == 0 else f"scheduler_{k}"


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

    __all__ += ["local_job"]
