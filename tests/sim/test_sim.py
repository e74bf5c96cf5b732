"""The simulated control plane (`tests/sim/control_plane.py`): many seeded schedules keep every
invariant, the same seed replays the same run, and each planted bug is caught."""

from __future__ import annotations

import pytest

from tests.sim.control_plane import PLANTS, Violation, run_seed
from tests.sim.run import main


def test_schedules_keep_every_invariant() -> None:
    for seed in range(300):
        run_seed(seed)


def test_the_same_seed_replays_the_same_run() -> None:
    first, again = run_seed(7), run_seed(7)
    assert first.trace == again.trace
    assert first.stored == again.stored


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_bug_is_caught(plant: str) -> None:
    caught = 0
    for seed in range(20):
        try:
            run_seed(seed, plant=plant)
        except Violation:
            caught += 1
    assert caught > 0, f"the plant {plant!r} ({PLANTS[plant]}) was never caught"


def test_the_command_line_says_what_it_found(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "20"]) == 0
    assert "20 schedules, 0 violations" in capsys.readouterr().out
    assert main(["--seeds", "20", "--plant", "early-release"]) == 1
    said = capsys.readouterr().out
    assert "told revision" in said
    assert "replay: python tests/sim/run.py --seed 0" in said
