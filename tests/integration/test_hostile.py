"""Hostile calls against a real job, made the way an attacker on the same network would.

The attacker is a plain gRPC client (the `cluster.v1` stubs, no help from the cluster library)
that first reads `Status`, which hands out every node's id, incarnation and address, and then
forges each call of issue 12's list. Each one must be refused and change nothing: no command
runs in a worker, no node is finished, failed or re-addressed, and the job ends with exit 0
everywhere at generation 1. The same with mutual TLS, where the attacker holds a valid client
certificate of the job's CA (which is not a node credential). Then members that flood the
scheduler: the caps refuse them with a clear error, its memory (VmHWM in /proc) stays bounded,
and the job goes on.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol import version
from cluster.scheduler.exchange import ROUNDS_PER_RANK
from cluster.scheduler.persist import STATE_KIND
from cluster.storage import store
from cluster.testing import Process, free_port, wait_until
from cluster.transport import certs
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.credentials import read_metadata, secret_of
from tests.integration.test_tls import pem_bytes
from tests.procs import PYTHON, ROOT, Procs, job_env, run_args

SCRIPTS = ROOT / "tests" / "integration" / "scripts"
TARGET = SCRIPTS / "hostile_target.py"
MEMBER = SCRIPTS / "hostile_member.py"
START_S = 60.0
CALL_S = 10.0
MIB = 1024 * 1024
RSS_LIMIT_KB = 600 * 1024


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


class Bomb:
    """Unpickled, it would run a command: the payload of the forged Exchange."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@dataclass
class Attacker:
    """A plain gRPC client of the scheduler, over plaintext or with a valid client certificate."""

    channel: grpc.Channel
    # The job secret, for reading Status as the operator does (an outsider cannot: with a
    # secret, Status needs its proof; the tests here grant the attacker what Status shows).
    secret: bytes | None = None

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        return pb_grpc.SchedulerStub(self.channel)

    def status(self) -> pb.StatusResponse:
        metadata = read_metadata(self.channel, self.secret)
        return self.stub.Status(pb.StatusRequest(), timeout=CALL_S, metadata=metadata)

    def refused(self, call: Any, request: Any, metadata: Any = None) -> grpc.StatusCode:
        """The code a call with one answer is refused with (it must be refused): `request`
        one message, or an iterator of them for a client-streaming method."""
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=CALL_S, metadata=metadata)
        return info.value.code()  # type: ignore[attr-defined,no-any-return]

    def first_event(
        self, request: pb.WatchRequest, metadata: Any = None, *, wait_for_ready: bool = False
    ) -> Any:
        """The first event of a Watch, or the error that ended it; the stream is then cut."""
        call = self.stub.Watch(
            request,
            timeout=1.0 if wait_for_ready else CALL_S,
            metadata=metadata,
            wait_for_ready=wait_for_ready,
        )
        try:
            return next(iter(call))
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined]
        finally:
            call.cancel()

    def heartbeats(self, node_id: str, incarnation: int, count: int, metadata: Any) -> Any:
        beats = iter([pb.HeartbeatRequest(node_id=node_id, incarnation=incarnation)] * count)
        try:
            self.stub.Heartbeat(beats, timeout=CALL_S, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined]
        return grpc.StatusCode.OK


@contextlib.contextmanager
def attacker(
    port: int, pki: certs.Pki | None, tmp: Path, secret: bytes | None = None
) -> Iterator[Attacker]:
    target = f"127.0.0.1:{port}"
    # Try again quickly while the scheduler is not listening yet (the squatters start first).
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 100)]
    if pki is None:
        channel = grpc.insecure_channel(target, options)
    else:
        # In memory: two squatter threads build their channels at once.
        pem = pem_bytes(pki.client_p12, pki.client_password)
        key, cert = pem.split(b"-----BEGIN CERTIFICATE-----", 1)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki.ca_pem.read_bytes(),
            private_key=key,
            certificate_chain=b"-----BEGIN CERTIFICATE-----" + cert,
        )
        channel = grpc.secure_channel(target, credentials, options)
    with channel:
        yield Attacker(channel, secret)


