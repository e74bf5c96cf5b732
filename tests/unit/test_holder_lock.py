"""cluster.storage.holder_lock.Hold: the one check of the launcher's, relay's, worker's and
event log's locks, with real files and real `flock`s (two open files of one process conflict
as two processes do)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from cluster.storage import holder_lock


def seen(found: holder_lock.Relock | None) -> tuple[object, ...] | None:
    """What a holder reads of `found`: taken, who holds it, why not, news, repeated."""
    if found is None:
        return None
    who = None if found.holder is None else found.holder.get("who")
    return found.taken, who, found.cause, found.news, found.repeated


def test_a_held_file_removed_is_locked_anew_at_the_next_keep(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    hold = holder_lock.Hold(path, port=1)
    assert hold.open_and_lock() is None
    assert hold.keep() is None  # the path names the file held
    path.unlink()
    assert seen(hold.keep()) == (True, None, "", True, False)
    assert json.loads(path.read_text())["port"] == 1
    assert hold.keep() is None
    hold.release()
    assert hold.keep() is None  # released: nothing held, nothing lost


def test_another_holder_is_news_once_then_holding_again_is_said(tmp_path: Path) -> None:
    """The file replaced by one another process holds: found each `keep` (tried again), news
    the first time only; once that one lets go, this one holds it again (`repeated`)."""
    path = tmp_path / "x.lock"
    hold = holder_lock.Hold(path)
    assert hold.open_and_lock() is None
    path.unlink()
    other = holder_lock.Hold(path, who="other")
    assert other.open_and_lock() is None
    assert seen(hold.keep()) == (False, "other", "", True, False)
    assert seen(hold.keep()) == (False, "other", "", False, True)  # said once
    other.release()
    assert seen(hold.keep()) == (True, None, "", True, True)  # holds it again
    hold.release()


@pytest.mark.parametrize("retry", [True, False])
def test_an_unlockable_file_is_tried_again_only_with_retry(tmp_path: Path, retry: bool) -> None:
    path = tmp_path / "x.lock"
    refusing = [True]

    def opener(where: Path) -> int:
        if refusing[0]:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return holder_lock.open_lock(where)

    hold = holder_lock.Hold(path, retry=retry, open_file=opener)
    assert hold.lock(holder_lock.open_lock(path)) is None
    path.unlink()
    assert seen(hold.keep()) == (False, None, "No locks available", True, False)
    refusing[0] = False
    # With retry, taken now; without, it goes on without the lock.
    assert seen(hold.keep()) == ((True, None, "", True, True) if retry else None)
    hold.release()


def test_a_fork_safe_hold_is_closed_in_a_forked_child(tmp_path: Path) -> None:
    hold = holder_lock.Hold(tmp_path / "x.lock", fork_safe=True)
    assert hold.open_and_lock() is None
    assert hold.fd is not None
    pid = os.fork()
    if pid == 0:  # the child: its copy of the descriptor is closed already
        try:
            os.fstat(hold.fd)
        except OSError:
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.fstat(hold.fd)  # the parent's stays open, locked
    hold.release()
