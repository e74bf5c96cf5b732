"""The checkpoint files of one rank and prefix, `<directory>/rank_<r>/<prefix>-<step:08d>.ckpt`,
as a `CheckpointManager` lists and removes them (`cluster.api.checkpoint`), and as its writer
sees them.

Only the canonical spelling of a step names its file ('p-000000001.ckpt' is not step 1's), a file
is complete when its preamble, size and footer say so (`checkpoint_files.looks_complete`; the
checksum is `load`'s to verify), a directory that is gone lists nothing, and a file removed is one
gone already too. A file that cannot be read (no permission, an I/O error, not a regular file)
is neither complete nor torn: it is not reported, nor removed as a torn one is, and each listing
checks it again; that it dropped out is said once (`tell`), until it is read again or gone. A
directory that cannot be listed or made, or a file that cannot be removed, is a CheckpointError
naming it. No thread and no job here: which steps to keep, and when, is the manager's writer's
(`cluster.api.checkpoint_writing`).

The writer's view (`look`, `held`) keeps what was listed and checked for the manager's life, so
that a save costs the same however many steps are kept. Before each write it looks at the
directory's own metadata: unchanged since the view was last whole (the writer's own file and
removals taken in), nothing is listed or opened; changed (a file added, removed or renamed
there), or RELIST_S after the last listing, the names are listed and only a file new to the view
(or another file under a known name) is checked. A file changed in place keeps its name: the
view does not see it, as the cheap check cannot see a flipped bit (`load` verifies); every
listing of the manager's callers (`files`, `complete_steps`) is a whole one, each file checked by
`complete_steps`, and the view takes what it finds. A change made in the very moment of the
writer's own is seen at the next listing: the directory's next change, RELIST_S later, or a
caller's.
"""

from __future__ import annotations

import bisect
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.protocol.errors import CheckpointError
from cluster.storage import atomic, checkpoint_files
from cluster.storage.checkpoint_files import SUFFIX

# The longest the writer's view goes without a listing, whatever the directory's metadata says
# (`RankFiles.look`): a change made in the moment of the writer's own is seen within it.
RELIST_S = 1.0
# What a name listed is to the view (`RankFiles._kind`), besides a step's file (its step >= 1).
_OTHER = 0  # not a file of this prefix
_TEMPORARY = -1  # a temporary of this prefix's files

# The directory's metadata that an entry added, removed or renamed there changes (its
# modification time), or another directory in its place (None: it cannot be looked at).
_State = tuple[int, int, int, int, int] | None


@dataclass(frozen=True)
class _Seen:
    """A step's file in the view: its inode (another file under its name is checked again) and
    whether it looked complete (None: it could not be read, and is checked again)."""

    inode: int
    complete: bool | None


