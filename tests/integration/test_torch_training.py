"""cluster.torch and examples/train_torch.py (DDP on gloo): a survivor's collective fails fast
when its peer is SIGKILLed, and training with SIGKILLs of workers and of the scheduler ends with
bit-for-bit the parameters of the run without faults."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from cluster.testing import free_port, launched_pid, wait_until
from tests.procs import PYTHON, ROOT, Process, Procs, job_env, launched, private_copy, run_args
from tests.training_job import (
    NODE_TIMEOUT_S,
    STEP_LINE,
    STEPS,
    WORKERS,
    Bounds,
    TrainingJob,
    train_args,
)

pytest.importorskip(
    "torch", reason="cluster.torch needs torch: pip install 'mscluster-grpc[torch]'"
)

TRAIN = ROOT / "examples" / "train_torch.py"
PEER_FAILURE = ROOT / "tests" / "integration" / "scripts" / "torch_peer_failure.py"
RELEASE = ROOT / "tests" / "integration" / "scripts" / "torch_release.py"
FINALIZE = ROOT / "tests" / "integration" / "scripts" / "torch_finalize.py"
OVERTAKEN = ROOT / "tests" / "integration" / "scripts" / "torch_restore_overtaken.py"
LATE_DEATH = ROOT / "tests" / "integration" / "scripts" / "torch_late_death.py"
STORE = ROOT / "tests" / "integration" / "scripts" / "torch_store.py"
DESTROY_FAILS = ROOT / "tests" / "integration" / "scripts" / "torch_destroy_fails.py"
STEP_BUG = ROOT / "tests" / "integration" / "scripts" / "torch_step_bug.py"
EARLY_GROUP = ROOT / "tests" / "integration" / "scripts" / "torch_early_group.py"
BEFORE_LOOP = ROOT / "tests" / "integration" / "scripts" / "collective_before_loop.py"
ABORT_HOOK = ROOT / "tests" / "integration" / "scripts" / "torch_abort_hook.py"
# Each process imports torch (seconds of CPU): generous bounds for a loaded 2-core machine.
START_S = 90
RESUMED = re.compile(r"resuming from step (\d+) in memory \((this worker's copy|a peer's copy);")
REDONE = re.compile(r"^steps redone: (\d+) in \d+ rollbacks$", re.MULTILINE)

pytestmark = pytest.mark.slow


def Job(processes: Procs, tmp: Path, name: str) -> TrainingJob:
    """The scheduler is `python -m cluster scheduler`: the script would import torch for nothing."""
    bounds = Bounds(step_s=START_S, exit_s=START_S)
    return TrainingJob(processes, tmp, name, TRAIN, standalone_scheduler=True, bounds=bounds)


@pytest.fixture(scope="module")
def fault_free_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("torch-fault-free")
    procs = Procs(tmp)
    try:
        job = Job(procs, tmp, "clean")
        # Meanwhile, the numpy example (light next to torch) on the same data and initial values:
        # the same network, so the same losses.
        example = [str(ROOT / "examples" / "train_mlp.py"), "--steps", str(STEPS)]
        args = run_args(
            *example, worker_num=WORKERS, master_port=free_port(), log_dir=tmp / "mlp-logs"
        )
        mlp = procs.start("mlp", args, job_env(WORKERS, 0))
        digest = job.final_hash()
        lines = STEP_LINE.findall(job.workers[0].output)
        assert len(lines) == STEPS
        assert lines[0][:2] == ("1", "1")
        assert float(lines[-1][2]) < float(lines[0][2])  # it learns
        assert mlp.wait(60) == 0, mlp.output
        assert STEP_LINE.findall((tmp / "mlp-logs" / "worker_0.log").read_text()) == lines
        return digest
    finally:
        procs.kill_all()


def start_job(processes: Procs, script: Path, workers: int, **extra: str) -> list[Process]:
    """A scheduler and `workers` workers running `script` (node ids 0, 1, ...), `extra` in
    their environment: the workers."""
    env = job_env(workers, free_port(), **extra)
    processes.start("sched", [PYTHON, "-m", "cluster", "scheduler"], env)
    return [
        processes.start_role(f"w{i}", "MS_WORKER", [str(script)], {**env, "MS_NODE_ID": str(i)})
        for i in range(workers)
    ]


def test_a_survivors_all_reduce_fails_at_once_when_its_peer_is_killed(
    processes: Procs, tmp_path: Path
) -> None:
    survivor, victim = start_job(
        processes,
        PEER_FAILURE,
        2,
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        MS_NODE_TIMEOUT="30",  # the group's timeout too: a failure within seconds is not it
    )
    victim.wait_for_output("rank 1 ready", START_S)
    survivor.wait_for_output("reducing", START_S)
    assert "rank 0 sum 3.0 timeout 30.0" in survivor.output
    killed = time.monotonic()
    victim.popen.send_signal(signal.SIGKILL)
    survivor.wait_for_output("all_reduce failed after", 5)
    # What TrainingLoop.step() then asks, answered at once too (not after its 32 s bound).
    survivor.wait_for_output("the scheduler confirms a peer failed: True", 5)
    assert time.monotonic() - killed < 5


def test_a_peer_blocked_on_a_worker_fails_at_once_when_that_worker_releases_its_group(
    processes: Procs, tmp_path: Path
) -> None:
    """What frees a survivor stuck in gloo waiting on a live neighbour (a ring, the failed rank
    beyond it): the neighbour's TrainingLoop releases its group as soon as its generation is
    over, and the stuck read ends at once instead of after the group's 30 s timeout. A
    connection of the program's own, opened while the group was being made, is no gloo's: it
    stays open."""
    workers = start_job(processes, RELEASE, 2)
    workers[0].wait_for_output("rank 0 released; group left: False", START_S)
    workers[0].wait_for_output("its own connection still carries: b'x'", 10)
    workers[1].wait_for_output("recv failed after", 10)
    failed_after = float(re.search(r"recv failed after (\d+\.\d+) s", workers[1].output)[1])
    assert failed_after < 25, workers[1].output  # not the timeout (30 s): the release
    assert all(w.wait(30) == 0 for w in workers), [w.output for w in workers]


def test_finalize_destroys_the_process_group(processes: Procs) -> None:
    """No group is left for torch to tear down at exit (NCCL warns "destroy_process_group() was
    not called before program exit"; gloo in torch 2.13 does not, so the test asks torch)."""
    workers = start_job(processes, FINALIZE, 2)
    for worker in workers:
        assert worker.wait(START_S) == 0, worker.output
        assert "sum 2.0" in worker.output, worker.output
        assert "after finalize, a group left: False" in worker.output, worker.output
        assert "destroy_process_group() was not called" not in worker.output


def test_the_rendezvous_store_closes_once_the_group_is_made_and_the_group_works(
    processes: Procs,
) -> None:
    """Rank 0's TCPStore (unauthenticated: anyone who reaches the port may write to it) serves
    only the group's making: once every rank's init_process_group has returned its port
    refuses connections, and the group still reduces and is destroyed at finalize."""
    workers = start_job(processes, STORE, 2)
    for worker in workers:
        assert worker.wait(START_S) == 0, worker.output
    assert "rank 0 store closed: True" in workers[0].output, workers[0].output
    for rank, worker in enumerate(workers):
        assert f"rank {rank} sum 3.0" in worker.output, worker.output
        assert f"rank {rank} after finalize, a group left: False" in worker.output


def test_a_group_whose_destroy_failed_is_still_cluster_torchs(processes: Procs) -> None:
    """torch's destroy raising left cluster.torch's record cleared and torch's group in place:
    the next init_process_group refused it as "a default process group that cluster.torch did
    not make". The record goes only once torch's destroy has succeeded."""
    (worker,) = start_job(processes, DESTROY_FAILS, 1)
    assert worker.wait(START_S) == 0, worker.output
    lines = [line for line in worker.output.splitlines() if not line.startswith("cluster[")]
    assert lines == [
        "destroy: injected: torch's destroy_process_group failed",
        "init again: True",
        "sum 1.0",
        "after finalize, a group left: False",
    ], worker.output


def test_fault_free_runs_are_reproducible(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    assert Job(processes, tmp_path, "again").final_hash() == fault_free_hash


def test_a_worker_then_the_scheduler_killed_mid_run_the_result_is_exact(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    """Both faults in one job: each job costs seconds of torch imports on every worker."""
    job = Job(processes, tmp_path, "kill")
    job.kill_worker_at(2, 23)
    job.workers[2].wait_for_output("in memory (a peer's copy", START_S)  # not step 20's file
    assert "a peer failed" in job.workers[0].output
    job.kill_scheduler_at(23 + 20)  # worker 0's step lines, the redone ones included
    assert job.final_hash() == fault_free_hash
    assert "resuming job" in job.scheduler.output


def test_launcher_restarts_the_killed_worker_and_the_result_is_exact(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    script = private_copy(tmp_path, TRAIN)
    out = tmp_path / "launched"
    args = run_args(
        *("--enable-recovery", "--recovery-path", tmp_path / "recovery"),
        *("--max-restarts", "2", "--node-timeout", NODE_TIMEOUT_S),
        *(script, *train_args(out)),
        worker_num=WORKERS,
        master_port=free_port(),
        log_dir=tmp_path / "logs",
    )
    run = processes.start("run", args, job_env(WORKERS, 0))
    log = tmp_path / "logs" / "worker_1.log"
    wait_until(
        lambda: log.exists() and len(STEP_LINE.findall(log.read_text())) >= 25, START_S, "step 25"
    )
    os.kill(launched(log.parent, "worker_1"), signal.SIGKILL)
    assert run.wait(START_S) == 0, run.output
    assert (out / "final.sha256").read_text().strip() == fault_free_hash


def test_a_spare_takes_a_sigkilled_rank_and_the_state_moves_from_peers_memory(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    """#15 items 3 and 4: `mscluster run --spares 1` with the default MS_NODE_TIMEOUT (30 s),
    a ranked worker SIGKILLed mid-run. The spare (torch imported already, waiting in
    cluster.init()) takes the rank; every worker makes the new generation's gloo group; the
    survivors resume from their own copy of the last step, the spare from theirs, peer to
    peer; at most the interrupted step is computed again, and the result is exact."""
    script = private_copy(tmp_path, TRAIN)
    out, logs = tmp_path / "out", tmp_path / "logs"
    args = run_args(
        *("--spares", "1", "--enable-recovery", "--max-restarts", "2"),
        *(script, *train_args(out, save_every=20)),
        worker_num=WORKERS,
        local_worker_num=WORKERS,
        master_port=free_port(),
        log_dir=logs,
    )
    run = processes.start("run", args, job_env(WORKERS, 0))
    log = logs / "worker_1.log"
    wait_until(
        lambda: log.exists() and len(STEP_LINE.findall(log.read_text())) >= 25, START_S, "step 25"
    )
    os.kill(launched(log.parent, "worker_1"), signal.SIGKILL)
    assert run.wait(START_S * 2) == 0, run.output
    assert (out / "final.sha256").read_text().strip() == fault_free_hash
    spare = (logs / "spare_0.log").read_text()
    assert "promoted: this spare takes rank 1" in spare, spare
    resumed = {}
    for name in ("worker_0.log", "worker_2.log", "worker_3.log", "spare_0.log"):
        text = (logs / name).read_text()
        found = RESUMED.findall(text)
        assert len(found) == 1, text
        resumed[name] = found[0]
        assert [int(n) for n in REDONE.findall(text)] in ([0], [1]), text
    steps = {int(step) for step, _ in resumed.values()}
    assert len(steps) == 1, resumed
    assert 25 <= steps.pop() < 40  # newer than the newest checkpoint every rank holds (20)
    assert resumed["spare_0.log"][1] == "a peer's copy"
    assert {whose for name, (_, whose) in resumed.items() if name != "spare_0.log"} == {
        "this worker's copy"
    }


def test_a_restore_overtaken_by_the_next_generation_goes_on_to_it(
    processes: Procs, tmp_path: Path
) -> None:
    """Rank 0 still puts generation 2's state back (its set_state held) when the spare it
    restores with is SIGKILLed and generation 3 forms: set_state belongs to generation 2, so
    its process group fails at once (PeerFailedError) and the loop goes on to generation 3.
    Unpinned, the store port's broadcast became generation 3's first collective against the
    new spare's allgather: both waited out the collective timeout (10 s here; 10 minutes by
    default), and the spare died of a CollectiveError."""
    script = private_copy(tmp_path, OVERTAKEN)
    out, logs = tmp_path / "out", tmp_path / "logs"
    args = run_args(
        *("--spares", "2", "--enable-recovery", "--max-restarts", "2", "--node-timeout", "5"),
        *(script, "--steps", "100", "--step-delay", "0.05", "--out", out),
        worker_num=2,
        master_port=free_port(),
        log_dir=logs,
    )
    run = processes.start("run", args, job_env(2, 0, CLUSTER_COLLECTIVE_TIMEOUT_S="10"))
    rank0, rank1 = logs / "worker_0.log", logs / "worker_1.log"
    wait_until(
        lambda: rank1.exists() and len(STEP_LINE.findall(rank1.read_text())) >= 20,
        START_S,
        "step 20 on rank 1",
    )
    os.kill(launched(logs, "worker_1"), signal.SIGKILL)
    wait_until(lambda: "set_state held in generation 2" in rank0.read_text(), START_S, "the hold")
    promoted = "promoted: this spare takes rank 1 in generation 2"
    spare = next(p for p in logs.glob("spare_*.log") if promoted in p.read_text())
    os.kill(launched(logs, spare.stem), signal.SIGKILL)
    assert run.wait(START_S * 2) == 0, run.output
    text = rank0.read_text()
    assert "set_state goes on; the job is at generation 3" in text, text
    assert re.search(r"generation 3 \(.*\): resuming from step \d+", text), text
    for log in logs.glob("*.log"):
        assert "CollectiveError" not in log.read_text(), log
    assert (out / "final.sha256").exists()


def test_a_worker_killed_after_the_final_barrier_restarts_and_the_job_succeeds(
    processes: Procs, tmp_path: Path
) -> None:
    """Every worker saved the last step and passed the final barrier; rank 0 has finished and
    exited; rank 1 is SIGKILLed before its finalize and restarted. It puts the final state
    back, and its set_state makes no process group (init_process_group returns False): rank 0
    could not join one. It made one, and died of "rank 0 ... has already finished"."""
    script = private_copy(tmp_path, LATE_DEATH)
    out, logs, port = tmp_path / "out", tmp_path / "logs", free_port()
    recovery = ["--enable-recovery", "--max-restarts", "1", "--node-timeout", "3"]
    train = ["--steps", "30", "--out", str(out)]
    args = run_args(*recovery, script, *train, worker_num=2, master_port=port, log_dir=logs)
    run = processes.start("run", args, job_env(2, 0))
    rank1 = logs / "worker_1.log"
    wait_until(
        lambda: rank1.exists() and "rank 1 lingers after its loop" in rank1.read_text(),
        START_S,
        "rank 1 after its loop",
    )
    wait_until(lambda: launched_pid(logs, "worker_0") is None, START_S, "rank 0's exit")
    os.kill(launched(logs, "worker_1"), signal.SIGKILL)
    assert run.wait(START_S) == 0, run.output
    text = rank1.read_text()
    assert re.search(r"generation 2 \(.*\): resuming from step 30\n", text), text
    assert (out / "final.sha256").exists()


def test_a_bug_in_a_step_ends_the_worker_at_once_and_its_peer_with_it(
    processes: Procs, tmp_path: Path
) -> None:
    """A ZeroDivisionError in rank 1's step is the program's, not a peer's failure: it is raised
    at once, with its traceback. Every error of a step waited MS_NODE_TIMEOUT + 2 s for a peer's
    failure that was not coming (62 s here), while rank 0 sat in its all_reduce on rank 1's gloo
    group: rank 1 exited after 62 s, rank 0 after gloo's timeout. Now rank 0's all_reduce fails
    as soon as rank 1 has exited, and the job's failure (recovery off) names rank 1's error."""
    rank0, rank1 = start_job(processes, STEP_BUG, 2, MS_NODE_TIMEOUT="60", CK=str(tmp_path))
    rank1.wait_for_output("rank 1 divides by zero", START_S)
    assert rank1.wait(20) == 1, rank1.output
    assert "Traceback (most recent call last)" in rank1.output, rank1.output
    assert "ZeroDivisionError: division by zero" in rank1.output, rank1.output
    assert "waiting up to" not in rank1.output, rank1.output
    assert rank0.wait(20) == 1, rank0.output
    assert "rank 0 all_reduce raised" in rank0.output, rank0.output
    assert "JobFailedError: job failed: rank 1" in rank0.output, rank0.output
    assert "ZeroDivisionError: division by zero" in rank0.output, rank0.output


def start_with_a_spare(
    processes: Procs, tmp_path: Path, script: Path
) -> tuple[Process, Process, Process, Process]:
    """A scheduler (recovery on), workers '0' and '1' and a spare running `script`."""
    env = job_env(
        2,
        free_port(),
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        MS_NODE_TIMEOUT="10",
        CK=str(tmp_path / "checkpoints"),
    )
    sched = processes.start("sched", [PYTHON, "-m", "cluster", "scheduler"], env)
    rank0, rank1 = (
        processes.start_role(f"w{i}", "MS_WORKER", [str(script)], {**env, "MS_NODE_ID": str(i)})
        for i in range(2)
    )
    spare_env = {**env, "MS_NODE_ID": "spare-0", "CLUSTER_SPARE": "1"}
    spare = processes.start_role("spare", "MS_WORKER", [str(script)], spare_env)
    return sched, rank0, rank1, spare


def test_a_group_made_before_the_loop_survives_a_spare_taking_a_killed_rank(
    processes: Procs, tmp_path: Path
) -> None:
    """The program makes its gloo group at its top, before its TrainingLoop. Rank 1 is
    SIGKILLed and the spare takes its rank: the spare, running the program from its start,
    made its group first (a broadcast of the store's port), while rank 0's first collective of
    generation 2 was its loop's resume allgather. Rank 0 died of a CollectiveError ("called
    allgather as collective #1, but another rank called broadcast"), then the spare of
    PeerFailedError: the whole job. Now the loop makes that group again at its resume point,
    before the allgather, and both go on to the end with every step counted once."""
    sched, rank0, rank1, spare = start_with_a_spare(processes, tmp_path, EARLY_GROUP)
    rank1.wait_for_output("rank 1 step 10 done", START_S)
    rank1.popen.send_signal(signal.SIGKILL)
    for worker in (rank0, spare):
        assert worker.wait(START_S) == 0, worker.output
    assert "promoted: this spare takes rank 1 in generation 2" in spare.output, spare.output
    assert "rank 1 made its group in generation 2" in spare.output, spare.output
    assert "rank 0 loop over: w=80" in rank0.output, rank0.output
    assert "rank 1 loop over: w=80" in spare.output, spare.output
    assert sched.wait(30) == 0, sched.output
    for worker in (rank0, spare):
        assert "CollectiveError" not in worker.output, worker.output


def test_another_collective_before_the_loop_is_named_where_the_loop_resumes(
    processes: Procs, tmp_path: Path
) -> None:
    """What the loop cannot make again (a cluster.barrier() before the loop) meets a survivor's
    resume allgather when a spare comes in: the survivor died of a bare CollectiveError ("rank
    0 called allgather as collective #1, but another rank called barrier"). It now dies of a
    ConfigError that names the likely cause and the fix, in one line. The loop knows the
    mismatch by its type (CollectiveMismatchError, from the reason of the scheduler's
    refusal), not by the scheduler's words; the program sees that type as the error's cause."""
    _sched, rank0, rank1, _spare = start_with_a_spare(processes, tmp_path, BEFORE_LOOP)
    rank1.wait_for_output("rank 1 step 5 done", START_S)
    rank1.popen.send_signal(signal.SIGKILL)
    assert rank0.wait(START_S) == 1, rank0.output
    assert "rank 0 loop raised for CollectiveMismatchError" in rank0.output, rank0.output
    [line] = [line for line in rank0.output.splitlines() if "cluster: " in line]
    assert "ConfigError: the TrainingLoop's first collective of generation 2" in line, line
    assert "called allgather as collective #1, but another rank called barrier" in line, line
    assert line.endswith("make it in set_state or in a step"), line
    assert "Traceback" not in rank0.output, rank0.output


def test_the_agent_aborts_an_nccl_group_once_when_its_generation_ends(
    processes: Procs, tmp_path: Path
) -> None:
    """An NCCL survivor's main thread blocked in a CUDA sync behind a collective its failed
    peer never joins raises nothing, so its loop never reached the abort of its group, and it
    hung until torch's watchdog. The agent, which hears of the failure, now aborts the group
    itself, on a thread of its own. No GPU here: a fake stands in for torch's NCCL group
    (tests/integration/scripts/torch_abort_hook.py); test_gpu.py aborts a real one. Only an
    NCCL group registers the abort; it runs once for generation 1, though rank 0's agent hears
    both rank 1's failure and the spare's generation 2, and while the main thread is blocked."""
    _sched, rank0, rank1, _spare = start_with_a_spare(processes, tmp_path, ABORT_HOOK)
    rank1.wait_for_output("rank 1 enders with an nccl group: 1", START_S)
    rank0.wait_for_output("rank 0 blocked", START_S)
    rank1.popen.send_signal(signal.SIGKILL)
    assert rank0.wait(START_S) == 0, rank0.output
    lines = [line for line in rank0.output.splitlines() if line.startswith("rank 0 ")]
    assert lines == [
        "rank 0 enders with a gloo group: 0",
        "rank 0 enders with an nccl group: 1",
        "rank 0 blocked",
        "rank 0 released: True",
        "rank 0 abort on cluster-generation-1-over of generation 1",
    ], rank0.output
