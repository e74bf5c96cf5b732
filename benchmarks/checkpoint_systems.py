"""The systems benchmarks/checkpoint.py compares: each saves, settles (until durable) and loads."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager

try:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
except ImportError:  # torch is optional: its rows are skipped
    torch = None

ROOT = Path(__file__).resolve().parents[1]


class System:
    """`save(round, state)` is what the loop waits for; `settle()` waits until it is durable;
    `load(round)` reads it back (None: this system does not load)."""

    def __init__(
        self,
        name: str,
        save: Callable[[int, Any], object],
        *,
        settle: Callable[[], object] = lambda: None,
        load: Callable[[int], Any] = lambda round_: None,
        close: Callable[[], object] = lambda: None,
        takes_torch: bool = False,
    ) -> None:
        self.name, self.save, self.settle, self.load = name, save, settle, load
        self.close, self.takes_torch = close, takes_torch


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_system(
    name: str,
    directory: Path,
    save: Callable[[Path, Any], object],
    load: Callable[[Path], Any],
    *,
    takes_torch: bool = False,
) -> System:
    """A save/load pair writing `state-<round>` files, fsynced, keeping the two newest."""
    directory.mkdir(parents=True)

    def path(round_: int) -> Path:
        return directory / f"state-{round_:08d}"

    def save_round(round_: int, state: Any) -> None:
        save(path(round_), state)
        fsync_file(path(round_))
        path(round_ - 2).unlink(missing_ok=True)

    return System(name, save_round, load=lambda round_: load(path(round_)), takes_torch=takes_torch)


def manager_systems(directory: Path, baseline: str) -> list[System]:
    config = CheckpointConfig(keep_checkpoint_max=2)
    numpy_manager = CheckpointManager(directory / "np", "s", config, rank=0, recovery=False)
    sync_manager = CheckpointManager(directory / "sync", "s", config, rank=0, recovery=False)

    def save_and_flush(round_: int, state: Any) -> None:
        sync_manager.save(round_, state)
        sync_manager.flush()

    systems = [
        System(
            "cluster async (numpy)",
            numpy_manager.save,
            settle=numpy_manager.flush,
            load=numpy_manager.load,
            close=numpy_manager.close,
        ),
        System(
            "cluster sync (flush, numpy)",
            save_and_flush,
            load=sync_manager.load,
            close=sync_manager.close,
        ),
    ]
    if torch is not None:
        torch_manager = CheckpointManager(directory / "pt", "s", config, rank=0, recovery=False)
        systems.append(
            System(
                "cluster async (torch)",
                torch_manager.save,
                settle=torch_manager.flush,
                load=torch_manager.load,
                close=torch_manager.close,
                takes_torch=True,
            )
        )
    old = baseline_module(baseline)
    if old is not None:
        before = old.CheckpointManager(
            directory / "old", "s", old.CheckpointConfig(keep_checkpoint_max=2), rank=0,
            recovery=False, report=lambda steps: None,
        )  # fmt: skip
        systems.append(System(f"cluster before ({baseline}, numpy)", before.save, load=before.load))
    return systems


def baseline_module(commit: str) -> ModuleType | None:
    """cluster/api/checkpoint.py as it was at `commit` (it imports only cluster.protocol)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{commit}:cluster/api/checkpoint.py"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"(no 'before' row: cannot read {commit} from git: {exc})")
        return None
    path = Path(tempfile.mkdtemp(prefix="ckpt-before-")) / "checkpoint_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("checkpoint_before", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def numpy_load(path: Path) -> dict[str, Any]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def numpy_savez(path: Path, state: dict[str, Any]) -> None:
    with open(path, "wb") as file:
        np.savez(file, **state)


def torch_systems(directory: Path, arrays: dict[str, np.ndarray]) -> list[System]:
    if torch is None:
        return []
    pt = file_system(
        "torch.save + fsync",
        directory / "torch",
        lambda path, state: torch.save(state, path),
        lambda path: torch.load(path, weights_only=True),
        takes_torch=True,
    )
    shapes = {name: array.shape for name, array in arrays.items()}
    return [pt, dcp_system(directory / "dcp", shapes)]


def dcp_system(directory: Path, shapes: dict[str, tuple[int, ...]]) -> System:
    """torch.distributed.checkpoint.async_save in one process (gloo, world size 1)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pending: list[Any] = []

    def save(round_: int, state: dict[str, Any]) -> None:
        pending.append(dcp.async_save(state, checkpoint_id=directory / f"{round_:08d}"))
        shutil.rmtree(directory / f"{round_ - 2:08d}", ignore_errors=True)

    def settle() -> None:
        while pending:
            result = pending.pop()
            future = getattr(result, "upload_completion", result)  # AsyncSaveResponse or Future
            future.result()

    def load(round_: int) -> dict[str, Any]:
        into = {name: torch.empty(shape) for name, shape in shapes.items()}
        dcp.load(into, checkpoint_id=directory / f"{round_:08d}")
        return into

    return System(
        "torch dcp.async_save (gloo, 1 proc)",
        save,
        settle=settle,
        load=load,
        close=dist.destroy_process_group,
        takes_torch=True,
    )


def copy_system(arrays: dict[str, np.ndarray]) -> System:
    """numpy.copyto into buffers kept from round to round: the floor of a save that copies."""
    buffers = {name: np.zeros_like(array) for name, array in arrays.items()}

    def save(round_: int, state: dict[str, Any]) -> None:
        for name, array in state.items():
            np.copyto(buffers[name], array)

    return System("memory copy alone (numpy.copyto)", save)


def make_systems(directory: Path, arrays: dict[str, np.ndarray], baseline: str) -> list[System]:
    npz = file_system("numpy.savez + fsync", directory / "npz", numpy_savez, numpy_load)
    systems = [
        copy_system(arrays),
        *manager_systems(directory, baseline),
        npz,
        *torch_systems(directory, arrays),
    ]
    return systems
