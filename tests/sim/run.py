"""Run seeded schedules of the simulated control plane (`tests/sim/control_plane.py`).

    python tests/sim/run.py --seeds 1000 [--nodes 3] [--spares 1] [--schedulers 1,2]
                            [--worker-cores no|yes|both] [--steps 200] [--seed S]
                            [--plant NAME] [--no-shrink]
    python tests/sim/run.py --list-plants

Prints `N schedules, 0 violations` and exits 0; or the violated invariant, the seed, the end of
its trace and the command that replays it, and exits 1. A failing seed is shrunk first (fewer
steps, workers, spares: `tests/sim/shrink.py`). `--seed S` runs that one seed; `--plant NAME`
plants a known bug (`tests/sim/plants.py`), which the schedules must catch. `--schedulers 1,2`
(the default): the seeds take turns, one scheduler with its disk (MS_RECOVERY_PATH), then two
on a simulated etcd, a leader and a standby (`tests/sim/standbys.py`). `--worker-cores both` (the
default): every other pair of seeds runs its workers by the real worker core
(`tests/sim/cores.py`) instead of the simulation's simple ones.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.sim.control_plane import (
    PLANT_CORES,
    PLANT_SCHEDULERS,
    PLANT_SPARES,
    PLANTS,
    Violation,
)
from tests.sim.shrink import Case, shrink, violation

TRACE_SHOWN = 24
TURNS = [1, 2]  # one scheduler with its disk, then a leader and a standby on etcd


def report(case: Case, exc: Violation, *, shrunk: bool) -> None:
    """What broke, where, and how to see it again."""
    trace = exc.sim.trace  # type: ignore[attr-defined]
    print(f"violated: {exc.invariant}")
    print(f"seed {case.seed}: {exc}")
    how = f" (shrunk to {case.steps} steps, {case.workers} workers, {case.spares} spares)"
    print(f"trace, last {min(len(trace), TRACE_SHOWN)} of {len(trace)}{how if shrunk else ''}:")
    for step in trace[-TRACE_SHOWN:]:
        print(f"  {step}")
    print(f"replay: {case.replay()}")


def schedulers(seed: int, turns: list[int] = TURNS) -> int:
    """How many schedulers the seed's schedule runs with: the seeds take `turns`."""
    return turns[seed % len(turns)]


def worker_cores(seed: int, choice: str = "both", turns: int = len(TURNS)) -> bool:
    """Whether the seed's workers run the real worker core: with `both`, after each round of
    scheduler turns the other kind."""
    return choice == "yes" or (choice == "both" and (seed // turns) % 2 == 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="schedules to run")
    parser.add_argument("--seed", type=int, help="run this one seed only")
    parser.add_argument("--nodes", type=int, default=3, help="workers")
    parser.add_argument("--spares", type=int, default=1, help="spare workers")
    parser.add_argument(
        "--schedulers",
        default=",".join(map(str, TURNS)),
        help="schedulers of the job (2 or 3: standbys on etcd); a list: the seeds take turns",
    )
    parser.add_argument(
        "--worker-cores",
        choices=["no", "yes", "both"],
        default="both",
        help="workers run by the real worker core (both: every other pair of seeds)",
    )
    parser.add_argument("--steps", type=int, default=200, help="steps per schedule")
    parser.add_argument("--plant", default="", choices=["", *PLANTS], help="a known bug")
    parser.add_argument("--no-shrink", action="store_true", help="print the failing seed as is")
    parser.add_argument("--list-plants", action="store_true", help="name the plants and exit")
    args = parser.parse_args(argv)
    if args.list_plants:
        for name, what in PLANTS.items():
            print(f"{name}: {what}")
        return 0
    seeds = [args.seed] if args.seed is not None else list(range(args.seeds))
    started = time.monotonic()
    turns = [int(n) for n in args.schedulers.split(",")]
    for seed in seeds:
        cores = worker_cores(seed, args.worker_cores, len(turns))
        case = Case(
            seed, args.steps, args.nodes, args.spares, args.plant, schedulers(seed, turns), cores
        )
        case = case.but(
            schedulers=max(case.schedulers, PLANT_SCHEDULERS.get(args.plant, 1)),
            spares=max(case.spares, PLANT_SPARES.get(args.plant, 0)),
            worker_cores=case.worker_cores or args.plant in PLANT_CORES,
        )
        exc = violation(case)
        if exc is not None:
            shrunk = not args.no_shrink and args.seed is None
            if shrunk:
                case, exc = shrink(case, exc)
            report(case, exc, shrunk=shrunk)
            return 1
    took = time.monotonic() - started
    print(f"{len(seeds)} schedules, 0 violations ({took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