def forged_metadata(node_id: str, incarnation: int) -> list[tuple[tuple[str, str], ...] | None]:
    """What a forger can send: nothing, or the node's id and incarnation with a guess."""
    return [
        None,
        (
            ("cluster-node-id", node_id),
            ("cluster-incarnation", str(incarnation)),
            ("cluster-credential", secrets.token_hex(32)),
        ),
    ]


def env_for(port: int, tmp: Path, pki: certs.Pki | None, **extra: str) -> dict[str, str]:
    tls = {} if pki is None else {"CLUSTER_TLS_CONFIG": str(pki.ssl_json)}
    return job_env(2, port, MS_TOPO_TIMEOUT="60", **tls, **extra)


def start_scheduler(processes: Procs, env: dict[str, str]) -> Process:
    sched = processes.start("scheduler", [PYTHON, "-m", "cluster", "scheduler"], env)
    sched.wait_for_output("listening on", START_S)
    return sched


def start_worker(processes: Procs, i: int, env: dict[str, str], script: list[str]) -> Process:
    return processes.start(
        f"worker{i}", [PYTHON, *script], {**env, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(i)}
    )


def nodes(status: pb.StatusResponse) -> dict[str, tuple[Any, ...]]:
    """What a forgery must not change, per node."""
    return {
        n.node_id: (
            n.rank,
            n.host,
            n.port,
            n.state,
            n.incarnation,
            n.connected,
            tuple(n.checkpoints),
        )
        for n in status.nodes
    }


def finished_at_generation_1(sched: Process, workers: list[Process]) -> None:
    for worker in workers:
        assert worker.wait(START_S) == 0, worker.output
    assert sched.wait(START_S) == 0, sched.output
    for rank, worker in enumerate(sorted(workers, key=lambda w: w.name)):
        assert f"done rank={rank} generation=1" in worker.output, worker.output
        assert "Traceback" not in worker.output
    assert "job finished: all 2 nodes finished" in sched.output
    assert "failed" not in sched.output


# -- forged calls -------------------------------------------------------------------------------


def forge_the_forming_job(spy: Attacker) -> None:
    """Register(node 0, its own incarnation, host 6.6.6.6) while the job forms: it would have
    moved rank 0 in every peer table."""
    (zero,) = spy.status().nodes
    before = nodes(spy.status())
    moved = pb.RegisterRequest(
        node_id="0",
        role=pb.ROLE_WORKER,
        host="6.6.6.6",
        port=zero.port,
        incarnation=zero.incarnation,
        worker_num=2,
        credential=secrets.token_bytes(32),
        protocol_revision=version.PROTOCOL_REVISION,
    )
    answer = spy.stub.Register(moved, timeout=CALL_S)
    assert answer.refused.reason == pb.REFUSAL_UNAUTHENTICATED, answer
    assert "another credential or address" in answer.refused.message
    event = spy.first_event(pb.WatchRequest(register=moved))
    assert event.refused.reason == pb.REFUSAL_UNAUTHENTICATED, event
    without = pb.RegisterRequest()
    without.CopyFrom(moved)
    without.ClearField("credential")
    assert spy.stub.Register(without, timeout=CALL_S).refused.reason == pb.REFUSAL_INVALID_NODE
    assert nodes(spy.status()) == before


