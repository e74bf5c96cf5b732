"""Where a worker is in its job, as its core keeps it (`cluster.worker.machine.core`); its part
`joining` moves it through registering, and the core through the rest.
"""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    JOINING = "joining"  # registering for the first time
    FORMING = "forming"  # accepted; the job has not formed yet
    SPARE = "spare"  # accepted as a spare: waiting for a topology that names this node
    READY = "ready"  # the topology is here
    RECONNECTING = "reconnecting"  # the stream was lost; registering again
    FINISHED = "finished"  # this node's Finish was heard, or the job finished
    FAILED = "failed"  # the job is over for this node with an error (final)
    CLOSED = "closed"  # closed by its owner (final)
