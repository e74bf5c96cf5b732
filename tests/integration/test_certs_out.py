"""`mscluster certs --out DIR` where DIR cannot take the set: one line, exit 2, and nothing of
the new set left behind, on real full and read-only filesystems."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests import tmpfs
from tests.procs import certs


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


def test_a_disk_that_fills_during_the_set_keeps_none_of_it() -> None:
    """Room for a few of the eight files (a page each on tmpfs), not for all of them."""
    with tmpfs.mounted("16k") as disk:
        line = one_line(certs(disk / "pki"))
        assert line.startswith(f"mscluster: ConfigError: --out '{disk / 'pki'}': cannot write")
        assert "No space left on device" in line
        assert "nothing was written" in line
        assert list(disk.iterdir()) == []  # not even the directory it made


def test_a_full_disk_leaves_the_directory_as_it_was() -> None:
    with tmpfs.mounted("64k") as disk:
        (disk / "pki").mkdir()
        (disk / "pki" / "notes.txt").write_text("mine\n")
        filler = tmpfs.fill(disk)
        line = one_line(certs(disk / "pki"))
        assert "No space left on device" in line
        assert [p.name for p in (disk / "pki").iterdir()] == ["notes.txt"]
        filler.unlink()


def test_a_forced_set_that_does_not_fit_keeps_the_old_one(tmp_path: Path) -> None:
    with tmpfs.mounted("64k") as disk:
        assert certs(disk / "pki").returncode == 0
        old = {p.name: p.read_bytes() for p in (disk / "pki").iterdir()}
        filler = tmpfs.fill(disk)
        assert "No space left on device" in one_line(certs(disk / "pki", "--force"))
        assert {p.name: p.read_bytes() for p in (disk / "pki").iterdir()} == old
        filler.unlink()


def test_a_read_only_disk_is_one_line() -> None:
    with tmpfs.mounted(read_only=True) as disk:
        line = one_line(certs(disk / "pki"))
        assert "Read-only file system" in line
        assert list(disk.iterdir()) == []


def test_an_out_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    line = one_line(certs(tmp_path / "file"))
    assert line.startswith(f"mscluster: ConfigError: --out '{tmp_path / 'file'}' is not a dir")


def test_an_out_under_proc_is_one_line() -> None:
    line = one_line(certs(Path("/proc/foo")))
    assert line.startswith("mscluster: ConfigError: --out '/proc/foo': cannot write")
