"""Readers prove the job secret (README, "Security model"): a real in-process scheduler with a
job secret refuses Status and WatchEvents to a reader without its proof (UNAUTHENTICATED, the
message naming the fix), admits one with it, and keeps the health service open; where
`mscluster status` and `events` find the secret."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.protocol.config import Limits
from cluster.protocol.environment import limits_from_env
from cluster.protocol.errors import ConfigError, ReadRefusedError
from cluster.scheduler import CoreSettings, SchedulerServer
from cluster.scheduler.machine.events import Kind, Record
from cluster.tools import events, reading, status
from cluster.tools.following import Following
from cluster.tools.watch import Watcher
from cluster.transport import membership
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S, eventually
from tests.scrape import settings

SECRET = b"0123456789abcdef" * 4
Read = Callable[[Any], Awaitable[Any]]


def closed(**limits: Any) -> CoreSettings:
    """A job of two workers with a job secret."""
    return dataclasses.replace(settings(), job_secret=SECRET, limits=Limits(**limits))


def reads(stub: pb_grpc.SchedulerStub) -> dict[str, Read]:
    """Status and WatchEvents (its retained events), each with the metadata given."""

    async def watch_events(metadata: Any) -> Any:
        call = stub.WatchEvents(
            pb.WatchEventsRequest(follow=False), timeout=BOUND_S, metadata=metadata
        )
        return [event async for event in call]

    def status_call(metadata: Any) -> Any:
        return stub.Status(pb.StatusRequest(), timeout=BOUND_S, metadata=metadata)

    return {"Status": status_call, "WatchEvents": watch_events}


async def proof(stub: pb_grpc.SchedulerStub, secret: bytes, method: str) -> Any:
    answer = await stub.Challenge(pb.ChallengeRequest(), timeout=BOUND_S)
    return membership.read_metadata(secret, answer.challenge, method)


async def test_a_job_with_a_secret_shows_itself_only_to_readers_that_prove_it() -> None:
    async with (
        SchedulerServer(closed()) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.SchedulerStub(channel)
        for method, read in reads(stub).items():
            for metadata, problem in (
                ((), "carries no proof of the job secret"),
                (await proof(stub, b"another secret", method), "not of this job's secret"),
                (await proof(stub, SECRET, "Status" if method != "Status" else "X"), "not"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await read(metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, method
                said = refused.value.details() or ""
                assert problem in said, said
                assert "pass --secret-file <log-dir>/job.secret" in said, said
                assert "CLUSTER_JOB_SECRET_FILE" in said, said
            assert await read(await proof(stub, SECRET, method))
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="cluster.v1.Scheduler"), timeout=BOUND_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_tools_prove_the_secret_and_say_in_one_line_what_is_missing() -> None:
    async with SchedulerServer(closed()) as server:
        address = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            view = await status.fetch(channel, address, secret=SECRET)
            assert view.worker_num == 2
            with pytest.raises(ReadRefusedError) as without:
                await status.fetch(channel, address, secret=None)
            wrong = reading.ReadSecret(b"another secret", "--secret-file 'x'")
            with pytest.raises(ReadRefusedError) as mistaken:
                await status.fetch(channel, address, secret=wrong)
        seen = [
            e.kind async for e in events.from_scheduler(address, None, follow=False, secret=SECRET)
        ]
        assert "started" in seen
        with pytest.raises(ReadRefusedError) as unproven:
            async for _ in events.from_scheduler(address, None, follow=False, secret=None):
                pass
    for refused in (without, unproven):
        said = str(refused.value)
        assert "\n" not in said
        assert membership.READ_FIX in said, said
        assert said.endswith(
            "pass --secret-file <log-dir>/job.secret or set CLUSTER_JOB_SECRET_FILE"
        ), said
    said = str(mistaken.value)
    assert "--secret-file 'x'" in said
    assert "not this job's secret" in said


def refused_as_replay(exc: grpc.aio.AioRpcError) -> None:
    assert exc.code() is grpc.StatusCode.UNAUTHENTICATED, exc
    assert "used before (a replay)" in (exc.details() or ""), exc.details()


async def test_a_captured_read_proof_is_refused_when_replayed() -> None:
    """A listener on a job with a secret but no TLS captures an operator's `cluster-read`
    metadata: replayed (a follow of the events for the job's life, or Status) it is refused,
    and the followers' room (CLUSTER_MAX_FOLLOWERS) stays the operator's."""
    async with (
        SchedulerServer(closed(max_followers=2)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as listener,
    ):
        stub, theirs = pb_grpc.SchedulerStub(channel), pb_grpc.SchedulerStub(listener)
        follow = pb.WatchEventsRequest(follow=True)
        captured = await proof(stub, SECRET, "WatchEvents")
        operator = stub.WatchEvents(follow, timeout=BOUND_S, metadata=captured)
        assert (await operator.read()).event == "started"
        for _ in range(3):
            replayed = theirs.WatchEvents(follow, timeout=BOUND_S, metadata=captured)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await replayed.read()
            refused_as_replay(refused.value)
        status_proof = await proof(stub, SECRET, "Status")
        assert await stub.Status(pb.StatusRequest(), timeout=BOUND_S, metadata=status_proof)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await theirs.Status(pb.StatusRequest(), timeout=BOUND_S, metadata=status_proof)
        refused_as_replay(refused.value)
        # A fresh challenge's proof is taken: the second follower's place was not taken.
        again = stub.WatchEvents(
            follow, timeout=BOUND_S, metadata=await proof(stub, SECRET, "WatchEvents")
        )
        assert (await again.read()).event == "started"
        operator.cancel()
        again.cancel()


class Repeating:
    """Something on the path that sends a read's proof again: the first proof it sees of each
    method goes out again on the next `times` reads of that method, in place of their own.
    (`interceptors`: one per kind of call; grpc files an interceptor under one kind only.)"""

    def __init__(self, times: int) -> None:
        self.first: dict[str, str] = {}
        self.times = times
        self.interceptors = [_Unary(self), _Stream(self)]

    def swap(self, details: Any) -> Any:
        pairs = [(k, v) for k, v in details.metadata or ()]
        own = next((v for k, v in pairs if k == membership.READ_KEY), None)
        if own is None:
            return details
        first = self.first.setdefault(details.method, own)
        if first == own or self.times <= 0:
            return details
        self.times -= 1
        pairs = [(k, first if k == membership.READ_KEY else v) for k, v in pairs]
        return details._replace(metadata=grpc.aio.Metadata(*pairs))


class _Unary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, path: Repeating) -> None:
        self.path = path

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.path.swap(details), request)


class _Stream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, path: Repeating) -> None:
        self.path = path

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.path.swap(details), request)


async def test_a_read_taken_for_a_replay_is_made_again_and_never_called_a_wrong_secret() -> None:
    """A read whose proof the scheduler takes for a replay is made once more on a fresh
    challenge (Status and the events); refused again, it is told in one line that the secret is
    right and something repeats its calls, never that the secret is wrong."""
    secret = reading.ReadSecret(SECRET, "CLUSTER_JOB_SECRET_FILE='job.secret'")
    path = Repeating(0)
    async with (
        SchedulerServer(closed()) as server,
        grpc.aio.insecure_channel(
            f"127.0.0.1:{server.port}", interceptors=path.interceptors
        ) as channel,
    ):
        address = f"127.0.0.1:{server.port}"

        async def events_read() -> list[events.JobEvent]:
            read = status.watch_events(channel, address, follow=False, secret=secret)
            return [event async for event in read]

        async def status_read() -> status.JobView:
            return await status.fetch(channel, address, secret=secret)

        for read in (status_read, events_read):
            assert await read()  # its proof is the one the path repeats
            path.times = 1
            assert await read()  # its first proof, the repeated one, refused; a fresh one taken
            assert path.times == 0
            path.times = 2
            with pytest.raises(ReadRefusedError) as refused:
                await read()
            said = str(refused.value)
            assert "for a replay" in said, said
            assert "CLUSTER_JOB_SECRET_FILE='job.secret' is right" in said, said
            assert "not this job's secret" not in said, said
            assert "\n" not in said


async def test_status_watch_proves_each_read_afresh_its_event_stream_reconnections_too() -> None:
    """`mscluster status --watch` on a job with a secret: every poll, and every reconnection of
    its event stream (here each new event ends the stream: CLUSTER_FOLLOWER_MAX_BYTES=1),
    answers a challenge of its own, so none is refused as a replay."""
    async with SchedulerServer(closed(follower_max_bytes=1)) as server:
        fetched: list[str] = []
        seen: list[str] = []
        following = Following([f"127.0.0.1:{server.port}"], None, lambda _: None, secret=SECRET)

        async def fetch() -> status.JobView:
            view = await following.fetch()
            fetched.append(view.phase.value)
            return view

        async def follow() -> AsyncIterator[events.JobEvent]:
            async for event in events.from_scheduler(
                following.address, None, follow=True, secret=following.secret
            ):
                seen.append(event.kind)
                yield event

        out = io.StringIO()
        watcher = Watcher(fetch, follow, out, interval_s=0.01, terminal=False)
        running = asyncio.create_task(watcher.run())
        try:
            await eventually(lambda: "started" in seen, "the watch's event stream")
            for i in range(3):
                server.core.journal.emit(Record(Kind.NODES_BACK, {"seconds": i}))
                await eventually(lambda: seen.count("nodes_back") > i, "a reconnection")
            polls = len(fetched)
            await eventually(lambda: len(fetched) >= polls + 5, "five more polls")
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            await following.close()
        assert "not answering" not in out.getvalue(), out.getvalue()


async def test_readers_prove_secret_0_opens_the_read_side_and_a_job_without_one_is_open() -> None:
    for open_job in (closed(readers_prove_secret=False), settings()):
        async with (
            SchedulerServer(open_job) as server,
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        ):
            for read in reads(pb_grpc.SchedulerStub(channel)).values():
                assert await read(())


def test_readers_prove_the_secret_by_default_and_0_opts_out() -> None:
    assert Limits().readers_prove_secret
    assert limits_from_env({}).readers_prove_secret
    assert limits_from_env({"CLUSTER_READERS_PROVE_SECRET": "1"}).readers_prove_secret
    assert not limits_from_env({"CLUSTER_READERS_PROVE_SECRET": "0"}).readers_prove_secret
    with pytest.raises(ConfigError, match="CLUSTER_READERS_PROVE_SECRET"):
        limits_from_env({"CLUSTER_READERS_PROVE_SECRET": "maybe"})


def secret_in(path: Path, value: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path


def test_the_secret_is_found_first_in_the_options_then_the_environment_then_logs(
    tmp_path: Path,
) -> None:
    given = secret_in(tmp_path / "given.secret", "s3cr3t-given")
    log_dir = tmp_path / "run"
    secret_in(log_dir / "job.secret", "log-dir")
    env_file = secret_in(tmp_path / "env.secret", "env")
    default = tmp_path / "logs"
    secret_in(default / "job.secret", "default")
    env = {"CLUSTER_JOB_SECRET_FILE": str(env_file)}

    def found(*args: Any, **kw: Any) -> bytes | None:
        secret = reading.find_secret(*args, default_log_dir=default, **kw)
        return None if secret is None else secret.value

    assert found(given, log_dir, env) == b"s3cr3t-given"
    assert found(None, log_dir, env) == b"log-dir"
    assert found(None, tmp_path / "no-secret-here", env) == b"env"
    assert found(None, None, {"CLUSTER_JOB_SECRET": "plain"}) == b"plain"
    assert found(None, None, {}) == b"default"
    assert found(None, tmp_path / "no-secret-here", {}) is None  # --log-dir: no other default
    assert reading.find_secret(env={}, default_log_dir=tmp_path / "none") is None
    named = reading.find_secret(given, env={})
    assert named is not None
    assert named.source == f"--secret-file {str(given)!r}"
    assert "s3cr3t" not in repr(named)  # the value never in a repr


def test_a_secret_file_found_that_others_may_read_is_one_clear_error(tmp_path: Path) -> None:
    loose = secret_in(tmp_path / "loose.secret", "s")
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match=r"--secret-file .*chmod 600"):
        reading.find_secret(loose, env={})
    with pytest.raises(ConfigError, match=r"--secret-file .* cannot be read"):
        reading.find_secret(tmp_path / "missing", env={})


def test_resolve_takes_bytes_a_found_secret_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert reading.resolve(None) is None
    made = reading.resolve(b"s")
    assert made is not None
    assert made.value == b"s"
    monkeypatch.setitem(os.environ, "CLUSTER_JOB_SECRET_FILE", str(secret_in(tmp_path / "e", "e")))
    from_env = reading.resolve(reading.FROM_ENV)
    assert from_env is not None
    assert from_env.value == b"e"
    assert "CLUSTER_JOB_SECRET_FILE" in from_env.source
