"""A private Slurm (Debian's slurm-wlm 22.05) on this machine: munged, slurmctld and two slurmd.

Everything is generated per instance: a munge key (random bytes, mode 0400) and a munged with
its own socket, pid, seed and log; a slurm.conf with free loopback ports, `SlurmUser=root`,
state and spool directories of its own, `AuthInfo=socket=...` (how the auth/munge and cred/munge
plugins, in the daemons and in srun/sinfo/scontrol alike, find this munged), process tracking by
/proc (`proctrack/linuxproc`, no cgroups needed) and `task/none`. The daemons run in the
foreground (`-D`) as children of the test. Pointing a client at it takes only `SLURM_CONF`:
`slurm.env` is the environment to run `srun`, `sinfo`, `scontrol` with, `slurm.run([...])` runs
one.

Two nodes, `node1` and `node2`, both on this host (NodeHostname = this host's short name,
NodeAddr 127.0.0.1): one slurmd per node, each started with `-N nodeN` on its own port, with
`%n` in its spool and pid paths (Debian's build runs several slurmd per host this way). Each
node claims CPUS_PER_NODE CPUs (`SlurmdParameters=config_overrides`), so a job can place several
tasks on a node of this 2-core machine.

Readiness: `sinfo` lists every node idle. Cleanup: running jobs are cancelled, the daemons
stopped by process group, and then every process whose environment names this instance's
slurm.conf (slurmstepd and the tasks it runs start sessions of their own) is killed.

Needs root. The munge socket's directory must be reachable by everyone (munged checks), which
pytest's 0700 temporary directories are not, and socket paths are limited to 108 bytes: the
munge and spool directories live in a short directory under /tmp of their own, removed after.
Fixture: `slurm` (function scope; about 1-2 s to start).

`scontrol show hostnames` needs a slurm.conf but no daemon: `scontrol_env` (fixture) and
`offline_env` give scontrol a two-line one, without root, and `scontrol_hostnames` expands a node
list with it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import suppress
from pathlib import Path

import pytest

from tests.servers import require
from tests.servers._process import (
    ServerError,
    ServerProcess,
    bind_failed,
    free_ports,
    pids_with_env,
    stop_all,
    wait_for,
)
from tests.servers.plugin import attach_log

START_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 30.0
BIND_ATTEMPTS = 3
NODES = 2
CPUS_PER_NODE = 8
BINARIES = {
    "munged": "munge",
    "munge": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "srun": "slurm-client",
    "sinfo": "slurm-client",
    "squeue": "slurm-client",
    "scancel": "slurm-client",
    "scontrol": "slurm-client",
}


def why_unavailable() -> str | None:
    for binary, package in BINARIES.items():
        if shutil.which(binary) is None:
            return (
                f"Slurm tests need `{binary}` (Debian package {package}; "
                "scripts/setup installs slurm-wlm and munge when run as root)"
            )
    if os.geteuid() != 0:
        return "Slurm tests need root: slurmd launches jobs and munged runs as root here"
    return None


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def _clean_env() -> dict[str, str]:
    """This process's environment without any Slurm job's variables (a test run inside an
    allocation must not leak them into the private cluster)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}


