"""A recovery path that another user could redirect is refused with one line: owned by someone
else, writable by group or others (sticky or not), under a directory others can swap, or
reached through someone else's link. The decision is pure (`recovery_path.problem`); the
check on disk (`check_recovery_path`) gathers what stat says."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cluster.protocol.config import RecoveryConfig
from cluster.protocol.errors import ConfigError
from cluster.protocol.recovery_path import Entry, problem
from cluster.storage.recovery_dir import check_recovery_path

ME = 1000
OTHER = 1001
DIR = stat.S_IFDIR
LINK = stat.S_IFLNK
NAMES = {0: "root", ME: "me", OTHER: "mallory"}


def directory(mode: int, uid: int = ME, path: str = "/data/job") -> Entry:
    return Entry(path, uid, DIR | mode)


ROOTS = [directory(0o755, 0, "/data"), directory(0o755, 0, "/")]


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o711, 0o2755])
def test_a_directory_of_ones_own_that_others_cannot_write_is_safe(mode: int) -> None:
    assert problem(directory(mode), ROOTS, ME, NAMES) is None


def test_root_may_keep_its_state_in_a_directory_of_roots() -> None:
    assert problem(directory(0o700, 0), ROOTS, 0, NAMES) is None


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777, 0o1777, 0o1770])
def test_a_directory_that_group_or_others_can_write_is_refused(mode: int) -> None:
    said = problem(directory(mode), ROOTS, ME, NAMES)
    assert said is not None
    assert "MS_RECOVERY_PATH='/data/job'" in said
    assert f"mode {mode:04o}, owner uid {ME} (me)" in said
    assert "\n" not in said


def test_tmp_itself_is_refused_and_a_directory_inside_it_is_advised() -> None:
    tmp = Entry("/tmp", 0, DIR | 0o1777)
    said = problem(tmp, [directory(0o755, 0, "/")], 0, NAMES)
    assert said is not None
    assert "mode 1777, owner uid 0 (root)" in said
    assert "mkdir -m 700 /tmp/JOB" in said  # never "chmod /tmp"
    assert "chmod" not in said


def test_a_group_writable_directory_of_ones_own_is_told_to_chmod() -> None:
    said = problem(directory(0o775), ROOTS, ME, NAMES)
    assert said is not None
    assert "chmod go-w /data/job" in said


def test_a_directory_of_another_user_is_refused() -> None:
    said = problem(directory(0o700, OTHER), ROOTS, ME, NAMES)
    assert said is not None
    assert "belongs to uid 1001 (mallory), not to this process (uid 1000 (me))" in said


def test_root_refuses_a_directory_of_another_user_too() -> None:
    assert problem(directory(0o755, OTHER), ROOTS, 0, NAMES) is not None


def test_a_directory_under_a_sticky_shared_one_is_safe() -> None:
    above = [Entry("/tmp", 0, DIR | 0o1777), directory(0o755, 0, "/")]
    assert problem(directory(0o700, ME, "/tmp/job"), above, ME, NAMES) is None


def test_a_directory_under_one_others_can_write_without_the_sticky_bit_is_refused() -> None:
    above = [Entry("/shared", 0, DIR | 0o777), directory(0o755, 0, "/")]
    said = problem(directory(0o700, ME, "/shared/job"), above, ME, NAMES)
    assert said is not None
    assert "'/shared' above it can be written by others without the sticky bit" in said


def test_a_directory_under_a_volume_shared_by_the_jobs_group_is_safe() -> None:
    above = [Entry("/shared", 0, DIR | 0o2775), directory(0o755, 0, "/")]  # fsGroup
    assert problem(directory(0o700, ME, "/shared/recovery"), above, ME, NAMES) is None


def test_a_directory_under_another_users_directory_is_refused() -> None:
    above = [Entry("/home/mallory", OTHER, DIR | 0o755), *ROOTS]
    said = problem(directory(0o700, ME, "/home/mallory/job"), above, ME, NAMES)
    assert said is not None
    assert "'/home/mallory' on its way belongs to uid 1001 (mallory)" in said


def test_a_link_on_the_way_must_be_roots_or_ones_own() -> None:
    theirs = Entry("/tmp/job", OTHER, LINK | 0o777)
    mine = Entry("/tmp/job", ME, LINK | 0o777)
    assert problem(directory(0o700), [theirs, *ROOTS], ME, NAMES) is not None
    assert problem(directory(0o700), [mine, *ROOTS], ME, NAMES) is None


# -- on disk ---------------------------------------------------------------------------------


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        check_recovery_path(RecoveryConfig(path))
    return str(caught.value)


def test_a_new_recovery_directory_is_made_for_its_user_alone(tmp_path: Path) -> None:
    target = tmp_path / "a" / "state"
    check_recovery_path(RecoveryConfig(target))
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_a_world_writable_directory_on_disk_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    said = refused(shared)
    assert repr(str(shared)) in said
    assert "mode 1777" in said
    (shared / "job").mkdir(mode=0o755)
    check_recovery_path(RecoveryConfig(shared / "job"))  # a directory of one's own in it is fine


def test_a_directory_reached_through_an_open_parent_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    assert "without the sticky bit" in refused(parent / "job")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_of_another_user_on_disk_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    said = refused(theirs)
    assert "belongs to uid 65534" in said
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "mine")
    (tmp_path / "mine").mkdir()
    os.lchown(link, 65534, 65534)
    assert "the link" in refused(link)


def test_a_link_to_nothing_or_to_a_file_where_the_directory_goes_is_named(
    tmp_path: Path,
) -> None:
    """A link to nothing (a volume not mounted) or to a file, where the recovery directory or
    one above it goes: the line says it is a link, to what, and what to do (mkdir's words
    alone, "File exists", said neither; a file there: tests/unit/test_config.py)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    nowhere = tmp_path / "unmounted"
    (tmp_path / "to_nothing").symlink_to(nowhere)
    (tmp_path / "to_a_file").symlink_to(a_file)
    fix = "point it at a directory this process can create files in"
    linked = (
        f"is a symbolic link to {str(nowhere)!r}, which does not exist (a volume not "
        f"mounted?): make that directory, or {fix}"
    )
    assert refused(tmp_path / "to_nothing").endswith(f"to_nothing' {linked}")
    assert refused(tmp_path / "to_nothing" / "job").endswith(f"to_nothing', which {linked}")
    assert refused(tmp_path / "to_a_file").endswith(
        f"is a symbolic link to {str(a_file)!r}, a file, not a directory: {fix}"
    )
    assert not nowhere.exists()
    assert a_file.read_text() == "not a directory"
