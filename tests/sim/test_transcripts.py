"""Transcripts (`tests/sim/transcripts/*.txt`, `tests/sim/transcript.py`): each scenario prints
what its file expects. CLUSTER_REWRITE_TRANSCRIPTS=1 writes what they print instead (then read
the diff)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from tests.sim.transcript import TRANSCRIPTS, parse, render, run

FILES = sorted(TRANSCRIPTS.glob("*.txt"))


def test_there_are_transcripts() -> None:
    assert len(FILES) >= 5


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_a_transcript_prints_what_it_expects(path: Path) -> None:
    expected = path.read_text()
    blocks = parse(expected)
    printed = render(blocks, run(blocks))
    if os.environ.get("CLUSTER_REWRITE_TRANSCRIPTS") == "1":
        path.write_text(printed)
        return
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            printed.splitlines(keepends=True),
            f"{path.name} (expected)",
            f"{path.name} (printed)",
        )
    )
    assert not diff, (
        f"{path.name} prints otherwise (CLUSTER_REWRITE_TRANSCRIPTS=1 rewrites):\n{diff}"
    )


def test_a_transcript_replays_alike() -> None:
    blocks = parse(FILES[0].read_text())
    assert run(blocks) == run(blocks)
