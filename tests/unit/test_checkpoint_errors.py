"""User mistakes and disk faults around checkpoints end in a ConfigError or a CheckpointError
that names the value or the path, never in a raw traceback."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.api.training import TrainingLoop
from cluster.protocol.errors import CheckpointError, ConfigError
from tests.procs import run_as_a_user

NOBODY = 65534  # the user that owns what this process, as a user, may not remove


def manager(tmp_path: Path, **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("recovery", False)
    config = CheckpointConfig(keep_checkpoint_max=2)
    return CheckpointManager(tmp_path, "net", config, rank=0, **kwargs)


@pytest.mark.parametrize("steps", ["100", 10.5, 10.0, -1, True, None])
def test_training_loop_steps_must_be_an_integer(tmp_path: Path, steps: Any) -> None:
    invalid = rf"steps={re.escape(repr(steps))} is invalid"
    with manager(tmp_path) as ckpt, pytest.raises(ConfigError, match=invalid):
        TrainingLoop(steps, ckpt, dict, lambda state: None)


# Saves step 2 beside a torn step 1 that it may not remove (`argv[1]`): what it raises and
# reports.
SAVE_BESIDE_UNREMOVABLE = """
import sys
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError
reports = []
config = CheckpointConfig(keep_checkpoint_max=2)
ckpt = CheckpointManager(sys.argv[1], "net", config, rank=0, recovery=False, report=reports.append)
ckpt.save(2, {"a": 2})
try:
    ckpt.flush()
except CheckpointError as exc:
    print("refused:", exc)
print("reported:", reports)
ckpt.close()
"""


def test_a_checkpoint_that_cannot_be_pruned_names_its_path(tmp_path: Path) -> None:
    """Step 1's file is torn, and the system refuses to remove it (another user's, in a sticky
    directory of theirs): the save that prunes it fails naming it, yet its own step, whole on
    disk, is reported."""
    rank_directory = tmp_path / "rank_0"
    rank_directory.mkdir()
    torn = rank_directory / "net-00000001.ckpt"
    torn.write_bytes(b"torn")
    for path, mode in ((torn, 0o644), (rank_directory, 0o1777)):
        os.chown(path, NOBODY, NOBODY)
        path.chmod(mode)
    said = run_as_a_user(SAVE_BESIDE_UNREMOVABLE, tmp_path, "fowner").stdout.splitlines()
    assert said[0].startswith(f"refused: cannot remove the checkpoint {torn} ("), said
    assert said[1:] == ["reported: [[2]]"], said
    assert torn.exists()


# Lists the checkpoints of rank 0 under `argv[1]`: what it says.
LIST = """
import sys
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError
ckpt = CheckpointManager(sys.argv[1], "net", CheckpointConfig(), rank=0, recovery=False)
try:
    print(ckpt.steps())
except CheckpointError as exc:
    print("refused:", exc)
"""


def test_a_checkpoint_directory_that_cannot_be_listed_names_its_path(tmp_path: Path) -> None:
    """The rank's directory may be written but not read (mode 0300), as a user: a listing is
    refused naming it."""
    rank_directory = tmp_path / "rank_0"
    rank_directory.mkdir(mode=0o300)
    rank_directory.chmod(0o300)
    said = run_as_a_user(LIST, tmp_path).stdout
    listing = f"refused: cannot list the checkpoint directory {rank_directory} (Permission denied)"
    assert said.startswith(listing), said


def test_a_directory_in_a_steps_place_is_named_never_reported_nor_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory where step 1's file would be: no checkpoint, so it is not reported, and
    not the manager's to remove; one line names it, and the saves go on around it."""
    reports: list[list[int]] = []
    ckpt = manager(tmp_path, report=reports.append)
    blocker = ckpt.path(1)
    blocker.mkdir()
    ckpt.save(2, {"a": 2})
    ckpt.flush()
    ckpt.save(3, {"a": 3})
    ckpt.close()
    assert reports[-1] == [2, 3]
    assert ckpt.steps() == [2, 3]
    assert blocker.is_dir()
    said = [r.getMessage() for r in caplog.records if str(blocker) in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "(a directory, not a regular file): step 1 is neither reported" in said[0]


def test_a_file_in_the_checkpoint_directorys_place_is_named(tmp_path: Path) -> None:
    """The rank's directory replaced by a file: each use says what stands there and what to
    do (the manager makes a removed directory again, not one something else holds)."""
    ckpt = manager(tmp_path)
    shutil.rmtree(ckpt.directory)  # its lock file with it
    ckpt.directory.write_bytes(b"")
    named = rf"the checkpoint directory {ckpt.directory} is no directory: move it away"
    with pytest.raises(CheckpointError, match=named):
        ckpt.steps()
    with pytest.raises(CheckpointError, match=named):
        ckpt.save(1, {})
    with pytest.raises(CheckpointError, match=named):
        ckpt.discard_newer(0)
    assert ckpt.directory.read_bytes() == b""


@pytest.mark.parametrize(
    "error",
    [concurrent.futures.CancelledError(), RuntimeError("Event loop is closed")],
    ids=["cancelled", "closed-loop"],
)
def test_a_report_that_fails_otherwise_is_a_checkpoint_error(
    tmp_path: Path, error: Exception
) -> None:
    """A session closed under the writer: the report's call is cancelled, or its loop gone."""

    def report(steps: list[int]) -> int:
        raise error

    ckpt = manager(tmp_path, report=report)
    ckpt.save(1, {})
    name = type(error).__name__
    with pytest.raises(
        CheckpointError, match=rf"step 1 is saved .*could not be reported \({name}"
    ) as info:
        ckpt.flush()
    assert "cluster.finalize()" in str(info.value)
    assert info.value.__cause__ is error


def test_a_close_whose_flush_fails_still_lets_everything_go(tmp_path: Path) -> None:
    """`with CheckpointManager(...)` around a save whose report fails: the close raises that
    error, and still ends the threads and lets go of the lock, so that another manager of the
    rank and prefix can be made."""

    def report(steps: list[int]) -> int:
        raise RuntimeError("the scheduler said no")

    before = set(threading.enumerate())
    ckpt = manager(tmp_path, report=report)
    with pytest.raises(CheckpointError, match="could not be reported"), ckpt:
        ckpt.save(1, {"w": np.zeros(1000)})
    assert not [t.name for t in set(threading.enumerate()) - before]
    with manager(tmp_path) as again:
        assert again.steps() == [1]
