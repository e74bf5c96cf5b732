"""How an operator's tool proves that it may read a job: `mscluster status` (and `--watch`),
`mscluster events --addr`, the launcher's progress line.

With a job secret the scheduler shows Status and WatchEvents only to a reader that proves it (an
HMAC under the secret of the scheduler's challenge and the method) or that holds a client
certificate of the job's CA (docs/design/security.md). `find_secret` finds the secret for the
user, first found first:

    --secret-file PATH                    the file named
    --log-dir DIR                         DIR/job.secret, when it is there
    CLUSTER_JOB_SECRET_FILE               (or CLUSTER_JOB_SECRET), as the job's processes get it
    logs/job.secret                       where `mscluster run` writes it by default, when there

An explicit option wins over the environment. A reader that finds none sends no proof: a job
without a secret (or a reader with a certificate) needs none, and a job with one refuses it,
which `refusal` turns into one line that says what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cluster.protocol.config import JobSecretSource
from cluster.protocol.display import safe
from cluster.protocol.environment import job_secret_from_env, read_job_secret
from cluster.protocol.errors import AccessDeniedError, ReadRefusedError
from cluster.tools.placement import DEFAULT_LOG_DIR
from cluster.tools.secret import JOB_SECRET_FILE
from cluster.transport import membership


@dataclass(frozen=True)
class ReadSecret:
    """The job secret a reader proves, and where it was found (named in messages)."""

    value: bytes = field(repr=False)
    source: str


class FromEnvironment:
    """The job secret of CLUSTER_JOB_SECRET_FILE (or CLUSTER_JOB_SECRET), if set."""


FROM_ENV = FromEnvironment()

# What a reader is given to prove: the secret itself, one found, the environment's, or none.
Secret = bytes | ReadSecret | FromEnvironment | None


def _file(path: Path, named: str) -> ReadSecret:
    value = read_job_secret(JobSecretSource(path=path), named=named)
    return ReadSecret(value, named)


def from_env(env: Mapping[str, str]) -> ReadSecret | None:
    """The secret CLUSTER_JOB_SECRET_FILE or CLUSTER_JOB_SECRET names (ConfigError when its
    file cannot be read)."""
    source = job_secret_from_env(env)
    if source is None:
        return None
    if source.path is None:
        return ReadSecret(read_job_secret(source), "CLUSTER_JOB_SECRET")
    return ReadSecret(read_job_secret(source), f"CLUSTER_JOB_SECRET_FILE={str(source.path)!r}")


def find_secret(
    secret_file: Path | None = None,
    log_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    default_log_dir: Path = DEFAULT_LOG_DIR,
) -> ReadSecret | None:
    """The job secret this reader proves (see the module), None when none is found. A file
    found that cannot be used (missing when named, readable by others, empty) is a
    ConfigError naming it."""
    if secret_file is not None:
        return _file(secret_file, f"--secret-file {str(secret_file)!r}")
    if log_dir is not None and (log_dir / JOB_SECRET_FILE).exists():
        return _file(log_dir / JOB_SECRET_FILE, f"--log-dir's {str(log_dir / JOB_SECRET_FILE)!r}")
    found = from_env(os.environ if env is None else env)
    if found is not None:
        return found
    default = default_log_dir / JOB_SECRET_FILE
    if log_dir is None and default.exists():
        return _file(default, f"{str(default)!r} (the log directory of `mscluster run`)")
    return None


def resolve(secret: Secret) -> ReadSecret | None:
    """`secret` as a ReadSecret (the environment's for FROM_ENV)."""
    if isinstance(secret, FromEnvironment):
        return from_env(os.environ)
    if isinstance(secret, bytes):
        return ReadSecret(secret, "the job secret given")
    return secret


def refused(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a read failed for want of proof of the job secret: the scheduler's refusal says
    so (`membership.read_refusal`). Another UNAUTHENTICATED (this reader's certificate refused)
    is `denied`."""
    return exc.code() is grpc.StatusCode.UNAUTHENTICATED and membership.READ_FIX in (
        exc.details() or ""
    )


def denied(address: str, exc: grpc.aio.AioRpcError) -> AccessDeniedError | None:
    """The scheduler at `address` refused this reader for another reason than the job secret
    (its certificate: revoked, expired), in the scheduler's words; None for any other failure."""
    if exc.code() is not grpc.StatusCode.UNAUTHENTICATED or refused(exc):
        return None
    return AccessDeniedError(
        f"the scheduler at {address} refused this reader: {safe(exc.details() or '', 1000)}"
    )


def refusal(address: str, secret: ReadSecret | None) -> ReadRefusedError:
    """One line that says why the scheduler at `address` refused to show the job, and what to
    do: find the job's secret file, or the right one."""
    if secret is None:
        return ReadRefusedError(
            f"the scheduler at {address} shows the job only to holders of its secret: "
            f"{membership.READ_FIX}"
        )
    return ReadRefusedError(
        f"the scheduler at {address} refused the proof made with the secret of {secret.source}: "
        "it is not this job's secret; pass --secret-file with this job's <log-dir>/job.secret"
    )
