"""The scheduler's /metrics: a real scheduler (grpc.aio on loopback, metrics on port 0), read
over HTTP and parsed with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.protocol.config import ObserveConfig
from cluster.protocol.errors import ConfigError, StateFileError
from cluster.protocol.events import MemoryResume
from cluster.scheduler import JobStore, SchedulerServer
from cluster.scheduler.job_gauges import NODE_LABEL_LIMIT
from cluster.scheduler.machine import state
from cluster.storage import store
from cluster.storage.kv_log import FILE_NAME
from cluster.transport import relay
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S, eventually
from tests.credentials import caller, digest
from tests.scrape import ON, form, reg, scrape, settings, value

HEALTH = "grpc.health.v1.Health"


async def test_a_formed_job_and_a_failure_as_metrics() -> None:
    async with SchedulerServer(settings(), observe=ON) as server:
        await form(server)
        seen = await scrape(server)
        assert value(seen, "cluster_nodes", role="worker", state="alive") == 2
        assert value(seen, "cluster_nodes", role="server", state="failed") == 0
        assert value(seen, "cluster_expected_workers") == 2
        assert value(seen, "cluster_generation") == 1
        assert value(seen, "cluster_job_phase", phase="ready") == 1
        assert value(seen, "cluster_job_phase", phase="waiting") == 0
        assert value(seen, "cluster_registrations_total") == 2
        assert value(seen, "cluster_formation_seconds") >= 0
        assert value(seen, "cluster_heartbeat_age_seconds_gcount") == 2
        assert value(seen, "cluster_heartbeat_age_seconds_bucket", le="+Inf") == 2
        assert value(seen, "cluster_member_alive", rank="1", node_id="1") == 1
        assert value(seen, "cluster_member_checkpoint_step", rank="0") == -1
        assert value(seen, "cluster_node_failures_total", cause="stream_broken") == 0

        core = server.core
        core.state.connect("1", 1)
        core._apply(core.state.disconnect("1", 1))
        seen = await scrape(server)
        assert value(seen, "cluster_node_failures_total", cause="stream_broken") == 1
        assert value(seen, "cluster_nodes", role="worker", state="failed") == 1
        assert value(seen, "cluster_job_phase", phase="failed") == 1  # recovery is off
        assert value(seen, "cluster_member_alive", rank="1") == 0

        assert value(seen, "cluster_memory_resumes_total") == 0
        core.journal.memory_resume("0", MemoryResume(core.state.generation, 5, "in memory"))
        assert value(await scrape(server), "cluster_memory_resumes_total") == 1


async def test_spares_and_promotions_as_metrics() -> None:
    async with SchedulerServer(settings(recovery=True), observe=ON) as server:
        await form(server)
        spare = dataclasses.replace(reg("0"), node_id="spare-0", port=7000, spare=True)
        spare = dataclasses.replace(spare, credential_digest=digest("spare-0", 1))
        await asyncio.wait_for(server.core.register(spare), BOUND_S)
        seen = await scrape(server)
        assert value(seen, "cluster_spares") == 1
        assert value(seen, "cluster_promotions_total") == 0
        core = server.core
        core.state.connect("1", 1)
        core._apply(core.state.disconnect("1", 1))
        seen = await scrape(server)
        assert value(seen, "cluster_spares") == 0  # it holds rank 1 now
        assert value(seen, "cluster_promotions_total") == 1
        assert value(seen, "cluster_rollbacks_total") == 1
        assert value(seen, "cluster_generation") == 2
        assert value(seen, "cluster_member_alive", rank="1", node_id="spare-0") == 1


async def test_rpcs_are_counted_by_method_and_code_and_unary_ones_timed() -> None:
    async with SchedulerServer(settings(), observe=ON) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.SchedulerStub(channel)
            await stub.Status(pb.StatusRequest(), timeout=BOUND_S)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Finish(pb.FinishRequest(node_id="nobody", incarnation=1), timeout=5)
            assert refused.value.code() is grpc.StatusCode.NOT_FOUND
        seen = await scrape(server)
    assert value(seen, "cluster_rpc_requests_total", method="Status", code="OK") == 1
    assert value(seen, "cluster_rpc_requests_total", method="Finish", code="NOT_FOUND") == 1
    assert value(seen, "cluster_rpc_duration_seconds_count", method="Status") == 1
    assert value(seen, "cluster_rpc_duration_seconds_bucket", method="Status", le="+Inf") == 1


async def test_a_relays_beats_stream_is_counted_not_timed() -> None:
    """HostBeats lives as long as a host's relay: timed as a unary call, each stream that ended
    (a relay reconnecting, the job's end) put its whole life in the latency histogram."""
    async with SchedulerServer(settings(), observe=ON) as server:
        await form(server)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.SchedulerStub(channel)

            async def beats() -> AsyncIterator[pb.HostBeatsRequest]:
                for _ in range(3):
                    yield pb.HostBeatsRequest()
                    await asyncio.sleep(0.1)  # sleep-ok: a relay's batches, apart

            stream = stub.HostBeats(beats(), metadata=relay.stamp())
            await asyncio.wait_for(stream, BOUND_S)
        seen = await scrape(server)
    assert value(seen, "cluster_rpc_requests_total", method="HostBeats", code="OK") == 1
    timed = seen.get("cluster_rpc_duration_seconds_count", [])
    assert [s for s in timed if s.labels["method"] == "HostBeats"] == []


async def test_the_health_services_watch_is_not_the_schedulers_watch() -> None:
    """Both services have a method named Watch: the `service` label tells them apart."""
    async with SchedulerServer(settings(), observe=ON) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=BOUND_S)
        metrics = server.observing.metrics
        assert metrics is not None

        def watch_counted() -> bool:  # once the server has seen the stream end
            samples = [s for f in metrics.rpc.requests.collect() for s in f.samples]
            return any(s.labels["method"] == "Watch" for s in samples)

        await eventually(watch_counted, "the health service's Watch to be counted")
        seen = await scrape(server)
    watches = {
        (s.labels["service"], s.labels["code"]): s.value
        for s in seen["cluster_rpc_requests_total"]
        if s.labels["method"] == "Watch"
    }
    assert watches == {(HEALTH, "CANCELLED"): 1}  # no Watch of the scheduler's was made
    assert value(seen, "cluster_rpc_requests_total", service=HEALTH, method="Check") == 1
    assert value(seen, "cluster_rpc_duration_seconds_count", service=HEALTH, method="Check") == 1


