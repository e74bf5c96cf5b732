"""`orphan.launcher_gone`: a running launcher, a pid reused by a newer process, a free pid."""

from __future__ import annotations

import os
import subprocess
import sys

from cluster.worker import orphan


def test_the_launcher_is_gone_when_its_pid_is_free_or_held_by_a_newer_process() -> None:
    assert not orphan.launcher_gone(os.getppid())  # started before this process, running
    child = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)
    try:
        assert orphan.launcher_gone(child.pid)  # started after this process: a reused pid
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    assert orphan.launcher_gone(child.pid)  # free (or reused by a process newer still)
