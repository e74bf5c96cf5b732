"""A worker's host disk lost in the simulation: the checkpoint files of its rank go with the
process, and its next process starts without them.

A worker whose files are lost gets the rollback step from a live peer of the generation (state
from peers: `CheckpointManager.load` fetches a file missing here through `peer_state.fetch`).
The scheduler cannot tell a new process that lost its files from one on the rank's disk: a
registration carries no checkpoints, and a worker reports its steps once it writes, fetches or
discards one, after the generation it resumes in is published. So the scheduler plans from the
steps the rank last reported, and a rank's files are lost only where a peer holds a copy of
them: in a job of two workers or more (data parallel, each rank holds the group's state; one
disk at most is lost per schedule). A job of one worker has no copy; losing its disk loses its
checkpoints for good, and the real worker then fails with a `CheckpointError` ("rank 0 needs
the checkpoint of step N and cannot get it"), which no decision of the scheduler can avoid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.sim.control_plane import Process, Sim

LOSS_CHANCE = 0.1  # of a kill, from the disk's own stream


def may_lose_disk(sim: Sim, proc: Process) -> bool:
    """Whether this kill of `proc` takes its disk with it: once a schedule at most, a worker
    of a rank, in a job where a peer holds a copy of its files."""
    if sim.wiped is not None or proc.rank is None or sim.workers < 2:
        return False
    return sim.disk_rng.random() < LOSS_CHANCE


def kill_with_disk(sim: Sim, proc: Process) -> None:
    """The process dies and its rank's checkpoint files are lost with it: its next process
    starts without them."""
    if proc.running and proc.rank is not None:
        sim.kill(proc)
        sim.files[proc.rank] = set()
        sim.wiped = proc.rank
