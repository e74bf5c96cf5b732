"""`cluster.tools.processes`: a process to signal is found through what started it (the
launcher's pids file, the descendants of a process), never by a name on the whole machine."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.testing import wait_until
from cluster.tools import processes

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]  # sleep-ok: a target that waits
# A shell that starts a sleeper and waits: the sleeper is a grandchild of this test.
NESTED = ["bash", "-c", f"{shlex.join(SLEEP)} & wait"]


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    popens: list[subprocess.Popen[bytes]] = []
    yield popens
    for popen in popens:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)  # its group: a shell's sleeper too
        popen.wait(10)


def start(started: list[subprocess.Popen[bytes]], args: list[str], **env: str) -> int:
    popen = subprocess.Popen(args, env={**os.environ, **env}, start_new_session=True)
    started.append(popen)
    return popen.pid


def test_descendants_holds_children_and_grandchildren_only(
    started: list[subprocess.Popen[bytes]],
) -> None:
    child = start(started, SLEEP)
    shell = start(started, NESTED)
    wait_until(lambda: bool(processes.descendants(shell)), 10, "the shell's child")
    below_shell = processes.descendants(shell)
    assert len(below_shell) == 1
    mine = processes.descendants(os.getpid())
    assert {child, shell, *below_shell} <= set(mine)
    assert os.getpid() not in mine
    assert 1 not in mine
    assert child not in below_shell


def test_worker_pid_looks_below_the_given_process_only(
    started: list[subprocess.Popen[bytes]],
) -> None:
    worker = {"MS_ROLE": "MS_WORKER", "MS_NODE_ID": "2"}
    ours = start(started, SLEEP, **worker)
    wait_until(  # until its exec shows the environment
        lambda: processes.worker_pid(os.getpid(), "2") is not None, 10, "the worker's exec"
    )
    assert processes.worker_pid(os.getpid(), "2") == ours
    assert processes.worker_pid(os.getpid(), "2", marker="no-such-script") is None
    assert processes.worker_pid(os.getpid(), "3") is None
    # A look-alike that is not below the root given is not seen.
    assert processes.worker_pid(ours, "2") is None


def test_launched_pid_gives_a_listed_child_of_the_listed_launcher_only(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    child = start(started, SLEEP)
    processes.write_pids(tmp_path, {"scheduler": child, "worker_0": 1})  # launcher: this test
    assert processes.launched_pids(tmp_path) == {
        "launcher": os.getpid(),
        "scheduler": child,
        "worker_0": 1,
    }
    assert processes.launched_pid(tmp_path, "scheduler") == child
    assert processes.launched_pid(tmp_path, "worker_0") is None  # pid 1 is not our child
    assert processes.launched_pid(tmp_path, "worker_1") is None  # not listed
    assert processes.launched_pid(tmp_path / "nowhere", "scheduler") is None
    started[0].kill()
    started[0].wait(10)  # reaped: no longer a process
    assert processes.launched_pid(tmp_path, "scheduler") is None  # exited


def test_a_group_whose_leader_exited_is_signalled_only_while_no_process_has_its_number(
    started: list[subprocess.Popen[bytes]],
) -> None:
    """A shell leads a group and exits, leaving its sleeper there: the group is still signalled.
    A process that has the number of a reaped leader got it since: its group is left alone."""
    shell = subprocess.Popen(
        ["bash", "-c", f"{shlex.join(SLEEP)} & echo $!"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert shell.stdout is not None
    sleeper = int(shell.stdout.readline())
    shell.stdout.close()
    shell.wait(10)
    try:
        assert processes.groups_running([shell.pid]) == {shell.pid}
        processes.signal_group(shell.pid, signal.SIGKILL, leader_reaped=True)
        wait_until(lambda: not processes.alive(sleeper), 10, "the sleeper to end")
        assert processes.groups_running([shell.pid]) == set()
    finally:
        processes.signal_group(shell.pid, signal.SIGKILL, leader_reaped=True)
    other = start(started, SLEEP)  # stands for a process given a reaped leader's number
    assert not processes.group_is_ours(other, leader_reaped=True)
    processes.signal_group(other, signal.SIGKILL, leader_reaped=True)
    assert processes.alive(other)
