"""Two managers of one rank in one job, with real processes: the earlier holder (this
process) and the successor the scheduler gave the rank to (a process that goes on without the
lock and claims the lock file). Whatever happens to the lock file once the successor claimed
it (removed alone, or with the rank's directory), only the successor writes the rank's files:
the earlier holder that read the claim makes no new lock, and a successor whose claim is gone
from a file the earlier holder made anew claims it again."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.api import checkpoint
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.storage import checkpoint_files, checkpoint_lock
from cluster.testing import Process
from tests.procs import PYTHON, Procs, job_env

JOB = "0a1b2c3d4e5f"
EARLIER = checkpoint_lock.Seat(JOB, "1", 11, 1)  # node 1 held rank 0 in generation 1
SPARE = checkpoint_lock.Seat(JOB, "spare-0", 22, 2)  # the spare given rank 0 in generation 2

# The spare: a CheckpointManager of rank 0, prefix 'mlp', under argv[1], seated as SPARE (as
# `cluster.init()` would seat it), which goes on behind the earlier holder at once; at each
# SIGUSR1 it saves the next step of argv[2:] and says so.
SUCCESSOR = """
import signal, sys
from cluster.api import checkpoint
from cluster.storage import checkpoint_lock

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
checkpoint_lock.SUCCESSOR_WAIT_S = 0.0
seat = checkpoint_lock.Seat("0a1b2c3d4e5f", "spare-0", 22, 2)
checkpoint._seat = lambda rank: seat
config = checkpoint.CheckpointConfig(keep_checkpoint_max=100)
ckpt = checkpoint.CheckpointManager(sys.argv[1], "mlp", config, rank=0, recovery=False)
print("behind" if ckpt._lock.behind else "holding", flush=True)
for step in sys.argv[2:]:
    signal.sigwait({signal.SIGUSR1})
    ckpt.save(int(step), {"by": "spare"})
    ckpt.flush()
    print(f"saved {step}", flush=True)
"""


def successor(processes: Procs, directory: Path, *steps: int) -> Process:
    args = [PYTHON, "-c", SUCCESSOR, str(directory), *map(str, steps)]
    proc = processes.start("successor", args, job_env(1, 0))
    proc.wait_for_output("behind", 30)
    return proc


def save_next(proc: Process, step: int) -> None:
    proc.signal(signal.SIGUSR1)
    proc.wait_for_output(f"saved {step}", 30)


@pytest.fixture
def earlier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CheckpointManager]:
    """The earlier holder of rank 0, seated as EARLIER, with step 1 saved."""
    monkeypatch.setattr(checkpoint, "_seat", lambda rank: EARLIER)
    config = CheckpointConfig(keep_checkpoint_max=100)
    ckpt = CheckpointManager(tmp_path / "ckpt", "mlp", config, rank=0, recovery=False)
    ckpt.save(1, {"by": "earlier"})
    ckpt.flush()
    yield ckpt
    ckpt.close()


def remove(rank_directory: Path, what: str) -> None:
    if what == "rank directory":
        shutil.rmtree(rank_directory)
    else:
        (rank_directory / ".mlp.lock").unlink()


def written_by(rank_directory: Path) -> dict[int, str]:
    """Each step on disk: who wrote it."""
    found = {}
    for path in rank_directory.glob("mlp-*.ckpt"):
        step = int(path.stem.removeprefix("mlp-"))
        found[step] = checkpoint_files.read(path, step)["by"]
    return dict(sorted(found.items()))


@pytest.mark.parametrize("what", ["rank directory", "lock file"])
def test_a_displaced_holder_whose_lock_file_is_removed_makes_no_new_lock_and_writes_nothing(
    processes: Procs,
    tmp_path: Path,
    earlier: CheckpointManager,
    what: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The earlier holder read the spare's claim (it writes nothing), then the lock file is
    removed (alone, or with the rank's directory). It made a new lock file and took it: the
    spare, behind, never claimed that one, so both wrote the rank's checkpoints. It remembers
    now that the rank went to the spare, makes no new lock and writes nothing, said in words
    naming the rank, the spare and what to do; the spare takes the lock."""
    rank_directory = tmp_path / "ckpt" / "rank_0"
    spare = successor(processes, tmp_path / "ckpt", 2, 5)
    save_next(spare, 2)
    with caplog.at_level(logging.WARNING):
        earlier.save(3, {"by": "earlier"})
        earlier.flush()
        remove(rank_directory, what)
        earlier.save(4, {"by": "earlier"})
        earlier.flush()
        save_next(spare, 5)
        earlier.save(6, {"by": "earlier"})
        earlier.flush()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    holder = f"(pid {spare.pid} on host {socket.gethostname()}, this host; node 'spare-0' of job"
    assert said[0].startswith(f"rank 0's checkpoints of prefix 'mlp' in {rank_directory} "), said
    assert f"went to another process of this job {holder} {JOB}, generation 2)" in said[0]
    assert said[0].endswith("ends once it hears its rank went away; stop it if it trains on")
    assert said[1].endswith(
        f"went to another process of this job {holder} {JOB}, generation "
        "2): this manager makes no new lock there"
    )
    steps = written_by(rank_directory)
    kept = {} if what == "rank directory" else {1: "earlier", 2: "spare"}  # before the removal
    assert steps == {**kept, 5: "spare"}
    assert json.loads((rank_directory / ".mlp.lock").read_text())["node"] == "spare-0"


@pytest.mark.parametrize("what", ["rank directory", "lock file"])
def test_a_successor_claims_again_a_lock_file_the_earlier_holder_made_anew(
    processes: Procs, tmp_path: Path, earlier: CheckpointManager, what: str
) -> None:
    """The lock file removed (alone, or with the rank's directory) before the earlier holder
    read the spare's claim: the earlier holder's next save makes a new one and takes it, and
    writes that step (nothing there tells it otherwise). The spare found the new file naming
    the earlier holder and went on behind it without claiming it, so both wrote the rank's
    checkpoints for good. Its next save claims the new file, said in one line, and from then
    on the earlier holder writes nothing."""
    rank_directory = tmp_path / "ckpt" / "rank_0"
    spare = successor(processes, tmp_path / "ckpt", 2, 4)
    save_next(spare, 2)
    remove(rank_directory, what)
    earlier.save(3, {"by": "earlier"})
    earlier.flush()
    save_next(spare, 4)
    assert spare.output.count("claimed it again") == 1, spare.output
    earlier.save(5, {"by": "earlier"})
    earlier.flush()
    assert earlier._displaced()
    kept = {} if what == "rank directory" else {1: "earlier", 2: "spare"}  # before the removal
    assert written_by(rank_directory) == {**kept, 3: "earlier", 4: "spare"}
    assert json.loads((rank_directory / ".mlp.lock").read_text())["node"] == "spare-0"
