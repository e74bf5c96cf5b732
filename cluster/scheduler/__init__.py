"""The scheduler's I/O shell: a grpc.aio server around the state machine of
`cluster.protocol.state`.

Here: the engine that applies the state machine's effects (`core`), the thin gRPC servicer
(`servicer`, no cluster logic) and what runs around every call (`gate`: which scheduler
answers; the client certificate's check is `cluster.transport.server_tls`), the server's
lifecycle (`server`), write-ahead saving (`persist`, and `kv_journal` for the key-value store)
to the state store made from the settings (`stores`: the directory, or etcd in `etcd_store`
over `etcd_client`), standby schedulers (`ha`, the election's
I/O loop in `leading`, on etcd in `etcd_election`), open streams (`streams`), the key-value
store (`kv`) and collective rounds (`exchange`), the open-files limit (`limits`), the protobuf
conversions (`convert`), and what the scheduler shows of itself (`observe`): the journal of
events and its file (`events`, `event_file`) and, when asked for, Prometheus metrics (`metrics`,
`job_gauges`, `rpc_metrics`).

May import: `cluster.protocol`, `cluster.transport`, `cluster.storage`, `cluster.v1`, grpc and
asyncio. Never the worker, the training API or the tools.
"""

from cluster.protocol.settings import JobSettings
from cluster.scheduler.core import CoreSettings, SchedulerCore
from cluster.scheduler.server import JobStore, SchedulerServer, run, serve

__all__ = [
    "CoreSettings",
    "JobSettings",
    "JobStore",
    "SchedulerCore",
    "SchedulerServer",
    "run",
    "serve",
]
