"""The import-linter contracts bite: a clock or an event loop planted in a pure machine breaks
them (`lint-imports`, run by scripts/test, fails)."""

from __future__ import annotations

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
    for module, planted in [("protocol/state.py", "time"), ("worker/core.py", "asyncio")]:
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
    assert "cluster.protocol.state is not allowed to import time" in found.stdout, found.stdout
    assert "cluster.worker.core is not allowed to import asyncio" in found.stdout, found.stdout
