"""The variables that define a job are the launcher's and the scheduler's own to decide: one
inherited from the environment that says otherwise is refused (`mscluster run`) or not read
(a scheduler's CLUSTER_SCHED_ADDRS), never silently taken over what was asked for."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cluster.testing import free_port
from tests.procs import MSCLUSTER, Procs, private_copy, processes_running, run_args

ETCD = "etcd://127.0.0.1:1/jobs/old"


def run(
    tmp_path: Path, script: Path, port: int, env: dict[str, str], *extra: str
) -> subprocess.CompletedProcess[str]:
    """`mscluster run --worker-num 1 ... script` in this environment with `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    return subprocess.run(
        run_args(*extra, script, worker_num=1, master_port=port, log_dir=tmp_path / "logs"),
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("env", "extra", "expected"),
    [
        # The workers went to 10.1.2.3:7000 while the launcher started the scheduler at
        # 127.0.0.1:PORT (and the scheduler, given the list too, failed naming MS_SCHED_HOST).
        (
            {"CLUSTER_SCHED_ADDRS": "10.1.2.3:7000"},
            [],
            "CLUSTER_SCHED_ADDRS='10.1.2.3:7000' is set in this environment, but mscluster run "
            "decides it (--master-addr and --master-port: 127.0.0.1:{port})",
        ),
        # The launcher planned recovery off; its scheduler attached to an old job's prefix.
        (
            {"CLUSTER_STATE_URL": ETCD},
            [],
            f"CLUSTER_STATE_URL='{ETCD}' is set in this environment, but mscluster run decides "
            "it (--state-url: not given), and its processes would take this one instead: unset "
            "it, or give --state-url",
        ),
        (
            {"CLUSTER_STATE_URL": "etcd://127.0.0.1:1/jobs/other"},
            ["--state-url", ETCD],
            f"(--state-url: {ETCD})",
        ),
        ({"CLUSTER_LEASE_S": "7"}, ["--state-url", ETCD], "CLUSTER_LEASE_S='7' is set"),
        ({"CLUSTER_LEASE_S": "7"}, ["--state-url", ETCD, "--lease", "3"], "(--lease: 3)"),
        ({"CLUSTER_SPARE": "1"}, [], "CLUSTER_SPARE='1' is set in this environment"),
        ({"CLUSTER_RELAY": "unix:/tmp/other.sock"}, ["--no-relay"], "CLUSTER_RELAY='unix:"),
        # Passed on, it would have the scheduler wait for servers that nobody starts.
        (
            {"MS_SERVER_NUM": "2"},
            [],
            "MS_SERVER_NUM='2' is set in this environment, but mscluster run decides it (it "
            "starts workers and no server: 0)",
        ),
    ],
)
def test_an_inherited_variable_against_the_launchers_options_is_refused(
    tmp_path: Path, env: dict[str, str], extra: list[str], expected: str
) -> None:
    script = private_copy(tmp_path)
    port = free_port()
    for dry_run in (["--dry-run"], []):
        result = run(tmp_path, script, port, env, *extra, *dry_run)
        assert result.returncode == 2, (dry_run, result.stdout, result.stderr)
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("mscluster: ConfigError: ")
        assert expected.format(port=port) in line
        assert not processes_running(str(script))
        assert not (tmp_path / "logs").exists()  # nothing made: checked before


@pytest.mark.parametrize(
    ("env", "extra"),
    [
        ({"CLUSTER_SCHED_ADDRS": " 127.0.0.1:{port} "}, []),
        (
            {"CLUSTER_STATE_URL": ETCD + "/", "CLUSTER_LEASE_S": "3"},
            ["--state-url", ETCD, "--lease", "3"],
        ),
        ({"CLUSTER_SPARE": "", "CLUSTER_RELAY": " "}, []),
        ({"MS_SERVER_NUM": "0"}, []),
    ],
)
def test_an_inherited_variable_that_agrees_is_taken(
    tmp_path: Path, env: dict[str, str], extra: list[str]
) -> None:
    port = free_port()
    env = {name: value.format(port=port) for name, value in env.items()}
    result = run(tmp_path, private_copy(tmp_path), port, env, "--dry-run", *extra)
    assert result.returncode == 0, result.stderr


def test_a_job_with_an_agreeing_address_list_runs(tmp_path: Path) -> None:
    port = free_port()
    env = {"CLUSTER_SCHED_ADDRS": f"127.0.0.1:{port}"}
    result = run(tmp_path, private_copy(tmp_path), port, env)
    assert result.returncode == 0, result.stderr
    assert "allgather rank=0 size=1" in (tmp_path / "logs" / "worker_0.log").read_text()


def test_a_scheduler_listens_where_its_options_say_whatever_the_workers_list(
    processes: Procs,
) -> None:
    """`CLUSTER_SCHED_ADDRS=127.0.0.1:Q,... mscluster scheduler --port P` listened on Q: the
    list says where workers look; a scheduler listens on --host and --port (MS_SCHED_*)."""
    port, listed = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    env["CLUSTER_SCHED_ADDRS"] = f"127.0.0.1:{listed},127.0.0.2:{listed}"
    args = ["--host", "127.0.0.1", "--port", str(port), "--worker-num", "1"]
    sched = processes.start("scheduler", [*MSCLUSTER, "scheduler", *args], env)
    sched.wait_for_output(f"listening on 127.0.0.1:{port} for 1 worker", 30)
