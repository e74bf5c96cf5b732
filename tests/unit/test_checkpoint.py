"""cluster.checkpoint: round trips, pruning, per-rank directories, corrupt files, SIGKILL."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import random
import re
import selectors
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from cluster.api import peer_state, runtime
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError, ClusterError, ConfigError
from cluster.scheduler.machine.admission import MAX_REPORTED_CHECKPOINTS
from cluster.storage import atomic, checkpoint_files
from cluster.storage.checkpoint_tree import aligned
from cluster.testing import wait_until

ROOT = Path(__file__).resolve().parents[2]


def manager(tmp_path: Path, keep: int = 5, every: int = 1, **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("recovery", False)
    kwargs.setdefault("rank", 0)
    config = CheckpointConfig(save_checkpoint_steps=every, keep_checkpoint_max=keep)
    return CheckpointManager(tmp_path / "ckpt", "net", config, **kwargs)


def names(directory: Path) -> list[str]:
    """The names in `directory`, sorted, but the managers' lock files (`.<prefix>.lock`)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock"))


def assert_same_array(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()  # bit-identical, NaN payloads included


# Round trips


ARRAYS = {
    "float32": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    "float64": np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-308, 5e-324]),
    "int64": np.arange(-5, 5, dtype=np.int64) * (2**60),
    "int8": np.array([-128, 0, 127], dtype=np.int8),
    "uint16": np.arange(7, dtype=np.uint16),
    "float16": np.array([1.5, -2.25], dtype=np.float16),
    "bool": np.array([[True, False], [False, True]]),
    "complex128": np.array([1 + 2j, -3.5j]),
    "big-endian": np.arange(4, dtype=">f4"),
    "unicode": np.array(["a", "bcd", "é€"]),
    "bytes": np.array([b"x", b"yz"]),
    "datetime": np.array(["2024-01-01T00:00", "1970-01-01"], dtype="datetime64[ns]"),
    "0-d": np.array(3.25, dtype=np.float64),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "empty-1d": np.array([], dtype=np.int64),
    "transposed": np.arange(12, dtype=np.float32).reshape(3, 4).T,
    "strided": np.arange(40, dtype=np.int32)[::3],
    "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
}


@pytest.mark.parametrize("name", list(ARRAYS))
def test_numpy_arrays_round_trip_bit_identical(tmp_path: Path, name: str) -> None:
    ckpt = manager(tmp_path)
    array = ARRAYS[name]
    ckpt.save(1, {"x": array, "nested": {"y": [array]}})
    loaded = ckpt.load(1)
    assert_same_array(loaded["x"], array)
    assert_same_array(loaded["nested"]["y"][0], array)


def test_python_values_round_trip_with_their_types(tmp_path: Path) -> None:
    state = {
        "none": None,
        "flags": [True, False],
        "ints": [0, -1, 2**100],
        "floats": [0.1, -0.0, math.inf, -math.inf, 1e-310],
        "text": 'ünïcødé \u2603 \n"quoted" $',
        "tuple": (1, "a", (2.5, None)),
        "int_keys": {0: "zero", 1: {"nested": [1, 2]}},
        "mixed_keys": {None: 1, True: 2, 2.5: 3, ("a", 1): 4, "$": 5},
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "empty": [[], {}, ()],
        "raw": b"\x00\xffbytes",
        "numpy_scalars": [np.float32(1.5), np.int64(-7), np.bool_(True), np.float64(2.0)],
    }
    ckpt = manager(tmp_path)
    ckpt.save(3, state)
    loaded = ckpt.load(3)
    assert loaded == state
    assert type(loaded["tuple"]) is tuple
    assert type(loaded["tuple"][2]) is tuple
    assert type(loaded["flags"][0]) is bool
    assert type(loaded["int_keys"]) is dict
    assert list(loaded["int_keys"]) == [0, 1]
    assert type(loaded["ordered"]) is OrderedDict
    assert list(loaded["ordered"]) == ["b", "a"]
    assert math.copysign(1.0, loaded["floats"][1]) == -1.0
    assert loaded["raw"] == b"\x00\xffbytes"
    assert [type(v) for v in loaded["numpy_scalars"]] == [
        np.float32,
        np.int64,
        np.bool_,
        np.float64,
    ]
    nan = manager(tmp_path / "nan")
    nan.save(1, {"nan": math.nan})
    assert math.isnan(nan.load(1)["nan"])


