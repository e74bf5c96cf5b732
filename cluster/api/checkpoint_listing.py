"""The checkpoint files of one rank and prefix, `<directory>/rank_<r>/<prefix>-<step:08d>.ckpt`,
as a `CheckpointManager` lists and removes them (`cluster.api.checkpoint`).

Only the canonical spelling of a step names its file ('p-000000001.ckpt' is not step 1's), a file
is complete when its preamble, size and footer say so (`checkpoint_files.looks_complete`; the
checksum is `load`'s to verify), a directory that is gone lists nothing, and a file removed is one
gone already too. A directory that cannot be listed or made, or a file that cannot be removed,
is a CheckpointError naming it. No thread and no job here: which steps to keep, and when, is the
manager's writer's (`cluster.api.checkpoint_writing`).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from cluster.protocol.errors import CheckpointError
from cluster.storage import atomic, checkpoint_files
from cluster.storage.checkpoint_files import SUFFIX


class RankFiles:
    """The files of rank `rank` of `prefix` under `root`, in `directory`."""

    def __init__(self, root: Path, prefix: str, rank: int) -> None:
        self.prefix = prefix
        self.directory = checkpoint_files.rank_directory(root, rank)
        self._name_re = re.compile(rf"^{re.escape(prefix)}-(\d{{8,}}){re.escape(SUFFIX)}$")

    def make(self) -> None:
        """Create the directory (and its parents) unless it is there."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint directory {self.directory} ({exc.strerror}): "
                "give a writable directory"
            ) from None

    def complete_steps(self) -> list[int]:
        files = self.files()
        return sorted(s for s, path in files.items() if checkpoint_files.looks_complete(path))

    def files(self) -> dict[int, Path]:
        files = {}
        for name in self.names():
            match = self._name_re.match(name)
            step = int(match.group(1)) if match else 0
            # Only the canonical spelling: 'p-000000001.ckpt' is not the file of step 1.
            if step >= 1 and name == checkpoint_files.file_name(self.prefix, step):
                files[step] = self.directory / name
        return files

    def names(self) -> list[str]:
        """The names in this rank's directory (none when it is gone)."""
        try:
            return os.listdir(self.directory)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(
                f"cannot list the checkpoint directory {self.directory} ({exc.strerror}): it must "
                "be a directory this process can read and write"
            ) from None

    def remove_temporaries(self) -> None:
        """Temporaries left by a save that was killed (this manager holds the lock of the rank's
        files of its prefix: no other is writing one)."""
        # A pattern, not a glob: '.model-*' would match the temporaries of prefix 'model-ema'.
        stem = rf"\.{re.escape(self.prefix)}-\d{{8,}}{re.escape(SUFFIX)}"
        stale = re.compile(stem + atomic.TEMPORARY_TAIL)
        for name in self.names():
            if stale.fullmatch(name):
                with contextlib.suppress(OSError):
                    (self.directory / name).unlink()


def remove(path: Path) -> None:
    """Remove the checkpoint `path` (one gone already is fine)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CheckpointError(
            f"cannot remove the checkpoint {path} ({exc.strerror}): it must be a file this "
            f"process can remove from {path.parent}; remove it by hand"
        ) from None
