"""A promoted spare whose checkpoint directory is its own (as on another host) gets its state from
the survivors' state servers, with real processes: two workers of replicated_counter.py and a
spare; node '1' dies where the test says, and every other process of the job must exit 0 with
the final state on every rank. And a worker restarted after the others finished the job ends
alone."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.testing import Process, StatusClient, free_port, wait_until
from tests.procs import ROOT, Procs, job_env

pytest.importorskip("numpy")

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "replicated_counter.py"
EXIT_S = 60


@dataclass
class CounterJob:
    """A scheduler, workers '0' and '1' and (`with_spare`) spare 'spare-0' of
    replicated_counter.py (or `script`) ARGS, each with a checkpoint directory of its own."""

    processes: Procs
    tmp: Path
    args: tuple[str, ...]
    with_spare: bool = True
    node_timeout_s: str = "2"
    first_of_node_1: tuple[str, ...] = ()  # more arguments for node '1''s first process
    script: Path = SCRIPT

    def __post_init__(self) -> None:
        self.env = job_env(
            2,
            free_port(),
            MS_ENABLE_RECOVERY="1",
            MS_RECOVERY_PATH=str(self.tmp / "recovery"),
            MS_NODE_TIMEOUT=self.node_timeout_s,
        )
        scheduler = ["-m", "cluster", "scheduler"]
        self.scheduler = self.processes.start_role("sched", "MS_SCHED", scheduler, self.env)
        self.workers = [self.start("0"), self.start("1", *self.first_of_node_1)]
        self.spare = self.start("spare-0", CLUSTER_SPARE="1") if self.with_spare else None

    def start(self, node: str, *more: str, host: str = "", **extra: str) -> Process:
        """Node `node` of the job with ARGS and `more` (again: a restarted worker, with the same
        directory, or that of `host`)."""
        directory = self.tmp / f"host-{host or node}"
        script = [str(self.script), str(directory), *self.args, *more]
        return self.processes.start_role(
            f"{node}-{len(self.processes.started)}",
            "MS_WORKER",
            script,
            {**self.env, "MS_NODE_ID": node, **extra},
        )

    def finished_by_the_spare(self, steps: int) -> Process:
        """Node '1' died, the spare took rank 1, and every other process exited 0, rank 0 and
        the spare with the state of `steps`; the spare."""
        assert self.spare is not None
        assert self.workers[1].wait(EXIT_S) == 1, self.workers[1].output
        for proc in (self.spare, self.workers[0], self.scheduler):
            assert proc.wait(EXIT_S) == 0, proc.output
        assert "promoted: this spare takes rank 1" in self.spare.output, self.spare.output
        final = f"rank {{}} final w {float(steps)}"
        assert final.format(0) in self.workers[0].output, self.workers[0].output
        assert final.format(1) in self.spare.output, self.spare.output
        return self.spare


def test_a_manager_made_before_init_serves_its_step_in_memory_before_its_first_save(
    processes: Procs, tmp_path: Path
) -> None:
    """The managers are made before cluster.init() and save every 100 steps: node '1' dies in
    step 5, before anything is saved. The job resumes from step 5, which rank 0 holds in
    memory only: the spare fetches it from rank 0's state server, which a manager made before
    init starts once the TrainingLoop connects it, not at its first save."""
    job = CounterJob(processes, tmp_path, ("--early", "--die-in-step", "5"))
    spare = job.finished_by_the_spare(10)
    assert "fetched the checkpoint of step 5 (" in spare.output, spare.output
    assert "serving this worker's checkpoints to peers at" in job.workers[0].output


def test_a_spare_whose_fetch_finds_its_holder_hung_waits_for_the_next_generation(
    processes: Procs, tmp_path: Path
) -> None:
    """Node '1' dies in step 5; the spare, taking its rank, fetches step 5 from rank 0, which
    holds it in memory only, and rank 0 is stopped as the fetch begins. The fetch gives up on
    it after 10 s of silence, before the scheduler names it (MS_NODE_TIMEOUT 12 s): the spare
    crashed with a CheckpointError. It now waits for the scheduler's word, and for the next
    generation: rank 0, continued, rejoins, and the job finishes."""
    cue = tmp_path / "cue"
    args = ("--die-in-step", "5", "--fetch-on-cue", str(cue))
    job = CounterJob(processes, tmp_path, args, node_timeout_s="12")
    assert job.spare is not None
    job.spare.wait_for_output("fetching step 5", EXIT_S)
    job.workers[0].signal(signal.SIGSTOP)
    cue.touch()
    job.spare.wait_for_output("a peer failed; waiting for the job's next generation", EXIT_S)
    assert "no peer gave its state; waiting up to 14 s" in job.spare.output, job.spare.output
    job.workers[0].signal(signal.SIGCONT)
    job.finished_by_the_spare(10)


def test_the_survivors_finish_only_once_the_spare_has_fetched_the_final_step(
    processes: Procs, tmp_path: Path
) -> None:
    """Every rank saves every step; node '1' dies once every rank holds the final step, before
    the loop's end barrier: the next generation's rollback step is the end. Rank 0 puts it back
    from its own file, and the spare, whose directory holds nothing, fetches it from rank 0,
    whose state server stops when it finalizes: rank 0 waits at the end barrier for it."""
    job = CounterJob(processes, tmp_path, ("--steps", "4", "--save-every", "1", "--die-at-the-end"))
    spare = job.finished_by_the_spare(4)
    assert "node 1 dies: every rank holds step 4" in job.workers[1].output
    assert "the newest checkpoint every rank holds is step 4" in spare.output
    assert "fetched the checkpoint of step 4 (" in spare.output, spare.output


def test_a_worker_killed_after_the_end_barrier_finishes_alone_once_restarted(
    processes: Procs, tmp_path: Path
) -> None:
    """Every rank passed the end barrier; node '1' lingers after its loop, rank 0 finishes, and
    node '1' is SIGKILLed and restarted (no spare). Its generation resumes at the end, from its
    own file; at the end barrier rank 0 has finished already, which says the job's end was
    agreed: it exits 0, and so does the job."""
    job = CounterJob(
        processes, tmp_path, ("--steps", "4", "--linger-after-the-loop"), with_spare=False
    )
    job.workers[1].wait_for_output("node 1 lingers after its loop", EXIT_S)
    assert job.workers[0].wait(EXIT_S) == 0, job.workers[0].output
    job.workers[1].signal(signal.SIGKILL)
    assert job.workers[1].wait(EXIT_S) == -signal.SIGKILL
    restarted = job.start("1")
    assert restarted.wait(EXIT_S) == 0, restarted.output
    assert job.scheduler.wait(EXIT_S) == 0, job.scheduler.output
    assert "resuming from step 4\n" in restarted.output, restarted.output
    assert "node 1 rank 1 final w 4.0" in restarted.output, restarted.output
    assert "the other workers finished the job before this one came back" in restarted.output


def test_a_rank_that_fails_once_every_other_worker_finished_waits_for_its_node(
    processes: Procs, tmp_path: Path
) -> None:
    """As above, with a spare: node '1' is SIGKILLed after rank 0 finished. No spare takes its
    rank (none could fetch the final state: the only peer that held it has finished); the rank
    waits for node '1', which comes back, finishes from its own file, and so does the job. The
    spare, never promoted, exits 0 with it."""
    job = CounterJob(processes, tmp_path, ("--steps", "4", "--linger-after-the-loop"))
    assert job.spare is not None
    job.workers[1].wait_for_output("node 1 lingers after its loop", EXIT_S)
    assert job.workers[0].wait(EXIT_S) == 0, job.workers[0].output
    job.workers[1].signal(signal.SIGKILL)
    assert job.workers[1].wait(EXIT_S) == -signal.SIGKILL
    job.scheduler.wait_for_output("no spare takes rank 1: every other worker has finished", EXIT_S)
    restarted = job.start("1")
    assert restarted.wait(EXIT_S) == 0, restarted.output
    assert job.scheduler.wait(EXIT_S) == 0, job.scheduler.output
    assert job.spare.wait(EXIT_S) == 0, job.spare.output
    assert "promoted" not in job.spare.output, job.spare.output
    assert "node 1 rank 1 final w 4.0" in restarted.output, restarted.output


def test_the_rank_waits_for_its_node_and_says_so_while_its_spare_is_away(
    processes: Procs, tmp_path: Path
) -> None:
    """As above, with the spare taken for dead when node '1' fails (stopped past MS_NODE_TIMEOUT,
    as a loaded machine may starve it): the scheduler still says why the rank waits, which it
    said only while a live spare waited. The spare, continued, waits out its guard and comes
    back as a spare; nothing takes the rank from node '1'."""
    job = CounterJob(processes, tmp_path, ("--steps", "4", "--linger-after-the-loop"))
    spare = job.spare
    assert spare is not None
    job.workers[1].wait_for_output("node 1 lingers after its loop", EXIT_S)
    assert job.workers[0].wait(EXIT_S) == 0, job.workers[0].output
    status = StatusClient(f"{job.env['MS_SCHED_HOST']}:{job.env['MS_SCHED_PORT']}")
    try:
        spare.signal(signal.SIGSTOP)
        wait_until(
            lambda: any(
                n.node_id == "spare-0" and n.state == "failed"
                for n in getattr(status.fetch(), "nodes", ())
            ),
            EXIT_S,
            "the scheduler takes the stopped spare for dead",
        )
    finally:
        status.close()
    job.workers[1].signal(signal.SIGKILL)
    assert job.workers[1].wait(EXIT_S) == -signal.SIGKILL
    job.scheduler.wait_for_output("no spare takes rank 1: every other worker has finished", EXIT_S)
    spare.signal(signal.SIGCONT)
    restarted = job.start("1")
    assert restarted.wait(EXIT_S) == 0, restarted.output
    assert job.scheduler.wait(EXIT_S) == 0, job.scheduler.output
    assert spare.wait(EXIT_S) == 0, spare.output
    assert "promoted" not in spare.output, spare.output
    assert "node 1 rank 1 final w 4.0" in restarted.output, restarted.output


def test_a_spare_that_trained_past_its_previous_holders_files_keeps_the_rank_for_its_node(
    processes: Procs, tmp_path: Path
) -> None:
    """Saves every 4 steps; node '1' dies in step 5, the spare takes rank 1 from step 4 and
    trains to the end, step 8, on its own disk, lingers there, and is SIGKILLed once rank 0
    has finished. Node '1', restarted, holds step 4 only: it waits as a spare instead of taking
    the rank back (no peer is left to give it step 8: it exited 1). The rank waits for the
    spare's node, which comes back, finishes from its own files, and so does the job."""
    args = ("--steps", "8", "--save-every", "4", "--spare-lingers-after-the-loop")
    job = CounterJob(processes, tmp_path, args, first_of_node_1=("--die-in-step", "5"))
    assert job.spare is not None
    assert job.workers[1].wait(EXIT_S) == 1, job.workers[1].output
    job.spare.wait_for_output("node spare-0 lingers after its loop", EXIT_S)
    assert job.workers[0].wait(EXIT_S) == 0, job.workers[0].output
    job.spare.signal(signal.SIGKILL)
    assert job.spare.wait(EXIT_S) == -signal.SIGKILL
    previous = job.start("1")
    previous.wait_for_output("as a spare", EXIT_S)
    spare = job.start("spare-0", CLUSTER_SPARE="1")  # taken once its guard is over
    for proc in (previous, spare, job.scheduler):
        assert proc.wait(EXIT_S) == 0, proc.output
    assert "promoted" not in previous.output, previous.output
    assert "resuming from step 8\n" in spare.output, spare.output
    assert "node spare-0 rank 1 final w 8.0" in spare.output, spare.output
    assert (
        "node '1', which held it before, does not take it back: the rank reached step 8 after "
        "it, and the newest step it reported was 4"
    ) in job.scheduler.output, job.scheduler.output