async def test_a_sole_scheduler_says_it_leads() -> None:
    """Without standbys the only scheduler leads its job: `max(cluster_leader) == 0` must mean
    that no scheduler leads."""
    async with SchedulerServer(settings(), observe=ON) as server:
        assert value(await scrape(server), "cluster_leader") == 1


async def test_formation_time_is_0_while_forming_and_absent_after_a_restart(
    tmp_path: Path,
) -> None:
    """The saved state does not keep how long the job took to form: a scheduler that resumes a
    formed job exports no formation time rather than 0, which means "not formed yet"."""
    server = SchedulerServer(
        settings(recovery=True), store=JobStore.directory(tmp_path), observe=ON
    )
    await server.start()
    try:
        assert value(await scrape(server), "cluster_formation_seconds") == 0
        await form(server)
        assert value(await scrape(server), "cluster_formation_seconds") > 0
    finally:
        await server.stop(drain_s=0)  # stopped, not ended: the job stays resumable
    async with SchedulerServer(
        settings(recovery=True), store=JobStore.directory(tmp_path), observe=ON
    ) as again:
        seen = await scrape(again)
        assert value(seen, "cluster_job_phase", phase="ready") == 1  # the job, resumed
        assert "cluster_formation_seconds" not in seen


async def test_every_refusal_is_counted_once_under_its_own_reason() -> None:
    """The journal tells one address's refusals once a minute; the metrics count them all, a
    registration refused by the job apart from a call of any method refused at the edge."""
    async with SchedulerServer(settings(), observe=ON) as server:
        await form(server)
        for i in range(2, 8):  # six more workers from one address ask to join a full job
            refused = await server.core.register(reg(str(i)), f"ipv4:10.0.0.5:{4000 + i}")
            assert isinstance(refused, state.Refused)
            assert refused.reason is state.Refusal.INVALID_NODE
        mismatched = dataclasses.replace(reg("9"), worker_num=3)
        refused = await server.core.register(mismatched, "ipv4:10.0.0.5:4009")
        assert isinstance(refused, state.Refused)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            status = channel.unary_unary("/cluster.v1.Scheduler/Status", None, None)
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError):
                    await status(b"\xff" * 8, timeout=BOUND_S)  # not a StatusRequest
        told = [e for e in server.core.journal.history() if e.kind == "refused"]
        seen = await scrape(server)
    assert len(told) == 2  # the journal's rate: one a minute per address, and the edge's own
    assert value(seen, "cluster_registration_refusals_total", reason="invalid_node") == 6
    assert value(seen, "cluster_registration_refusals_total", reason="worker_num_mismatch") == 1
    assert value(seen, "cluster_registration_refusals_total", reason="cluster_full") == 0
    assert value(seen, "cluster_edge_refusals_total", method="Status", reason="malformed") == 3
    assert sum(s.value for s in seen["cluster_registration_refusals_total"]) == 7


