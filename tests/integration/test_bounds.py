"""Absurd launch values are one line, not a traceback, and a failed job's scheduler exits.

`MS_WORKER_NUM=10**12` overflowed gRPC's channel arguments (a traceback); a scheduler of 10**8
workers whose topology timed out spent its last 20 s and gigabytes listing every missing rank;
an advertise host with an escape was a socket.gaierror. Each is now bounded where it is read.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from cluster.protocol.config import MAX_NODES
from cluster.protocol.errors import ConfigError
from cluster.testing import free_port
from cluster.worker.identity import make_identity
from tests.procs import PYTHON, ROOT, example_error_line, job_env

EXIT_S = 30.0


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`mscluster ARGS` in the checkout with `env`, run to its end (bounded)."""
    return subprocess.run(
        [PYTHON, "-m", "cluster", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=EXIT_S * 2,
        cwd=ROOT,
        check=False,
    )


def scheduler(**env: str) -> subprocess.CompletedProcess[str]:
    base = {
        "MS_ROLE": "MS_SCHED",
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": "0",
        "MS_WORKER_NUM": "1",
    }
    return cli("scheduler", env={**os.environ, **base, **env})


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"MS_WORKER_NUM": str(10**12)}, "MS_WORKER_NUM='1000000000000' is out of range"),
        ({"MS_WORKER_NUM": str(10**8)}, "between 1 and 1000000"),
        ({"MS_SERVER_NUM": str(10**12)}, "MS_SERVER_NUM='1000000000000' is out of range"),
        ({"MS_SCHED_HOST": "evil\x1b]0;x\x07"}, "'evil\\x1b]0;x\\x07' is not a host name"),
        ({"MS_SCHED_HOST": "h" * 4096}, "...(4096 chars)' is not a host name"),
        # 2147483 s passed, then gRPC's keepalive (a C int of ms) was an OverflowError.
        ({"MS_NODE_TIMEOUT": "2147483"}, "MS_NODE_TIMEOUT='2147483' is out of range"),
        ({"MS_NODE_TIMEOUT": "1e20"}, "at most 2000000 (23 days)"),
        ({"MS_NODE_TIMEOUT": "0.01"}, "at least 1 and at most"),
        ({"CLUSTER_HEARTBEAT_INTERVAL": "1e-9"}, "at least 0.1 and at most"),
        ({"MS_TOPO_TIMEOUT": "1e300"}, "MS_TOPO_TIMEOUT='1e300' is out of range"),
    ],
)
def test_an_absurd_value_is_one_line(env: dict[str, str], said: str) -> None:
    done = scheduler(**env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert said in lines[0]
    assert "\x1b" not in lines[0]
    assert len(lines[0]) < 400


def dry_run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`mscluster run --dry-run ARGS examples/allgather_check.py` in this environment with `env`."""
    return cli("run", "--dry-run", *args, "examples/allgather_check.py", env={**os.environ, **env})


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("3e6", "--node-timeout='3000000' is out of range"),
        ("0.5", "--node-timeout='0.5' is out of range"),
    ],
)
def test_a_node_timeout_out_of_bounds_is_refused_by_the_launcher(option: str, said: str) -> None:
    """`mscluster run --dry-run --node-timeout 3e6` planned a job whose scheduler would die."""
    done = dry_run("--node-timeout", option)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"mscluster: ConfigError: {said}: it must be a positive number of seconds, at least 1 "
        "and at most 2000000 (23 days)"
    ]


@pytest.mark.parametrize("value", ["4GiB", "\uff14", "-1"])
def test_a_bad_pinned_memory_bound_is_refused_at_init_and_by_the_launcher(value: str) -> None:
    """CLUSTER_PINNED_MAX_BYTES=4GiB passed init and failed hours later, at the first checkpoint
    of CUDA tensors; a fullwidth 4 was 4 bytes."""
    said = "CLUSTER_PINNED_MAX_BYTES="
    env = {**job_env(2, free_port()), "MS_ROLE": "MS_WORKER", "CLUSTER_PINNED_MAX_BYTES": value}
    line = example_error_line(env)
    assert said in line, line
    assert "it must be >= 0" in line, line
    done = dry_run(CLUSTER_PINNED_MAX_BYTES=value)
    assert done.returncode == 2, done.stderr
    assert [said in line for line in done.stderr.strip().splitlines()] == [True], done.stderr


def test_a_failed_job_of_the_most_workers_ends_its_scheduler_at_once() -> None:
    """The topology of MAX_NODES workers times out: the scheduler says so and exits 1, within
    seconds (the missing ranks are spans of the registered ones, never a list of each)."""
    started = time.monotonic()
    done = scheduler(MS_WORKER_NUM=str(MAX_NODES), MS_TOPO_TIMEOUT="1")
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert f"job failed: 0 of {MAX_NODES} workers registered" in done.stderr
    assert f"missing: ranks 0-{MAX_NODES - 1}" in done.stderr
    assert took < EXIT_S


def test_an_advertised_host_with_an_escape_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLUSTER_ADVERTISE_HOST", "10.0.0.1\x1b[2J")
    with pytest.raises(ConfigError, match=r"^CLUSTER_ADVERTISE_HOST '10\.0\.0\.1\\x1b\[2J' is"):
        make_identity("0", "127.0.0.1", 1)
