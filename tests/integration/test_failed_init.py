"""An init() that fails (its scheduler is not up) leaves nothing behind: the program that
catches the error may call init() again (and hears the same error, not that init() was
already called), the getters still say to call it, no agent thread is left, and a program
that goes on without the job and returns exits 0, with nothing raised again at exit and its
atexit handlers run once. A real process, refused by a port that nothing listens on."""

from __future__ import annotations

import subprocess
import sys

from cluster.testing import free_port
from tests.procs import ROOT, job_env

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "failed_init.py")


def test_a_failed_init_can_be_retried_and_is_not_raised_again_at_exit() -> None:
    env = job_env(1, free_port(), MS_ROLE="MS_WORKER", MS_NODE_ID="0", MS_TOPO_TIMEOUT="1")
    result = subprocess.run(
        [sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "first init: TopologyTimeoutError",
        "second init: TopologyTimeoutError",
        "get_rank: this needs the job to be formed: call cluster.init() first (in every worker)",
        "agent threads: []",
        "going on without the job",
        "atexit handler ran",
    ]
    assert "cluster: " not in result.stderr, result.stderr  # no error line at exit
    assert "Traceback" not in result.stderr, result.stderr