def forge_the_formed_job(spy: Attacker, marker: Path) -> None:
    status = spy.status()
    assert (status.phase, status.generation) == (pb.PHASE_READY, 1)
    before = nodes(status)
    incarnations = {n.node_id: n.incarnation for n in status.nodes}
    bomb = pickle.dumps(Bomb(marker))
    for node_id, incarnation in incarnations.items():
        for metadata in forged_metadata(node_id, incarnation):
            # Rank 0 waits in allgather_object: as rank 1, deliver it a pickle that runs a command.
            exchange = pb.ExchangeRequest(
                node_id=node_id, generation=1, seq=1, op=pb.EXCHANGE_ALLGATHER, value=bomb
            )
            assert spy.refused(spy.stub.Exchange, iter([exchange]), metadata) in (
                grpc.StatusCode.UNAUTHENTICATED,
            )
            finish = pb.FinishRequest(node_id=node_id, incarnation=incarnation)
            assert spy.refused(spy.stub.Finish, finish, metadata) == grpc.StatusCode.UNAUTHENTICATED
            report = pb.ReportCheckpointsRequest(
                node_id=node_id, incarnation=incarnation, steps=[999, 1000]
            )
            code = spy.refused(spy.stub.ReportCheckpoints, report, metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            hello = pb.WatchRequest(hello=pb.Hello(node_id=node_id, incarnation=incarnation))
            assert spy.first_event(hello, metadata) == grpc.StatusCode.UNAUTHENTICATED
            beats = spy.heartbeats(node_id, incarnation, 3, metadata)
            assert beats == grpc.StatusCode.UNAUTHENTICATED
            kv = pb.KvSetRequest(key="seed", value=b"forged")
            assert spy.refused(spy.stub.KvSet, iter([kv]), metadata) in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.NOT_FOUND,  # no node id at all: not a member
            )
        # The incarnation before a restart, as an old Status showed it.
        stale = pb.FinishRequest(node_id=node_id, incarnation=incarnation + 1)
        assert spy.refused(spy.stub.Finish, stale) == grpc.StatusCode.NOT_FOUND
    assert nodes(spy.status()) == before
    assert spy.status().generation == 1


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
def test_every_forged_call_is_refused_and_changes_nothing(
    processes: Procs, tmp_path: Path, pki: certs.Pki, tls: bool
) -> None:
    """No job secret: only the node credential protects the members (the hardest case)."""
    port = free_port()
    env = env_for(
        port,
        tmp_path,
        pki if tls else None,
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "state"),
    )
    go, marker = tmp_path / "go", tmp_path / "pwned"
    sched = start_scheduler(processes, env)
    with attacker(port, pki if tls else None, tmp_path) as spy:
        first = start_worker(processes, 0, env, [str(TARGET), str(go)])
        wait_until(lambda: len(spy.status().nodes) == 1, START_S, "worker 0 registered")
        forge_the_forming_job(spy)
        second = start_worker(processes, 1, env, [str(TARGET), str(go)])
        first.wait_for_output("gathering", START_S)
        second.wait_for_output("joined rank=1", START_S)
        forge_the_formed_job(spy, marker)
        go.touch()
        finished_at_generation_1(sched, [first, second])
    assert "gathered rank=0 result=[0, 1]" in first.output
    for worker in (first, second):
        # Every peer table names rank 0 where it is, not at the forger's address.
        assert "('0', '127.0.0.1'," in worker.output, worker.output
        assert "6.6.6.6" not in worker.output
    assert not marker.exists(), "a forged pickle ran its command in a worker"
    saved = store.load(tmp_path / "state" / "scheduler.json", STATE_KIND)
    assert saved is not None
    # The invented steps were never taken, and no credential is saved, only hashes.
    assert [m["checkpoints"] for m in saved["members"]] == [[], []]
    assert all(len(m["credential_sha256"]) == 64 for m in saved["members"])


def test_forged_heartbeats_do_not_keep_a_stopped_node_alive(
    processes: Procs, tmp_path: Path
) -> None:
    port = free_port()
    env = env_for(port, tmp_path, None, MS_NODE_TIMEOUT="3")
    go = tmp_path / "go"
    sched = start_scheduler(processes, env)
    workers = [start_worker(processes, i, env, [str(TARGET), str(go)]) for i in range(2)]
    workers[1].wait_for_output("joined rank=1", START_S)
    with attacker(port, None, tmp_path) as spy:
        incarnation = {n.node_id: n.incarnation for n in spy.status().nodes}["1"]
        os.kill(workers[1].pid, signal.SIGSTOP)
        try:
            # Beat for it, as its peer waits, until the scheduler gives it up all the same.
            refusals = 0
            deadline = time.monotonic() + START_S
            while sched.popen.poll() is None and time.monotonic() < deadline:
                for metadata in forged_metadata("1", incarnation):
                    code = spy.heartbeats("1", incarnation, 1, metadata)
                    refusals += code == grpc.StatusCode.UNAUTHENTICATED
        finally:
            os.kill(workers[1].pid, signal.SIGCONT)
    assert refusals > 0
    assert sched.wait(START_S) == 1, sched.output
    found = re.search(r"node '1' \(rank 1\) failed: no heartbeat for ([0-9.]+) s", sched.output)
    assert found, sched.output
    # Failed after MS_NODE_TIMEOUT of its own silence: the forged beats counted for nothing
    # (on main they kept it "alive" for 4x MS_NODE_TIMEOUT).
    assert float(found.group(1)) < 2 * 3
    assert workers[0].wait(START_S) != 0


