"""deploy/grafana/cluster.json, the dashboard of the scheduler's metrics: every metric it
queries is exported by a real scheduler's /metrics, and every query is PromQL that a real
Prometheus accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.scheduler import JobStore, SchedulerServer
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S
from tests.procs import ROOT
from tests.scrape import ON, form, scrape, settings
from tests.servers.prometheus import Prometheus

DASHBOARD = ROOT / "deploy" / "grafana" / "cluster.json"
METRIC = re.compile(r"\b((?:cluster|process)_[a-z_]+)\b")
# Grafana's own variables, as a query against Prometheus directly would have them.
VARIABLES = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*"}


def panels(node: Any) -> list[dict[str, Any]]:
    found = []
    for panel in node.get("panels", []):
        found.append(panel)
        found.extend(panels(panel))
    return found


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
    assert len(queries()) >= 30


async def test_every_metric_the_dashboard_queries_is_exported(tmp_path: Path) -> None:
    async with SchedulerServer(
        settings(recovery=True), store=JobStore.directory(tmp_path), observe=ON
    ) as server:
        await form(server)  # a formed job: the per-node series exist
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            await pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=BOUND_S)
            malformed = channel.unary_unary("/cluster.v1.Scheduler/Status", None, None)
            with pytest.raises(grpc.aio.AioRpcError):  # a refusal at the edge: its series
                await malformed(b"\xff" * 8, timeout=BOUND_S)
        exported = set(await scrape(server))
    queried = {name for expr in queries() for name in METRIC.findall(expr)}
    assert len(queried) >= 25
    assert sorted(queried - exported) == []


def test_every_query_is_promql_that_prometheus_accepts(prometheus: Prometheus) -> None:
    for query in queries():
        promql = query
        if promql.startswith("label_values("):  # Grafana's, not PromQL: its selector is
            promql = promql.removeprefix("label_values(").rsplit(",", 1)[0]
        for name, value in VARIABLES.items():
            promql = promql.replace(name, value)
        prometheus.query(promql)  # ServerError with Prometheus's reason when it refuses it
