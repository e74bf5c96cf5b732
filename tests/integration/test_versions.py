"""Processes of different releases of cluster, with real processes, files and etcd: a scheduler
refuses a node and a saved state of another protocol revision at the first contact, in one line
that names both releases and what to do, and nothing of the job, on disk or in etcd changes.

A node of another release is played two ways: a forged registration over gRPC (as a worker makes
it, but naming another revision), and a real worker process whose `cluster.protocol.version`
says another release (set before its script runs, as an installed newer release would)."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest

from cluster.protocol import version
from cluster.protocol.environment import from_env
from cluster.protocol.settings import JobSettings
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler import etcd_store, stores
from cluster.scheduler.machine.state import SchedulerState
from cluster.storage import store
from cluster.storage.state_store import SCHEDULER_KIND
from cluster.testing import free_port, wait_until
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from cluster.worker.convert import register_request
from cluster.worker.identity import NodeIdentity, new_incarnation
from tests.credentials import read_metadata, secret_of
from tests.integration.test_recovery import WORKER, run_scheduler, saved_state
from tests.integration.test_standby import HOSTS, Schedulers
from tests.procs import PYTHON, ROOT, Procs, job_env
from tests.servers.etcd import EtcdCluster

OURS = f"cluster {version.VERSION} (protocol revision {version.PROTOCOL_REVISION})"
NEWER = version.PROTOCOL_REVISION + 1
THEIRS = f"cluster 9.9.9 (protocol revision {NEWER})"
ADVICE = (
    "start every process of the job (schedulers, relays, workers) from the same version of cluster"
)
# A worker of another release: its script run once `cluster.protocol.version` says so.
ANOTHER_RELEASE = (
    "import runpy, sys\n"
    "import cluster.protocol.version as v\n"
    f"v.VERSION, v.PROTOCOL_REVISION = '9.9.9', {NEWER}\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _job(stub: pb_grpc.SchedulerStub) -> tuple[object, ...]:
    """What a refusal must not change: the job's id, phase, generation and nodes."""
    status = stub.Status(pb.StatusRequest(), timeout=5)
    nodes = [(n.node_id, n.incarnation, n.state, n.rank) for n in status.nodes]
    return status.cluster_id, status.phase, status.generation, nodes


def _forged(
    port: int, secret: bytes | None = None, challenge: tuple[bytes, str] = (b"", "")
) -> pb.RegisterRequest:
    """Node 1's registration as this release's worker makes it (with the job `secret`, its
    proof of `challenge`), but naming release 9.9.9."""
    env = job_env(2, port, MS_ROLE="MS_WORKER")
    identity = NodeIdentity("1", new_incarnation(), "127.0.0.1", 1)
    request = register_request(from_env(env), identity, "", secret, challenge=challenge)
    request.protocol_revision, request.cluster_version = NEWER, "9.9.9"
    return request


