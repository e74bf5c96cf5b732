"""An init() that fails (its scheduler is not up; its TLS certificate cannot be loaded) leaves
nothing behind: the program that catches the error may call init() again (and hears the same
error, not that init() was already called), the getters still say to call it, no agent thread
is left, SIGUSR2 has its default action and GRPC_ENABLE_FORK_SUPPORT is unset again, and a
program that goes on without the job and returns exits 0, with nothing raised again at exit
and its atexit handlers run once. A real process, refused by a port that nothing listens on,
or by its own wrong password.

An init() that failed as the session was made (the wrong password) left the agent's thread
running, the session's SIGUSR2 handler installed and GRPC_ENABLE_FORK_SUPPORT set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.testing import free_port
from tests.procs import ROOT, certs, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "failed_init.py")


def tls_with_a_wrong_password(tmp_path: Path) -> dict[str, str]:
    assert certs(tmp_path / "pki").returncode == 0
    config = str(tmp_path / "pki" / "ssl.json")
    return {"CLUSTER_TLS_CONFIG": config, "CLUSTER_TLS_CLIENT_PASSWORD": "wrong"}


@pytest.mark.parametrize(
    ("cause", "error"),
    [("no scheduler", "TopologyTimeoutError"), ("a wrong password", "TLSConfigError")],
)
def test_a_failed_init_can_be_retried_and_is_not_raised_again_at_exit(
    tmp_path: Path, cause: str, error: str
) -> None:
    extra = tls_with_a_wrong_password(tmp_path) if cause == "a wrong password" else {}
    env = job_env(1, free_port(), MS_ROLE="MS_WORKER", MS_NODE_ID="0", MS_TOPO_TIMEOUT="1", **extra)
    result = subprocess.run(
        [sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"first init: {error}",
        f"second init: {error}",
        "get_rank: this needs the job to be formed: call cluster.init() first (in every worker)",
        "agent threads: []",
        "SIGUSR2 default: True",
        "GRPC_ENABLE_FORK_SUPPORT: None",
        "going on without the job",
        "atexit handler ran",
    ]
    assert "cluster: " not in result.stderr, result.stderr  # no error line at exit
    assert "Traceback" not in result.stderr, result.stderr
