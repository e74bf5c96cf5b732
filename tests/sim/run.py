"""Run seeded schedules of the simulated control plane (`tests/sim/control_plane.py`).

    python tests/sim/run.py --seeds 1000 [--nodes 3] [--steps 200] [--seed S] [--plant NAME]
    python tests/sim/run.py --list-plants

Prints `N schedules, 0 violations` and exits 0; or the violated invariant, the seed, the last
steps of its trace and the command that replays it, and exits 1. `--seed S` runs that one
seed; `--plant NAME` plants a known bug, which the schedules must catch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.sim.control_plane import PLANTS, Violation, run_seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="schedules to run")
    parser.add_argument("--seed", type=int, help="run this one seed only")
    parser.add_argument("--nodes", type=int, default=3, help="workers")
    parser.add_argument("--steps", type=int, default=200, help="steps per schedule")
    parser.add_argument("--plant", default="", choices=["", *PLANTS], help="a known bug")
    parser.add_argument("--list-plants", action="store_true", help="name the plants and exit")
    args = parser.parse_args(argv)
    if args.list_plants:
        for name, what in PLANTS.items():
            print(f"{name}: {what}")
        return 0
    seeds = [args.seed] if args.seed is not None else list(range(args.seeds))
    started = time.monotonic()
    for seed in seeds:
        try:
            run_seed(seed, steps=args.steps, workers=args.nodes, plant=args.plant)
        except Violation as exc:
            print(exc)
            plant = f" --plant {args.plant}" if args.plant else ""
            print(
                f"replay: python tests/sim/run.py --seed {seed} --nodes {args.nodes} "
                f"--steps {args.steps}{plant}"
            )
            return 1
    took = time.monotonic() - started
    print(f"{len(seeds)} schedules, 0 violations ({took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
