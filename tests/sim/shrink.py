"""Shrinking a failing schedule: the same invariant broken with fewer steps, fewer workers and
fewer spares, so that the trace printed is short enough to read.

Steps shrink first: the schedule of the first k steps is a prefix of the schedule of more (the
steps draw from the seed's stream in order; the network has its own), so a violation found at
step k is found again with `steps=k`; then halving tries shorter ones. Then the workers and the
spares: another count makes another schedule from the same seed, kept when it breaks the same
invariant; steps shrink again after each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tests.sim.control_plane import Sim, Violation, run_seed
from tests.sim.finishing import NOT_STEPS


@dataclass(frozen=True)
class Case:
    seed: int
    steps: int
    workers: int
    spares: int
    plant: str = ""
    schedulers: int = 1
    worker_cores: bool = False

    def replay(self) -> str:
        plant = f" --plant {self.plant}" if self.plant else ""
        cores = "yes" if self.worker_cores else "no"
        return (
            f"python tests/sim/run.py --seed {self.seed} --nodes {self.workers} "
            f"--spares {self.spares} --schedulers {self.schedulers} --worker-cores {cores} "
            f"--steps {self.steps}{plant}"
        )

    def but(self, **changes: int | bool) -> Case:
        return replace(self, **changes)


def violation(case: Case) -> Violation | None:
    try:
        run_seed(
            case.seed,
            case.steps,
            case.workers,
            case.plant,
            case.spares,
            case.schedulers,
            case.worker_cores,
        )
    except Violation as exc:
        return exc
    return None


def failed_at(exc: Violation) -> int:
    """How many steps of the schedule ran when `exc` broke (all of them: during the heal)."""
    sim: Sim = exc.sim  # type: ignore[attr-defined]
    return len([s for s in sim.trace if s != "faults stop" and not s.startswith(NOT_STEPS)])


def shorter(case: Case, exc: Violation) -> tuple[Case, Violation]:
    """Fewer steps, the same invariant broken."""
    best, best_exc = case, exc
    steps = failed_at(exc)
    while steps >= 1:
        tried = case.but(steps=steps)
        found = violation(tried)
        if found is None or found.invariant != exc.invariant:
            break
        best, best_exc = tried, found
        steps = failed_at(found) // 2
    return best, best_exc


def shrink(case: Case, exc: Violation) -> tuple[Case, Violation]:
    """The smallest case found that breaks `exc.invariant`."""
    best, best_exc = shorter(case, exc)
    for workers in range(1, case.workers + 1):
        for spares in range(0, case.spares + 1):
            if (workers, spares) >= (best.workers, best.spares):
                continue
            tried = case.but(steps=best.steps, workers=workers, spares=spares)
            found = violation(tried)
            if found is not None and found.invariant == exc.invariant:
                best, best_exc = shorter(tried, found)
    return best, best_exc


__all__ = ["Case", "shrink", "violation"]
