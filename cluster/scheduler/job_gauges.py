"""The job as it is, for Prometheus: gauges computed at scrape time from the scheduler's state.

`JobGauges.of(core)` reads what the gauges show in one step on the scheduler's loop, from the
scheduler's state (one pass over the nodes); `job_metrics` turns it into metric families for
prometheus_client at each scrape (`cluster.scheduler.metrics.SchedulerCollector`, only while
this scheduler leads the job). Nothing here runs between scrapes: a heartbeat costs no more with
metrics on.

Series per node (`cluster_member_*`, labelled by rank and node id) exist only in jobs of at most
NODE_LABEL_LIMIT nodes; past it, the ages are a histogram and a maximum only.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric

from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.machine import state

# Jobs of at most this many nodes also get one series per node (rank and node id as labels).
NODE_LABEL_LIMIT = 64
HEARTBEAT_AGE_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
_ROLES = tuple(r.value for r in state.NodeRole)
_STATES = tuple(s.value for s in state.NodeState)


@dataclass(frozen=True)
class NodeGauge:
    rank: str
    node_id: str
    alive: bool
    heartbeat_age_s: float
    checkpoint_step: int  # newest reported, -1: none


@dataclass(frozen=True)
class JobGauges:
    """What the gauges show, read from the scheduler in one step on its loop."""

    cluster_id: str
    phase: str
    generation: int
    rollback_step: int
    worker_num: int
    server_num: int
    node_timeout_s: float
    heartbeat_interval_s: float
    nodes: dict[tuple[str, str], int]  # (role, state) -> how many
    heartbeat_ages: tuple[float, ...]  # of the alive nodes
    per_node: tuple[NodeGauge, ...]  # empty past NODE_LABEL_LIMIT nodes
    kv_bytes: int
    kv_keys: int
    kv_max_bytes: int  # CLUSTER_KV_MAX_BYTES
    kv_max_keys: int  # CLUSTER_KV_MAX_KEYS
    saves_pending: int
    watch_streams: int
    spares: int = 0  # live spares (connected workers without a rank)
    # Seconds from this scheduler's start to the job formed, 0 while it forms; None when the
    # job had formed before this scheduler took it (a restart, a standby that took over).
    formation_s: float | None = None

    @classmethod
    def of(cls, core: SchedulerCore, formation_s: float | None = None) -> JobGauges:
        """Phase, generation and rollback step as the nodes were told (with recovery, as on
        disk), the same as `mscluster status` shows; the nodes as the scheduler sees them."""
        st, told, saving, now = core.state, core.told(), core.saving(), core.now()
        members = [*st.members.values(), *st.spares.values()]
        nodes: dict[tuple[str, str], int] = {}
        ages: list[float] = []
        for m in members:
            key = (m.role.value, m.state.value)
            nodes[key] = nodes.get(key, 0) + 1
            if m.state is state.NodeState.ALIVE:
                ages.append(max(0.0, now - m.last_seen))
        live_spares = sum(1 for m in st.spares.values() if m.state is state.NodeState.ALIVE)
        per_node = (
            ()
            if len(members) > NODE_LABEL_LIMIT
            else tuple(_node(m, now) for m in st.in_status_order())
        )
        return cls(
            cluster_id=st.cluster_id,
            phase=told.phase.value,
            generation=told.generation,
            rollback_step=told.rollback_step,
            worker_num=st.settings.worker_num,
            server_num=st.settings.server_num,
            node_timeout_s=core.settings.node_timeout_s,
            heartbeat_interval_s=core.settings.heartbeat_interval_s,
            nodes=nodes,
            heartbeat_ages=tuple(ages),
            per_node=per_node,
            kv_bytes=core.kv.held_bytes,
            kv_keys=len(core.kv),
            kv_max_bytes=core.kv.max_bytes,
            kv_max_keys=core.kv.max_keys,
            saves_pending=0 if saving is None else saving.unsaved_changes,
            watch_streams=core.open_streams,
            spares=live_spares,
            formation_s=formation_s,
        )


def _node(m: state.Member, now: float) -> NodeGauge:
    return NodeGauge(
        rank="" if m.rank is None else str(m.rank),
        node_id=m.node_id,
        alive=m.state is state.NodeState.ALIVE,
        heartbeat_age_s=max(0.0, now - m.last_seen),
        checkpoint_step=m.checkpoints[-1] if m.checkpoints else -1,
    )


def job_metrics(g: JobGauges) -> Iterator[Metric]:
    """The job's gauges as metric families."""
    yield from _job(g)
    yield from _nodes(g)
    yield from _heartbeats(g)
    yield from _per_node(g)
    yield from _store(g)
    yield gauge("cluster_spares", "Live spare workers: registered, without a rank.", g.spares)
    if g.formation_s is not None:
        yield gauge(
            "cluster_formation_seconds",
            "Seconds from the scheduler's start to the job formed (0 while it forms; no sample "
            "when the job had formed before this scheduler took it).",
            g.formation_s,
        )


