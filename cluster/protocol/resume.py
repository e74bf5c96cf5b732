"""Where a new generation resumes: the step the survivors hold in memory, or the rollback step
on disk.

Every generation names a rollback step: the newest checkpoint every rank holds on disk. When a
worker fails between two steps (or its step is abandoned cleanly), the survivors all hold the
state of the same, newer step in memory (a `TrainingLoop` keeps the state of its last step
boundary), and resuming from there costs at most the interrupted step instead of up to
`save_checkpoint_steps` steps. The workers decide it among themselves: on taking a new
generation each one contributes, to one allgather, the step it holds in memory or nothing (a
newcomer: a promoted spare, a restarted worker; or a worker whose state is over its
`memory_snapshot` limit). `decide` is a pure function of the gathered list, the generation's
rollback step and whether the ranks' states are replicas, so every worker computes the same
answer without another message; the scheduler is not involved (it still names the disk step).

The rule: the in-memory step is taken only when every rank can get its state of that step. A
rank that holds it restores its own copy; a rank that holds nothing fetches it from a rank that
holds it, which is its own state only when the ranks' states are replicas (data parallel, the
default). With per-rank states (`replicated=False`) a newcomer needs its rank's own state, whose
holder is the worker it replaces, gone: then every rank rolls back to disk.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

# One contribution on the wire: the step held, as a signed 64-bit integer; NOTHING for none.
_WIRE = struct.Struct("<q")
NOTHING = -1


@dataclass(frozen=True)
class Resume:
    """The step every worker of the generation resumes from, and where its state comes from."""

    step: int
    in_memory: bool  # from the survivors' memory (True), or from the checkpoints on disk
    servers: tuple[int, ...]  # the ranks holding `step` in memory: a rank without it asks them
    why: str  # for the log line: why this source

    def source(self, rank: int, held: int | None) -> str:
        """Where `rank`, which holds `held` in memory, gets the state: "own" (its memory),
        "peer" (a server's memory) or "disk" (a checkpoint: its own, or a peer's file)."""
        if not self.in_memory:
            return "disk"
        return "own" if held == self.step else "peer"


def encode(step: int | None) -> bytes:
    """This worker's contribution: the step it holds in memory, or None."""
    return _WIRE.pack(NOTHING if step is None else step)


def decode(raw: bytes) -> int | None:
    """A contribution read back; anything but 8 bytes of a step >= 0 counts as holding nothing
    (every worker reads the same bytes, so every worker reads it the same way)."""
    if len(raw) != _WIRE.size:
        return None
    (step,) = _WIRE.unpack(raw)
    return step if step >= 0 else None


def decide(held: Sequence[int | None], disk_step: int, *, replicated: bool) -> Resume:
    """Where the generation resumes, from `held[r]` (the step rank r holds in memory, or None),
    the generation's rollback step on disk, and whether every rank's state is the same."""
    steps = sorted({step for step in held if step is not None})
    if not steps:
        return _disk(disk_step, "no worker holds a step in memory")
    if len(steps) > 1:
        return _disk(
            disk_step, f"the workers hold different steps in memory ({_by_step(held, steps)})"
        )
    step = steps[0]
    if step < disk_step:
        return _disk(disk_step, f"the step in memory, {step}, is older than the one on disk")
    servers = tuple(rank for rank, mine in enumerate(held) if mine == step)
    without = [rank for rank, mine in enumerate(held) if mine is None]
    if without and not replicated:
        return _disk(
            disk_step,
            f"{_ranks(without)} without step {step} in memory, and no other worker holds "
            "its own state (replicated=False)",
        )
    if without:
        why = f"{_ranks(list(servers))} at step {step}; {_ranks(without)} gets it from a peer"
    else:
        why = f"every worker holds step {step}"
    return Resume(step, True, servers, why)


def _disk(step: int, why: str) -> Resume:
    return Resume(step, False, (), why)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(r) for r in ranks[:8])
    return f"ranks {shown}{', ...' if len(ranks) > 8 else ''}"


def _by_step(held: Sequence[int | None], steps: list[int]) -> str:
    return "; ".join(
        f"{_ranks([r for r, mine in enumerate(held) if mine == step])} at {step}"
        for step in steps[:4]
    )
