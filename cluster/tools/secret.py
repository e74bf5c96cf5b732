"""A job secret made for one job: a file of 64 random hex digits, readable by its owner only.

`mscluster run` and `cluster.testing.LocalJob` make one for every job whose processes they all
start, and give its path to each of them as CLUSTER_JOB_SECRET_FILE (docs/design/security.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from pathlib import Path

from cluster.protocol.errors import ConfigError
from cluster.storage import atomic

JOB_SECRET_FILE = "job.secret"  # noqa: S105 - the file's name, not a secret


_SECRET = re.compile(rb"[0-9a-f]{64}\n?\Z")


def write_job_secret(directory: Path, *, keep: bool = False) -> Path:
    """A new random job secret in `directory`/job.secret, readable by this user only, written
    whole or not at all: where it cannot be, a ConfigError naming the directory and the cause,
    and the file there before is left as it was. With `keep`, a secret already there is kept
    when it is one this function wrote (this user's own regular file, of mode 0600, holding 64
    hex digits): a job with recovery started again in its log directory resumes its saved
    state, which the scheduler takes only under the job's own secret."""
    path = directory / JOB_SECRET_FILE
    if keep and held_job_secret(path) is not None:
        return path
    # A previous job's file (`mscluster run` holds its log directory's lock, `launch_lock`,
    # while its job runs), or a link, is replaced whole, never written through: the new secret
    # goes to a temporary of mode 0600, is synced and renamed over it (`atomic`).
    secret = (secrets.token_hex(32) + "\n").encode()

    def refused(exc: OSError) -> ConfigError:
        return ConfigError(
            f"cannot write the job secret in {str(directory)!r} ({exc.strerror or exc})"
        )

    atomic.write_atomically(path, lambda fd: atomic.write_all(fd, secret), refused)
    return path


def held_job_secret(path: Path) -> str | None:
    """The text of the job secret at `path` when it is one that `write_job_secret` (or a Slurm
    step's node 0, `slurm_io`) made: this user's own regular file, never a link, of mode 0600,
    holding 64 hex digits. None otherwise (missing, unreadable, another file)."""
    with contextlib.suppress(OSError):
        descriptor = atomic.open_no_follow(path, os.O_RDONLY)
        with os.fdopen(descriptor, "rb") as handle:
            st = os.fstat(handle.fileno())
            if atomic.not_own_file(st) or stat.S_IMODE(st.st_mode) != 0o600:
                return None
            text = handle.read(80)
            return text.decode() if _SECRET.match(text) else None
    return None
