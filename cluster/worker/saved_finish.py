"""Whether the scheduler's saved state shows this node's Finish counted: what a worker whose
Finish got no answer can read of it once its scheduler is gone.

The scheduler saves a finish before it answers it, and the job's end before it tells it
(write-ahead), so its saved state names every finish it counted, also one whose answer a
partition lost just as the job finished and the scheduler exited. A worker reads that state
where its own MS_RECOVERY_PATH holds it (`scheduler.json` beside the worker's record: on the
scheduler's host, or a directory the hosts share), and takes it as evidence only when it names
this node's job and lists this very process (node id and incarnation) as finished. A state of
another job, of another process of this node, a state it cannot read, or none (another host,
a state store in etcd) shows nothing: the worker then cannot know, and says so.

A held Finish looks every second, for as long as its node's reconnect window (MS_TOPO_TIMEOUT
with recovery), and the file is the whole job's state (about 430 bytes a member: 28 MB, and
half a second of a core or more to read, at 65,536 workers), often on a volume the hosts
share: a state that showed nothing is read again only once the file changed (`SavedFinish`),
which a scheduler that went away never does. Between two looks a worker only stats it.
"""

from __future__ import annotations

from pathlib import Path

from cluster.protocol.config import canonical_node_id
from cluster.protocol.errors import StateFileError
from cluster.protocol.records import NodeState, Phase
from cluster.storage import store
from cluster.storage.directory_store import STATE_FILE, FileIdentity, file_identity
from cluster.storage.state_store import SCHEDULER_KIND


def counted(directory: Path, cluster_id: str, node_id: str, incarnation: int) -> str:
    """The evidence, in words, that the scheduler counted the Finish of process `incarnation` of
    node `node_id` in job `cluster_id`, from its state saved in `directory` ("" when none)."""
    path = directory / STATE_FILE
    try:
        saved = store.load(path, SCHEDULER_KIND)
    except StateFileError:
        return ""  # torn, foreign or unreadable: shows nothing
    if not cluster_id or saved is None or saved.get("cluster_id") != cluster_id:
        return ""
    members = saved.get("members")
    me = canonical_node_id(node_id)
    finished = isinstance(members, list) and any(
        isinstance(m, dict)
        and m.get("node_id") == me
        and m.get("incarnation") == incarnation
        and m.get("state") == NodeState.FINISHED.value
        for m in members
    )
    if not finished:
        return ""
    job = " and the job as finished" if saved.get("phase") == Phase.FINISHED.value else ""
    return f"its saved state ({path}) lists this node's finish as counted{job}"


class SavedFinish:
    """The looks of one process (`incarnation`) of node `node_id` in job `cluster_id` at the
    scheduler's state saved in `directory`: `counted`'s evidence, the file read only when it
    changed since a read that showed nothing."""

    def __init__(self, directory: Path, cluster_id: str, node_id: str, incarnation: int) -> None:
        self._directory, self._path = directory, directory / STATE_FILE
        self._whose = (cluster_id, node_id, incarnation)
        self._nothing_in: FileIdentity | None = None  # the file last read, that showed nothing

    def look(self) -> str:
        """The evidence, in words, that the scheduler counted this process's Finish ("" when
        none)."""
        try:
            identity = file_identity(self._path)
        except OSError:
            return ""  # cannot be looked at now: looked at again next time
        if identity is None or identity == self._nothing_in:
            return ""
        evidence = counted(self._directory, *self._whose)
        if not evidence:
            self._nothing_in = identity  # replaced meanwhile: another identity, read next time
        return evidence
