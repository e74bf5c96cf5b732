"""The scheduler's open-files limit: raised to the hard limit, and what it leaves room for."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest

from cluster.scheduler import limits


@pytest.fixture
def low_soft_limit() -> Iterator[int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    yield low
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_to_the_hard_one(low_soft_limit: int) -> None:
    files = limits.raise_open_files()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert (files.before, files.limit, soft) == (low_soft_limit, soft, soft)
    if hard != resource.RLIM_INFINITY:
        assert soft == hard
    assert files.nodes == soft - limits.HEADROOM
    line = files.describe()
    assert f"open-files limit {soft} (raised from {low_soft_limit})" in line
    assert f"room for about {soft - limits.HEADROOM} nodes" in line


def test_a_job_larger_than_the_limit_is_warned_about() -> None:
    files = limits.OpenFiles(before=1024, limit=1024, hard=1024)
    assert files.too_low(900) is None
    warning = files.too_low(2048)
    assert warning is not None
    assert "this job has 2048 nodes, but the open-files limit of 1024" in warning
    assert "room for about 924 connections" in warning
    assert "ulimit -Hn" in warning
    assert "behind a relay per host" in warning  # the way that needs no limit raised
