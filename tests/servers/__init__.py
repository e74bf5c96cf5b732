"""Real servers for the tests: etcd, Prometheus, Slurm and headless Chromium.

Each module starts its server as child processes on loopback ports with every file in a
temporary directory, waits (bounded) for its readiness, and stops it in a `finally`, process
groups included. `scripts/setup` installs the Debian packages they need (as root).

A fixture whose server cannot run here calls `require(why)`: the test is skipped with the reason,
except when CLUSTER_REQUIRE_SERVERS=1 (CI), where it fails: CI installs everything, so a skip
there means a broken install, not a missing feature.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ENV = "CLUSTER_REQUIRE_SERVERS"


def servers_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") == "1"


def require(why: str | None) -> None:
    """Go on when `why` is None; else skip the test saying why (fail it under CI's setting)."""
    if why is None:
        return
    if servers_required():
        pytest.fail(
            f"{why}; {REQUIRE_ENV}=1 forbids skipping a server test "
            "(run scripts/setup as root to install the servers)",
            pytrace=False,
        )
    pytest.skip(why)