# -- who may join -------------------------------------------------------------------------------


def squat(
    port: int, pki: certs.Pki | None, tmp: Path, stop: threading.Event, got: list[str]
) -> None:
    """Outsiders' registrations with random ids, again and again until `stop`; what they got is
    appended to `got` as it comes."""
    with attacker(port, pki, tmp) as spy:
        while not stop.is_set():
            request = pb.WatchRequest(
                register=pb.RegisterRequest(
                    node_id=f"squatter-{secrets.token_hex(4)}",
                    role=pb.ROLE_WORKER,
                    host="10.6.6.6",
                    port=4444,
                    incarnation=secrets.randbits(62),
                    worker_num=2,
                    credential=secrets.token_bytes(32),
                    protocol_revision=version.PROTOCOL_REVISION,
                )
            )
            try:
                event = spy.first_event(request, wait_for_ready=True)
            except grpc.RpcError:
                continue
            if isinstance(event, grpc.StatusCode):
                got.append(event.name)  # not listening yet, or TLS not up yet
            else:
                got.append(event.WhichOneof("kind"))
                if event.HasField("refused"):
                    got.append(pb.RefusalReason.Name(event.refused.reason))


def test_outsiders_cannot_take_the_slots_of_a_job_with_a_secret(
    processes: Procs, tmp_path: Path
) -> None:
    port = free_port()
    secret = tmp_path / "job.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    env = env_for(port, tmp_path, None, CLUSTER_JOB_SECRET_FILE=str(secret))
    go = tmp_path / "go"
    go.touch()
    sched = start_scheduler(processes, env)
    assert "nodes join with proof of the job secret" in sched.output
    with attacker(port, None, tmp_path, secret_of(env)) as spy:
        for _ in range(2):
            event = spy.first_event(
                pb.WatchRequest(
                    register=pb.RegisterRequest(
                        node_id=secrets.token_hex(4),
                        role=pb.ROLE_WORKER,
                        host="10.6.6.6",
                        port=4444,
                        incarnation=7,
                        worker_num=2,
                        credential=secrets.token_bytes(32),
                        protocol_revision=version.PROTOCOL_REVISION,
                    )
                )
            )
            assert event.refused.reason == pb.REFUSAL_NOT_A_MEMBER, event
            assert "CLUSTER_JOB_SECRET_FILE" in event.refused.message
        assert spy.status().nodes == []
    workers = [start_worker(processes, i, env, [str(TARGET), str(go)]) for i in range(2)]
    finished_at_generation_1(sched, workers)


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
def test_slot_squatting_against_mscluster_run_fails(
    processes: Procs, tmp_path: Path, pki: certs.Pki, tls: bool
) -> None:
    """Outsiders register with random ids from before the launch until the job has formed; the
    launcher's own job secret keeps them out, and the job forms with its own workers (which end
    only when both squatters have been refused: `go` is touched then)."""
    port = free_port()
    go = tmp_path / "go"
    stop = threading.Event()
    got: list[list[str]] = [[], []]
    squatters = [
        threading.Thread(target=squat, args=(port, pki if tls else None, tmp_path, stop, got[i]))
        for i in range(2)
    ]
    for thread in squatters:
        thread.start()
    tls_args = ["--tls-config", str(pki.ssl_json)] if tls else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    try:
        args = run_args(
            *("--cluster-time-out", "60", *tls_args, TARGET, go),
            worker_num=2,
            master_port=port,
            log_dir=tmp_path / "logs",
        )
        run = processes.start("run", args, env)
        refused = "REFUSAL_NOT_A_MEMBER"
        wait_until(lambda: all(refused in g for g in got), START_S, "both squatters refused")
        go.touch()
        assert run.wait(START_S * 2) == 0, run.output
    finally:
        stop.set()
        for thread in squatters:
            thread.join(CALL_S * 2)
    attempts = got[0] + got[1]
    assert "accepted" not in attempts, attempts
    assert attempts.count("REFUSAL_NOT_A_MEMBER") >= 2, attempts
    logs = tmp_path / "logs"
    for rank in range(2):
        text = (logs / f"worker_{rank}.log").read_text()
        assert f"done rank={rank} generation=1" in text, text
        assert "squatter" not in text


