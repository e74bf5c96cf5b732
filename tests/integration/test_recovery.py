"""Disaster recovery with real processes: scheduler and worker SIGKILL and restart, the guard,
identity takeover, and state files that cannot be used."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster.testing import Process, free_port, wait_until
from tests.procs import PYTHON, ROOT, Procs, job_env
from tests.proxy import Proxy

WORKER = [str(ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py")]
NODE_TIMEOUT_S = 5


class Job:
    """A scheduler and n workers of recovery_worker.py, recovery on, held until released."""

    def __init__(self, processes: Procs, tmp: Path, n: int, **extra: str) -> None:
        self.processes = processes
        self.tmp = tmp
        self.n = n
        self.port = free_port()
        self.state_dir = tmp / "recovery"
        self.release_file = tmp / "release"
        self.env = job_env(
            n,
            self.port,
            MS_ENABLE_RECOVERY="1",
            MS_RECOVERY_PATH=str(self.state_dir),
            MS_NODE_TIMEOUT=str(NODE_TIMEOUT_S),
            **extra,
        )
        self.args = [*WORKER, "--release", str(self.release_file)]
        self.scheduler = self.start_scheduler()
        self.workers = [self.start_worker(i) for i in range(n)]
        for worker in self.workers:
            worker.wait_for_output("allgather rank=", 30)

    def start_scheduler(self, name: str = "scheduler") -> Process:
        return self.processes.start_role(name, "MS_SCHED", self.args, self.env)

    def start_worker(self, index: int, name: str | None = None) -> Process:
        return self.processes.start_role(
            name or f"worker{index}", "MS_WORKER", self.args, {**self.env, "MS_NODE_ID": str(index)}
        )

    def status(self) -> dict[str, object]:
        result = subprocess.run(
            [PYTHON, "-m", "cluster", "status", "--json", "--addr", f"127.0.0.1:{self.port}"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        if result.returncode != 0:
            return {}
        status = json.loads(result.stdout)
        assert isinstance(status, dict)
        return status

    def finish(self, workers: list[Process]) -> None:
        self.release_file.touch()
        for worker in workers:
            assert worker.wait(30) == 0, worker.output
            assert re.search(r"after rank=\d+ generation=\d+ result=\[", worker.output)
        assert self.scheduler.wait(30) == 0, self.scheduler.output


def nodes_back(status: dict[str, object], n: int) -> bool:
    nodes = status.get("nodes", [])
    assert isinstance(nodes, list)
    return sorted(
        node["rank"] for node in nodes if node["state"] == "alive" and node["connected"]
    ) == list(range(n))


def test_scheduler_sigkill_and_restart_keeps_the_workers(processes: Procs, tmp_path: Path) -> None:
    job = Job(processes, tmp_path, 4)
    before = job.status()
    job.scheduler.popen.send_signal(signal.SIGKILL)
    job.scheduler.wait(10)
    job.scheduler = job.start_scheduler("scheduler-restarted")
    job.scheduler.wait_for_output("resuming job", 15)
    job.scheduler.wait_for_output("listening on", 15)
    listening = time.monotonic()
    wait_until(lambda: nodes_back(job.status(), 4), 3.0 + 1.5, "all 4 workers back")
    print(f"all 4 workers back {time.monotonic() - listening:.2f} s after the scheduler listened")
    after = job.status()
    assert after["cluster_id"] == before["cluster_id"]
    assert after["generation"] == before["generation"] == 1
    assert after["recovery"] is True
    assert [(n["rank"], n["incarnation"]) for n in after["nodes"]] == [  # type: ignore[union-attr]
        (n["rank"], n["incarnation"])
        for n in before["nodes"]  # type: ignore[union-attr]
    ]
    for worker in job.workers:
        assert worker.popen.poll() is None, worker.output
        assert "training goes on (recovery is on)" in worker.output
    job.finish(job.workers)


def test_sigterm_leaves_a_recovering_job_to_the_scheduler_started_next(
    processes: Procs, tmp_path: Path
) -> None:
    # What Kubernetes (a pod deleted, a node drained) and systemd send: the job is saved, not
    # ended, and a scheduler started again on the same path resumes it.
    job = Job(processes, tmp_path, 2)
    before = job.status()
    job.scheduler.popen.send_signal(signal.SIGTERM)
    assert job.scheduler.wait(15) == 0, job.scheduler.output
    (left,) = [line for line in job.scheduler.output.splitlines() if "left to resume" in line]
    assert "scheduler stopped by SIGTERM" in left
    assert f"saved in {job.state_dir / 'scheduler.json'};" in left
    assert "start one again with the same MS_RECOVERY_PATH to resume the job" in left
    assert "Traceback" not in job.scheduler.output
    for worker in job.workers:
        assert worker.popen.poll() is None, worker.output
    job.scheduler = job.start_scheduler("scheduler-restarted")
    job.scheduler.wait_for_output("resuming job", 15)
    wait_until(lambda: nodes_back(job.status(), 2), 15, "both workers back")
    after = job.status()
    assert (after["cluster_id"], after["generation"]) == (before["cluster_id"], 1)
    job.finish(job.workers)
    for worker in job.workers:
        assert "generation=1 result=[0, 1]" in worker.output, worker.output


def test_another_jobs_scheduler_is_refused_the_state_its_secret_does_not_match(
    processes: Procs, tmp_path: Path
) -> None:
    """A job left to resume (SIGTERM) on MS_RECOVERY_PATH, then another job's scheduler (its
    own secret, the same worker count) started on that path by mistake: refused at start in
    one line, not resuming the job and refusing all of its nodes; the job's own resumes it."""
    job = Job(processes, tmp_path, 1, CLUSTER_JOB_SECRET="a" * 64)
    job.scheduler.popen.send_signal(signal.SIGTERM)
    assert job.scheduler.wait(15) == 0, job.scheduler.output
    saved = (job.state_dir / "scheduler.json").read_bytes()
    env = {**job.env, "MS_ROLE": "MS_SCHED", "CLUSTER_JOB_SECRET": "b" * 64}
    env["MS_SCHED_PORT"] = str(free_port())
    foreign = subprocess.run(
        [PYTHON, "-m", "cluster", "scheduler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert foreign.returncode == 2, foreign.stderr
    lines = [line for line in foreign.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, foreign.stderr
    assert f"MS_RECOVERY_PATH is not usable: the recovery state {job.state_dir}" in lines[0]
    assert "another job secret than this scheduler" in lines[0]
    assert "if it is this job's, start this scheduler with that job's secret; " in lines[0]
    assert "to start a new job, move the whole MS_RECOVERY_PATH directory away" in lines[0]
    assert "on every host of the job" in lines[0]
    assert (job.state_dir / "scheduler.json").read_bytes() == saved
    job.scheduler = job.start_scheduler("scheduler-restarted")
    job.scheduler.wait_for_output("resuming job", 15)
    job.finish(job.workers)


@pytest.mark.parametrize(
    ("recovery", "signum"),
    [(False, signal.SIGTERM), (True, signal.SIGINT)],
    ids=["sigterm-without-recovery", "sigint-with-recovery"],
)
def test_a_scheduler_signal_that_nothing_could_resume_from_ends_the_job(
    processes: Procs, tmp_path: Path, recovery: bool, signum: signal.Signals
) -> None:
    # Without a state store nothing could resume the job; SIGINT (Ctrl-C, `mscluster run`
    # ending its job) ends it whatever the store.
    port = free_port()
    extra = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(tmp_path / "recovery")}
    env = job_env(1, port, **(extra if recovery else {}))
    args = [*WORKER, "--release", str(tmp_path / "never")]
    scheduler = processes.start_role("scheduler", "MS_SCHED", args, env)
    worker = processes.start_role("worker", "MS_WORKER", args, {**env, "MS_NODE_ID": "0"})
    worker.wait_for_output("allgather rank=", 30)
    scheduler.popen.send_signal(signum)
    assert scheduler.wait(15) == 1, scheduler.output
    assert worker.wait(30) == 1, worker.output
    assert f"JobFailedError: job failed: scheduler stopped by {signum.name}" in worker.output


def test_restarted_worker_waits_for_the_guard_and_rejoins_with_its_rank(
    processes: Procs, tmp_path: Path
) -> None:
    job = Job(processes, tmp_path, 3)
    victim = job.workers[1]
    victim.popen.send_signal(signal.SIGKILL)
    victim.wait(10)
    restarted = job.start_worker(1, "worker1-restarted")
    restarted.wait_for_output("registration refused for now", 15)
    assert re.search(r"MS_NODE_TIMEOUT=5 s .*retry in \d+\.\d s", restarted.output)
    for survivor in (job.workers[0], job.workers[2]):
        survivor.wait_for_output("rank 1 (node '1') failed", 10)
    restarted.wait_for_output("rejoined rank=1 size=3 generation=2", NODE_TIMEOUT_S + 15)
    for survivor in (job.workers[0], job.workers[2]):
        survivor.wait_for_output("generation 2", 10)
        assert survivor.popen.poll() is None, survivor.output
    status = job.status()
    node = next(n for n in status["nodes"] if n["node_id"] == "1")  # type: ignore[union-attr]
    assert (node["rank"], node["restarts"], status["generation"]) == (1, 1, 2)
    job.finish([job.workers[0], job.workers[2], restarted])
    for worker in (job.workers[0], job.workers[2], restarted):
        assert "generation=2 result=[0, 1, 2]" in worker.output, worker.output


def test_a_worker_that_finishes_while_the_scheduler_restarts_is_heard_once_back(
    processes: Procs, tmp_path: Path
) -> None:
    """Rank 1 finalizes while its scheduler is dead: its Finish waits for the restarted
    scheduler to take the node back, as long as a training node would wait for it (past the
    Finish's own give-up time, 10 s here), and goes then, so the job ends 0. (Given up, the
    process exited 0, and the restarted scheduler failed the job MS_TOPO_TIMEOUT later, though
    every rank had finished.)"""
    port, go = free_port(), [tmp_path / "go0", tmp_path / "go1"]
    env = job_env(
        2,
        port,
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        MS_NODE_TIMEOUT="3",  # a Finish sent is given up after 10 s, one held after 30
        MS_TOPO_TIMEOUT="30",
    )
    script = str(ROOT / "tests" / "integration" / "scripts" / "finish_on_cue.py")
    scheduler = processes.start_role("scheduler", "MS_SCHED", [script, "-"], env)
    workers = [
        processes.start_role(
            f"worker{i}", "MS_WORKER", [script, str(go[i])], env | {"MS_NODE_ID": str(i)}
        )
        for i in range(2)
    ]
    for worker in workers:
        worker.wait_for_output("in rank=", 30)
    go[0].touch()
    assert workers[0].wait(20) == 0, workers[0].output
    scheduler.popen.send_signal(signal.SIGKILL)
    scheduler.wait(10)
    go[1].touch()
    workers[1].wait_for_output("this node's finish waits for it to take this node back", 15)
    time.sleep(11)  # sleep-ok: the outage's length (past the Finish's give-up time), the fault
    restarted = processes.start_role("scheduler-restarted", "MS_SCHED", [script, "-"], env)
    assert workers[1].wait(20) == 0, workers[1].output
    assert "could not tell" not in workers[1].output, workers[1].output
    assert restarted.wait(20) == 0, restarted.output
    assert "job finished: all 2 nodes finished" in restarted.output, restarted.output


def test_a_live_node_id_cannot_be_claimed(processes: Procs, tmp_path: Path) -> None:
    """A claimant on the live node's MS_RECOVERY_PATH is refused at init() by the node's lock;
    one with its own (as from another host) by the scheduler, while the node heartbeats."""
    job = Job(processes, tmp_path, 2)
    before = job.status()
    beside = job.start_worker(1, "claimant-beside")
    assert beside.wait(15) == 1, beside.output
    assert f"pid {job.workers[1].pid} on this host" in beside.output, beside.output
    elsewhere = {**job.env, "MS_NODE_ID": "1", "MS_RECOVERY_PATH": str(tmp_path / "elsewhere")}
    claimant = job.processes.start_role("claimant", "MS_WORKER", job.args, elsewhere)
    claimant.wait_for_output("registration refused for now", 15)
    assert "node id '1' is held by a live process" in claimant.output, claimant.output
    claimant.popen.send_signal(signal.SIGKILL)
    claimant.wait(10)
    after = job.status()
    assert after["generation"] == before["generation"]
    assert after["nodes"] == [  # the live node is not disturbed
        {**n, "seconds_since_heartbeat": m["seconds_since_heartbeat"]}
        for n, m in zip(before["nodes"], after["nodes"], strict=True)  # type: ignore[call-overload]
    ]
    job.finish(job.workers)


def run_scheduler(
    tmp_path: Path, state_dir: Path, timeout_s: float = 20, worker_num: int = 2
) -> subprocess.CompletedProcess[str]:
    env = job_env(
        worker_num,
        free_port(),
        MS_ROLE="MS_SCHED",
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(state_dir),
    )
    return subprocess.run(
        [PYTHON, "-m", "cluster", "scheduler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def saved_state(tmp_path: Path) -> bytes:
    """A real scheduler.json of a formed 2-worker job (the job is killed while it runs)."""
    state_dir = tmp_path / "saved"
    port = free_port()
    env = job_env(2, port, MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(state_dir))
    args = [*WORKER, "--release", str(tmp_path / "never")]
    with_procs = Procs(tmp_path)
    try:
        with_procs.start_role("s", "MS_SCHED", args, env)
        workers = [
            with_procs.start_role(f"w{i}", "MS_WORKER", args, {**env, "MS_NODE_ID": str(i)})
            for i in range(2)
        ]
        for worker in workers:
            worker.wait_for_output("allgather rank=", 30)
    finally:
        with_procs.kill_all()
    return (state_dir / "scheduler.json").read_bytes()


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda data: data[: len(data) // 2], "is truncated or corrupt"),
        (lambda data: data.replace(b'"generation": 1', b'"generation": 7'), "fails its checksum"),
        (lambda data: b"\x00" * len(data), "is truncated or corrupt"),
        (lambda data: data.replace(b'"version": 1', b'"version": 99'), "format version 99"),
        (lambda data: b"", "is truncated or corrupt"),
    ],
    ids=["truncated", "edited", "zeroed", "newer", "empty"],
)
def test_unusable_state_file_is_one_clear_line_and_left_alone(
    tmp_path: Path, damage: object, expected: str
) -> None:
    state_dir = tmp_path / "damaged"
    state_dir.mkdir()
    damaged = damage(saved_state(tmp_path))  # type: ignore[operator]
    (state_dir / "scheduler.json").write_bytes(damaged)
    result = run_scheduler(tmp_path, state_dir)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert str(state_dir / "scheduler.json") in lines[0]
    assert "Traceback" not in result.stderr
    assert (state_dir / "scheduler.json").read_bytes() == damaged


def test_second_scheduler_on_one_recovery_path_refuses_to_start(
    processes: Procs, tmp_path: Path
) -> None:
    job = Job(processes, tmp_path, 1)
    result = run_scheduler(tmp_path, job.state_dir)
    assert result.returncode != 0
    assert "another scheduler (pid" in result.stderr
    assert str(job.state_dir) in result.stderr
    assert "Traceback" not in result.stderr
    job.finish(job.workers)


def test_recovery_without_node_id_is_a_clear_error(tmp_path: Path) -> None:
    env = job_env(
        2,
        free_port(),
        MS_ROLE="MS_WORKER",
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path),
    )
    result = subprocess.run(
        [PYTHON, str(ROOT / "examples" / "allgather_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode != 0
    assert "needs MS_NODE_ID" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_worker_state_file_names_its_job_and_rank(processes: Procs, tmp_path: Path) -> None:
    job = Job(processes, tmp_path, 2)
    saved = json.loads((job.state_dir / "worker-1.json").read_text())["payload"]
    assert (saved["node_id"], saved["rank"], saved["finished"]) == ("1", 1, False)
    assert saved["cluster_id"] == job.status()["cluster_id"]
    job.finish(job.workers)
    assert json.loads((job.state_dir / "worker-1.json").read_text())["payload"]["finished"]
    scheduler_state = json.loads((job.state_dir / "scheduler.json").read_text())["payload"]
    assert scheduler_state["phase"] == "finished"


def test_a_new_job_on_the_same_path_after_the_old_one_finished(
    processes: Procs, tmp_path: Path
) -> None:
    first = Job(processes, tmp_path, 2)
    old_id = first.status()["cluster_id"]
    first.finish(first.workers)
    first.release_file.unlink()
    second = Job(processes, tmp_path, 2)
    assert second.status()["cluster_id"] != old_id
    assert "had ended (finished); starting a new job" in second.scheduler.output
    second.finish(second.workers)


def test_kill_everything_then_start_the_whole_job_again(processes: Procs, tmp_path: Path) -> None:
    """Every process killed mid-job: restarting them all resumes the same job."""
    job = Job(processes, tmp_path, 2)
    cluster_id = job.status()["cluster_id"]
    for proc in [job.scheduler, *job.workers]:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    job.scheduler = job.start_scheduler("scheduler-2")
    workers = [job.start_worker(i, f"worker{i}-2") for i in range(2)]
    for worker in workers:
        worker.wait_for_output("rejoined rank=", NODE_TIMEOUT_S + 20)
    assert job.status()["cluster_id"] == cluster_id
    job.finish(workers)


def test_scheduler_killed_at_random_moments_always_resumes(
    processes: Procs, tmp_path: Path
) -> None:
    """SIGKILL the scheduler while the job forms and again while a worker rejoins (each at a
    random moment), restarting it each time: it starts from a consistent state every time and
    the job completes. One seed with real processes, files and signals; the interleavings are
    the simulation's (`tests/sim`: thousands of scheduler restarts at random steps)."""
    rng = random.Random(1)
    port = free_port()
    state_dir = tmp_path / "recovery"
    release = tmp_path / "release"
    env = job_env(
        3,
        port,
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(state_dir),
        MS_NODE_TIMEOUT=str(NODE_TIMEOUT_S),
    )
    args = [*WORKER, "--release", str(release)]

    def scheduler(name: str) -> Process:
        return processes.start_role(name, "MS_SCHED", args, env)

    def worker(i: int, name: str) -> Process:
        return processes.start_role(name, "MS_WORKER", args, {**env, "MS_NODE_ID": str(i)})

    def kill_and_restart(victim: Process, at_s: float, name: str) -> Process:
        time.sleep(at_s)  # sleep-ok: the fault lands at a random moment; nothing is awaited
        victim.popen.send_signal(signal.SIGKILL)
        victim.wait(10)
        restarted = scheduler(name)
        restarted.wait_for_output("listening on", 20)
        return restarted

    sched = scheduler("scheduler")
    sched.wait_for_output("listening on", 20)
    workers = [worker(i, f"worker{i}") for i in range(3)]
    sched = kill_and_restart(sched, rng.uniform(0.0, 1.5), "scheduler-2")  # while forming
    for w in workers:
        # `cut`: the scheduler died while answering the gather, to some ranks only (the test
        # below makes that moment on purpose): the job re-formed under it.
        wait_until(lambda w=w: re.search("(allgather|cut) rank=", w.output) is not None, 40, w.name)
    # The rejoin starts a new generation: 2, or 3 after a cut gather's re-forming.
    final = 3 if any("cut rank=" in w.output for w in workers) else 2
    workers[1].popen.send_signal(signal.SIGKILL)
    workers[1].wait(10)
    workers[1] = worker(1, "worker1-restarted")
    sched = kill_and_restart(sched, rng.uniform(0.0, NODE_TIMEOUT_S + 1.0), "scheduler-3")
    workers[1].wait_for_output("rejoined rank=1 size=3", 3 * NODE_TIMEOUT_S + 20)
    release.touch()
    for w in workers:
        assert w.wait(40) == 0, w.output
        assert re.search(rf"after rank=\d generation={final} result=\[0, 1, 2\]", w.output), (
            w.output
        )
    assert sched.wait(30) == 0, sched.output


def test_a_gather_the_dead_scheduler_answered_to_some_ranks_only_re_forms_the_job_at_once(
    processes: Procs, tmp_path: Path
) -> None:
    """The scheduler dies after answering a gather to ranks 0 and 2 but before rank 1 heard
    it (a proxy drops what it sends to rank 1). Rank 1 calls the gather again on the restarted
    scheduler; the others hold, calling nothing, and say when they register again how far
    their collectives got: the restarted scheduler re-forms the job at once (rank 1's call
    fails with PeerFailedError) instead of leaving rank 1 waiting for ranks that moved on,
    until the collective's 10 minute deadline. Then everyone gathers in the new generation."""
    port = free_port()
    proxy = Proxy(("127.0.0.1", port))
    release, go = tmp_path / "release", tmp_path / "go"
    env = job_env(
        3,
        port,
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        MS_NODE_TIMEOUT=str(NODE_TIMEOUT_S),
    )
    args = [*WORKER, "--release", str(release), "--generation", "2"]

    def worker(i: int, more: list[str], **extra: str) -> Process:
        return processes.start_role(
            f"worker{i}", "MS_WORKER", [*args, *more], {**env, "MS_NODE_ID": str(i), **extra}
        )

    try:
        sched = processes.start_role("scheduler", "MS_SCHED", args, env)
        sched.wait_for_output("listening on", 20)
        # Rank 1 reaches the scheduler through the proxy, and gathers when told to.
        late = worker(1, ["--go", str(go)], MS_SCHED_PORT=str(proxy.port))
        workers = [worker(0, []), late, worker(2, [])]
        late.wait_for_output("ready rank=", 30)
        proxy.hold_replies()
        go.touch()
        for w in (workers[0], workers[2]):
            w.wait_for_output("allgather rank=", 30)
        sched.popen.send_signal(signal.SIGKILL)
        sched.wait(10)
        proxy.cut()  # rank 1 never heard the answer
        restarted = processes.start_role("scheduler-2", "MS_SCHED", args, env)
        late.wait_for_output("cut rank=", 30)
        # Said as the new generation arrives: before or after the cut call returns.
        late.wait_for_output("cut in two by the scheduler's restart", 30)
        restarted.wait_for_output("re-forming the job", 30)
        release.touch()
        for w in workers:
            assert w.wait(40) == 0, w.output
            assert re.search(r"after rank=\d generation=2 result=\[0, 1, 2\]", w.output), w.output
        assert restarted.wait(30) == 0, restarted.output
    finally:
        proxy.close()


# A worker killed under `mscluster run` and restarted by the launcher, refused during the guard,
# then back with its rank: the launcher's restart is tested with the training's exact result
# (`test_training.py::test_launcher_restarts_the_killed_worker_and_the_result_is_exact`), the
# guard and the rejoin by real processes above, and the protocol by the transcript
# `tests/sim/transcripts/rejoin.txt`.


def test_a_collective_with_a_failed_peer_raises_peer_failed(
    processes: Procs, tmp_path: Path
) -> None:
    script = [str(ROOT / "tests" / "integration" / "scripts" / "peer_failure.py")]
    env = job_env(
        2, free_port(), MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(tmp_path / "recovery")
    )
    processes.start_role("scheduler", "MS_SCHED", script, env)
    rank0 = processes.start_role("w0", "MS_WORKER", script, {**env, "MS_NODE_ID": "0"})
    rank1 = processes.start_role("w1", "MS_WORKER", script, {**env, "MS_NODE_ID": "1"})
    rank1.wait_for_output("rank 1 ready", 30)
    rank0.wait_for_output("gathering (in flight)", 30)
    rank1.popen.send_signal(signal.SIGKILL)
    rank0.wait_for_output("afterwards: PeerFailedError", 15)
    # Killed while rank 0 waits (usually) or just before its call arrives: a PeerFailedError.
    assert re.search(
        r"in flight: PeerFailedError: (rank 1 \(node '1'\) died|allgather cannot complete)",
        rank0.output,
    )
    assert "afterwards: PeerFailedError: allgather cannot complete: rank 1" in rank0.output
    assert "waits for it to rejoin" in rank0.output


def test_standalone_scheduler_with_recovery_path(processes: Procs, tmp_path: Path) -> None:
    port = free_port()
    state_dir = tmp_path / "state"
    sched = processes.start(
        "scheduler",
        [
            PYTHON,
            "-m",
            "cluster",
            "scheduler",
            "--port",
            str(port),
            "--worker-num",
            "1",
            "--recovery-path",
            str(state_dir),
        ],
        job_env(1, port),
    )
    env = job_env(1, port, MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(state_dir))
    (tmp_path / "release").touch()
    worker = processes.start_role(
        "worker",
        "MS_WORKER",
        [*WORKER, "--release", str(tmp_path / "release")],
        {**env, "MS_NODE_ID": "0"},
    )
    assert worker.wait(30) == 0, worker.output
    assert sched.wait(30) == 0, sched.output
    assert json.loads((state_dir / "scheduler.json").read_text())["payload"]["phase"] == "finished"
