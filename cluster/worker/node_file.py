"""A worker's own recovery file: the job it belongs to, its node id and its rank.

It sits beside the scheduler's state under MS_RECOVERY_PATH (on the worker's host), one file per
node id. A restarted process reads it to present its old job id, so that a scheduler running
another job (a new one, after its state was lost) refuses it instead of mixing two jobs; when
the node has finished its part, the file says so and a new start is a new job's node.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from cluster.protocol.errors import StateFileError
from cluster.protocol.value import frozen
from cluster.storage import store

KIND = "worker"


@frozen
class NodeRecord:
    cluster_id: str
    node_id: str
    rank: int
    generation: int
    finished: bool = False


def path_for(directory: Path, node_id: str) -> Path:
    return directory / f"worker-{node_id}.json"


def load(directory: Path, node_id: str) -> NodeRecord | None:
    path = path_for(directory, node_id)
    payload = store.load(path, KIND)
    if payload is None:
        return None
    try:
        record = NodeRecord(
            cluster_id=str(payload["cluster_id"]),
            node_id=str(payload["node_id"]),
            rank=int(payload["rank"]),
            generation=int(payload["generation"]),
            finished=bool(payload["finished"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StateFileError(
            f"the recovery state {path} lacks or garbles {exc}: move it away to start this node "
            "as a new one"
        ) from None
    if record.node_id != node_id:
        raise StateFileError(
            f"the recovery state {path} belongs to node {record.node_id!r}, not {node_id!r}: "
            "move it away"
        )
    return record


def save(directory: Path, record: NodeRecord) -> None:
    store.save(path_for(directory, record.node_id), KIND, asdict(record))
