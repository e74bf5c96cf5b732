"""The scheduler's I/O shell: a grpc.aio server around the state machine of
`cluster.protocol.state`.

Here: the engine that applies the state machine's effects (`core`), the thin gRPC servicer
(`servicer`, no cluster logic), the server's lifecycle (`server`), write-ahead saving
(`persist`), open streams (`streams`), the key-value store (`kv`) and collective rounds
(`exchange`), the open-files limit (`limits`), the protobuf conversions (`convert`), and what
the scheduler shows of itself (`observe`): the journal of events and its file (`events`,
`event_file`) and, when asked for, Prometheus metrics (`metrics`, `job_gauges`, `rpc_metrics`).

May import: `cluster.protocol`, `cluster.transport`, `cluster.storage`, `cluster.v1`, grpc and
asyncio. Never the worker, the training API or the tools.
"""

from cluster.protocol.settings import JobSettings
from cluster.scheduler.core import CoreSettings, SchedulerCore
from cluster.scheduler.server import SchedulerServer, run, serve

__all__ = [
    "CoreSettings",
    "JobSettings",
    "SchedulerCore",
    "SchedulerServer",
    "run",
    "serve",
]
