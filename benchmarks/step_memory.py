"""What the in-memory copy of the last step (CheckpointConfig(memory_snapshot=...)) costs the
training loop, and what it saves when a step is put back.

One real worker in this process, with recovery on (without it the loop keeps no copy), and a
real scheduler process beside it (as in checkpoint_training.py), runs a `cluster.TrainingLoop`
over a state of `--size` MB (`--arrays` float32 arrays of random values); each step changes
one element of each array, so the step itself costs next to nothing and the loop's time per
step is what the loop adds. The runs alternate, `--repeat` runs of `--steps` steps each,
median ms per step:

- memory_snapshot=0: no copy, no checkpoint but the final one (the loop's floor);
- default limit (1 GiB): a copy of the state at every step boundary, into one buffer reused
  from step to step;
- every step saved, memory_snapshot=0 and default: the copy is the manager's own (shared), so
  the second adds nothing.

Then, once: putting a step back from memory (`StepMemory.state()`, a decoded copy) against
reading and verifying it from its file (`CheckpointManager.load`, from the page cache).

Usage: python benchmarks/step_memory.py [--size 100] [--arrays 4] [--steps 50] [--repeat 5]
       [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from checkpoint_training import join_job

import cluster
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.api.checkpoint_config import MEMORY_SNAPSHOT_DEFAULT

MODES = {
    "no copy": (0, False),
    "copy every step": (MEMORY_SNAPSHOT_DEFAULT, False),
    "save every step, no copy": (0, True),
    "save every step, copy shared": (MEMORY_SNAPSHOT_DEFAULT, True),
}


def state_of(size_mb: int, arrays: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    per = size_mb * 10**6 // 4 // arrays
    return {f"w{i}": rng.standard_normal(per, dtype=np.float32) for i in range(arrays)}


def run(directory: Path, state: dict[str, Any], mode: str, steps: int) -> float:
    """Milliseconds per step of one run."""
    limit, every = MODES[mode]
    config = CheckpointConfig(1 if every else steps, 2, memory_snapshot=limit)
    checkpoints = CheckpointManager(directory, "bench", config)
    loop = cluster.TrainingLoop(steps, checkpoints, lambda: state, state.update)
    start = time.perf_counter()
    for step in loop:
        with loop.step():
            for array in state.values():
                array[step % array.size] += 1.0
    elapsed = time.perf_counter() - start
    checkpoints.close()
    return elapsed / steps * 1e3


def restore_times(directory: Path, state: dict[str, Any], repeat: int) -> dict[str, float]:
    """Median seconds to put a step back: from memory, and from its file."""
    config = CheckpointConfig(1, 2)
    checkpoints = CheckpointManager(directory, "restore", config)
    loop = cluster.TrainingLoop(1, checkpoints, lambda: state, state.update)
    loop.memory.keep(1, state, saved=False)
    checkpoints.save(1, state)
    checkpoints.flush()
    memory, disk = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        loop.memory.state()
        memory.append(time.perf_counter() - start)
        start = time.perf_counter()
        checkpoints.load(1)
        disk.append(time.perf_counter() - start)
    loop.memory.close()
    checkpoints.close()
    return {"memory_s": statistics.median(memory), "file_s": statistics.median(disk)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100, help="state size in MB (10**6 bytes)")
    parser.add_argument("--arrays", type=int, default=4, help="number of float32 arrays")
    parser.add_argument("--steps", type=int, default=50, help="steps per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per mode (median reported)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        (directory / "recovery").mkdir()
        recovery = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(directory / "recovery")}
        os.environ.update({**recovery, "MS_NODE_ID": "0"})  # the scheduler's and this worker's
        scheduler = join_job(directory)
        try:
            state = state_of(args.size, args.arrays)
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            for round_ in range(args.repeat + 1):  # round 0 warms up
                for mode, measured in times.items():
                    ms = run(directory / f"{round_}-{len(measured)}", state, mode, args.steps)
                    if round_ > 0:
                        measured.append(ms)
            restore = restore_times(directory / "restore", state, args.repeat)
            cluster.finalize()
            scheduler.wait(30)
        finally:
            if scheduler.poll() is None:
                scheduler.kill()
                scheduler.wait()
    return report(args, times, restore)


def report(args: argparse.Namespace, times: dict[str, list[float]], restore: Any) -> int:
    print(
        f"\nthe loop's time per step, a {args.size} MB state ({args.arrays} float32 arrays), "
        f"{args.steps} steps a run, median of {args.repeat} runs"
    )
    base = statistics.median(times["no copy"])
    results: dict[str, Any] = {}
    for mode, measured in times.items():
        ms = statistics.median(measured)
        print(f"  {mode:<30} {ms:8.2f} ms/step  ({ms - base:+.2f} ms against no copy)")
        results[mode] = {"ms_per_step": ms, "all": measured}
    print(
        f"putting the step back: from memory {restore['memory_s'] * 1e3:.1f} ms, from its file "
        f"(page cache, checksum verified) {restore['file_s'] * 1e3:.1f} ms"
    )
    results["restore"] = restore
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