def _job(g: JobGauges) -> Iterator[Metric]:
    """The job as a whole: its id, phase, generation, rollback step and size."""
    yield gauge(
        "cluster_job_info", "The job (its id as a label); always 1.", 1, cluster_id=g.cluster_id
    )
    phases = GaugeMetricFamily(
        "cluster_job_phase",
        "1 for the job's current phase, 0 for the others.",
        labels=["phase"],
    )
    for phase in state.Phase:
        phases.add_metric([phase.value], 1.0 if phase.value == g.phase else 0.0)
    yield phases
    yield gauge(
        "cluster_generation",
        "The topology generation (1 once formed, +1 per re-formation).",
        g.generation,
    )
    yield gauge(
        "cluster_rollback_step",
        "The step the current generation (re)started training from.",
        g.rollback_step,
    )
    yield gauge("cluster_expected_workers", "Workers the job has (MS_WORKER_NUM).", g.worker_num)
    yield gauge(
        "cluster_expected_servers",
        "Parameter servers the job has (MS_SERVER_NUM).",
        g.server_num,
    )


def _nodes(g: JobGauges) -> Iterator[Metric]:
    """Registered nodes by role and state."""
    nodes = GaugeMetricFamily(
        "cluster_nodes", "Registered nodes by role and state.", labels=["role", "state"]
    )
    for role in _ROLES:
        for node_state in _STATES:
            nodes.add_metric([role, node_state], g.nodes.get((role, node_state), 0))
    yield nodes


def _store(g: JobGauges) -> Iterator[Metric]:
    """The key-value store against its caps, the saves held back and the open streams."""
    yield gauge(
        "cluster_kv_bytes", "Bytes of keys and values in the job's key-value store.", g.kv_bytes
    )
    yield gauge("cluster_kv_keys", "Keys in the job's key-value store.", g.kv_keys)
    yield gauge(
        "cluster_kv_max_bytes",
        "The store's cap on bytes (CLUSTER_KV_MAX_BYTES).",
        g.kv_max_bytes,
    )
    yield gauge(
        "cluster_kv_max_keys", "The store's cap on keys (CLUSTER_KV_MAX_KEYS).", g.kv_max_keys
    )
    yield gauge(
        "cluster_state_saves_pending",
        "Changes decided but not yet saved (with recovery): the nodes hear of them once saved.",
        g.saves_pending,
    )
    yield gauge(
        "cluster_watch_streams", "Open Watch streams (one per connected node).", g.watch_streams
    )


def gauge(name: str, documentation: str, value: float, **labels: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _heartbeats(g: JobGauges) -> Iterator[Metric]:
    ages = sorted(g.heartbeat_ages)
    buckets = [
        (f"{bound:g}", float(bisect.bisect_right(ages, bound))) for bound in HEARTBEAT_AGE_BUCKETS
    ]
    buckets.append(("+Inf", float(len(ages))))
    yield GaugeHistogramMetricFamily(
        "cluster_heartbeat_age_seconds",
        "Seconds since each alive node's last sign of life (heartbeat, call or connection), "
        "as they are at the scrape.",
        buckets=buckets,
        gsum_value=sum(ages),
    )
    yield gauge(
        "cluster_heartbeat_age_max_seconds",
        "The oldest of those ages (0: no alive node).",
        ages[-1] if ages else 0.0,
    )
    yield gauge(
        "cluster_node_timeout_seconds",
        "MS_NODE_TIMEOUT: an age past it fails the node.",
        g.node_timeout_s,
    )
    yield gauge(
        "cluster_heartbeat_interval_seconds",
        "Seconds between a node's heartbeats.",
        g.heartbeat_interval_s,
    )


def _per_node(g: JobGauges) -> Iterator[Metric]:
    if not g.per_node:
        return
    labels = ["rank", "node_id"]
    alive = GaugeMetricFamily(
        "cluster_member_alive",
        f"1 while the node is alive (jobs of at most {NODE_LABEL_LIMIT} nodes).",
        labels=labels,
    )
    age = GaugeMetricFamily(
        "cluster_member_heartbeat_age_seconds",
        "Seconds since the node's last sign of life.",
        labels=labels,
    )
    step = GaugeMetricFamily(
        "cluster_member_checkpoint_step",
        "The newest checkpoint step the node reported (-1: none).",
        labels=labels,
    )
    for node in g.per_node:
        values = [node.rank, node.node_id]
        alive.add_metric(values, 1.0 if node.alive else 0.0)
        age.add_metric(values, node.heartbeat_age_s)
        step.add_metric(values, node.checkpoint_step)
    yield from (alive, age, step)
