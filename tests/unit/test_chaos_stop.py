"""A chaos run stopped by a signal exits within its bound even when its teardown blocks, and
says what blocked (every thread's stack) first."""

from __future__ import annotations

import subprocess

from tests.procs import PYTHON, ROOT

BLOCKED = """
import threading
from cluster.tools import chaos_run
chaos_run._exit_within(0.2, 130)
threading.Event().wait(60)  # a teardown that blocks
"""


def test_a_stopped_run_whose_teardown_blocks_exits_with_the_stacks() -> None:
    done = subprocess.run(
        [PYTHON, "-c", BLOCKED], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 130, done.stderr
    assert "still ending 0.2 s after the signal" in done.stderr, done.stderr
    assert 'File "<string>", line 5' in done.stderr, done.stderr  # where it blocked
