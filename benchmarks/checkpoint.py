"""Checkpoint benchmark: the cost of saving and loading a ~100 MB state, against its peers.

The state is `--arrays` float32 arrays of `--mb` MB in all (random values). Each round saves it
once with every system, each to a new file, and removes the file of two rounds before (what
`CheckpointManager` does with keep_checkpoint_max=2, so every system pays the same deletions),
then loads it back in full:

- cluster.checkpoint: `CheckpointManager.save` (temporary file, SHA-256, fsync, rename, fsync of
  the directory, prune) and `load` (reads and verifies the SHA-256); once with numpy arrays,
  once with the same data as torch tensors.
- numpy.savez + fsync of the file; `numpy.load` of every array (zip CRC-32 checked on read).
- torch.save + fsync of the file; `torch.load(weights_only=True)` (skipped without torch).

Figures are medians over `--repeat` rounds; MB/s is the state's size over that median. Loads
read from the page cache (the file was just written), so they measure the CPU cost of reading,
checking and rebuilding the state, not the disk.

Usage: python benchmarks/checkpoint.py [--mb 100] [--arrays 4] [--repeat 7] [--dir DIR]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager

try:
    import torch
except ImportError:  # torch is optional: its rows are skipped
    torch = None


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Peer:
    """A save/load pair writing `<name>-<round><suffix>` and keeping the two newest files."""

    def __init__(
        self,
        directory: Path,
        suffix: str,
        save: Callable[[Path, dict[str, Any]], None],
        load: Callable[[Path], dict[str, Any]],
    ) -> None:
        self.directory, self.suffix, self._save, self._load = directory, suffix, save, load
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, round_: int) -> Path:
        return self.directory / f"state-{round_:08d}{self.suffix}"

    def save(self, round_: int, state: dict[str, Any]) -> None:
        self._save(self.path(round_), state)
        fsync_file(self.path(round_))
        self.path(round_ - 2).unlink(missing_ok=True)

    def load(self, round_: int) -> dict[str, Any]:
        return self._load(self.path(round_))


def numpy_load(path: Path) -> dict[str, Any]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def systems(directory: Path) -> dict[str, tuple[Callable[..., Any], Callable[[int], Any], bool]]:
    """name -> (save(round, state), load(round), whether it takes torch tensors)."""
    config = CheckpointConfig(keep_checkpoint_max=2)
    ours = CheckpointManager(directory / "cluster", "state", config, rank=0, recovery=False)
    ours_torch = CheckpointManager(
        directory / "cluster-torch", "state", config, rank=0, recovery=False
    )
    npz = Peer(directory / "npz", ".npz", lambda path, state: np.savez(path, **state), numpy_load)
    found: dict[str, tuple[Callable[..., Any], Callable[[int], Any], bool]] = {
        "cluster.checkpoint (numpy)": (ours.save, ours.load, False),
        "numpy.savez + fsync": (npz.save, npz.load, False),
    }
    if torch is not None:
        pt = Peer(
            directory / "torch",
            ".pt",
            lambda path, state: torch.save(state, path),
            lambda path: torch.load(path, weights_only=True),
        )
        found["cluster.checkpoint (torch)"] = (ours_torch.save, ours_torch.load, True)
        found["torch.save + fsync"] = (pt.save, pt.load, True)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="state size in MB (10**6 bytes)")
    parser.add_argument("--arrays", type=int, default=4, help="number of float32 arrays")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (median reported)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    per_array = int(args.mb * 1e6 / 4 / args.arrays)
    arrays = {f"w{i}": rng.random(per_array, dtype=np.float32) for i in range(args.arrays)}
    size = sum(a.nbytes for a in arrays.values())
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()} if torch is not None else {}

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt-bench-") as tmp:
        found = systems(Path(tmp))
        times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in found}
        # Round 1 warms up (imports, first allocations) and is not counted.
        for round_ in range(1, args.repeat + 2):
            for name, (save, load, takes_torch) in found.items():
                state = tensors if takes_torch else arrays
                start = time.perf_counter()
                save(round_, state)
                saved = time.perf_counter()
                loaded = load(round_)
                done = time.perf_counter()
                assert len(loaded) == len(state)
                if round_ > 1:
                    times[name]["save"].append(saved - start)
                    times[name]["load"].append(done - saved)

    results: dict[str, Any] = {
        "state_bytes": size,
        "arrays": args.arrays,
        "repeat": args.repeat,
        "systems": {},
    }
    print(
        f"checkpoint of {size / 1e6:.0f} MB ({args.arrays} float32 arrays), median of "
        f"{args.repeat} rounds; loads from the page cache"
    )
    print(f"{'system':<28}  {'save s':>7}  {'save MB/s':>9}  {'load s':>7}  {'load MB/s':>9}")
    for name, measured in times.items():
        save_s = statistics.median(measured["save"])
        load_s = statistics.median(measured["load"])
        results["systems"][name] = {
            "save_s": save_s,
            "load_s": load_s,
            "save_mb_s": size / 1e6 / save_s,
            "load_mb_s": size / 1e6 / load_s,
            "save_all_s": measured["save"],
            "load_all_s": measured["load"],
        }
        print(
            f"{name:<28}  {save_s:>7.3f}  {size / 1e6 / save_s:>9.0f}  {load_s:>7.3f}  "
            f"{size / 1e6 / load_s:>9.0f}"
        )
    if torch is None:
        print("(torch is not installed: its rows are skipped)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