def test_a_node_of_another_revision_is_refused_and_the_job_goes_on(
    processes: Procs, tmp_path: Path
) -> None:
    port = free_port()
    env = job_env(2, port)
    args = [*WORKER, "--release", str(tmp_path / "release")]
    scheduler = processes.start_role("scheduler", "MS_SCHED", args, env)
    first = processes.start_role("worker0", "MS_WORKER", args, {**env, "MS_NODE_ID": "0"})
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SchedulerStub(channel)
        wait_until(lambda: _status_nodes(stub) == 1, 30, "worker 0 registered")
        before = _job(stub)

        refused = stub.Register(_forged(port), timeout=5).refused
        assert refused.reason == pb.REFUSAL_VERSION_MISMATCH
        assert (
            refused.message == f"node '1' runs {THEIRS}, but this scheduler runs {OURS}: {ADVICE}"
        )
        assert refused.retry_after_s == 0
        # As a worker registers: the first event of its Watch stream.
        (answer,) = list(stub.Watch(pb.WatchRequest(register=_forged(port)), timeout=5))
        assert answer.refused.reason == pb.REFUSAL_VERSION_MISMATCH
        assert _job(stub) == before

        # A worker of another release ends at once: one line, exit 1, no traceback.
        newer = processes.start(
            "worker1-newer",
            [PYTHON, "-c", ANOTHER_RELEASE, *args],
            {**env, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": "1"},
        )
        assert newer.wait(30) == 1, newer.output
        assert "Traceback" not in newer.output
        (line,) = [line for line in newer.output.splitlines() if "RegistrationRefused" in line]
        assert f"the scheduler at 127.0.0.1:{port} refused this node" in line
        assert f"node '1' runs {THEIRS}, but this scheduler runs {OURS}: {ADVICE}" in line
        assert _job(stub) == before

    # This release's worker joins the job, which forms and ends well.
    second = processes.start_role("worker1", "MS_WORKER", args, {**env, "MS_NODE_ID": "1"})
    for worker in (first, second):
        worker.wait_for_output("allgather rank=", 30)
    (tmp_path / "release").touch()
    for worker in (first, second):
        assert worker.wait(30) == 0, worker.output
    assert scheduler.wait(30) == 0, scheduler.output


def _secret_file(tmp_path: Path) -> Path:
    secret = tmp_path / "job.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    return secret


def test_with_a_job_secret_only_a_node_that_proves_it_learns_the_release(
    processes: Procs, tmp_path: Path
) -> None:
    """A registration of another revision from whoever reaches the port (a raw gRPC client: a
    challenge is anyone's to ask) is told its own release and what to do, not this scheduler's,
    which the scheduler's log names; one that proves the job secret is told both."""
    port, secret = free_port(), _secret_file(tmp_path)
    env = job_env(2, port, CLUSTER_JOB_SECRET_FILE=str(secret))
    scheduler = processes.start("scheduler", [PYTHON, "-m", "cluster", "scheduler"], env)
    scheduler.wait_for_output("listening on", 30)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SchedulerStub(channel)

        def challenge() -> tuple[bytes, str]:
            answer = stub.Challenge(pb.ChallengeRequest(), timeout=5)
            return answer.challenge, answer.job_id

        for forged in (_forged(port), _forged(port, b"another secret", challenge())):
            refused = stub.Register(forged, timeout=5).refused
            assert refused.reason == pb.REFUSAL_VERSION_MISMATCH
            assert refused.message.startswith(
                f"node '1' runs {THEIRS}, which this scheduler does not speak; it names its own "
                "release only to a process that proves the job secret"
            )
            assert refused.message.endswith(ADVICE)
            assert f"cluster {version.VERSION}" not in refused.message
        # The scheduler's operator learns both (its first refusal of an address is logged).
        scheduler.wait_for_output(f"but this scheduler runs {OURS}", 30)
        (line,) = [line for line in scheduler.output.splitlines() if "refused node '1'" in line]
        assert f"node '1' runs {THEIRS}, but this scheduler runs {OURS}: {ADVICE}" in line

        proven = _forged(port, secret.read_text().encode(), challenge())
        refused = stub.Register(proven, timeout=5).refused
        assert refused.reason == pb.REFUSAL_VERSION_MISMATCH
        assert (
            refused.message == f"node '1' runs {THEIRS}, but this scheduler runs {OURS}: {ADVICE}"
        )


# `mscluster` of another release: run once `cluster.protocol.version` says so.
ANOTHER_MSCLUSTER = ANOTHER_RELEASE.replace(
    "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')",
    "sys.argv = ['mscluster', *sys.argv[1:]]\nrunpy.run_module('cluster', run_name='__main__')",
)
EXAMPLE = str(ROOT / "examples" / "allgather_check.py")


@pytest.mark.parametrize("with_secret", [False, True], ids=["open", "job-secret"])
def test_a_relay_of_another_revision_is_refused_and_its_workers_say_so(
    processes: Procs, short_dir: Path, tmp_path: Path, with_secret: bool
) -> None:
    """The relay's own calls name its release: the scheduler refuses its link, and each worker
    behind it ends at its first contact with one line naming both releases (with a job secret,
    which a relay does not prove, only the relay's: the scheduler logs both). The job is
    unchanged, and the worker started without the relay joins it."""
    port = free_port()
    secret = {"CLUSTER_JOB_SECRET_FILE": str(_secret_file(tmp_path))} if with_secret else {}
    env = job_env(1, port, **secret)
    scheduler = processes.start_role("scheduler", "MS_SCHED", [EXAMPLE], env)
    sock = short_dir / "relay.sock"
    relay = processes.start(
        "relay", [PYTHON, "-c", ANOTHER_MSCLUSTER, "relay", "--socket", f"unix:{sock}"], env
    )
    relay.wait_for_output("mscluster relay: serving", 30)
    relayed = {**env, "MS_ROLE": "MS_WORKER", "CLUSTER_RELAY": f"unix:{sock}"}
    behind = processes.start("worker-behind", [PYTHON, EXAMPLE], relayed)
    assert behind.wait(30) == 1, behind.output
    assert "Traceback" not in behind.output
    (line,) = [line for line in behind.output.splitlines() if "RegistrationRefused" in line]
    both = f"the relay of host 127.0.0.1 runs {THEIRS}, but this scheduler runs {OURS}"
    if with_secret:
        assert f"the relay of host 127.0.0.1 runs {THEIRS}, which this scheduler does not" in line
        assert f"cluster {version.VERSION}" not in line
    else:
        assert both in line
    assert line.endswith(ADVICE)
    scheduler.wait_for_output(f"refused a HostWatch call from 127.0.0.1: {both}", 30)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        proof = read_metadata(channel, secret_of(env))
        status = pb_grpc.SchedulerStub(channel).Status(
            pb.StatusRequest(), metadata=proof, timeout=5
        )
        assert (status.phase, list(status.nodes)) == (pb.PHASE_WAITING, [])

    direct = processes.start_role("worker", "MS_WORKER", [EXAMPLE], env)
    assert direct.wait(30) == 0, direct.output
    assert "allgather rank=0 size=1" in direct.output
    assert scheduler.wait(30) == 0, scheduler.output


def _status_nodes(stub: pb_grpc.SchedulerStub) -> int:
    try:
        return len(stub.Status(pb.StatusRequest(), timeout=2).nodes)
    except grpc.RpcError:
        return -1


def _stamped(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` as a scheduler of release 9.9.9 (revision NEWER) would have saved it."""
    return {**payload, "protocol_revision": NEWER, "cluster_version": "9.9.9"}


def test_a_state_file_of_another_revision_is_one_line_and_left_alone(tmp_path: Path) -> None:
    saved = json.loads(saved_state(tmp_path))["payload"]
    assert (saved["protocol_revision"], saved["cluster_version"]) == (
        version.PROTOCOL_REVISION,
        version.VERSION,
    )
    state_dir = tmp_path / "recovery"
    state_dir.mkdir()
    path = state_dir / "scheduler.json"
    newer = store.encode(SCHEDULER_KIND, _stamped(saved))
    path.write_bytes(newer)

    result = run_scheduler(tmp_path, state_dir)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert f"the recovery state {path} cannot be resumed: it was saved by {THEIRS}" in line
    assert f"but this scheduler runs {OURS}: start the job's schedulers from cluster 9.9.9" in line
    assert "to start a new job, move the whole MS_RECOVERY_PATH directory away" in line
    assert path.read_bytes() == newer
    assert sorted(p.name for p in state_dir.iterdir()) == ["scheduler.json", "scheduler.lock"]


async def _etcd_contents(etcd: EtcdCluster) -> dict[bytes, bytes]:
    url = parse_state_url(etcd.state_url())
    host, port = url.endpoints[0]
    async with aetcd.Client(host=host, port=port, timeout=10) as client:
        got = await client.get_prefix(url.prefix.encode())
        return {kv.key: kv.value for kv in got}


async def _save_newer_state(etcd: EtcdCluster, phase: str) -> None:
    """A job saved in etcd by a scheduler of release 9.9.9, which then stopped."""
    settings = JobSettings(2, 0, 30.0, 60.0, 1.0, recovery=True)
    snapshot = _stamped(SchedulerState("job-newer", settings, time.monotonic).snapshot())
    snapshot["phase"] = phase
    saver = await stores.open_etcd(parse_state_url(etcd.state_url()), "127.0.0.1:1", lease_s=2)
    try:
        assert await saver.acquire() is None
        written = await saver.save(snapshot, "")
        assert written.ok
    finally:
        await saver.close()


@pytest.mark.parametrize("phase", ["waiting", "finished"])
def test_a_state_in_etcd_of_another_revision_is_one_line_and_left_alone(
    etcd_cluster: EtcdCluster, phase: str
) -> None:
    """Whatever the job's phase: a job that ended is not taken as ended by another revision
    either (what its keys say may mean something else)."""
    asyncio.run(_save_newer_state(etcd_cluster, phase))
    before = asyncio.run(_etcd_contents(etcd_cluster))
    assert any(key.endswith(b"/state") for key in before)

    args = ["--host", "127.0.0.1", "--port", str(free_port()), "--worker-num", "2"]
    args += ["--state-url", etcd_cluster.state_url(), "--lease", "2"]
    result = subprocess.run(
        [PYTHON, "-m", "cluster", "scheduler", *args],
        env=job_env(2, 1),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    # Its start is said as ever (listening, the etcd it uses); then the one line of the refusal.
    (line,) = [line for line in result.stderr.splitlines() if "Error" in line]
    assert result.stderr.splitlines()[-1] == line
    assert line.startswith("mscluster: ConfigError: ")
    assert f"CLUSTER_STATE_URL={etcd_cluster.state_url().rstrip('/')!r} cannot be used" in line
    assert f"it was saved by {THEIRS}, but this scheduler runs {OURS}" in line
    assert "start the job's schedulers from cluster 9.9.9 to resume the job" in line
    assert "to start a new job, give it a prefix of its own in CLUSTER_STATE_URL" in line
    assert asyncio.run(_etcd_contents(etcd_cluster)) == before


async def _change_saved_state(etcd: EtcdCluster, change: Callable[[bytes], bytes]) -> bytes:
    """The job's state in etcd, as its key holds it, replaced by what `change` makes of it;
    what it held before."""
    url = parse_state_url(etcd.state_url())
    host, port = url.endpoints[0]
    key = f"{url.prefix}state".encode()
    async with aetcd.Client(host=host, port=port, timeout=10) as client:
        got = await client.get(key)
        assert got is not None
        await client.put(key, change(got.value))
        return bytes(got.value)


def _as_newer(value: bytes) -> bytes:
    """A state saved by this release's leader (inline in its key) as release 9.9.9 saves it."""
    assert value[:1] == etcd_store.INLINE
    saved = store.decode(value[1:], SCHEDULER_KIND, "the state key", "")
    assert saved["protocol_revision"] == version.PROTOCOL_REVISION
    return etcd_store.INLINE + store.encode(SCHEDULER_KIND, _stamped(saved))


def test_a_standby_that_finds_another_revisions_state_at_takeover_gives_the_lead_back(
    processes: Procs, etcd_cluster: EtcdCluster
) -> None:
    """A leader of another release saved the job after this standby started: the standby that
    wins the election says so once, in the start-time refusal's words, gives the leader key
    back at once and exits 2, rather than stepping down and winning again at every term."""
    schedulers = Schedulers(processes, etcd_cluster)
    leader = schedulers.leader()
    standby = schedulers.procs[next(host for host in HOSTS if host != leader)]
    asyncio.run(_change_saved_state(etcd_cluster, _as_newer))
    schedulers.procs[leader].popen.send_signal(signal.SIGKILL)  # its key ends with its lease
    assert schedulers.procs[leader].wait(10) == -signal.SIGKILL

    assert standby.wait(60) == 2, standby.output
    said = standby.output
    assert "Traceback" not in said
    assert "stepping down" not in said
    (line,) = [line for line in said.splitlines() if "it was saved by" in line]
    assert said.strip().splitlines()[-1] == line
    assert line.startswith("mscluster: ConfigError: ")
    assert f"CLUSTER_STATE_URL={schedulers.url.rstrip('/')!r} cannot be used" in line
    assert f"it was saved by {THEIRS}, but this scheduler runs {OURS}" in line
    assert "start the job's schedulers from cluster 9.9.9 to resume the job" in line
    assert "to start a new job, give it a prefix of its own in CLUSTER_STATE_URL" in line
    prefix = parse_state_url(etcd_cluster.state_url()).prefix
    assert etcd_cluster.etcdctl("get", f"{prefix}leader") == ""


def _torn_at_takeover(processes: Procs, etcd: EtcdCluster) -> tuple[Schedulers, str, bytes]:
    """Two schedulers; the job's state torn, then the leader killed: the standby's host, once
    it has stepped down at its takeover, and the state as it was whole."""
    schedulers = Schedulers(processes, etcd)
    leader = schedulers.leader()
    host = next(host for host in HOSTS if host != leader)
    whole = asyncio.run(_change_saved_state(etcd, lambda value: value[: len(value) // 2]))
    schedulers.procs[leader].popen.send_signal(signal.SIGKILL)
    assert schedulers.procs[leader].wait(10) == -signal.SIGKILL
    schedulers.procs[host].wait_for_output("stepping down: it could not take the job over", 30)
    return schedulers, host, whole


def test_a_standby_that_cannot_read_the_state_at_takeover_campaigns_again(
    processes: Procs, etcd_cluster: EtcdCluster
) -> None:
    """A state that cannot be read (here torn) may read well later: the standby that wins the
    election steps down and campaigns again, and leads the job once the state is whole."""
    schedulers, host, whole = _torn_at_takeover(processes, etcd_cluster)
    standby = schedulers.procs[host]
    assert "truncated or corrupt" in standby.output
    assert standby.running
    asyncio.run(_change_saved_state(etcd_cluster, lambda _: whole))
    wait_until(lambda: schedulers.role(host) == "leader", 30, "the standby leading the job")
    assert "Traceback" not in standby.output


async def _terms_begun_within(etcd: EtcdCluster, seconds: float) -> int:
    """How many terms begin (a campaign puts the job's leader key) within the next `seconds`."""
    url = parse_state_url(etcd.state_url())
    host, port = url.endpoints[0]
    puts = 0
    async with aetcd.Client(host=host, port=port, timeout=10) as client:
        watch = await client.watch(f"{url.prefix}leader".encode())

        async def count() -> None:
            nonlocal puts
            async for event in watch:
                puts += event.kind == aetcd.EventKind.PUT

        try:
            await asyncio.wait_for(count(), seconds)
        except asyncio.TimeoutError:  # the window is over
            pass
        finally:
            await watch.cancel()
    return puts


def test_a_standby_that_keeps_finding_the_state_unreadable_says_so_once_and_does_not_spin(
    processes: Procs, etcd_cluster: EtcdCluster
) -> None:
    """A torn state that nobody mends: the standby that wins steps down and campaigns again,
    after a pause that grows, and says why once, not a step-down, a warning and "etcd answers
    again" at every term (225 terms a minute here without the pause); once the state is mended
    it leads the job, and says so."""
    schedulers, host, whole = _torn_at_takeover(processes, etcd_cluster)
    standby = schedulers.procs[host]

    terms = asyncio.run(_terms_begun_within(etcd_cluster, 10.0))
    assert 1 <= terms <= 5, f"{terms} terms in 10 s"
    said = standby.output
    assert said.count("leading the job") == 1, said
    assert said.count("stepping down") == 1, said
    assert "truncated or corrupt" in said
    assert "it campaigns again after a pause that grows to 16 s" in said
    assert "etcd answers again" not in said
    assert "cannot use the job's state" not in said
    assert standby.running

    asyncio.run(_change_saved_state(etcd_cluster, lambda _: whole))
    wait_until(lambda: schedulers.role(host) == "leader", 30, "the standby leading the job")
    standby.wait_for_output("the job's state in etcd://", 10)
    assert "can be used again" in standby.output
    assert "Traceback" not in standby.output
