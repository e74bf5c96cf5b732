"""The checked-in generated code is exactly what `python scripts/gen_protos.py` produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh = sorted((tmp_path / "cluster" / "v1").glob("*_pb2*"))
    committed = sorted((ROOT / "cluster" / "v1").glob("*_pb2*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    stale = [p.name for p, q in zip(fresh, committed) if p.read_bytes() != q.read_bytes()]
    assert not stale, f"regenerate with `python scripts/gen_protos.py`: {stale} differ"
