"""What a `CheckpointManager` saves and when (`CheckpointConfig`, checked when it is made), and
what saving has cost the loop (`CheckpointStats`, from `CheckpointManager.stats`)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.protocol.errors import ConfigError

# 1 GiB: a copy of that costs the loop about 0.15 s a step on this machine's memory bandwidth
# (benchmarks/RESULTS.md); larger states opt in.
MEMORY_SNAPSHOT_DEFAULT = 1 << 30


@dataclass(frozen=True)
class CheckpointConfig:
    """When to save and how many checkpoints to keep (MindSpore's CheckpointConfig names).

    `memory_snapshot`: the bytes of state a `TrainingLoop` may keep in memory, a copy of its
    last step boundary, so that a failure between steps costs at most the interrupted step
    instead of the rollback to disk (0: off; a larger state rolls back to disk, as without it).
    """

    save_checkpoint_steps: int = 1
    keep_checkpoint_max: int = 5
    # Every rank's state is the same (data parallel): a rank without its checkpoint may take any
    # live peer's. False: states differ per rank (optimizer shards, ...), only the rank's own
    # files will do.
    replicated: bool = True
    memory_snapshot: int = MEMORY_SNAPSHOT_DEFAULT

    def __post_init__(self) -> None:
        for name in ("save_checkpoint_steps", "keep_checkpoint_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"CheckpointConfig {name}={value!r} is invalid: it must be an integer >= 1"
                )
        if not isinstance(self.replicated, bool):
            raise ConfigError(
                f"CheckpointConfig replicated={self.replicated!r} is invalid: it must be True "
                "(every rank's state is the same) or False (states differ per rank)"
            )
        limit = self.memory_snapshot
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(
                f"CheckpointConfig memory_snapshot={limit!r} is invalid: it must be a number of "
                "bytes >= 0 (0 turns the in-memory copy of the last step off)"
            )


@dataclass(frozen=True)
class CheckpointStats:
    """What saving has cost the loop so far."""

    saves: int  # save() calls that returned
    pause_s: float  # the time the loop spent inside them, in all
    waits: int  # saves that waited for the writer (two snapshots were held)
    wait_s: float  # the time those waited, in all (part of pause_s)
    persisted: int  # checkpoints written whole (each reported by the reporter after)