class RankFiles:
    """The files of rank `rank` of `prefix` under `root`, in `directory`."""

    def __init__(self, root: Path, prefix: str, rank: int, tell: Callable[[str], None]) -> None:
        self.prefix = prefix
        self._tell = tell  # says a line to the user (a file that cannot be read)
        self.directory = checkpoint_files.rank_directory(root, rank)
        self._name_re = re.compile(rf"^{re.escape(prefix)}-(\d{{8,}}){re.escape(SUFFIX)}$")
        # A pattern, not a glob: '.model-*' would match the temporaries of prefix 'model-ema'.
        stem = rf"\.{re.escape(prefix)}-\d{{8,}}{re.escape(SUFFIX)}"
        self._temporary_re = re.compile(stem + atomic.TEMPORARY_TAIL)
        self._lock = threading.Lock()  # the writer's thread, and the manager's callers
        self._seen: dict[int, _Seen] = {}  # each step's file, as last listed or written
        self._complete: list[int] = []  # the steps of those that look complete, ascending
        self._kinds: dict[str, int] = {}  # each name last listed: what it is (`_kind`)
        self._whole: _State = None  # the directory when the view was last whole (None: list)
        self._listed_at = 0.0  # time.monotonic() of the last listing
        self._unread: set[int] = set()  # the steps whose file was said to be unreadable

    def make(self) -> bool:
        """Create the directory (and its parents) unless it is there; whether it was made."""
        if self.directory.is_dir():
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # something else stands there (a link to none is not followed)
            kind = "a link" if self.directory.is_symlink() else "no directory"
            raise CheckpointError(
                f"the checkpoint directory {self.directory} is {kind}: move it away (the "
                "manager makes the directory again), or give another directory"
            ) from None
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint directory {self.directory} ({exc.strerror}): "
                "give a writable directory"
            ) from None
        return True

    def identity(self) -> tuple[int, int] | None:
        """The directory's device and inode (None: it is gone): another one made in its place
        has another."""
        state = self._state()
        return None if state is None else state[:2]

    def path_of(self, step: int) -> Path:
        return self.directory / checkpoint_files.file_name(self.prefix, step)

    # -- the manager's callers: a whole listing each ------------------------------------------

    def complete_steps(self) -> list[int]:
        """The steps of the complete files, ascending, each file checked now."""
        with self._lock:
            self._list(sweep=False, check_all=True)
            return list(self._complete)

    def files(self) -> dict[int, Path]:
        """Each step's file, complete or not, as listed now."""
        with self._lock:
            self._list(sweep=False)
            return {step: self.path_of(step) for step in self._seen}

    # -- the writer's view --------------------------------------------------------------------

    def look(self, *, sweep: bool) -> None:
        """Before a write: the view up to date. With `sweep` (the writer holds the lock of these
        files), taken as it is while the directory is unchanged since it was last whole, and a
        temporary left by a save that was killed is removed when listed; without (behind an
        earlier holder, who may write here; or to report at once), listed."""
        with self._lock:
            if (
                sweep
                and self._whole is not None
                and self._whole == self._state()
                and time.monotonic() - self._listed_at < RELIST_S
            ):
                return
            self._list(sweep=sweep)

    def held(self) -> list[int]:
        """The steps of the complete files, ascending, as the view holds them."""
        with self._lock:
            return list(self._complete)

    def incomplete(self) -> list[int]:
        """The steps whose file was read and did not look complete, as the view holds them
        (one that could not be read is not known to be torn)."""
        with self._lock:
            if len(self._seen) == len(self._complete):
                return []
            return sorted(s for s, seen in self._seen.items() if seen.complete is False)

    def wrote(self, step: int) -> None:
        """The writer wrote the file of `step`, whole (`checkpoint_files.write` renames it so)."""
        with self._lock:
            try:
                inode = os.stat(self.path_of(step)).st_ino
            except OSError:  # gone already: the next look lists the directory
                self._whole = None
                return
            if step not in self._seen or not self._seen[step].complete:
                self._insert(step)
            self._seen[step] = _Seen(inode, complete=True)

    def remove(self, step: int) -> None:
        """Remove the file of `step` (one gone already is fine); CheckpointError."""
        remove(self.path_of(step))
        with self._lock:
            seen = self._seen.pop(step, None)
            if seen is not None and seen.complete:
                self._complete.remove(step)

    def settle(self) -> None:
        """After the writer's own changes (its file, its removals): the directory as it is now
        is the view's, unless the view is not whole (its file gone at once, or a temporary left
        by a caller's listing meanwhile)."""
        with self._lock:
            if self._whole is not None:
                self._whole = self._state()

    # -- listing ------------------------------------------------------------------------------

    def _list(self, *, sweep: bool, check_all: bool = False) -> None:
        """List the directory into the view, checking each file new to it (`check_all`: each
        file); `sweep`: remove the temporaries listed. The view is whole from then on unless a
        temporary is left."""
        state = self._state()
        seen: dict[int, _Seen] = {}
        kinds: dict[str, int] = {}
        left = False
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    kind = self._kinds.get(entry.name)
                    kinds[entry.name] = kind = self._kind(entry.name) if kind is None else kind
                    if kind > 0:
                        seen[kind] = self._check(kind, entry.inode(), check_all)
                    elif kind == _TEMPORARY:
                        left = left or not (sweep and _removed(entry.path))
        except FileNotFoundError:
            pass  # gone: nothing there
        except OSError as exc:
            raise CheckpointError(
                f"cannot list the checkpoint directory {self.directory} ({exc.strerror}): it must "
                "be a directory this process can read and write"
            ) from None
        self._seen, self._kinds = seen, kinds
        self._complete = sorted(s for s, file in seen.items() if file.complete is True)
        self._unread &= {s for s, file in seen.items() if file.complete is None}
        self._whole = None if left else state
        self._listed_at = time.monotonic()

    def _check(self, step: int, inode: int, again: bool) -> _Seen:
        known = self._seen.get(step)
        if again or known is None or known.inode != inode or known.complete is None:
            return _Seen(inode, self._examine(step))
        return known

    def _examine(self, step: int) -> bool | None:
        """Whether the file of `step` looks complete; None when that cannot be told. Such a
        file drops out of the reports: said once, until it is read again or gone."""
        path = self.path_of(step)
        found = checkpoint_files.examine(path)
        if isinstance(found, bool):
            self._unread.discard(step)
            return found
        if step not in self._unread and os.path.lexists(path):  # one removed meanwhile: gone
            self._unread.add(step)
            self._tell(
                f"the checkpoint {path} cannot be read ({found}): step {step} is neither "
                "reported as held nor removed while it cannot; make it a regular file this "
                "process can read, or move it away"
            )
        return None

    def _kind(self, name: str) -> int:
        """The step whose file `name` is, or _TEMPORARY, or _OTHER."""
        match = self._name_re.match(name)
        step = int(match.group(1)) if match else 0
        # Only the canonical spelling: 'p-000000001.ckpt' is not the file of step 1.
        if step >= 1 and name == checkpoint_files.file_name(self.prefix, step):
            return step
        return _TEMPORARY if self._temporary_re.fullmatch(name) else _OTHER

    def _state(self) -> _State:
        try:
            stat = os.stat(self.directory)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino, stat.st_mode, stat.st_mtime_ns, stat.st_ctime_ns

    def _insert(self, step: int) -> None:
        bisect.insort(self._complete, step)  # a step past the newest, as a save's, at the end


def _removed(path: str) -> bool:
    """Remove a temporary left by a killed save; whether it is gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


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
