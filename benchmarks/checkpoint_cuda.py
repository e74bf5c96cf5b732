"""`benchmarks/checkpoint.py --device cuda`: what a save of CUDA tensors costs the loop.

For each state size (`--arrays` float32 CUDA tensors), in one run, each round saving the same
state with every system:

- D2H floor, pageable: `copy_` of every tensor into host tensors kept from round to round,
  then `torch.cuda.synchronize()`: the floor of a save that copies into pageable memory.
- D2H floor, pinned: the same into pinned host tensors, `non_blocking=True`: the floor of any
  save that copies to the host.
- cluster async: `CheckpointManager.save` (pinned buffers, a copy stream; the copy complete when
  it returns), durable at `flush()`.
- torch dcp.async_save (gloo, 1 process): pause until it returns (staged), durable when done.
- torch.save + fsync of the file.

Without a GPU it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint_systems import System, dcp_system, file_system

from cluster import CheckpointConfig, CheckpointManager
from cluster.storage.host_buffers import PINNED_MAX_ENV, default_buffers

try:
    import torch
except ImportError:
    torch = None

WARMUP = 2


def available() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def floor(name: str, tensors: dict[str, Any], *, pinned: bool) -> System:
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for k, t in tensors.items()}

    def save(round_: int, state: dict[str, Any]) -> None:
        for key, tensor in state.items():
            host[key].copy_(tensor, non_blocking=pinned)
        torch.cuda.synchronize()

    return System(name, save)


def systems(directory: Path, tensors: dict[str, Any]) -> list[System]:
    manager = CheckpointManager(
        directory / "cluster", "s", CheckpointConfig(keep_checkpoint_max=2), rank=0, recovery=False
    )
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    return [
        floor("D2H floor, pageable", tensors, pinned=False),
        floor("D2H floor, pinned", tensors, pinned=True),
        System(
            "cluster async (CheckpointManager)",
            manager.save,
            settle=manager.flush,
            load=manager.load,
            close=manager.close,
        ),
        dcp_system(directory / "dcp", shapes),
        file_system(
            "torch.save + fsync",
            directory / "torch",
            lambda path, state: torch.save(state, path),
            lambda path: torch.load(path, weights_only=True),
        ),
    ]


def measure(all_systems: list[System], tensors: dict[str, Any], repeat: int) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {
        s.name: {"pause": [], "durable": [], "load": []} for s in all_systems
    }
    for round_ in range(1, repeat + WARMUP + 1):
        for system in all_systems:
            torch.cuda.synchronize()  # the step before the save is done
            start = time.perf_counter()
            system.save(round_, tensors)
            saved = time.perf_counter()
            system.settle()
            durable = time.perf_counter()
            loaded = system.load(round_)
            done = time.perf_counter()
            if round_ > WARMUP:
                times[system.name]["pause"].append(saved - start)
                times[system.name]["durable"].append(durable - start)
                if loaded is not None:
                    times[system.name]["load"].append(done - durable)
    return times


def run(args: argparse.Namespace, report: Callable[..., dict[str, Any]]) -> dict[str, Any] | None:
    """The rows for every size of `--sizes`, printed by `report`; None (said) without a GPU."""
    why = available()
    if why is not None:
        print(f"checkpoint --device cuda: skipped, {why}")
        return None
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "sizes": {}}
    generator = torch.Generator(device="cuda").manual_seed(0)
    for mb in (float(s) for s in args.sizes.split(",") if s):
        per_array = int(mb * 1e6 / 4 / args.arrays)
        tensors = {
            f"w{i}": torch.rand(per_array, device="cuda", generator=generator)
            for i in range(args.arrays)
        }
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt-cuda-") as tmp:
            made = systems(Path(tmp), tensors)
            try:
                times = measure(made, tensors, args.repeat)
                pinned = default_buffers().pinned_bytes  # before close gives them back
            finally:
                for system in made:
                    system.close()
        results["sizes"][str(size)] = report(size, times, args.repeat)
        print(f"cluster pinned {pinned / 1e6:.0f} MB of host buffers ({PINNED_MAX_ENV} bounds it)")
        del tensors
    return results