def test_torch_state_dicts_round_trip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(6, 8)).square().sum().backward()
    optimizer.step()
    extra = {
        "bf16": torch.randn(5).to(torch.bfloat16),
        "int64": torch.arange(10, dtype=torch.int64),
        "bool": torch.tensor([True, False]),
        "0-d": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "half": torch.tensor([1.0, 65504.0], dtype=torch.float16),
        "complex": torch.tensor([1 + 2j]),
        "grad": torch.ones(2, requires_grad=True) * 3,
    }
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": extra}
    ckpt = manager(tmp_path)
    ckpt.save(1, state)
    loaded = ckpt.load(1)

    for name, want in {**state["model"], **extra}.items():
        got = loaded["model"][name] if name in state["model"] else loaded["extra"][name]
        assert isinstance(got, torch.Tensor), name
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert torch.equal(got, want.detach()), name
        assert not got.requires_grad
    assert type(loaded["model"]) is OrderedDict
    assert loaded["model"]._metadata == state["model"]._metadata
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    for index, moments in state["optim"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(loaded["optim"]["state"][index][key], value)

    # The loaded dicts drive the real torch loaders, and training goes on identically.
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh.load_state_dict(loaded["model"])
    fresh_optimizer.load_state_dict(loaded["optim"])
    batch = torch.randn(6, 8)
    for net, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        opt.zero_grad()
        net(batch).square().sum().backward()
        opt.step()
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_loading_tensors_without_torch_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    ckpt = manager(tmp_path)
    ckpt.save(1, {"w": torch.ones(2)})
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(CheckpointError, match="install torch"):
        ckpt.load(1)


def test_numpy_state_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from cluster.api.checkpoint import *\n"
        "m = CheckpointManager(sys.argv[1], 'p', CheckpointConfig(), rank=0, recovery=False)\n"
        "import numpy as np; m.save(1, {'a': np.ones(3)}); m.load(1)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ({1, 2}, r"state\['bad'\]\[0\] is a set"),
        (object(), r"state\['bad'\]\[0\] is a object"),
        (np.array([object()]), "dtype object"),
        (np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]), "records"),
        ({frozenset(): 1}, "dict keys"),
    ],
)
def test_unsupported_values_are_refused_before_writing(
    tmp_path: Path, value: object, what: str
) -> None:
    ckpt = manager(tmp_path)
    with pytest.raises(CheckpointError, match=what):
        ckpt.save(1, {"bad": [value]})
    assert names(ckpt.directory) == []


def test_a_lazy_modules_uninitialized_parameters_are_refused_in_words(tmp_path: Path) -> None:
    """A lazy module before its first forward pass holds no values: refused with what to do,
    not with torch's ValueError from deep inside the copy."""
    torch = pytest.importorskip("torch")
    ckpt = manager(tmp_path)
    lazy = torch.nn.LazyLinear(4)
    with pytest.raises(CheckpointError, match=r"state\['model'\]\['weight'\] is an uninitial"):
        ckpt.save(1, {"model": lazy.state_dict()})
    assert names(ckpt.directory) == []
    lazy(torch.randn(2, 3))  # materialised: saved as any module
    ckpt.save(1, {"model": lazy.state_dict()})


class Tagged(np.ndarray[Any, Any]):
    """A subclass of ndarray, as np.matrix is one (which warns when it is made)."""


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False]), "numpy.ma.MaskedArray"),
        (np.ma.masked, "numpy.ma.core.MaskedConstant"),
        (np.arange(4.0).view(Tagged), "tests.unit.test_checkpoint.Tagged"),
    ],
    ids=["masked", "masked-constant", "subclass"],
)
def test_a_subclass_of_ndarray_is_refused_not_saved_without_what_it_adds(
    tmp_path: Path, value: object, name: str
) -> None:
    """A masked array saved as an ndarray would come back with its masked values as data."""
    ckpt = manager(tmp_path)
    place = re.escape("state['opt'][1]")
    with pytest.raises(CheckpointError, match=rf"{place} is a {name}.*subclass of numpy.ndarray"):
        ckpt.save(1, {"opt": [np.zeros(2), value]})
    assert names(ckpt.directory) == []
    ckpt.save(1, {"data": np.asarray(value), "mask": np.ma.getmaskarray(value)})
    assert type(ckpt.load(1)["data"]) is np.ndarray


def test_state_must_be_a_mapping_of_str(tmp_path: Path) -> None:
    ckpt = manager(tmp_path)
    with pytest.raises(CheckpointError, match="keys are str"):
        ckpt.save(1, {1: "x"})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="mapping"):
        ckpt.save(1, [1, 2])  # type: ignore[arg-type]
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(CheckpointError, match="contains itself"):
        ckpt.save(1, loop)


# Files, pruning, ranks, reports


