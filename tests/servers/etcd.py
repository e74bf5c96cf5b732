"""A real etcd v3 cluster (Debian's etcd-server 3.4) of n members on loopback ports.

Each member is an `etcd` process with its own data directory and log; readiness is every running
member answering `{"health": "true"}` on /health (which needs an elected leader). etcd cannot
bind port 0 and report it, so the ports are picked free beforehand, and a start whose bind lost
a race is made again on fresh ports.

Fixtures:

- `etcd_cluster`: a 3-member cluster shared by the tests of one module, healed before each test
  (a member a previous test killed or stopped is started again and the cluster waited healthy;
  a cluster that does not heal is made anew), with a fresh key prefix per test in
  `etcd_cluster.prefix`. A 3-member bootstrap costs about 3 s here (each new member waits 1 s per
  peer to learn whether the cluster exists), a restart about 1 s: sharing keeps that cost once
  per module while each test still starts with every member up. A test may kill, restart, stop
  and start members freely; one that changes the cluster's membership or auth should take its
  own cluster from `make_etcd_cluster`.
- `make_etcd_cluster(n=3, quota_bytes=0)`: clusters of the test's own, closed after it (a
  `quota_bytes` other than 0 is the members' --quota-backend-bytes).
- `etcd_auth_cluster`: a 1-member cluster with authentication on (a `root` user, `auth enable`),
  shared by the tests of a module; each test gets a fresh prefix and a user of its own
  (`etcd_auth_cluster.user`, `.password`) whose role may read and write that prefix only.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from tests.servers import require
from tests.servers._process import (
    ServerError,
    ServerProcess,
    bind_failed,
    free_ports,
    http_get,
    wait_for,
)
from tests.servers.plugin import attach_log

START_TIMEOUT_S = 60.0
BIND_ATTEMPTS = 3
COMMAND_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


def why_unavailable() -> str | None:
    for binary, package in (("etcd", "etcd-server"), ("etcdctl", "etcd-client")):
        if shutil.which(binary) is None:
            return (
                f"etcd tests need `{binary}` (Debian package {package}; "
                "scripts/setup installs it when run as root)"
            )
    return None


def _env() -> dict[str, str]:
    # etcd reads every ETCD_* variable as a flag, etcdctl every ETCDCTL_*: none may leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "ETCDCTL_"))}
    env["ETCDCTL_API"] = "3"
    return env


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    process: ServerProcess

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def listen_url(self, any_address: bool) -> str:
        return f"http://0.0.0.0:{self.client_port}" if any_address else self.client_url

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def healthy(self) -> bool:
        answer = http_get(f"{self.client_url}/health", timeout_s=1.0)
        if answer is None or answer[0] != 200:
            return False
        try:
            return bool(json.loads(answer[1]).get("health") == "true")
        except ValueError:
            return False


class EtcdCluster:
    """`n` etcd members on loopback; files under `base_dir`. Use as a context manager, or call
    `start()` and `close()`."""

    def __init__(
        self, base_dir: Path, n: int = 3, *, listen_any: bool = False, quota_bytes: int = 0
    ) -> None:
        """`listen_any`: clients reach the members on every address of this host (network
        namespaces joined to it by veth pairs), not on loopback only. `quota_bytes`: the
        members' --quota-backend-bytes (0: etcd's default, 2 GiB)."""
        if n < 1:
            raise ValueError(f"an etcd cluster needs at least one member, not {n}")
        self.base_dir = base_dir
        self.n = n
        self.members: list[Member] = []
        self.prefix = "/"  # the fixture gives each test its own
        self.listen_any = listen_any
        self.quota_bytes = quota_bytes
        self._bootstraps = 0
        # With authentication on (`enable_auth`): root's password, which etcdctl then logs in
        # with, and the test's own user (`add_user`).
        self.root_password = ""
        self.user = ""
        self.password = ""

    # -- what tests use ------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """`127.0.0.1:port` of every member's client URL, in member order."""
        return [m.endpoint for m in self.members]

    @property
    def client_urls(self) -> list[str]:
        return [m.client_url for m in self.members]

    @property
    def logs(self) -> list[Path]:
        return [m.process.log for m in self.members]

    def state_url(self, prefix: str | None = None) -> str:
        """`etcd://h:p,h:p,h:p/prefix` (CLUSTER_STATE_URL's form); the test's prefix by default."""
        path = self.prefix if prefix is None else prefix
        return f"etcd://{','.join(self.endpoints)}/{path.lstrip('/')}"

    def running(self, i: int) -> bool:
        return self.members[i].process.running

    def kill(self, i: int) -> None:
        """SIGKILL member i (its data directory stays, for `restart(i)`)."""
        self.members[i].process.kill()

    def stop_member(self, i: int) -> None:
        """SIGTERM member i (SIGKILL after a bound)."""
        self.members[i].process.stop()

    def restart(self, i: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Stop member i if it runs, start it again on its ports and data, and wait until every
        running member is healthy."""
        member = self.members[i]
        member.process.stop()
        member.process.start()
        self.wait_healthy(timeout_s)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Bootstrap the cluster, or start again every stopped member of one that ran; returns
        when every member is healthy."""
        if not self.members:
            self._bootstrap(timeout_s)
            return
        for member in self.members:
            if not member.process.running:
                member.process.start()
        self.wait_healthy(timeout_s)

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL after a bound); data stays for `start()`.

        One after the other, each once the others have seen the previous one go: a leader told
        to stop hands its leadership to the peer it believes connected, and when that peer is
        stopping too, it waits for seconds."""
        live = [m for m in self.members if m.process.running]
        for i, member in enumerate(live):
            member.process.stop()
            rest = live[i + 1 :]
            for other in rest:
                with suppress(ServerError):
                    wait_for(
                        partial(self._sees_at_most, other, len(rest) - 1),
                        STOP_TIMEOUT_S,
                        f"{other.name} to see {member.name} gone",
                        [other.process],
                    )

    def _sees_at_most(self, member: Member, peers: int) -> bool:
        return self._active_peers(member) <= peers

    def _active_peers(self, member: Member) -> int:
        """How many peers `member` is connected to, from its etcd_network_active_peers."""
        answer = http_get(f"{member.client_url}/metrics", timeout_s=1.0)
        if answer is None or answer[0] != 200:
            return 0
        return sum(
            round(float(line.rsplit(" ", 1)[1]))
            for line in answer[1].decode(errors="replace").splitlines()
            if line.startswith("etcd_network_active_peers{")
        )

    def close(self) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every running member is healthy; fails early if one of them exits."""
        live = [m for m in self.members if m.process.running]
        if not live:
            raise ServerError("no etcd member is running")
        wait_for(
            lambda: all(m.healthy() for m in live),
            timeout_s,
            f"etcd members {', '.join(m.name for m in live)} to be healthy",
            [m.process for m in live],
        )

    def etcdctl(
        self,
        *args: str,
        endpoints: list[str] | None = None,
        timeout_s: float = COMMAND_TIMEOUT_S,
        stdin: str | None = None,
    ) -> str:
        """Run `etcdctl --endpoints=... args` against the cluster (or `endpoints`), `stdin` on
        its standard input; its stdout. A failure raises ServerError with its output."""
        command = ["etcdctl", f"--endpoints={','.join(endpoints or self.endpoints)}", *args]
        if self.root_password:  # a test cluster's password: argv is fine here
            command.insert(2, f"--user=root:{self.root_password}")
        try:
            done = subprocess.run(
                command,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=_env(),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"{' '.join(command)} did not end within {timeout_s:g} s") from exc
        if done.returncode != 0:
            raise ServerError(
                f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
            )
        return done.stdout

    def enable_auth(self) -> None:
        """Turn etcd's authentication on: a `root` user (etcd's rule: it must exist first) with a
        random password, which `etcdctl` uses from then on."""
        password = secrets.token_hex(12)
        self.etcdctl("user", "add", f"root:{password}", "--interactive=false")
        self.etcdctl("auth", "enable")
        self.root_password = password

    def add_user(self, user: str, prefix: str) -> str:
        """A user whose role may read and write the keys under `prefix` only; its password."""
        password = secrets.token_hex(12)
        role = f"{user}-role"
        self.etcdctl("role", "add", role)
        self.etcdctl("role", "grant-permission", role, "--prefix=true", "readwrite", prefix)
        self.etcdctl("user", "add", f"{user}:{password}", "--interactive=false")
        self.etcdctl("user", "grant-role", user, role)
        return password

    def leader(self) -> int:
        """The index of the member that leads now, as the running members see it."""
        live = [m for m in self.members if m.process.running]
        endpoints = [m.endpoint for m in live]
        status = json.loads(self.etcdctl("endpoint", "status", "-w", "json", endpoints=endpoints))
        leaders = {entry["Status"]["leader"] for entry in status}
        by_id = {entry["Status"]["header"]["member_id"]: entry["Endpoint"] for entry in status}
        if len(leaders) != 1 or (leader := leaders.pop()) not in by_id:
            raise ServerError(f"the etcd members do not agree on a live leader: {status}")
        return self.endpoints.index(by_id[leader].removeprefix("http://"))

    def heal(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Every member running and healthy again; made anew (fresh ports and data) when that
        fails."""
        try:
            self.start(timeout_s)
        except ServerError:
            self.stop()
            self.members = []
            self._bootstrap(timeout_s)

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bootstrap -----------------------------------------------------------------------------

    def _bootstrap(self, timeout_s: float) -> None:
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self._make_members()
            for member in self.members:
                member.process.start()
            try:
                self.wait_healthy(timeout_s)
                return
            except ServerError:
                lost_race = any(bind_failed(m.process) for m in self.members)
                self.stop()
                if not lost_race or attempt == BIND_ATTEMPTS:
                    raise

    def _make_members(self) -> None:
        self._bootstraps += 1
        ports = free_ports(2 * self.n)
        tag = f"b{self._bootstraps}"
        members = []
        for i in range(self.n):
            name = f"m{i}"
            members.append(
                Member(
                    name=name,
                    client_port=ports[2 * i],
                    peer_port=ports[2 * i + 1],
                    data_dir=self.base_dir / tag / name,
                    process=ServerProcess(
                        f"etcd {name}", [], self.base_dir / f"{name}.log", env=_env()
                    ),
                )
            )
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
        token = f"cluster-tests-{uuid.uuid4().hex[:12]}"  # two clusters never merge
        for m in members:
            m.process.args = [
                "etcd",
                f"--name={m.name}",
                f"--data-dir={m.data_dir}",
                f"--listen-client-urls={m.listen_url(self.listen_any)}",
                f"--advertise-client-urls={m.client_url}",
                f"--listen-peer-urls={m.peer_url}",
                f"--initial-advertise-peer-urls={m.peer_url}",
                f"--initial-cluster={initial}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token={token}",
                "--logger=zap",
                "--log-outputs=stderr",
                *([f"--quota-backend-bytes={self.quota_bytes}"] if self.quota_bytes else []),
            ]
        self.members = members


@pytest.fixture(scope="module")
def _etcd_module_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    require(why_unavailable())
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def etcd_cluster(_etcd_module_cluster: EtcdCluster, request: pytest.FixtureRequest) -> EtcdCluster:
    cluster = _etcd_module_cluster
    cluster.heal()
    cluster.prefix = f"/tests/{uuid.uuid4().hex[:12]}/"
    for member in cluster.members:
        attach_log(request.node, member.process.name, member.process.log)
    return cluster


@pytest.fixture(scope="module")
def _etcd_auth_module_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    require(why_unavailable())
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-auth"), n=1)
    try:
        cluster.start()
        cluster.enable_auth()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def etcd_auth_cluster(
    _etcd_auth_module_cluster: EtcdCluster, request: pytest.FixtureRequest
) -> EtcdCluster:
    cluster = _etcd_auth_module_cluster
    made = cluster._bootstraps
    cluster.heal()
    if cluster._bootstraps != made:  # made anew: without its users
        cluster.root_password = ""
        cluster.enable_auth()
    tag = uuid.uuid4().hex[:12]
    cluster.prefix = f"/tests/{tag}/"
    cluster.user = f"job-{tag}"
    cluster.password = cluster.add_user(cluster.user, cluster.prefix)
    for member in cluster.members:
        attach_log(request.node, member.process.name, member.process.log)
    return cluster


@pytest.fixture
def make_etcd_cluster(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., EtcdCluster]]:
    require(why_unavailable())
    made: list[EtcdCluster] = []

    def make(n: int = 3, *, listen_any: bool = False, quota_bytes: int = 0) -> EtcdCluster:
        base = tmp_path / f"etcd{len(made)}"
        cluster = EtcdCluster(base, n, listen_any=listen_any, quota_bytes=quota_bytes)
        made.append(cluster)
        cluster.start()
        for member in cluster.members:
            name = f"{member.process.name} of cluster {len(made)}"
            attach_log(request.node, name, member.process.log, whole=True)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
