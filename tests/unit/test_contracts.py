"""The import-linter contracts bite: a clock or an event loop planted in a pure machine breaks
them (`lint-imports`, run by scripts/test, fails)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed")
def test_time_or_asyncio_in_a_pure_machine_breaks_the_contracts(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "cluster", tmp_path / "cluster", ignore=shutil.ignore_patterns("*.pyc"))
    planted_in = [("scheduler/machine/state.py", "time"), ("worker/machine/core.py", "asyncio")]
    for module, planted in planted_in:
        path = tmp_path / "cluster" / module
        text = path.read_text()
        head = "from __future__ import annotations\n"
        path.write_text(text.replace(head, f"{head}\nimport {planted}\n", 1))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    found = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert found.returncode != 0, found.stdout
    said = found.stdout
    assert "cluster.scheduler.machine.state -> time" in said, said
    assert "cluster.worker.machine.core -> asyncio" in said, said


# The modules that may speak the wire (cluster.v1): the converters, the servicer, the stubs and
# clients, the worker's Watch call, the peer table's wire deltas and the peer-state server.
# Everything else works on the domain's records.
WIRE_MODULES = {
    "cluster/scheduler/convert.py",
    "cluster/scheduler/servicer.py",
    "cluster/tools/status.py",
    "cluster/transport/stub.py",
    "cluster/worker/convert.py",
    "cluster/worker/peer_table.py",
    "cluster/worker/state_fetch.py",
    "cluster/worker/state_server.py",
    "cluster/worker/watch_stream.py",
}


def _imports_the_wire(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cluster.v1"):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "cluster"
            and any(alias.name == "v1" for alias in node.names)
        ):
            return True
        if isinstance(node, ast.Import) and any(
            alias.name.startswith("cluster.v1") for alias in node.names
        ):
            return True
    return False


def test_only_the_edge_imports_the_wire_format() -> None:
    package = ROOT / "cluster"
    found = {
        str(path.relative_to(ROOT))
        for path in package.rglob("*.py")
        if "v1" not in path.relative_to(package).parts and _imports_the_wire(path)
    }
    assert found == WIRE_MODULES
    assert len(WIRE_MODULES) <= 9
