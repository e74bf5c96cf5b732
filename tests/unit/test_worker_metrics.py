"""A worker's metrics hooks: nothing when off; with metrics on, what each hook records."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api import worker_metrics
from cluster.api.worker_metrics import WorkerMetrics


def samples(m: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_hook_does_nothing_when_metrics_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_metrics, "_metrics", None)
    monkeypatch.setattr(worker_metrics, "_checked", True)
    worker_metrics.step_done(0.0)
    worker_metrics.rolled_back(3)
    with worker_metrics.checkpoint(10), worker_metrics.collective("barrier"):
        pass
    worker_metrics.reported([10])


def test_the_hooks_record_steps_rollbacks_checkpoints_and_collectives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = WorkerMetrics(rank=2, node_id="2")
    monkeypatch.setattr(worker_metrics, "_metrics", m)
    monkeypatch.setattr(worker_metrics, "_checked", True)
    worker_metrics.step_done(0.0)
    worker_metrics.step_done(0.0)
    worker_metrics.rolled_back(7)
    for step in (10, 20, 30):
        with worker_metrics.checkpoint(step):
            pass
    worker_metrics.reported([10, 20])  # 10 and 20 on disk; 30 still being written
    worker_metrics.reported([20, 30])  # then 30; 10 was pruned meanwhile
    with worker_metrics.collective("allreduce"):
        pass
    got = samples(m)
    assert got[("cluster_worker_info", (("node_id", "2"), ("rank", "2")))] == 1
    assert got[("cluster_worker_steps_total", ())] == 2
    assert got[("cluster_worker_step_seconds_count", ())] == 2
    assert got[("cluster_worker_rollbacks_total", ())] == 1
    assert got[("cluster_worker_steps_redone_total", ())] == 7
    assert got[("cluster_worker_checkpoint_pause_seconds_count", ())] == 3
    assert got[("cluster_worker_checkpoint_persist_seconds_count", ())] == 3
    assert got[("cluster_worker_collective_seconds_count", (("op", "allreduce"),))] == 1
    assert got[("cluster_worker_collective_seconds_count", (("op", "barrier"),))] == 0
    assert m.saving == {}
