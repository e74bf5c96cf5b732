"""State from a live peer (issue #15, item 2), with real processes: a promoted spare whose
checkpoint directory is its own (as on another host) gets the rollback step from a live peer and
the job ends with the fault-free parameters; a transfer cut by a SIGKILL of the serving peer
starts again from another; per-rank states (`replicated=False`) whose holder is gone give a clear
error; and the state server of a worker leaves nothing behind when the process ends."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol import auth, peer_state
from cluster.storage import checkpoint_files
from cluster.testing import Process, free_port, wait_until
from cluster.transport import certs
from cluster.v1 import peer_state_pb2 as pb
from cluster.v1 import peer_state_pb2_grpc as pb_grpc
from cluster.worker import state_fetch
from cluster.worker.session import BackgroundLoop
from tests.integration.test_hostile import peak_rss_kb
from tests.procs import PYTHON, ROOT, Procs, job_env
from tests.training_job import WORKERS, TrainingJob, steps_done, train_args

TRAIN = ROOT / "examples" / "train_mlp.py"
SCRIPTS = ROOT / "tests" / "integration" / "scripts"


def finish(job: TrainingJob, procs: list[Process]) -> str:
    for proc in procs:
        assert proc.wait(job.exit_s) == 0, proc.output
    assert job.scheduler.wait(30) == 0, job.scheduler.output
    return (job.out / "final.sha256").read_text().strip()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("fault-free")
    procs = Procs(tmp)
    try:
        job = TrainingJob(procs, tmp, "clean", TRAIN)
        return finish(job, job.workers)
    finally:
        procs.kill_all()


def test_a_promoted_spare_without_the_files_gets_the_state_from_a_live_peer(
    processes: Procs, tmp_path: Path, fault_free: str
) -> None:
    job = TrainingJob(processes, tmp_path, "faulty", TRAIN)
    elsewhere = tmp_path / "spare-host" / "checkpoints"  # the spare sees none of the others' files
    spare = processes.start_role(
        "spare",
        "MS_WORKER",
        [*job.args, "--checkpoint-dir", str(elsewhere)],
        {**job.env, "MS_NODE_ID": "spare-0", "CLUSTER_SPARE": "1"},
    )
    victim = job.workers[1]
    wait_until(lambda: steps_done(victim) >= 25, job.wait_s, "step 25 on rank 1")
    victim.popen.send_signal(signal.SIGKILL)
    survivors = [w for i, w in enumerate(job.workers) if i != 1]
    assert finish(job, [*survivors, spare]) == fault_free
    out = spare.output
    assert "promoted: this spare takes rank 1" in out, out
    assert "fetched the checkpoint of step" in out, out
    # Rank 1's checkpoints are in the spare's directory, with nothing half-written beside them.
    stored = elsewhere / "rank_1"
    assert list(stored.glob("mlp-*.ckpt"))
    assert not [p for p in stored.iterdir() if p.name.endswith(".tmp")]
    assert not (elsewhere / "rank_0").exists()
    for survivor in survivors:
        assert "serving this worker's checkpoints to peers at 127.0.0.1:" in survivor.output


def test_a_damaged_checkpoint_is_moved_aside_and_its_step_fetched_from_a_live_peer(
    processes: Procs, tmp_path: Path, fault_free: str
) -> None:
    """Rank 1 is SIGKILLed and a bit of the data of every checkpoint it holds is flipped: they
    still look complete, so the restarted worker reports them as held and is told to roll back
    to one. Its load moves that file aside (kept), reports again and fetches the step from a live
    peer, and the job ends with the fault-free parameters. (No copy in memory: the rollback is
    from disk.)"""
    env = job_env(
        WORKERS,
        free_port(),
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        MS_NODE_TIMEOUT="2",
    )
    out = tmp_path / "damaged"
    args = [str(TRAIN), *train_args(out), "--memory-snapshot", "0"]
    scheduler = processes.start("sched", [PYTHON, "-m", "cluster", "scheduler"], env)

    def worker(i: int, name: str) -> Process:
        return processes.start_role(name, "MS_WORKER", args, {**env, "MS_NODE_ID": str(i)})

    workers = [worker(i, f"w{i}") for i in range(WORKERS)]
    wait_until(lambda: steps_done(workers[1]) >= 25, 60, "step 25 on rank 1")
    workers[1].signal(signal.SIGKILL)
    workers[1].wait(10)
    rank_dir = out / "checkpoints" / "rank_1"
    held = sorted(rank_dir.glob("mlp-*.ckpt"))
    assert held
    for path in held:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    workers[1] = worker(1, "w1-restarted")
    for proc in workers:
        assert proc.wait(120) == 0, proc.output
    assert scheduler.wait(30) == 0, scheduler.output
    assert (out / "final.sha256").read_text().strip() == fault_free
    said = workers[1].output
    moved = (
        r"the checkpoint \S+/rank_1/mlp-(\d+)\.ckpt is torn or corrupt \(its XXH3-128 checksum "
        r"does not match its content\).*; it is moved aside to mlp-\1\.ckpt\.damaged, kept for "
        r"a look; fetching step (\d+) from a live peer"
    )
    found = re.search(moved, said)
    assert found is not None, said
    assert f"fetched the checkpoint of step {found.group(2)} " in said, said
    assert (rank_dir / f"mlp-{found.group(1)}.ckpt.damaged").exists()


def start_server(processes: Procs, name: str, root: Path, rank: int) -> tuple[Process, Path]:
    proc = processes.start(
        name,
        [PYTHON, str(SCRIPTS / "state_server.py"), str(root), "net", str(rank), "4"],
        job_env(4, 0),
    )
    proc.wait_for_output("published ", 30)
    return proc, root


def holder_of(proc: Process, rank: int) -> state_fetch.Holder:
    line = next(x for x in proc.output.splitlines() if x.startswith("published "))
    published = peer_state.Published.decode(line.split(" ", 1)[1].encode(), proc.name)
    return state_fetch.Holder(rank, proc.name, published)


def test_a_transfer_cut_by_a_sigkill_of_the_serving_peer_starts_again_from_another(
    processes: Procs, tmp_path: Path
) -> None:
    state = {"w": np.arange(24_000_000, dtype=np.float64)}  # 192 MB: a transfer takes a while
    config = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=2)
    for rank in (2, 3):
        with CheckpointManager(tmp_path / f"host{rank}", "net", config, rank=rank) as manager:
            manager.save(7, state)
    first, _ = start_server(processes, "peer-2", tmp_path / "host2", 2)
    second, _ = start_server(processes, "peer-3", tmp_path / "host3", 3)
    dest_dir = tmp_path / "newcomer" / "rank_1"
    dest_dir.mkdir(parents=True)
    dest = dest_dir / checkpoint_files.file_name("net", 7)
    loop = BackgroundLoop("test-fetch")
    result: list[state_fetch.Fetched | BaseException] = []

    def run() -> None:
        try:
            holders = [holder_of(first, 2), holder_of(second, 3)]
            wanted = peer_state.Request("net", 1, 7, True)
            result.append(state_fetch.fetch(loop, holders, wanted, dest))
        except BaseException as exc:
            result.append(exc)

    fetching = threading.Thread(target=run)
    fetching.start()
    try:

        def under_way() -> bool:
            return any(p.stat().st_size > 0 for p in dest_dir.glob("*.tmp"))

        wait_until(under_way, 30, "the first transfer under way")
        first.signal(signal.SIGSTOP)  # frozen mid-transfer, then killed
        assert not dest.exists()
        first.signal(signal.SIGKILL)
        fetching.join(60)
        assert not fetching.is_alive()
    finally:
        loop.stop()
    fetched = result[0]
    assert isinstance(fetched, state_fetch.Fetched), fetched
    assert fetched.holder.rank == 3
    assert "rank 2" in fetched.failures[0]
    assert dest.read_bytes() == (tmp_path / "host3" / "rank_3" / dest.name).read_bytes()
    assert [p.name for p in dest_dir.iterdir()] == [dest.name]  # the torn temporary is gone
    second.signal(signal.SIGTERM)
    assert second.wait(10) == 0, second.output


def sharded_job(
    processes: Procs, tmp_path: Path, roots: list[Path], tls: certs.Pki | None = None
) -> tuple[list[Process], Process]:
    """Two workers of sharded_state.py (worker i's checkpoints under roots[i]) and a spare
    under a directory of its own; rank 1 is SIGKILLed at step 6, and the spare takes its rank.
    With `tls`, every process of the job runs with its ssl.json."""
    env = job_env(
        2,
        free_port(),
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        **({} if tls is None else {"CLUSTER_TLS_CONFIG": str(tls.ssl_json)}),
    )
    script = [str(SCRIPTS / "sharded_state.py")]
    processes.start("sched", [PYTHON, "-m", "cluster", "scheduler"], {**env, "MS_ROLE": "MS_SCHED"})
    workers = [
        processes.start_role(
            f"w{i}", "MS_WORKER", [*script, str(root)], {**env, "MS_NODE_ID": str(i)}
        )
        for i, root in enumerate(roots)
    ]
    spare = processes.start_role(
        "spare",
        "MS_WORKER",
        [*script, str(tmp_path / "spare-host")],
        {**env, "MS_NODE_ID": "spare-0", "CLUSTER_SPARE": "1"},
    )
    workers[1].wait_for_output("at step 6", 60)
    workers[1].signal(signal.SIGKILL)
    return workers, spare


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize("with_tls", [False, True], ids=["plaintext", "mutual-tls"])
def test_per_rank_states_come_from_a_peer_that_holds_the_ranks_own_files(
    processes: Procs, tmp_path: Path, pki: certs.Pki, with_tls: bool
) -> None:
    """Ranks 0 and 1 keep their checkpoints on one directory (a host's disk, shared storage):
    the spare, elsewhere, gets rank 1's own file from rank 0, not rank 0's state; with TLS on,
    over mutual TLS with the job's certificates."""
    shared = tmp_path / "host01"
    workers, spare = sharded_job(processes, tmp_path, [shared, shared], pki if with_tls else None)
    assert spare.wait(60) == 0, spare.output
    assert workers[0].wait(60) == 0, workers[0].output
    assert "fetched the checkpoint of step" in spare.output
    assert "rank 1 final shard 80.0" in spare.output, spare.output  # 40 steps of + 2
    assert "rank 0 final shard 40.0" in workers[0].output


def test_per_rank_states_whose_holder_is_gone_give_an_error_naming_rank_step_and_places(
    processes: Procs, tmp_path: Path
) -> None:
    _, spare = sharded_job(processes, tmp_path, [tmp_path / "host0", tmp_path / "host1"])
    assert spare.wait(60) == 1, spare.output
    lines = [x for x in spare.output.splitlines() if x.startswith("cluster: NoPeerStateError")]
    assert len(lines) == 1, spare.output
    line = lines[0]
    assert re.search(r"rank 1 needs the checkpoint of step \d+ and cannot get it", line), line
    assert str(tmp_path / "spare-host" / "rank_1") in line, line
    assert "no live peer gave rank 1's own file" in line, line
    assert "rank 0 (node '0' at 127.0.0.1:" in line, line
    assert "NOT_FOUND" in line, line
    assert not list((tmp_path / "spare-host").rglob("*.tmp"))


def test_a_workers_state_server_leaves_nothing_when_the_process_ends(
    processes: Procs, tmp_path: Path
) -> None:
    """The job ends: every worker exits 0 at once, no port left listening."""
    port = free_port()
    env = job_env(2, port, MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(tmp_path / "recovery"))
    script = [str(SCRIPTS / "sharded_state.py")]
    sched = processes.start(
        "sched", [PYTHON, "-m", "cluster", "scheduler"], {**env, "MS_ROLE": "MS_SCHED"}
    )
    workers = [
        processes.start_role(
            f"w{i}",
            "MS_WORKER",
            [*script, str(tmp_path / f"host{i}"), "--steps", "2"],
            {**env, "MS_NODE_ID": str(i)},
        )
        for i in range(2)
    ]
    for worker in workers:
        assert worker.wait(60) == 0, worker.output
    assert sched.wait(30) == 0, sched.output
    for worker in workers:
        address = worker.output.split("serving this worker's checkpoints to peers at ")[1]
        port_of = int(address.split()[0].rsplit(":", 1)[1])
        assert not _listening(port_of)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def served_at(worker: Process) -> str:
    line = worker.output.split("serving this worker's checkpoints to peers at ")[1]
    return line.split()[0]


def forged(ask: peer_state.Request, token: bytes) -> pb.FetchRequest:
    nonce = auth.new_nonce()
    return pb.FetchRequest(
        prefix=ask.prefix,
        rank=ask.rank,
        step=ask.step,
        any_rank=ask.any_rank,
        nonce=nonce,
        proof=ask.prove(token, nonce),
    )


def refusal(address: str, request: pb.FetchRequest) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            list(pb_grpc.PeerStateStub(channel).Fetch(request, timeout=10))
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    raise AssertionError(f"{address} sent a state to an outsider")


def test_outsiders_get_nothing_from_the_workers_state_servers_and_training_goes_on(
    processes: Procs, tmp_path: Path, fault_free: str
) -> None:
    """An attacker that reaches every worker's state server (it found the ports) but cannot
    read the job's key-value store: forged and absent proofs, fields out of range, an absurd
    request and a flood of 200 at once are all refused; the job ends at generation 1 with the
    fault-free parameters."""
    env = job_env(
        WORKERS,
        free_port(),
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
    )
    out = tmp_path / "attacked"
    args = [str(TRAIN), *train_args(out)]
    args[args.index("--step-delay") + 1] = "0.15"  # time for the attack while it trains
    scheduler = processes.start("sched", [PYTHON, "-m", "cluster", "scheduler"], env)
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", args, {**env, "MS_NODE_ID": str(i)})
        for i in range(WORKERS)
    ]
    for worker in workers:
        worker.wait_for_output("serving this worker's checkpoints to peers at", 60)
    addresses = [served_at(w) for w in workers]
    guess = peer_state.new_token()
    for address in addresses:
        assert refusal(address, forged(peer_state.Request("mlp", 1, 5, True), guess)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        absent = pb.FetchRequest(prefix="mlp", rank=1, step=5, any_rank=True)
        assert refusal(address, absent) == grpc.StatusCode.INVALID_ARGUMENT  # no nonce
        bad_rank = forged(peer_state.Request("mlp", 99, 5, True), guess)
        assert refusal(address, bad_rank) == grpc.StatusCode.INVALID_ARGUMENT
        huge = forged(peer_state.Request("mlp", 1, 5, True), guess)
        huge.proof = b"x" * (1 << 20)
        assert refusal(address, huge) == grpc.StatusCode.RESOURCE_EXHAUSTED
    flood = [forged(peer_state.Request("mlp", 0, 5, True), guess) for _ in range(200)]
    codes: list[grpc.StatusCode] = []
    threads = [
        threading.Thread(target=lambda r=r: codes.append(refusal(addresses[0], r))) for r in flood
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(codes) == 200
    assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    for worker in workers:
        assert worker.wait(120) == 0, worker.output
        assert "rolled back" not in worker.output
    assert scheduler.wait(30) == 0, scheduler.output
    assert (out / "final.sha256").read_text().strip() == fault_free
    assert "state server: refused a request" in workers[0].output


def test_a_strangers_large_requests_are_refused_unread_by_a_state_server(
    processes: Procs, tmp_path: Path
) -> None:
    """32 requests of 16 MiB at once over 8 connections to a worker's state server (which
    takes requests of at most 4 KiB): gRPC refuses each from its length, and each stream may
    send only a request ahead of what the server read, so the training's process grows by a
    megabyte or two (72-92 MiB while gRPC's bandwidth-delay probe opened each stream to
    megabytes)."""
    server, _ = start_server(processes, "peer-0", tmp_path / "host0", 0)
    published = holder_of(server, 0).published
    before = peak_rss_kb(server.pid)
    body = pb.FetchRequest(prefix="net", rank=1, step=5, proof=b"x" * (16 << 20))
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(published.address, options) for _ in range(8)]
    codes: set[grpc.StatusCode] = set()
    try:
        stubs = [pb_grpc.PeerStateStub(channel) for channel in channels]
        calls = [stubs[i % 8].Fetch(body, timeout=60) for i in range(32)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                list(call)
            codes.add(refused.value.code())  # type: ignore[attr-defined]
    finally:
        for channel in channels:
            channel.close()
    assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    grown_mib = (peak_rss_kb(server.pid) - before) / 1024
    assert grown_mib < 16, f"the state server's peak grew by {grown_mib:.0f} MiB"


def test_finalize_stops_the_state_server_and_ends_the_checkpoint_writers(
    processes: Procs, tmp_path: Path
) -> None:
    """Nothing serves this rank's checkpoints with the job's token once it is done, and no
    thread of the job is left running until the process exits."""
    env = job_env(1, free_port(), MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(tmp_path / "rec"))
    sched = processes.start("sched", [PYTHON, "-m", "cluster", "scheduler"], env)
    script = [str(SCRIPTS / "finalize_closes.py"), str(tmp_path / "ckpt")]
    worker = processes.start_role("w0", "MS_WORKER", script, {**env, "MS_NODE_ID": "0"})
    assert worker.wait(60) == 0, worker.output
    assert sched.wait(30) == 0, sched.output
    seen = json.loads(worker.output.strip().splitlines()[-1])
    assert seen["before"]["accepts"], seen
    assert any(n.startswith("checkpoint-writer-fin-rank0") for n in seen["before"]["threads"])
    assert "cluster-peer-state" in seen["before"]["threads"], seen
    assert seen["after"] == {"accepts": False, "threads": []}, seen
