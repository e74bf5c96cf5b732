"""The pytest side of the test servers: a failing test shows what its servers logged while it ran.

Fixtures call `attach_log(request.node, name, path)`; when the test fails (in setup, call or
teardown), the report gets one section per log with the lines written since it was attached.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _pytest.nodes import Node  # what request.node is

from tests.servers._process import tail


@dataclass(frozen=True)
class AttachedLog:
    name: str
    path: Path
    offset: int


LOGS = pytest.StashKey[list[AttachedLog]]()
REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def attach_log(node: Node, name: str, path: Path, *, whole: bool = False) -> None:
    """Show `path` in the report of `node` if it fails: what is written from now on, or the
    whole file (its last lines)."""
    offset = path.stat().st_size if path.exists() and not whole else 0
    node.stash.setdefault(LOGS, []).append(AttachedLog(name, path, offset))


def failed(node: Node) -> bool:
    """Whether the test has failed so far (for a fixture's teardown)."""
    return any(report.failed for report in node.stash.get(REPORTS, {}).values())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    if report.failed:
        for log in item.stash.get(LOGS, []):
            report.sections.append((f"{log.name} ({log.path})", tail(log.path, offset=log.offset)))
    return report