async def test_no_series_per_node_past_the_limit() -> None:
    workers = NODE_LABEL_LIMIT + 1
    async with SchedulerServer(settings(workers), observe=ON) as server:
        await form(server, workers)
        seen = await scrape(server)
    assert value(seen, "cluster_nodes", role="worker", state="alive") == workers
    assert value(seen, "cluster_heartbeat_age_seconds_gcount") == workers
    assert not [name for name in seen if name.startswith("cluster_member_")]


async def test_saves_of_the_recovery_state_are_counted_timed_and_sized(tmp_path: Path) -> None:
    async with SchedulerServer(
        settings(recovery=True), store=JobStore.directory(tmp_path), observe=ON
    ) as server:
        await form(server)
        seen = await scrape(server)
    assert value(seen, "cluster_state_saves_total") >= 1
    assert value(seen, "cluster_state_save_seconds_count") >= 1
    assert value(seen, "cluster_state_save_bytes") > 100  # the file, as last saved
    assert value(seen, "cluster_state_save_failures_total") == 0
    assert value(seen, "cluster_state_saves_pending") == 0


async def test_a_failing_save_is_counted_and_is_one_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with SchedulerServer(
        settings(recovery=True), store=JobStore.directory(tmp_path), observe=ON
    ) as server:

        def broken(*args: object, **kwargs: object) -> None:
            raise StateFileError("cannot write the recovery state: the disk is full")

        def kinds() -> list[str]:
            return [e.kind for e in server.core.journal.history()]

        await form(server)
        monkeypatch.setattr(store, "save", broken)
        node = server.core.state.members["1"]
        server.core.state.report_checkpoints("1", node.incarnation, [10])  # a change to save
        server.core._apply([])
        await eventually(lambda: "save_failed" in kinds(), "a failed save")
        seen = await scrape(server)
        monkeypatch.undo()  # the disk works again: the next retry lands
        await eventually(lambda: "save_recovered" in kinds(), "a save that landed again")
    assert value(seen, "cluster_state_save_failures_total") >= 1
    assert value(seen, "cluster_state_saves_pending") >= 1
    assert kinds().count("save_failed") == 1  # said once, however many retries failed


async def test_failing_key_value_saves_are_failing_saves(tmp_path: Path) -> None:
    """The key-value log cannot be written and no state change waits: Status, the event log
    and the metrics say saves fail while the key set waits, and say when they work again."""
    async with SchedulerServer(
        settings(recovery=True), store=JobStore.directory(tmp_path), observe=ON
    ) as server:
        core = server.core

        def kinds() -> list[str]:
            return [e.kind for e in core.journal.history()]

        await form(server)
        kv_log, aside = tmp_path / FILE_NAME, tmp_path / "kv.log.aside"
        kv_log.rename(aside)
        kv_log.mkdir()  # every append fails, as on a broken disk
        node = core.state.members["1"]
        kv_set = asyncio.ensure_future(core.kv_set(caller("1", node.incarnation), "k", b"v"))
        await eventually(lambda: "save_failed" in kinds(), "a failed key-value save")
        seen = await scrape(server)
        saving = core.saving()
        assert saving is not None
        assert str(kv_log) in saving.error
        assert saving.unsaved_changes == 1  # the key set
        assert saving.failures >= 1
        assert not kv_set.done()
        assert value(seen, "cluster_state_save_failures_total") >= 1
        assert value(seen, "cluster_state_saves_pending") == 1
        persister, revision = core.persister, core.state.revision
        assert persister is not None
        core.state.report_checkpoints("1", node.incarnation, [10])  # a state save that lands
        core._apply([])
        await eventually(lambda: persister.saved > revision, "the state saved meanwhile")
        assert "save_recovered" not in kinds()  # the key set still waits: saves still fail
        kv_log.rmdir()
        aside.rename(kv_log)
        await asyncio.wait_for(kv_set, BOUND_S)
        await eventually(lambda: "save_recovered" in kinds(), "saves working again")
        saving = core.saving()
        assert saving is not None
        assert (saving.error, saving.failing_for_s, saving.unsaved_changes) == ("", 0.0, 0)
    assert kinds().count("save_failed") == 1  # said once, however many retries failed


async def test_a_metrics_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = SchedulerServer(settings(), observe=ObserveConfig(metrics_port=port))
        with pytest.raises(ConfigError, match=rf"CLUSTER_METRICS_PORT={port}: .*choose a free"):
            await server.start()
    assert server.port == 0  # the scheduler did not start serving


def test_metrics_off_by_default_import_and_install_nothing() -> None:
    probe = """
import asyncio, sys
from cluster.scheduler import CoreSettings, SchedulerServer

async def main():
    async with SchedulerServer(CoreSettings(2, 0, 5.0, 60.0, 1.0)) as server:
        assert server.observing.metrics is None and server.observing.interceptors() == []
        assert server.observing.metrics_port is None
    print("prometheus_client" in sys.modules)

asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