def test_file_name_and_no_temporary_left(tmp_path: Path) -> None:
    ckpt = manager(tmp_path)
    path = ckpt.save(7, {"a": 1})
    ckpt.flush()
    assert path == tmp_path / "ckpt" / "rank_0" / "net-00000007.ckpt"
    assert names(ckpt.directory) == ["net-00000007.ckpt"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    reports: list[list[int]] = []
    ckpt = manager(tmp_path, keep=3, report=reports.append)
    for step in range(1, 7):
        ckpt.save(step, {"step": step})
    assert ckpt.steps() == [4, 5, 6]
    assert names(ckpt.directory) == [
        "net-00000004.ckpt",
        "net-00000005.ckpt",
        "net-00000006.ckpt",
    ]
    ckpt.flush()
    # Each report names the steps held once a write was done, in order, the last one's last; a
    # list that another overtook while a report was under way is never sent.
    after_each = [[1], [1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6]]
    assert reports == [held for held in after_each if held in reports]
    assert reports[-1] == [4, 5, 6]
    assert ckpt.latest() == (6, {"step": 6})


def test_a_report_names_at_most_the_newest_steps_the_scheduler_takes(tmp_path: Path) -> None:
    """keep_checkpoint_max past the scheduler's bound on a report (MAX_REPORTED_CHECKPOINTS,
    whose report it refuses): the rank keeps every checkpoint, and reports the newest only."""
    most = MAX_REPORTED_CHECKPOINTS
    reports: list[list[int]] = []
    ckpt = manager(tmp_path, keep=most + 10, report=reports.append)
    ckpt.save(1, {"w": np.ones(1)})
    ckpt.flush()
    # Steps 2 to most + 4 as links to step 1's file: the listing's cheap check (preamble, size,
    # footer) takes them as complete, and this test loads none of them.
    for step in range(2, most + 5):
        os.link(ckpt.path(1), ckpt.path(step))
    ckpt.save(most + 5, {"w": np.ones(1)})
    ckpt.flush()
    assert ckpt.steps() == list(range(1, most + 6))
    assert reports[-1] == list(range(6, most + 6))
    assert runtime.newest_reported([3, 1, 2]) == [1, 2, 3]


def test_the_step_every_rank_holds_is_kept_past_keep_checkpoint_max(tmp_path: Path) -> None:
    """This rank's writer runs ahead of the others' reports: the step the scheduler answers as
    held by every rank (the job's rollback step) stays, with every newer one, until the
    answer moves on."""
    held_by_all = 2

    def report(steps: list[int]) -> int:
        return held_by_all

    ckpt = manager(tmp_path, keep=2, report=report)
    for step in range(1, 6):
        ckpt.save(step, {"step": step})
    ckpt.flush()
    assert ckpt.steps() == [2, 3, 4, 5]  # 1 went before the answer said 2
    held_by_all = 4  # answered to the report of step 6, which follows its pruning
    ckpt.save(6, {"step": 6})
    ckpt.save(7, {"step": 7})
    ckpt.flush()
    assert ckpt.steps() == [4, 5, 6, 7]


def test_saving_an_older_step_drops_the_newer_ones(tmp_path: Path) -> None:
    """After a rollback to step 2, checkpoints 3 and 4 of the abandoned run must go."""
    ckpt = manager(tmp_path, keep=5)
    for step in range(1, 5):
        ckpt.save(step, {"run": 1, "step": step})
    ckpt.save(3, {"run": 2, "step": 3})
    assert ckpt.steps() == [1, 2, 3]
    assert ckpt.load(3) == {"run": 2, "step": 3}


def test_should_save_every_k_steps(tmp_path: Path) -> None:
    ckpt = manager(tmp_path, every=3)
    assert [s for s in range(1, 10) if ckpt.should_save(s)] == [3, 6, 9]


@pytest.mark.parametrize("every", [1, 3])
def test_should_save_takes_step_0_of_a_loop_over_range_and_says_no(
    tmp_path: Path, every: int
) -> None:
    """`for step in range(n): if should_save(step): save(step, ...)`: step 0, where no training
    step is done yet, is asked about too, and is no saving step (save itself takes 1 on)."""
    ckpt = manager(tmp_path, keep=10, every=every)
    for step in range(7):
        if ckpt.should_save(step):
            ckpt.save(step, {"step": step})
    assert ckpt.steps() == [s for s in range(1, 7) if s % every == 0]
    for bad in (-1, True, 1.0):
        with pytest.raises(CheckpointError, match=r"step=.*integer >= 0"):
            ckpt.should_save(bad)  # type: ignore[arg-type]


def test_each_rank_has_its_own_directory(tmp_path: Path) -> None:
    zero, one = manager(tmp_path, rank=0), manager(tmp_path, rank=1)
    zero.save(1, {"rank": 0})
    one.save(1, {"rank": 1})
    one.save(2, {"rank": 1})
    zero.flush()
    one.flush()
    assert (tmp_path / "ckpt" / "rank_0" / "net-00000001.ckpt").is_file()
    assert (tmp_path / "ckpt" / "rank_1" / "net-00000002.ckpt").is_file()
    assert zero.steps() == [1]
    assert one.steps() == [1, 2]
    assert zero.load(1) == {"rank": 0}
    assert one.latest() == (2, {"rank": 1})


def test_defaults_without_cluster_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MS_ENABLE_RECOVERY", raising=False)
    ckpt = CheckpointManager(tmp_path, "p", CheckpointConfig())
    assert ckpt.rank == 0
    assert ckpt.recovery is False
    assert ckpt.directory == tmp_path / "rank_0"
    ckpt.save(1, {"a": 1})  # the default report is a no-op before cluster.init()


def test_defaults_after_cluster_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank, recovery and the report come from the joined job (faked here: no network); the
    report says the generation the worker reports from as its steps were listed."""
    reported: list[tuple[list[int], int]] = []
    session = SimpleNamespace(
        config=SimpleNamespace(recovery=SimpleNamespace(path=tmp_path)),
        topology=None,
        say=print,
        agent=SimpleNamespace(report_generation=7),
    )

    def report(steps: list[int], generation: int = 0) -> None:
        reported.append((steps, generation))

    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "get_rank", lambda: 3)
    monkeypatch.setattr(runtime, "session", lambda: session)
    monkeypatch.setattr(runtime, "report_checkpoints", report, raising=False)
    offered: list[Any] = []  # the state server (tests/unit/test_peer_state.py) is not started
    monkeypatch.setattr(peer_state, "serve", offered.append)
    monkeypatch.delenv("MS_ENABLE_RECOVERY", raising=False)
    with pytest.raises(ConfigError, match="recovery on"):
        CheckpointManager(tmp_path, "p", CheckpointConfig(keep_checkpoint_max=1))
    ckpt = CheckpointManager(tmp_path, "p", CheckpointConfig(keep_checkpoint_max=2))
    assert (ckpt.rank, ckpt.recovery) == (3, True)
    assert offered == [ckpt.served]  # with recovery on, offered to the job's members
    for step in (1, 2, 3):
        ckpt.save(step, {"a": step})
    ckpt.flush()
    # No step every rank holds heard yet (the fake answers None): at least 4 are kept.
    assert reported == [([1], 7), ([1, 2], 7), ([1, 2, 3], 7)]
    assert (tmp_path / "rank_3" / "p-00000003.ckpt").is_file()


def test_prefixes_share_a_directory_without_mixing(tmp_path: Path) -> None:
    config = CheckpointConfig(keep_checkpoint_max=1)
    model = CheckpointManager(tmp_path, "model", config, rank=0, recovery=False)
    ema = CheckpointManager(tmp_path, "model-ema", config, rank=0, recovery=False)
    model.save(1, {"m": 1})
    ema.save(1, {"e": 1})
    ema.save(2, {"e": 2})
    assert model.steps() == [1]
    assert ema.steps() == [2]
    ema_temporary = ema.directory / ".model-ema-00000003.ckpt.123.tmp"
    ema_temporary.write_bytes(b"being written")
    model.save(2, {"m": 2})  # removes its own temporaries only
    model.flush()
    assert ema_temporary.exists()


def test_foreign_and_non_canonical_names_are_ignored(tmp_path: Path) -> None:
    ckpt = manager(tmp_path)
    ckpt.save(1, {"a": 1})
    for name in ("net-1.ckpt", "net-00000000.ckpt", "net-000000002.ckpt", "other-00000003.ckpt"):
        (ckpt.directory / name).write_bytes(b"junk")
    assert ckpt.steps() == [1]
    ckpt.save(2, {"a": 2})
    assert (ckpt.directory / "other-00000003.ckpt").exists()


def test_missing_step_names_the_steps_held(tmp_path: Path) -> None:
    ckpt = manager(tmp_path)
    assert ckpt.latest() is None
    ckpt.save(2, {"a": 1})
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 5 .*holds steps \[2\]"):
        ckpt.load(5)


def test_a_leftover_temporary_is_ignored_then_removed(tmp_path: Path) -> None:
    ckpt = manager(tmp_path)
    ckpt.save(1, {"a": 1})
    ckpt.flush()
    stale = ckpt.directory / ".net-00000002.ckpt.999999.tmp"
    stale.write_bytes(ckpt.path(1).read_bytes()[:100])
    assert ckpt.steps() == [1]
    assert ckpt.latest() == (1, {"a": 1})
    ckpt.save(2, {"a": 2})
    ckpt.flush()
    assert not stale.exists()


def test_a_failed_save_leaves_the_older_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk in the background: the next save raises it (naming the file and the cause),
    the step is never reported, and saving works again once the disk has room."""
    reports: list[list[int]] = []
    ckpt = manager(tmp_path, report=reports.append)
    ckpt.save(1, {"a": np.ones(1000)})
    ckpt.flush()
    full = [True]

    def disk_full(fd: int, data: memoryview | bytes) -> None:
        if full[0] and len(data) >= 8000:  # the header went out, the array does not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(fd, data)

    original = atomic.write_all
    monkeypatch.setattr(atomic, "write_all", disk_full)
    ckpt.save(2, {"a": np.ones(1000)})  # returns: the write fails in the background
    assert ckpt.steps() == [1]  # (once the writer is done)
    message = rf"step 2 to {re.escape(str(ckpt.path(2)))} .*No space left on device.*unchanged"
    with pytest.raises(CheckpointError, match=message):
        ckpt.save(3, {"a": np.ones(1000)})
    assert names(ckpt.directory) == ["net-00000001.ckpt"]
    assert reports == [[1]]
    ckpt.save(2, {"a": np.ones(1000)})
    with pytest.raises(CheckpointError, match="No space left on device"):
        ckpt.flush()
    full[0] = False
    ckpt.save(2, {"a": np.ones(1000) * 2})
    ckpt.flush()
    assert reports == [[1], [1, 2]]
    assert_same_array(ckpt.load(2)["a"], np.ones(1000) * 2)


def test_a_save_whose_directory_sync_fails_says_its_file_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory's fsync fails (an I/O error) once the rename has landed: the error says
    the step's file is in place but may be lost to a crash, not that nothing changed."""
    ckpt = manager(tmp_path)
    ckpt.save(1, {"a": np.ones(10)})
    ckpt.flush()

    def failing(directory: Path) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(atomic, "fsync_directory", failing)
    ckpt.save(2, {"a": np.ones(10) * 2})
    with pytest.raises(CheckpointError) as info:
        ckpt.flush()
    assert str(info.value) == (
        f"the checkpoint of step 2 is in place at {ckpt.path(2)}, but syncing its directory "
        "failed (Input/output error): a crash of the host may still lose it; the checkpoints "
        "of other steps are unchanged; check the disk"
    )
    assert names(ckpt.directory) == ["net-00000001.ckpt", "net-00000002.ckpt"]
    assert_same_array(ckpt.load(2)["a"], np.ones(10) * 2)
    ckpt.close()


# Corrupt files


def saved_pair(tmp_path: Path) -> tuple[CheckpointManager, Path]:
    """Steps 1 and 2 saved; the path of step 2, the one the tests damage."""
    ckpt = manager(tmp_path)
    ckpt.save(1, {"w": np.arange(1000, dtype=np.float32), "step": 1})
    ckpt.save(2, {"w": np.arange(1000, dtype=np.float32) * 2, "step": 2})
    ckpt.flush()
    return ckpt, ckpt.path(2)


def assert_refused(ckpt: CheckpointManager, path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`latest()` skips the damaged step 2 with a warning naming it, and moves it aside; damaged
    again, `load(2)` refuses it naming it, and moves it aside again."""
    damaged = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="cluster.api.checkpoint"):
        latest = ckpt.latest()
    assert latest is not None
    assert latest[0] == 1
    assert latest[1]["step"] == 1
    assert any(str(path) in record.getMessage() for record in caplog.records)
    aside = path.with_name(path.name + ".damaged")
    assert aside.read_bytes() == damaged
    assert ckpt.steps() == [1]
    path.write_bytes(damaged)
    moved = rf"{path.name}.*(torn|corrupt).*moved aside to {re.escape(aside.name)}"
    with pytest.raises(CheckpointError, match=moved) as info:
        ckpt.load(2)
    assert str(path) in str(info.value)
    assert not path.exists()


@pytest.mark.parametrize("keep", [0, 1, 31, 100, 0.5, -1, -40])
def test_truncated_files_are_refused_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, keep: float
) -> None:
    ckpt, path = saved_pair(tmp_path)
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path.write_bytes(data[:cut])
    assert ckpt.steps() == [1]  # the cheap check sees a short file
    assert_refused(ckpt, path, caplog)


@pytest.mark.parametrize("where", [0, 9, 20, 40, 60, 0.3, 0.6, 0.9, -41, -20, -1])
def test_a_flipped_bit_anywhere_is_detected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: float
) -> None:
    ckpt, path = saved_pair(tmp_path)
    data = bytearray(path.read_bytes())
    index = int(len(data) * where) if isinstance(where, float) else where % len(data)
    data[index] ^= 0x10
    path.write_bytes(bytes(data))
    assert_refused(ckpt, path, caplog)


def test_a_renamed_file_is_not_taken_for_another_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, path = saved_pair(tmp_path)
    path.write_bytes(ckpt.path(1).read_bytes())
    with pytest.raises(CheckpointError, match="holds step 1, not 2"):
        ckpt.load(2)


def test_a_foreign_file_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt, path = saved_pair(tmp_path)
    path.write_bytes(b"PK\x03\x04" + bytes(200))
    assert ckpt.steps() == [1]
    assert_refused(ckpt, path, caplog)


def forged_array_file(path: Path, step: int, entry: dict[str, Any]) -> None:
    """A checkpoint file whose one array is `entry` (of no bytes), its checksum wrong: what
    a header edited by hand, or damaged into other valid JSON, looks like."""
    header = {
        "format": checkpoint_files.FORMAT,
        "version": checkpoint_files.VERSION,
        "step": step,
        "rank": 0,
        "prefix": "net",
        "data_bytes": 0,
        "entries": [entry],
        "state": {"$": "dict", "items": [["w", {"$": "ndarray", "i": 0}]]},
    }
    raw = json.dumps(header).encode()
    start = aligned(checkpoint_files.PREAMBLE.size + len(raw))
    size = start + checkpoint_files.FOOTER_SIZE
    preamble = checkpoint_files.PREAMBLE.pack(
        checkpoint_files.MAGIC, checkpoint_files.VERSION, 0, len(raw), size
    )
    head = preamble + raw
    path.write_bytes(head + bytes(start - len(head)) + checkpoint_files.END_MAGIC + bytes(16))


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        ("<f8", [0, 10**19]),  # numpy: ValueError, "Maximum allowed dimension exceeded"
        ("<f8", [0, 2**62, 2**62]),  # numpy: ValueError, "array is too big"
        ("u1,,", [0]),  # numpy's dtype parser: SyntaxError
        ("float32", [0, 2**62, 2**62]),  # a tensor: torch's RuntimeError, stride overflow
    ],
)
def test_an_array_numpy_or_torch_cannot_make_is_a_damaged_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dtype: str, shape: list[int]
) -> None:
    """An array entry its checks let through, but that numpy or torch refuses to make, is
    damage like any other: the file is named, moved aside, and an older step is taken."""
    if dtype == "float32":
        pytest.importorskip("torch")
    kind = "tensor" if dtype == "float32" else "ndarray"
    ckpt, path = saved_pair(tmp_path)
    entry = {"kind": kind, "dtype": dtype, "shape": shape, "offset": 0, "nbytes": 0}
    forged_array_file(path, 2, entry)
    assert_refused(ckpt, path, caplog)


def test_a_damaged_checkpoint_is_moved_aside_and_no_longer_reported(tmp_path: Path) -> None:
    """A bit flipped in the data: the file still looks complete, so it is listed and reported;
    its load refuses it naming it, moves it aside (kept) and reports what is held without it,
    so that a restarted worker does not name it again. Pruning leaves the evidence alone."""
    reports: list[list[int]] = []
    ckpt = manager(tmp_path, keep=2, report=reports.append)
    ckpt.save(1, {"w": np.arange(1000.0)})
    ckpt.save(2, {"w": np.arange(1000.0) * 2})
    ckpt.flush()
    path = ckpt.path(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert ckpt.steps() == [1, 2]  # the cheap check cannot see it
    moved = rf"{re.escape(str(path))} is torn or corrupt \(its XXH3-128 checksum does not match"
    with pytest.raises(CheckpointError, match=moved) as info:
        ckpt.load(2)
    assert "it is moved aside to net-00000002.ckpt.damaged, kept for a look" in str(info.value)
    assert reports[-1] == [1]
    assert ckpt.steps() == [1]
    assert (ckpt.directory / "net-00000002.ckpt.damaged").read_bytes() == bytes(data)
    for step in (3, 4, 5):
        ckpt.save(step, {"w": np.arange(1000.0) * step})
    ckpt.flush()
    assert names(ckpt.directory) == [
        "net-00000002.ckpt.damaged",
        "net-00000004.ckpt",
        "net-00000005.ckpt",
    ]


def test_when_every_checkpoint_is_corrupt_latest_is_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, _ = saved_pair(tmp_path)
    for step in (1, 2):
        ckpt.path(step).write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="cluster.api.checkpoint"):
        assert ckpt.latest() is None
    assert len(caplog.records) == 2
    assert ckpt.steps() == []


# A process killed in the middle of saving

SAVER = """
import os, signal, sys, threading
from pathlib import Path
import numpy as np
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.storage import atomic, checkpoint_files

directory, size, kill_at = sys.argv[1], int(sys.argv[2]), sys.argv[3]


printing = threading.Lock()  # the loop's lines and the reporter's, each whole


def say(*words):
    with printing:
        print(*words, flush=True)


whole = set()  # the steps whose write returned: whole and durable
durable_write = checkpoint_files.write


def write_down(path, step, parts):
    durable_write(path, step, parts)
    whole.add(step)


checkpoint_files.write = write_down


def report(steps):
    # On the reporter's thread, when it names the steps held: each was written whole before it
    # was named; one the writer has not removed since (pruned) is whole on disk now.
    for step in steps:
        if step not in whole:
            say("BAD", step, "reported before its write returned")
        try:
            state = checkpoint_files.read(ckpt.path(step), step)
            assert state["step"] == step and state["w"][-1] == step
        except Exception as exc:
            if ckpt.path(step).exists():
                say("BAD", step, exc)
    say("held", *steps)


ckpt = CheckpointManager(directory, "big", CheckpointConfig(keep_checkpoint_max=2), rank=0,
                         recovery=False, report=report)

# kill_at "<step>:<point>[:<fraction>]": the writer SIGKILLs this process at that point of the
# background write of that step.
if kill_at != "none":
    kill_step, point, *rest = kill_at.split(":")
    writing = [0]

    def die(where):
        if writing[0] == int(kill_step) and where == point:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(module, name, where, before=True):
        original = getattr(module, name)
        def wrapper(*args):
            if before:
                die(where)
            result = original(*args)
            if not before:
                die(where)
            return result
        setattr(module, name, wrapper)

    original_write = checkpoint_files.write
    def write(path, step, parts):
        writing[0] = step
        written[0] = 0
        original_write(path, step, parts)
    checkpoint_files.write = write

    written = [0]
    original_write_all = atomic.write_all
    def write_all(fd, data):
        if writing[0] == int(kill_step) and point == "write":
            cut = int(size * 4 * float(rest[0])) - written[0]
            if 0 <= cut < len(data):
                original_write_all(fd, memoryview(data)[:cut])
                die("write")
            written[0] += len(data)
        original_write_all(fd, data)
    atomic.write_all = write_all
    wrap(atomic.os, "fsync", "fsync")
    wrap(atomic.os, "replace", "replace", before=False)
    wrap(Path, "unlink", "prune", before=False)

state = {"w": np.zeros(size, dtype=np.float32)}
for step in range(1, 10_000):
    # The loop changes its state in place right after each save: a copy must have been made.
    state["step"] = step
    state["w"][:] = step
    state["b"] = np.arange(step % 97, dtype=np.int64)
    ckpt.save(step, state)
    state["w"][:] = -1
    say("copied", step)
"""


def read_lines(process: subprocess.Popen[bytes], done: Callable[[list[str]], bool]) -> list[str]:
    """The lines the process prints, until `done(lines)` or its exit, for 60 s at most."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + 60
    buffer, lines = b"", []
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while not done(lines):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out after 60 s; the saver printed {lines[-5:]}")
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            lines.extend(line.decode() for line in complete)
    return lines


def run_saver(
    tmp_path: Path,
    size: int,
    copied: int = 10_000,
    kill_at: str = "none",
    written: float | None = None,
) -> list[str]:
    """Run SAVER until it copied `copied` steps (or killed itself) and, with `written`, until
    the checkpoint of that step has that fraction of its bytes in its temporary file (or is
    complete); SIGKILL it. Every line it printed."""
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(tmp_path), str(size), kill_at],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        printed = read_lines(saver, lambda lines: f"copied {copied}" in lines)
        if written is not None:
            wait_for_bytes(tmp_path / "rank_0", copied, written * size * 4)
    finally:
        saver.kill()
        returncode = saver.wait(10)
        assert saver.stdout is not None
        printed += saver.stdout.read().decode().splitlines()  # what it printed meanwhile
        saver.stdout.close()
    assert returncode == -signal.SIGKILL, printed
    return printed


def wait_for_bytes(directory: Path, step: int, count: float) -> None:
    """Until the temporary of `step` holds `count` bytes, or the checkpoint is complete."""
    name = f"big-{step:08d}.ckpt"

    def reached() -> bool:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name == name:
                    return True
                if entry.name.startswith(f".{name}.") and entry.name.endswith(".tmp"):
                    with suppress(FileNotFoundError):  # renamed since it was listed
                        if entry.stat().st_size >= count:
                            return True
        return False

    # Polled often: the test kills the saver while it writes, not after.
    wait_until(reached, 30, f"the saver to write {count} bytes of {name}", poll_s=0.0005)


def check_after_kill(tmp_path: Path, size: int, printed: list[str]) -> tuple[int, list[int]]:
    """No step was reported before it was whole; every checkpoint left is whole, the newest
    written (the 2 kept, and one whose pruning was cut short), none older than the one before
    the newest reported. The newest step reported held, and the steps on disk."""
    assert not [line for line in printed if line.startswith("BAD")], printed
    held = [[int(s) for s in line.split()[1:]] for line in printed if line.startswith("held")]
    done = held[-1][-1] if held else 0
    ckpt = CheckpointManager(
        tmp_path, "big", CheckpointConfig(keep_checkpoint_max=2), rank=0, recovery=False
    )
    steps = ckpt.steps()
    assert done == 0 or max(steps) >= done
    if steps:
        assert steps == list(range(steps[0], steps[-1] + 1))
    else:
        assert done == 0
    assert len(steps) <= 3
    assert min(steps, default=done) >= done - 1
    for step in steps:
        state = ckpt.load(step)
        assert state["step"] == step
        assert_same_array(state["w"], np.full(size, step, dtype=np.float32))
        assert_same_array(state["b"], np.arange(step % 97, dtype=np.int64))
    latest = ckpt.latest()
    assert latest is None or latest[0] == max(steps)
    ckpt.save(done + 5, {"step": done + 5})
    ckpt.flush()
    assert not list(ckpt.directory.glob(".*.tmp"))
    return done, steps


@pytest.mark.parametrize("seed", range(16))
def test_sigkill_during_background_writes_leaves_only_complete_checkpoints(
    tmp_path: Path, seed: int
) -> None:
    """A process saving 16-44 MB checkpoints in a loop is SIGKILLed once the background write
    of its n-th checkpoint has a random part of it in the temporary file (or right after n
    copies): every checkpoint left loads and verifies, the newest one reported held is there,
    no step was reported before it was whole, and the next save clears the temporary."""
    rng = random.Random(seed)
    size = rng.randrange(4, 12) * 2**20  # float32 elements
    copies = rng.randrange(1, 6)
    written = None if seed % 4 == 3 else rng.random()
    printed = run_saver(tmp_path, size, copied=copies, written=written)
    done, steps = check_after_kill(tmp_path, size, printed)
    assert max(steps, default=0) >= copies - 2  # at most one written and one copied pending
    if written is not None:
        assert done <= copies


@pytest.mark.parametrize(
    "point",
    ["write:0.0", "write:0.37", "write:0.999", "write:1.0", "fsync", "replace", "prune"],
)
def test_sigkill_at_each_point_of_a_background_write(tmp_path: Path, point: str) -> None:
    """The writer kills the process inside its fourth write: part-way through the data, before
    an fsync, after the rename, in the middle of pruning; the loop was ahead of it."""
    size = 2**20
    printed = run_saver(tmp_path, size, kill_at=f"4:{point}")
    done, steps = check_after_kill(tmp_path, size, printed)
    assert done <= 3  # never step 4: the kill came before its report
    assert 3 in steps  # written before the fourth began
    # After the rename the new checkpoint is whole, and it is kept.
    assert (4 in steps) == (point in ("replace", "prune"))


# Configuration


@pytest.mark.parametrize("field", ["save_checkpoint_steps", "keep_checkpoint_max"])
@pytest.mark.parametrize("value", [0, -3, 1.5, "2", True, None])
def test_bad_config_values_name_the_field_value_and_rule(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointConfig(**{field: value})  # type: ignore[arg-type]
    message = str(info.value)
    assert f"{field}={value!r}" in message
    assert "integer >= 1" in message
    assert isinstance(info.value, ClusterError)


def test_recovery_needs_two_checkpoints_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = CheckpointConfig(keep_checkpoint_max=1)
    with pytest.raises(ConfigError, match=r"keep_checkpoint_max=1 .*recovery on.*>= 2"):
        CheckpointManager(tmp_path, "p", one, rank=0, recovery=True)
    CheckpointManager(tmp_path, "p", one, rank=0, recovery=False)
    CheckpointManager(tmp_path, "p", CheckpointConfig(keep_checkpoint_max=2), recovery=True)

    monkeypatch.setenv("MS_ENABLE_RECOVERY", "1")
    with pytest.raises(ConfigError, match="keep_checkpoint_max=1"):
        CheckpointManager(tmp_path, "p", one, rank=0)
    monkeypatch.setenv("MS_ENABLE_RECOVERY", "maybe")
    with pytest.raises(ConfigError, match="MS_ENABLE_RECOVERY='maybe' is not a boolean"):
        CheckpointManager(tmp_path, "p", one, rank=0)


@pytest.mark.parametrize("prefix", ["", "a/b", "../x", ".hidden", "x" * 129, 5, "x\n"])
def test_bad_prefix(tmp_path: Path, prefix: object) -> None:
    with pytest.raises(ConfigError, match="prefix="):
        CheckpointManager(tmp_path, prefix, CheckpointConfig(), rank=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [-1, True, 1.0, "0"])
def test_bad_rank(tmp_path: Path, rank: object) -> None:
    with pytest.raises(ConfigError, match="rank="):
        CheckpointManager(tmp_path, "p", CheckpointConfig(), rank=rank)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [0, -1, True, 1.0, "3"])
def test_bad_step(tmp_path: Path, step: object) -> None:
    ckpt = manager(tmp_path)
    with pytest.raises(CheckpointError, match=r"step=.*integer >= 1"):
        ckpt.save(step, {})  # type: ignore[arg-type]


def test_discard_newer_removes_the_abandoned_steps_and_reports(tmp_path: Path) -> None:
    reports: list[list[int]] = []
    ckpt = CheckpointManager(
        tmp_path, "net", CheckpointConfig(1, 5), rank=0, recovery=False, report=reports.append
    )
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"step": step})
    ckpt.flush()
    assert reports[-1] == [1, 2, 3, 4]
    ckpt.discard_newer(2)
    assert ckpt.steps() == [1, 2]
    assert reports[-1] == [1, 2]
    count = len(reports)
    ckpt.discard_newer(2)  # nothing newer: nothing to report
    assert len(reports) == count
