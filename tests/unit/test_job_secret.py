"""The launcher's job secret: a new one for every job, the same one for a job with recovery
started again in its log directory (`write_job_secret(keep=True)`), never a file it did not
make."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.tools.secret import JOB_SECRET_FILE, write_job_secret
from tests import tmpfs


def test_a_new_job_gets_a_new_secret(tmp_path: Path) -> None:
    first = write_job_secret(tmp_path).read_bytes()
    assert write_job_secret(tmp_path).read_bytes() != first
    assert os.stat(tmp_path / JOB_SECRET_FILE).st_mode & 0o777 == 0o600


def test_a_job_with_recovery_keeps_the_secret_it_made(tmp_path: Path) -> None:
    first = write_job_secret(tmp_path).read_bytes()
    assert write_job_secret(tmp_path, keep=True).read_bytes() == first


def test_a_secret_it_did_not_make_is_not_kept(tmp_path: Path) -> None:
    path = tmp_path / JOB_SECRET_FILE
    path.write_text("a" * 64 + "\n")
    path.chmod(0o644)  # readable by others: not one it made
    assert write_job_secret(tmp_path, keep=True).read_text() != "a" * 64 + "\n"
    path.write_text("not hex\n")
    path.chmod(0o600)
    assert write_job_secret(tmp_path, keep=True).read_text() != "not hex\n"
    path.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("b" * 64 + "\n")
    elsewhere.chmod(0o600)
    path.symlink_to(elsewhere)  # never followed: replaced by a file of its own
    kept = write_job_secret(tmp_path, keep=True)
    assert not kept.is_symlink()
    assert elsewhere.read_text() == "b" * 64 + "\n"


def test_a_secret_that_cannot_be_written_leaves_the_old_one_whole() -> None:
    # The old file was removed and the new one made empty before its bytes were refused: a job
    # then ran on a secret of nothing. It is written whole beside it and renamed now.
    with tmpfs.mounted("256k") as disk:
        old = write_job_secret(disk).read_bytes()
        tmpfs.fill(disk)
        with pytest.raises(ConfigError, match="No space left on device"):
            write_job_secret(disk)
        assert (disk / JOB_SECRET_FILE).read_bytes() == old
        assert sorted(p.name for p in disk.iterdir()) == ["filler", JOB_SECRET_FILE]
