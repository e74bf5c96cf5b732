"""A job secret made for one job: a file of 64 random hex digits, readable by its owner only.

`mscluster run` and `cluster.testing.LocalJob` make one for every job whose processes they all
start, and give its path to each of them as CLUSTER_JOB_SECRET_FILE (docs/design/security.md).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

JOB_SECRET_FILE = "job.secret"  # noqa: S105 - the file's name, not a secret


def write_job_secret(directory: Path) -> Path:
    """A new random job secret in `directory`/job.secret, readable by this user only."""
    path = directory / JOB_SECRET_FILE
    # A previous job's (`mscluster run` holds its log directory's lock, `launch_lock`, while
    # its job runs): this one gets its own, made 0600 below.
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secrets.token_hex(32) + "\n")
    return path