# -- caps ---------------------------------------------------------------------------------------


def peak_rss_kb(pid: int) -> int:
    """The process's peak resident set (VmHWM), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def flood(
    processes: Procs, tmp_path: Path, args: list[str], **extra: str
) -> tuple[Process, list[Process]]:
    """A job of hostile_member.py: returns once every worker flooded (and waits for GO)."""
    port = free_port()
    env = env_for(port, tmp_path, None, **extra)
    go = tmp_path / "go"
    sched = start_scheduler(processes, env)
    workers = [start_worker(processes, i, env, [str(MEMBER), str(go), *args]) for i in range(2)]
    for i, worker in enumerate(workers):
        worker.wait_for_output(f"flooded rank={i}", START_S * 2)
    return sched, workers


def goes_on(sched: Process, workers: list[Process], go: Path) -> None:
    go.touch()
    for rank, worker in enumerate(workers):
        assert worker.wait(START_S) == 0, worker.output
        assert f"done rank={rank} result=[0, 1] generation=1" in worker.output
    assert sched.wait(START_S) == 0, sched.output


def test_a_key_value_flood_from_a_member_is_refused_past_the_cap(
    processes: Procs, tmp_path: Path
) -> None:
    """600 KvSet of 4 MiB (2.4 GiB) from a real worker's cluster.kv_store(): the store keeps
    that member's share (CLUSTER_KV_MAX_BYTES, 256 MiB by default, over the job's 2 nodes) and
    refuses the rest; the other worker still sets its keys (the job goes on)."""
    sched, workers = flood(processes, tmp_path, ["--kv", "600"])
    peak_kb = peak_rss_kb(sched.pid)
    found = re.search(r"kv accepted=(\d+) refused=(\d+)", workers[0].output)
    assert found, workers[0].output
    accepted, refused = int(found.group(1)), int(found.group(2))
    assert accepted + refused == 600
    assert 30 <= accepted <= 32  # 128 MiB of 4 MiB values and their keys
    assert "kv refusal: " in workers[0].output
    for words in ("node '0'", "past its share", "134217728 bytes", "CLUSTER_KV_MAX_BYTES"):
        assert words in workers[0].output
    assert peak_kb < RSS_LIMIT_KB, f"the scheduler peaked at {peak_kb // 1024} MiB"
    goes_on(sched, workers, tmp_path / "go")


def test_collective_floods_from_a_member_are_refused_past_the_caps(
    processes: Procs, tmp_path: Path
) -> None:
    """Every rank gathers 30 MiB (60 MiB in all, past a 48 MiB CLUSTER_COLLECTIVE_MAX_BYTES):
    the round fails for both with the cap's message. Then a member opens 12 rounds at once
    (rounds no other rank will join): the scheduler keeps 2 of them, its share, and refuses the
    rest."""
    sched, workers = flood(
        processes,
        tmp_path,
        ["--gather-mib", "30", "--rounds", "12", "--round-mib", "8"],
        CLUSTER_COLLECTIVE_MAX_BYTES=str(48 * MIB),
    )
    peak_kb = peak_rss_kb(sched.pid)
    for worker in workers:
        assert "big gather refused: " in worker.output, worker.output
        assert f"CLUSTER_COLLECTIVE_MAX_BYTES={48 * MIB}" in worker.output
    found = re.search(r"rounds refused=(\d+) codes=(.*)", workers[0].output)
    assert found, workers[0].output
    assert int(found.group(1)) == 12 - ROUNDS_PER_RANK, workers[0].output
    assert f"per rank ({ROUNDS_PER_RANK})" in workers[0].output
    assert peak_kb < RSS_LIMIT_KB, f"the scheduler peaked at {peak_kb // 1024} MiB"
    goes_on(sched, workers, tmp_path / "go")


def test_no_pickle_loads_of_wire_data_outside_the_object_collectives() -> None:
    """Only allgather_object and broadcast_object unpickle, and only members' values."""
    found = subprocess.run(
        ["grep", "-rn", "-e", "pickle.loads", "-e", "allow_pickle=True", str(ROOT / "cluster")],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()
    assert len(found) == 2, found
    assert all("api/collective.py" in line for line in found), found
