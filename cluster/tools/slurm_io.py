"""What `mscluster run` does with a Slurm allocation that needs more than the environment:
asking scontrol for a node's address, finding this host's address towards the step's other
nodes, and sharing one job secret among the nodes of a step.

The job secret (docs/howto/slurm.md): when the step spans several nodes and no
CLUSTER_JOB_SECRET[_FILE] is given, node 0's launcher writes 32 random bytes, hex, to
`.mscluster/slurm-<job>.<step>.r<restarts>.secret` under the job's working directory (a directory
of mode 0700, the file 0600, written to a temporary name and renamed, so no node reads half of
it). Every node's launcher, node 0's too, waits for it (bounded), copies it to
`<log-dir>/job.secret` (0600) and gives that file to its processes as CLUSTER_JOB_SECRET_FILE;
node 0 removes the shared file when its launcher ends. The secret is random, so nothing about the
job (its id, its nodes) guesses it, and it is readable only by the job's user.

`<restarts>` is SLURM_RESTART_COUNT (0 when unset): a requeued job keeps its id and its step ids,
and a run that ended with its node may have left its file behind, which the next run's nodes
must not take for node 0's new one. Node 0 removes such files of earlier runs before it writes.

With recovery on, the secret node 0 publishes is the one its `<log-dir>/job.secret` holds when
an earlier run of the step made it there (this user's file, mode 0600, 64 hex digits:
`secret.held_job_secret`): the step's saved state resumes only under the secret it was saved
with, and a requeued step (same ids, same log directories) resumes it. Without recovery, or
without such a file, the secret is new.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import lookup_name
from cluster.storage import atomic
from cluster.tools import hostlist
from cluster.tools.secret import JOB_SECRET_FILE, held_job_secret
from cluster.tools.slurm import SECRET_DIR, Allocation, earlier_run, node_addr
from cluster.worker.identity import local_address_towards

SCONTROL_TIMEOUT_S = 10.0
# How long the other nodes wait for node 0's launcher to write the shared secret.
SECRET_WAIT_S = 60.0
SECRET_POLL_S = 0.1
# How many of the step's other nodes are tried to find this host's address towards them.
PEERS_TRIED = 3


def node_address(name: str) -> str | None:
    """The NodeAddr Slurm reaches node `name` at (`scontrol show node -o NAME`); None when
    scontrol is missing, fails or shows none."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run(
            [scontrol, "show", "node", "-o", name],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return node_addr(done.stdout) if done.returncode == 0 else None


def reachable_address(name: str) -> str | None:
    """An IP address of node `name` as this host reaches it: the name resolved, else its
    NodeAddr (scontrol) resolved; None when neither."""
    for host in (name, node_address(name)):
        if host is None:
            continue
        try:
            infos = socket.getaddrinfo(lookup_name(host), None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            continue
        return str(infos[0][4][0])
    return None


def address_towards_peers(allocation: Allocation, port: int) -> tuple[str, str] | None:
    """(this host's local address towards another node of the step, that node), from the
    first of the step's other nodes (at most PEERS_TRIED) that resolves here and has a route;
    None when none does. No packet is sent (`local_address_towards`)."""
    first = allocation.first_node
    peers = (host for host in hostlist.iter_hosts(allocation.nodelist) if host != first)
    for peer in itertools.islice(peers, PEERS_TRIED):
        address = reachable_address(peer)
        if address is None:
            continue
        try:
            return local_address_towards(address, port), peer
        except ConfigError:  # no route to it from here
            continue
    return None


def shares_secret(allocation: Allocation | None, env: Mapping[str, str]) -> bool:
    """Whether this step's nodes share a secret made by node 0: several nodes, none given."""
    given = env.get("CLUSTER_JOB_SECRET_FILE", "").strip() or "CLUSTER_JOB_SECRET" in env
    return allocation is not None and allocation.node_count > 1 and not given


def local_secret_file(log_dir: Path) -> Path:
    return log_dir / JOB_SECRET_FILE


def share_secret(
    allocation: Allocation, log_dir: Path, *, keep: bool = False, wait_s: float = SECRET_WAIT_S
) -> Path:
    """Node 0 publishes the step's secret; every node copies it to LOG_DIR/job.secret, returned.
    With `keep` (recovery on), node 0 publishes the secret its LOG_DIR/job.secret holds when an
    earlier run of the step made it (`held_job_secret`), else a new one."""
    shared = allocation.secret_path
    local = local_secret_file(log_dir)
    if allocation.node_rank == 0:
        held = held_job_secret(local) if keep else None
        _remove_earlier_runs(allocation)
        secret = held or secrets.token_hex(32) + "\n"
        _write_private(shared, secret, directory_mode=0o700)
    try:
        secret = _wait_for(shared, allocation, wait_s)
        _write_private(local, secret, directory_mode=None)
    except (ConfigError, KeyboardInterrupt):  # node 0's launcher ends here: nothing of it stays
        remove_shared_secret(allocation)
        raise
    return local


def remove_shared_secret(allocation: Allocation) -> None:
    """Node 0, at the end: the shared copy has served (each node keeps its own)."""
    if allocation.node_rank == 0:
        allocation.secret_path.unlink(missing_ok=True)


def _remove_earlier_runs(allocation: Allocation) -> None:
    """The shared secrets (and temporaries) that runs of this job before a requeue left."""
    if allocation.restart_count == 0:
        return
    try:
        names = [entry.name for entry in os.scandir(SECRET_DIR)]
    except OSError:
        return  # none to remove; writing says what is wrong with the place
    for name in names:
        if earlier_run(name, allocation.job_id, allocation.restart_count):
            (SECRET_DIR / name).unlink(missing_ok=True)


def _write_private(path: Path, text: str, directory_mode: int | None) -> None:
    """`text` in `path`, mode 0600, whole or not at all (`atomic.write_atomically`: a
    temporary beside it, synced, renamed over it), its directory made first (with
    `directory_mode`, else as the umask has it)."""

    def refused(exc: OSError) -> ConfigError:
        return ConfigError(
            f"cannot write the job secret to {path.absolute()} ({exc.strerror or exc}): run the "
            "job from a directory it may write, or give CLUSTER_JOB_SECRET_FILE"
        )

    try:
        if directory_mode is None:
            path.parent.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(mode=directory_mode, parents=True, exist_ok=True)
            path.parent.chmod(directory_mode)
    except OSError as exc:
        raise refused(exc) from None
    data = text.encode()
    atomic.write_atomically(path, lambda fd: atomic.write_all(fd, data), refused)


def _wait_for(shared: Path, allocation: Allocation, wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = shared.read_text()
        except FileNotFoundError:
            text = ""
        except OSError as exc:
            raise ConfigError(
                f"cannot read the job secret {shared.absolute()} ({exc.strerror}): give "
                "CLUSTER_JOB_SECRET_FILE"
            ) from None
        if text.strip():
            return text
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"node 0 of {allocation.describe()} did not write the job secret "
                f"{Path.cwd() / shared} within {wait_s:g} s: is the working directory shared by "
                "the nodes, and did node 0's mscluster run start? Otherwise make the secret in "
                "the batch script and pass it (CLUSTER_JOB_SECRET_FILE, a file of mode 0600 every "
                "node can read)"
            )
        time.sleep(SECRET_POLL_S)
