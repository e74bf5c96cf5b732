"""etcd with authentication on (issue 24, item 6): a real etcd whose `root` turned `auth enable`
on, and a user per test whose role may read and write the test's prefix only.

The job runs with CLUSTER_ETCD_USER and CLUSTER_ETCD_PASSWORD_FILE (two schedulers, one leads,
workers of train_mlp.py), and goes on when etcd ends the schedulers' tokens mid-run (a password
change does that: they log in again). A scheduler that etcd refuses (no user, a wrong password)
or whose password file others may read says so in one line at start and exits 2, no traceback,
no "etcd does not answer" retried for ever."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cluster.protocol.state_url import state_url_from_env
from cluster.scheduler import stores
from cluster.testing import free_port
from tests.integration.test_failover import HOSTS, HaJob
from tests.procs import PYTHON, Procs, job_env
from tests.servers.etcd import EtcdCluster
from tests.training_job import STEP_LINE

pytest.importorskip("numpy")

REFUSED = "refused the scheduler"
FIX = "set CLUSTER_ETCD_USER and CLUSTER_ETCD_PASSWORD_FILE"


def password_file(tmp_path: Path, password: str, mode: int = 0o600) -> Path:
    path = tmp_path / "etcd-password"
    path.write_text(password + "\n")
    path.chmod(mode)
    return path


def login_env(etcd: EtcdCluster, path: Path, user: str | None = None) -> dict[str, str]:
    return {"CLUSTER_ETCD_USER": user or etcd.user, "CLUSTER_ETCD_PASSWORD_FILE": str(path)}


def test_a_job_runs_on_an_etcd_with_auth_and_its_schedulers_log_in_again_when_tokens_end(
    processes: Procs, tmp_path: Path, etcd_auth_cluster: EtcdCluster
) -> None:
    etcd = etcd_auth_cluster
    env = login_env(etcd, password_file(tmp_path, etcd.password))
    job = HaJob(processes, tmp_path, etcd, scheduler_env=env)
    # A password change ends every token of the user: each scheduler's next request is refused
    # ("invalid auth token"), and it logs in again with the same password.
    etcd.etcdctl("user", "passwd", etcd.user, "--interactive=false", stdin=etcd.password + "\n")
    assert len(job.final_hash()) == 64
    assert all(STEP_LINE.search(w.output) for w in job.workers)
    leader = job.schedulers[job.first_leader]
    assert leader.wait(30) == 0, leader.output
    assert "logging in again" in leader.output
    stored = etcd.etcdctl("get", "--prefix", "--keys-only", etcd.prefix)
    assert f"{etcd.prefix}state" in stored.split()
    for host in HOSTS:
        assert "Traceback" not in job.schedulers[host].output


def start_scheduler(etcd: EtcdCluster, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    args = ["--worker-num", "1", "--host", "127.0.0.1", "--port", str(free_port())]
    return subprocess.run(
        [PYTHON, "-m", "cluster", "scheduler", *args, "--state-url", etcd.state_url()],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=job_env(1, 1, **env),
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if "mscluster:" in line]
    assert len(said) == 1, result.stderr
    return said[0]


def test_without_a_user_the_scheduler_says_etcd_refused_it_in_one_line(
    etcd_auth_cluster: EtcdCluster,
) -> None:
    said = one_line(start_scheduler(etcd_auth_cluster, {}))
    assert f"etcd at {etcd_auth_cluster.state_url().rstrip('/')} {REFUSED}" in said
    assert f"authentication required: {FIX}" in said


@pytest.mark.parametrize("wrong", ["password", "user"])
def test_a_wrong_user_or_password_is_one_line_at_start(
    etcd_auth_cluster: EtcdCluster, tmp_path: Path, wrong: str
) -> None:
    etcd = etcd_auth_cluster
    password = "not-" + etcd.password if wrong == "password" else etcd.password
    user = "nobody" if wrong == "user" else etcd.user
    said = one_line(start_scheduler(etcd, login_env(etcd, password_file(tmp_path, password), user)))
    assert f"{REFUSED}: wrong user or password (user {user!r}): {FIX}" in said
    assert password not in said


def test_a_user_without_permission_on_the_prefix_is_one_line_at_start(
    etcd_auth_cluster: EtcdCluster, tmp_path: Path
) -> None:
    etcd = etcd_auth_cluster
    env = login_env(etcd, password_file(tmp_path, etcd.password))
    etcd.prefix = "/tests/someone-else/"
    said = one_line(start_scheduler(etcd, env))
    assert f"{REFUSED}: user {etcd.user!r} may not read and write /tests/someone-else/" in said


def test_a_password_file_that_others_may_read_is_refused(
    etcd_auth_cluster: EtcdCluster, tmp_path: Path
) -> None:
    etcd = etcd_auth_cluster
    path = password_file(tmp_path, etcd.password, 0o644)
    said = one_line(start_scheduler(etcd, login_env(etcd, path)))
    assert f"CLUSTER_ETCD_PASSWORD_FILE={str(path)!r} is open to other users (mode 0644)" in said
    assert f"chmod 600 {path}" in said


async def test_the_store_logs_in_again_when_etcd_ends_its_token(
    etcd_auth_cluster: EtcdCluster, tmp_path: Path
) -> None:
    etcd = etcd_auth_cluster
    env = login_env(etcd, password_file(tmp_path, etcd.password))
    url = state_url_from_env({"CLUSTER_STATE_URL": etcd.state_url(), **env})
    assert url is not None
    store = await stores.open_etcd(url, "127.0.0.1:1", 5)
    try:
        assert await store.acquire() is None  # it leads: its writes landed
        etcd.etcdctl("user", "passwd", etcd.user, "--interactive=false", stdin=etcd.password + "\n")
        assert (await store.load()).snapshot is None  # refused once, logged in again, read
        assert await store.election.keepalive() > 0  # (aetcd's lease stream: the new token)
    finally:
        await store.close()
