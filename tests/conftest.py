from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.procs import Procs


# Tests under these folders start processes or servers: all of them are `slow`, so that
# `pytest -m "not slow"` is the fast tier (the units, the simulation and its transcripts).
SLOW_FOLDERS = ("integration", "servers", "chaos")
# Unit files whose every test starts a process (a Python child, protoc, checkov, a script).
SLOW_FILES = frozenset(
    {
        "unit/test_chaos_stop.py",
        "unit/test_ending.py",
        "unit/test_manifest_scan.py",
        "unit/test_orphan.py",
        "unit/test_processes.py",
        "unit/test_protos_current.py",
        "unit/test_scripts.py",
    }
)


# Files whose tests time real network faults or load the machine on purpose: `solo`, run
# alone after the rest (`scripts/test` runs the rest three at a time: pytest-xdist).
SOLO_FILES = frozenset(
    {
        "integration/test_partition.py",  # network namespaces, partitions timed against 3 s
        "integration/test_scale.py",  # 64 real workers
        "integration/test_hostile.py",  # floods, and the scheduler's peak memory
        "integration/test_member_floods.py",  # a member's calls at once, past its share
        "integration/test_connections.py",  # file-descriptor limits, thousands of sockets
        "integration/test_hosts.py",  # 4 network namespaces, 32 real workers, faults
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test under SLOW_FOLDERS and in SLOW_FILES (an explicit mark elsewhere
    still counts), and `solo` every test in SOLO_FILES."""
    tests = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(tests).parts if item.path.is_relative_to(tests) else ()
        if "/".join(parts) in SOLO_FILES and item.get_closest_marker("solo") is None:
            item.add_marker(pytest.mark.solo)
        slow = bool(parts) and (parts[0] in SLOW_FOLDERS or "/".join(parts) in SLOW_FILES)
        if slow and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _outside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite run inside a Slurm allocation: `mscluster run` must not read it (it would
    place the tests' jobs by the allocation); the Slurm tests make allocations of their own."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SLURMD_")):
            monkeypatch.delenv(name)


class FakeClock:
    """The clock the pure cores take (`clock()` -> seconds), moved only by the test."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path, for unix sockets (a socket's path has at most 107 bytes,
    and pytest's tmp_path may be longer)."""
    directory = Path(tempfile.mkdtemp(prefix="sock-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def processes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Procs]:
    """The test's processes, killed when it ends; a failed test's report shows the last lines
    each of them wrote (a restarted name: its last process)."""
    # Imported here: tests.procs imports cluster.testing, which pytest must first load as the
    # plugin below (so that its asserts are rewritten).
    from tests.procs import procs  # noqa: PLC0415
    from tests.servers.plugin import attach_log  # noqa: PLC0415

    def show(name: str, log: Path) -> None:
        attach_log(request.node, f"process {name}", log, whole=True)

    with procs(tmp_path, on_start=show) as group:
        yield group


@pytest.fixture
def left() -> Iterator[dict[int, str]]:
    """A job's processes (pid -> start time, `tests.procs.note_below`); any still running at
    the end (the test failed) is killed then, once checked to be that process still."""
    from tests.procs import kill_noted  # noqa: PLC0415 - see `processes`

    found: dict[int, str] = {}
    yield found
    kill_noted(found)


# The fault-injection fixture users get (cluster.testing.local_job), and the real servers'
# fixtures (tests/servers/: etcd_cluster, prometheus, slurm, scontrol_env, browser, ...).
pytest_plugins = [
    "cluster.testing",
    "tests.servers.plugin",
    "tests.servers.etcd",
    "tests.servers.prometheus",
    "tests.servers.slurm",
    "tests.servers.browser",
]
