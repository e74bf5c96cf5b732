"""The scheduler's I/O shell: a grpc.aio server around the pure machine of
`cluster.scheduler.machine`.

Here: the engine that carries out the machine's decisions (`core`), the thin gRPC servicer
(`servicer`, no cluster logic) and what runs around every call (`gate`: which scheduler
answers; `servicer_edge`: the refusals at the edge and the books of the members' connections;
the client certificate's check is `cluster.transport.server_tls`), the server's
lifecycle (`server`), write-ahead saving of the state and the key-value store (`persist`)
to the state store made from the settings (`stores`: the directory, or etcd in `etcd_store`
over `etcd_client`), standby schedulers (`ha`, the election's
I/O loop in `leading`, on etcd in `etcd_election`), open streams (`streams`), the key-value
store's waits (`kv`) and the collective rounds' futures (`exchange`), the open-files limit
(`limits`), the protobuf conversions (`convert`), and what the scheduler shows of itself
(`observe`): the journal of events and its file (`events`, `event_file`) and, when asked for,
Prometheus metrics (`metrics`, `job_gauges`, `rpc_metrics`).

May import: `cluster.protocol`, `cluster.transport`, `cluster.storage`, `cluster.v1`, grpc and
asyncio. Never the worker, the training API or the tools. The package resolves its public
names on first use, so that importing the pure machine imports no grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_WHERE = {
    "CoreSettings": "cluster.scheduler.core",
    "SchedulerCore": "cluster.scheduler.core",
    "JobSettings": "cluster.protocol.settings",
    "JobStore": "cluster.scheduler.server",
    "SchedulerServer": "cluster.scheduler.server",
    "run": "cluster.scheduler.server",
    "serve": "cluster.scheduler.server",
}


def __getattr__(name: str) -> Any:
    import importlib  # noqa: PLC0415 - on first use

    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'cluster.scheduler' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value