class Slurm:
    """A private Slurm of `nodes` nodes; logs, config and state under `base_dir`."""

    def __init__(self, base_dir: Path, nodes: int = NODES) -> None:
        if nodes < 1:
            raise ValueError(f"a Slurm cluster needs at least one node, not {nodes}")
        self.base_dir = base_dir
        self.node_names = [f"node{i + 1}" for i in range(nodes)]
        self.conf = base_dir / "slurm.conf"
        self.run_dir: Path | None = None  # the short, world-reachable directory under /tmp
        self.munged = ServerProcess("munged", [], base_dir / "munged.log")
        self.slurmctld = ServerProcess("slurmctld", [], base_dir / "slurmctld.log")
        self.slurmds = [
            ServerProcess(f"slurmd {name}", [], base_dir / f"slurmd-{name}.log")
            for name in self.node_names
        ]

    # -- what tests use ------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment for srun, sinfo, scontrol, ... to use this Slurm."""
        return {**_clean_env(), "SLURM_CONF": str(self.conf)}

    @property
    def munge_socket(self) -> Path:
        if self.run_dir is None:
            raise ServerError("Slurm was not started")
        return self.run_dir / "munge" / "munge.socket"

    @property
    def processes(self) -> list[ServerProcess]:
        return [self.munged, self.slurmctld, *self.slurmds]

    def run(
        self,
        args: Sequence[str],
        *,
        timeout_s: float = COMMAND_TIMEOUT_S,
        check: bool = True,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (`srun ...`, `sinfo ...`) against this Slurm; bounded.
        With `check`, a non-zero exit raises ServerError with its output and the daemons'."""
        try:
            done = subprocess.run(
                list(args),
                env=self.env,
                cwd=cwd or self.base_dir,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerError(
                f"{' '.join(args)} did not end within {timeout_s:g} s\n{self.describe()}"
            ) from exc
        if check and done.returncode != 0:
            raise ServerError(
                f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}\n"
                f"{self.describe()}"
            )
        return done

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo shows it (`idle`, `alloc`, `down*`, ...); empty while
        slurmctld does not answer."""
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout_s=10)
        if done.returncode != 0:
            return {}
        states = {}
        for line in done.stdout.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def describe(self) -> str:
        return "\n".join(p.describe() for p in self.processes)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix="cl-slurm-", dir="/tmp"))
        self.run_dir.chmod(0o755)
        self._start_munged(timeout_s)
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self._write_conf(attempt)
            daemon_env = self.env
            self.slurmctld.args = ["slurmctld", "-D", "-f", str(self.conf)]
            self.slurmctld.env = daemon_env
            self.slurmctld.start()
            for name, slurmd in zip(self.node_names, self.slurmds, strict=True):
                slurmd.args = ["slurmd", "-D", "-N", name, "-f", str(self.conf)]
                slurmd.env = daemon_env
                slurmd.start()
            try:
                wait_for(
                    lambda: self.node_states() == dict.fromkeys(self.node_names, "idle"),
                    timeout_s,
                    f"sinfo to show {', '.join(self.node_names)} idle",
                    self.processes,
                )
                return
            except ServerError:
                lost_race = any(bind_failed(p) for p in [self.slurmctld, *self.slurmds])
                self._stop_slurm()
                if not lost_race or attempt == BIND_ATTEMPTS:
                    self.close()
                    raise

    def close(self) -> None:
        try:
            self._stop_slurm()
        finally:
            self.munged.stop()
            if self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> Slurm:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _start_munged(self, timeout_s: float) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(mode=0o755)
        munge_dir.chmod(0o755)  # munged wants its socket's directory reachable by all
        key = munge_dir / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(1024))
        self.munged.args = [
            "munged",
            "--foreground",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
            f"--log-file={self.base_dir / 'munged.file.log'}",
        ]
        self.munged.start()

        def answers() -> bool:
            if not self.munge_socket.exists():
                return False
            done = subprocess.run(
                ["munge", "-n", "-S", str(self.munge_socket)],
                capture_output=True,
                timeout=10,
                check=False,
            )
            return done.returncode == 0

        wait_for(answers, timeout_s, "munged to issue a credential", [self.munged])

    def _write_conf(self, attempt: int) -> None:
        assert self.run_dir is not None
        ctld_port, slurmd_port, *node_ports = free_ports(2 + len(self.node_names))
        state = self.base_dir / f"state{attempt}"
        state.mkdir()
        spool = self.run_dir / f"spool{attempt}"
        for name in self.node_names:
            (spool / name).mkdir(parents=True)
        plugstack = self.base_dir / "plugstack.conf"
        plugstack.write_text("")
        host = short_hostname()
        lines = [
            "ClusterName=clustertests",
            # Job ids from a random start: two test runs on one machine then seldom share a job
            # id, nor what is derived from it (mscluster run's default port, its secret's name).
            f"FirstJobId={secrets.randbelow(900_000) + 1000}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={spool}/%n",
            f"SlurmctldPidFile={self.run_dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.run_dir / 'slurmd-%n.pid'}",
            f"PlugStackConfig={plugstack}",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/builtin",
            "ReturnToService=2",
            "InactiveLimit=0",
            "KillWait=2",
            "MinJobAge=2",
            "MessageTimeout=10",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        lines += [
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for name, port in zip(self.node_names, node_ports, strict=True)
        ]
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _stop_slurm(self) -> None:
        """Cancel the jobs and wait (bounded) until they are gone, stop the daemons, then kill
        whatever still carries this SLURM_CONF (a step whose slurmd did not end it)."""
        if self.slurmctld.running:
            with suppress(ServerError, subprocess.TimeoutExpired):
                self.run(["scancel", "--user=root"], check=False, timeout_s=10)
                wait_for(self._no_jobs, 10, "the cancelled jobs to end", [self.slurmctld])
        stop_all([*self.slurmds, self.slurmctld])
        marker = f"SLURM_CONF={self.conf}"
        with suppress(ServerError):
            wait_for(lambda: not _kill_all(pids_with_env(marker)), 10, "Slurm's leftovers to go")

    def _no_jobs(self) -> bool:
        done = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout_s=10)
        return done.returncode == 0 and not done.stdout.strip()


def _kill_all(pids: list[int]) -> list[int]:
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


def why_scontrol_unavailable() -> str | None:
    if shutil.which("scontrol") is None:
        return (
            "this test needs `scontrol` (Debian package slurm-client; "
            "scripts/setup installs slurm-wlm when run as root)"
        )
    return None


def offline_env(directory: Path) -> dict[str, str]:
    """The environment for scontrol's commands that ask no daemon (`show hostnames`,
    `show hostlist`): they still read a slurm.conf, and two lines are enough. No root needed."""
    conf = directory / "offline-slurm.conf"
    conf.write_text("ClusterName=clustertests\nSlurmctldHost=localhost\n")
    return {**_clean_env(), "SLURM_CONF": str(conf)}


def scontrol_hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    """Slurm's own expansion of a node list (`a[1-3],b08` -> a1 a2 a3 b08)."""
    done = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist],
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise ServerError(f"scontrol show hostnames {nodelist!r}: {done.stderr.strip()}")
    return done.stdout.split()


@pytest.fixture
def scontrol_env(tmp_path: Path) -> dict[str, str]:
    """`offline_env`: scontrol without a running Slurm (for node-list tests)."""
    require(why_scontrol_unavailable())
    return offline_env(tmp_path)


@pytest.fixture
def slurm(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Slurm]:
    require(why_unavailable())
    cluster = Slurm(tmp_path / "slurm")
    for process in cluster.processes:
        attach_log(request.node, process.name, process.log)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