def test_a_worker_restarted_on_an_empty_disk_keeps_the_rollback_step_on_disk(
    processes: Procs, tmp_path: Path
) -> None:
    """Saves every 4 steps; node '1' dies in step 6 and is restarted on an empty disk (as on
    another host): generation 2 resumes from step 6, which rank 0 holds in memory, a step
    between saves. Then every worker dies in step 7, before the next save, and both are
    restarted: nobody holds a step in memory, so generation 3 resumes from the rollback step on
    disk. That is step 4, which rank 0 holds, and so does node '1': on taking the rank it got
    the rank's rollback step as a file of its own. Not step 0, with every step lost."""
    args = ("--save-every", "4", "--all-die-in-step", "7")
    job = CounterJob(
        processes, tmp_path, args, with_spare=False, first_of_node_1=("--die-in-step", "6")
    )
    assert job.workers[1].wait(EXIT_S) == 1, job.workers[1].output
    second = job.start("1", host="elsewhere")
    for proc in (job.workers[0], second):
        proc.wait_for_output("dies in step 7 of generation 2", EXIT_S)
        assert proc.wait(EXIT_S) == 1, proc.output
    assert "resuming from step 6 in memory (a peer's copy" in second.output, second.output
    last = [job.start("0"), job.start("1", host="elsewhere")]
    for rank, proc in enumerate(last):
        assert proc.wait(EXIT_S) == 0, proc.output
        assert "resuming from step 4\n" in proc.output, proc.output
        assert f"rank {rank} final w 10.0" in proc.output, proc.output
    assert job.scheduler.wait(EXIT_S) == 0, job.scheduler.output
    assert "fetched the checkpoint of step 4 (" in second.output, second.output


def test_a_newcomer_that_no_peer_gives_the_rollback_step_goes_on_from_memory(
    processes: Procs, tmp_path: Path
) -> None:
    """As above, but rank 0's checkpoint files are removed by hand while node '1' is down: the
    restarted node '1' gets step 6 from rank 0's memory, and no peer gives it step 4. It says
    what that costs and goes on from step 6, and the job finishes."""
    args = ("--save-every", "4")
    job = CounterJob(
        processes, tmp_path, args, with_spare=False, first_of_node_1=("--die-in-step", "6")
    )
    assert job.workers[1].wait(EXIT_S) == 1, job.workers[1].output
    files = list((tmp_path / "host-0" / "rank_0").glob("w-*.ckpt"))
    assert files, "rank 0 holds no checkpoint file"
    for path in files:
        path.unlink()
    second = job.start("1", host="elsewhere")
    for rank, proc in enumerate((job.workers[0], second)):
        assert proc.wait(EXIT_S) == 0, proc.output
        assert f"rank {rank} final w 10.0" in proc.output, proc.output
    assert "resuming from step 6 in memory (a peer's copy" in second.output, second.output
    assert "does not hold the rollback step 4 on disk, and no live peer gave" in second.output
