from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Procs, procs


@pytest.fixture(autouse=True)
def _outside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite run inside a Slurm allocation: `mscluster run` must not read it (it would
    place the tests' jobs by the allocation); the Slurm tests make allocations of their own."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SLURMD_")):
            monkeypatch.delenv(name)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Procs]:
    with procs(tmp_path) as group:
        yield group


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
