"""Checkpoint benchmark: what a save costs the training loop, loads, and training throughput.

Part 1, saves and loads, for each state size in `--sizes` (MB; `--arrays` float32 arrays of
random values). Each round saves the state once with every system, each to a new file (the
files of two rounds before are removed, as `CheckpointManager` does with keep_checkpoint_max=2),
waits until it is durable, then loads it back in full:

- cluster async: `CheckpointManager.save` returns once the state is copied into its buffers; the
  background writer then writes the file (XXH3-128, fsync, rename, fsync of the directory,
  prune). "pause" is what the loop waits for (the writer is idle when it starts: the cost of a
  save that does not wait for the previous one); "durable" is until `flush()` returns. `load`
  reads and verifies the checksum. Once with numpy arrays, once with the same data as tensors.
- cluster sync (flush): the same with `flush()` after each save, a loop that waits for the disk.
- cluster before (<commit>): `CheckpointManager` of the commit before the background writer
  (synchronous, SHA-256), loaded from git (`--baseline`); its load verifies the SHA-256.
- numpy.savez + fsync of the file; `numpy.load` of every array (zip CRC-32 checked on read).
- torch.save + fsync of the file; `torch.load(weights_only=True)` (no checksum).
- torch dcp.async_save: `torch.distributed.checkpoint.async_save` in one process (gloo, world
  size 1); "pause" until it returns (staged), "durable" until its future is done (its writer
  fsyncs); load with `dcp.load` into fresh tensors.
- memory copy alone: `numpy.copyto` of every array into buffers kept from round to round: the
  floor of any save that copies.

The first two rounds warm up (imports, first allocations: a buffer's first touch costs a page
fault per 4 KiB, and the manager alternates between two buffers) and are not counted. Figures
are medians over `--repeat` rounds; loads read from the page cache (the file was just written),
so they measure the CPU cost of reading, checking and rebuilding the state, not the disk.

Part 2, training throughput (`--steps`; skipped with `--steps 0`): the loop body of
examples/train_torch.py (its Trainer: DDP over a gloo group made by cluster.torch, one worker, a
real scheduler process) in a `cluster.TrainingLoop`, in this process, with no checkpoint but the
final one, with one every step, and with one every step written synchronously; the runs
alternate, `--repeat` runs each, median steps/s. Each step also sleeps for each of
`--step-delays` seconds in turn (train_torch.py's --step-delay: a step whose time is spent
waiting, as for a GPU), since whether a checkpoint every step is free depends on how long a step
takes against how long the disk takes to write one. `--sizes ""` runs part 2 only.

With `--device cuda` the state is CUDA tensors instead, and the rows are the device's
(`benchmarks/checkpoint_cuda.py`: the D2H floors, pageable and pinned, cluster, dcp.async_save,
torch.save + fsync); part 2 is not run. Without a GPU it says so in one line and exits 0.

Usage: python benchmarks/checkpoint.py [--sizes 100,1000] [--arrays 4] [--repeat 5]
       [--steps 300] [--step-delays 0,0.02] [--baseline COMMIT] [--dir DIR] [--json PATH]
       [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from checkpoint_systems import System, make_systems

try:
    import torch
except ImportError:  # torch is optional: its rows are skipped
    torch = None

# The commit before the background writer: CheckpointManager saved synchronously.
BASELINE = "caadf55"
WARMUP = 2


def measure(systems: list[System], arrays: dict[str, Any], repeat: int) -> dict[str, Any]:
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()} if torch is not None else {}
    times: dict[str, dict[str, list[float]]] = {
        s.name: {"pause": [], "durable": [], "load": []} for s in systems
    }
    for round_ in range(1, repeat + WARMUP + 1):
        for system in systems:
            state = tensors if system.takes_torch else arrays
            start = time.perf_counter()
            system.save(round_, state)
            saved = time.perf_counter()
            system.settle()
            durable = time.perf_counter()
            loaded = system.load(round_)
            done = time.perf_counter()
            if loaded is not None:
                assert len(loaded) == len(state), system.name
            if round_ > WARMUP:
                times[system.name]["pause"].append(saved - start)
                times[system.name]["durable"].append(durable - start)
                if loaded is not None:
                    times[system.name]["load"].append(done - durable)
    return times


def report(size: int, times: dict[str, dict[str, list[float]]], repeat: int) -> dict[str, Any]:
    print(f"\n{size / 1e6:.0f} MB state, median of {repeat} rounds; loads from the page cache")
    header = f"{'system':<34}  {'pause ms':>9}  {'ms/100MB':>8}  {'durable ms':>10}  {'load ms':>8}"
    print(header)
    rows: dict[str, Any] = {}
    for name, measured in times.items():
        pause = statistics.median(measured["pause"])
        durable = statistics.median(measured["durable"])
        load = statistics.median(measured["load"]) if measured["load"] else None
        rows[name] = {"pause_s": pause, "durable_s": durable, "load_s": load, **measured}
        load_text = f"{load * 1e3:8.1f}" if load is not None else f"{'-':>8}"
        print(
            f"{name:<34}  {pause * 1e3:9.1f}  {pause * 1e3 / (size / 1e8):8.1f}  "
            f"{durable * 1e3:10.1f}  {load_text}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000", help="state sizes in MB (10**6 bytes)")
    parser.add_argument("--arrays", type=int, default=4, help="number of float32 arrays")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (median reported)")
    parser.add_argument("--steps", type=int, default=300, help="steps per throughput run")
    parser.add_argument(
        "--step-delays", default="0,0.02", help="seconds each step also waits (a device's step)"
    )
    parser.add_argument("--baseline", default=BASELINE, help="commit of the 'before' rows")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the state's tensors are"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        from checkpoint_cuda import run  # noqa: PLC0415 - only for --device cuda

        cuda_results = run(args, report)
        if args.json and cuda_results is not None:
            Path(args.json).write_text(json.dumps(cuda_results, indent=2))
        return 0

    results: dict[str, Any] = {"arrays": args.arrays, "repeat": args.repeat, "sizes": {}}
    rng = np.random.default_rng(0)
    for mb in (float(s) for s in args.sizes.split(",") if s):
        per_array = int(mb * 1e6 / 4 / args.arrays)
        arrays = {f"w{i}": rng.random(per_array, dtype=np.float32) for i in range(args.arrays)}
        size = sum(a.nbytes for a in arrays.values())
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt-bench-") as tmp:
            systems = make_systems(Path(tmp), arrays, args.baseline)
            try:
                times = measure(systems, arrays, args.repeat)
            finally:
                for system in systems:
                    system.close()
        results["sizes"][str(size)] = report(size, times, args.repeat)
        del arrays
    if torch is None:
        print("(torch is not installed: its rows are skipped)")
    if args.steps > 0 and torch is not None:
        from checkpoint_training import throughput  # noqa: PLC0415 - it imports cluster.torch

        with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt-train-") as tmp:
            delays = [float(d) for d in args.step_delays.split(",")]
            results["throughput"] = throughput(Path(tmp), args.steps, args.repeat, delays)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
