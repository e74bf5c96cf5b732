from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Procs, procs


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
