"""cluster.tools.launch_policy: what `mscluster run` does next, from what it has seen."""

from __future__ import annotations

import dataclasses
import signal

from hypothesis import given
from hypothesis import strategies as st

from cluster.scheduler.machine.state import Phase
from cluster.tools.launch_policy import (
    JOINING_ANSWER_S,
    Action,
    Decision,
    JobSeen,
    Seen,
    WorkerSeen,
    awaits_joined,
    awaits_scheduler,
    cause,
    decide,
    describe_exit,
    error_line,
    joined_by_answers,
    not_joined_note,
    unjoined,
    unjoined_line,
    why_not_restart,
    why_not_restart_scheduler,
)

READY = JobSeen(Phase.READY, recovery=True)
READY_NO_RECOVERY = JobSeen(Phase.READY, recovery=False)
WAITING = JobSeen(Phase.WAITING, recovery=False)
KILLED = -signal.SIGKILL


def workers(*codes: int | None, restarts: int = 0) -> tuple[WorkerSeen, ...]:
    return tuple(WorkerSeen(i, code, restarts) for i, code in enumerate(codes))


def test_a_signal_stops_the_job_whatever_else_happened() -> None:
    seen = Seen(workers(KILLED, 0), max_restarts=3, stop_signal=signal.SIGINT, now=READY)
    assert decide(seen) == Decision(Action.STOP)


def test_running_workers_mean_wait() -> None:
    assert decide(Seen(workers(None, None, 0))) == Decision(Action.WAIT)


def test_every_worker_exiting_0_finishes_the_job() -> None:
    assert decide(Seen(workers(0, 0), own_scheduler=True)) == Decision(Action.FINISH)


def test_a_failed_worker_is_restarted_while_restarts_are_left_and_the_job_can_take_it() -> None:
    seen = Seen(workers(None, KILLED), max_restarts=2, last=READY, now=READY)
    assert decide(seen) == Decision(Action.RESTART, 1)


def test_no_restarts_asked_for_fails_the_job_naming_the_option() -> None:
    decision = decide(Seen(workers(None, 1), max_restarts=0, last=READY, now=READY))
    assert decision == Decision(Action.FAIL, 1, "no restarts left (--max-restarts 0)")


def test_restarts_used_up_fail_the_job() -> None:
    seen = Seen(workers(1, restarts=2), max_restarts=2, last=READY, now=READY)
    assert decide(seen).action is Action.FAIL


def test_a_formed_job_without_recovery_takes_no_worker_back_before_its_scheduler_knows() -> None:
    """The scheduler still answers READY (the dead worker's connection outlives it: a forked
    child holds it): a worker started again would wait out the guard and be refused, its
    restart used up and its refusal blamed instead of the crash."""
    seen = Seen(workers(None, 3), max_restarts=3, last=READY_NO_RECOVERY, now=READY_NO_RECOVERY)
    assert decide(seen) == Decision(
        Action.FAIL, 1, "the job had formed and recovery is off, so it cannot take it back"
    )
    forming = JobSeen(Phase.WAITING, recovery=False)
    assert decide(Seen(workers(None, 3), max_restarts=3, last=forming, now=forming)) == Decision(
        Action.RESTART, 1
    )


def test_a_job_that_is_over_does_not_take_a_restarted_worker() -> None:
    over = JobSeen(Phase.FAILED, recovery=False, detail="rank 0 died")
    seen = Seen(workers(1), max_restarts=3, last=READY_NO_RECOVERY, now=over)
    assert decide(seen) == Decision(
        Action.FAIL, 0, "the job is failed (rank 0 died) and recovery is off"
    )


def test_an_exited_scheduler_of_ours_takes_no_worker_back() -> None:
    seen = Seen(
        workers(1),
        max_restarts=3,
        own_scheduler=True,
        scheduler_exit=1,
        last=READY_NO_RECOVERY,
    )
    assert why_not_restart(seen.workers[0], seen) == "the scheduler has exited; recovery is off"


def test_with_standbys_the_leader_decides_once_our_scheduler_handed_over() -> None:
    """Our scheduler exited 0 after handing the job to a standby: the leader's answer says
    whether a failed worker is taken back, not our scheduler's exit."""
    handed = Seen(
        workers(1, None),
        max_restarts=1,
        own_scheduler=True,
        scheduler_exit=0,
        standbys=True,
        last=READY,
        now=READY,
    )
    assert decide(handed) == Decision(Action.RESTART, 0)
    gone = dataclasses.replace(handed, now=None, unreachable="no scheduler answers")
    assert decide(gone) == Decision(
        Action.FAIL, 0, "the job had formed and its scheduler is gone (no scheduler answers)"
    )
    alone = dataclasses.replace(handed, standbys=False)
    assert decide(alone) == Decision(Action.FAIL, 0, "the scheduler has exited")


def test_a_silent_scheduler_of_a_job_still_forming_can_take_the_worker() -> None:
    forming = JobSeen(Phase.WAITING, recovery=False)
    for last in (None, forming):
        seen = Seen(workers(1), max_restarts=1, last=last, now=None, unreachable="refused")
        assert decide(seen) == Decision(Action.RESTART, 0)


def test_a_silent_scheduler_of_a_formed_job_cannot() -> None:
    seen = Seen(workers(1), max_restarts=1, last=READY_NO_RECOVERY, unreachable="refused")
    reason = why_not_restart(seen.workers[0], seen)
    assert reason is not None
    assert "its scheduler is gone (refused)" in reason
    assert "recovery is off" in reason


CONNECTION_REFUSED = "no scheduler answers at 127.0.0.1:8118: Connection refused"
# The OOM killer took the scheduler and rank 1 together; the launcher started the scheduler
# again, and it does not listen yet when rank 1's exit is decided on.
RESTARTED_SILENT = Seen(
    (WorkerSeen(0, None), WorkerSeen(1, KILLED)),
    max_restarts=3,
    own_scheduler=True,
    scheduler_exit=None,
    scheduler_restarts=1,
    recovery=True,
    last=READY,
    now=None,
    unreachable=CONNECTION_REFUSED,
    scheduler_silent_s=0.01,
    scheduler_start_s=1800.0,
)


def test_a_scheduler_of_ours_started_again_a_moment_ago_is_asked_again_not_taken_for_gone() -> None:
    """The decision on rank 1 waits for the answer of the scheduler started again (within the
    job's wait for its scheduler), and that answer decides."""
    assert awaits_scheduler(RESTARTED_SILENT)
    assert decide(RESTARTED_SILENT).action is Action.ASK
    assert decide(RESTARTED_SILENT).worker == 1
    # It answers: the job takes rank 1 back.
    answered = dataclasses.replace(RESTARTED_SILENT, now=READY, unreachable="")
    assert decide(answered) == Decision(Action.RESTART, 1)
    # It answers that the job is over: rank 1 is not started again.
    over = JobSeen(Phase.FAILED, recovery=True, detail="rank 0 died")
    assert decide(dataclasses.replace(answered, now=over)).action is Action.FAIL


def test_a_scheduler_of_ours_silent_past_its_bound_or_exited_fails_the_formed_job() -> None:
    past = dataclasses.replace(RESTARTED_SILENT, scheduler_silent_s=1800.0)
    assert decide(past) == Decision(
        Action.FAIL,
        1,
        "the job had formed and its scheduler, running, has not answered for 1800 s "
        f"({CONNECTION_REFUSED})",
    )
    # Exited (dead, not to be started again): no answer is waited for.
    exited = dataclasses.replace(past, scheduler_exit=1, scheduler_silent_s=None)
    assert decide(exited).action is Action.FAIL
    # Killed and to be started again: that comes first.
    killed = dataclasses.replace(exited, scheduler_exit=KILLED)
    assert decide(killed) == Decision(Action.RESTART_SCHEDULER)


def test_a_silent_scheduler_is_waited_for_only_where_its_answer_can_take_the_worker() -> None:
    waiting = dataclasses.replace(RESTARTED_SILENT, max_restarts=1)
    assert decide(waiting).action is Action.ASK
    # A job still forming (or never answered) takes the worker without an answer.
    for last in (None, JobSeen(Phase.WAITING, recovery=True)):
        assert decide(dataclasses.replace(waiting, last=last)) == Decision(Action.RESTART, 1)
    # Without recovery a formed job never takes it back; with no restarts left, nothing can.
    assert decide(dataclasses.replace(waiting, last=READY_NO_RECOVERY)).action is Action.FAIL
    used_up = dataclasses.replace(waiting, workers=workers(None, KILLED, restarts=1))
    assert decide(used_up).action is Action.FAIL
    # A scheduler that is not ours, or a refused read (one that is up), is not waited for.
    assert decide(dataclasses.replace(waiting, own_scheduler=False)).action is Action.FAIL
    refused = dataclasses.replace(waiting, unreachable="", unread=REFUSED)
    assert decide(refused) == Decision(Action.RESTART, 1)


REFUSED = (
    "the scheduler at 127.0.0.1:8118 refused the proof made with the secret of "
    "CLUSTER_JOB_SECRET_FILE='job.secret': it is not this job's secret (3 tries)"
)


def test_a_refused_read_is_no_gone_scheduler_and_a_recovering_job_takes_the_worker_back() -> None:
    """The launcher's fresh read was refused (the scheduler is up): its last answer decides,
    as a fresh one would, and a formed job with recovery takes a killed worker back."""
    seen = Seen(
        (WorkerSeen(0, None), WorkerSeen(1, None), WorkerSeen(2, KILLED), WorkerSeen(3, None)),
        max_restarts=2,
        own_scheduler=True,
        recovery=True,
        last=READY,
        now=None,
        unread=REFUSED,
    )
    assert decide(seen) == Decision(Action.RESTART, 2)
    forming = JobSeen(Phase.WAITING, recovery=False)
    for last in (None, forming):
        assert decide(dataclasses.replace(seen, last=last)) == Decision(Action.RESTART, 2)


def test_a_refused_read_leaves_a_job_over_or_without_recovery_failed_saying_so() -> None:
    seen = Seen(workers(KILLED), max_restarts=1, last=READY_NO_RECOVERY, unread=REFUSED)
    decision = decide(seen)
    assert decision.action is Action.FAIL
    assert "recovery is off" in decision.reason
    assert f"its scheduler is up but refused a fresh read: {REFUSED}" in decision.reason
    assert "gone" not in decision.reason
    over = JobSeen(Phase.FAILED, recovery=True, detail="rank 1 died")
    reason = decide(dataclasses.replace(seen, last=over)).reason
    assert reason.startswith("the job was failed at its last answer (rank 1 died); its scheduler")


def test_a_failed_scheduler_of_ours_fails_the_job() -> None:
    seen = Seen(workers(None, None), own_scheduler=True, scheduler_exit=1)
    assert decide(seen) == Decision(Action.FAIL, None, "it exited with code 1, which ends the job")


def test_a_killed_scheduler_of_ours_is_started_again_with_recovery() -> None:
    seen = Seen(
        workers(None, None),
        max_restarts=1,
        own_scheduler=True,
        scheduler_exit=KILLED,
        recovery=True,
        last=READY,
    )
    assert decide(seen) == Decision(Action.RESTART_SCHEDULER)


def test_a_scheduler_that_never_answered_is_started_again_too() -> None:
    seen = Seen(workers(None), 1, own_scheduler=True, scheduler_exit=KILLED, recovery=True)
    assert decide(seen) == Decision(Action.RESTART_SCHEDULER)


def test_scheduler_restarts_are_counted_apart_from_the_workers() -> None:
    # The workers used theirs up; the scheduler has its own.
    seen = Seen(
        workers(None, restarts=2),
        max_restarts=2,
        own_scheduler=True,
        scheduler_exit=KILLED,
        scheduler_restarts=1,
        recovery=True,
        last=READY,
    )
    assert decide(seen) == Decision(Action.RESTART_SCHEDULER)
    used_up = Seen(**{**seen.__dict__, "scheduler_restarts": 2})
    assert decide(used_up) == Decision(Action.FAIL, None, "no restarts left (--max-restarts 2)")


def test_without_recovery_a_killed_scheduler_fails_the_job_as_before() -> None:
    seen = Seen(workers(None), 3, own_scheduler=True, scheduler_exit=KILLED, last=READY)
    decision = decide(seen)
    assert decision.action is Action.FAIL
    assert decision.worker is None
    assert "recovery is off" in decision.reason


def test_a_scheduler_that_exited_by_itself_ended_the_job_and_is_not_started_again() -> None:
    # Exit 1: it ended the job as failed (or could not go on); 2: it could not start. Started
    # again it would begin a new job, or fail the same way.
    for code in (1, 2):
        seen = Seen(workers(None), 3, own_scheduler=True, scheduler_exit=code, recovery=True)
        assert why_not_restart_scheduler(seen) == f"it exited with code {code}, which ends the job"
        assert decide(seen).action is Action.FAIL


def test_a_scheduler_that_left_the_job_to_resume_is_started_again() -> None:
    """Exit 0 before the job's end, with recovery and no standby: stopped by SIGTERM alone, it
    saved the job and left it to a scheduler started again; against its restarts."""
    seen = Seen(
        workers(None, None), 1, own_scheduler=True, scheduler_exit=0, recovery=True, last=READY
    )
    assert decide(seen) == Decision(Action.RESTART_SCHEDULER)
    used_up = dataclasses.replace(seen, scheduler_restarts=1)
    assert decide(used_up) == Decision(Action.FAIL, None, "no restarts left (--max-restarts 1)")
    # The job's end seen (its answer, its event log): a scheduler done with the job.
    assert decide(dataclasses.replace(seen, ended=True)) == Decision(Action.WAIT)
    assert decide(dataclasses.replace(seen, ended=True, workers=workers(0, 0))).action is (
        Action.FINISH
    )
    # A standby took it over; without recovery exit 0 is the job's end.
    assert decide(dataclasses.replace(seen, standbys=True)) == Decision(Action.WAIT)
    assert decide(dataclasses.replace(seen, recovery=False)) == Decision(Action.WAIT)
    # A signal to the launcher still ends the job.
    stopped = dataclasses.replace(seen, stop_signal=signal.SIGINT)
    assert decide(stopped) == Decision(Action.STOP)


def test_a_scheduler_killed_after_the_job_ended_is_not_started_again() -> None:
    over = JobSeen(Phase.FAILED, recovery=True, detail="rank 1 never came back")
    seen = Seen(
        workers(None), 3, own_scheduler=True, scheduler_exit=KILLED, recovery=True, last=over
    )
    assert why_not_restart_scheduler(seen) == "the job was already failed"


def test_a_signal_wins_over_a_scheduler_restart() -> None:
    seen = Seen(
        workers(None),
        3,
        own_scheduler=True,
        scheduler_exit=KILLED,
        recovery=True,
        stop_signal=signal.SIGTERM,
    )
    assert decide(seen) == Decision(Action.STOP)


def test_a_scheduler_that_is_not_ours_is_not_watched() -> None:
    assert decide(Seen(workers(None), own_scheduler=False, scheduler_exit=1)).action is Action.WAIT


def test_the_cause_is_the_worker_killed_by_a_signal_not_one_that_exited_because_of_it() -> None:
    assert cause(workers(1, KILLED, 1), first=0) == 1
    assert cause(workers(1, 1), first=0) == 0
    assert cause(workers(None, None), first=None) is None


def test_of_several_killed_the_cause_is_the_earliest_ranked_one_not_a_consequence() -> None:
    """Rank 1 SIGKILLed (the OOM killer), then rank 0 SIGABRTed of it (NCCL's watchdog): the
    index does not decide. A spare killed long before is no cause of a later failure."""
    abort = -signal.SIGABRT
    died = (WorkerSeen(0, abort, exited_at=1.2), WorkerSeen(1, KILLED, exited_at=1.0))
    assert cause(died, first=1) == 1
    assert cause(died, first=None) == 1
    told = {0: "cluster: JobFailedError: job failed: rank 1 (node '1') died"}
    aborted_first = (WorkerSeen(0, abort, exited_at=0.9), WorkerSeen(1, KILLED, exited_at=1.0))
    assert cause(aborted_first, first=0, errors=told) == 0  # the first to fail, killed
    assert cause(aborted_first, first=None, errors=told) == 1  # its line is the job's failure
    spare = WorkerSeen(2, KILLED, spare=True, exited_at=5.0)
    crashed = WorkerSeen(0, 3, exited_at=50.0)
    assert cause((crashed, WorkerSeen(1, None), spare), first=0) == 0


def test_the_cause_is_the_worker_that_died_of_its_own_error_whoever_exited_first() -> None:
    """Rank 1 dies of an NCCL error; the scheduler (told by the broken stream) or rank 0 (told
    of the job's failure) may exit before the launcher sees rank 1's exit."""
    nccl = "RuntimeError: NCCL error: Duplicate GPU detected"
    told = "cluster: JobFailedError: the job failed: node '1' exited"
    errors = {0: told, 1: nccl}
    assert cause(workers(1, 1), first=None, errors=errors, scheduler_exit=1) == 1
    assert cause(workers(1, 1), first=0, errors=errors) == 1
    assert cause(workers(1, 1), first=1, errors=errors) == 1
    peer = "cluster.protocol.errors.PeerFailedError: rank 1 died"
    assert cause(workers(1, 1), first=0, errors={0: peer, 1: nccl}) == 1
    # Nobody's own error: the first to fail.
    assert cause(workers(1, 1), first=None, errors={0: told, 1: None}, scheduler_exit=1) is None
    # The scheduler killed: it is the cause, though the workers print errors.
    assert cause(workers(1, 1), first=None, errors=errors, scheduler_exit=KILLED) is None
    # Rank 1 printed its error but its exit blocks (NCCL): the cause all the same.
    assert cause(workers(1, None), first=None, errors=errors, scheduler_exit=1) == 1
    assert cause(workers(1, None), first=0, errors={0: told, 1: None}) == 0
    # A spare's exit is never the cause.
    spare = (WorkerSeen(0, 1), WorkerSeen(1, 1, spare=True))
    assert cause(spare, first=0, errors={0: told, 1: nccl}) == 0


def test_the_first_failed_worker_is_the_one_that_exited_first_whatever_its_index() -> None:
    """Rank 2 exits 3; ranks 0, 1 and 3 die of the job's failure just after it, before the
    launcher decides: the failure is rank 2's."""
    gave_up = (
        WorkerSeen(0, 1, exited_at=10.2),
        WorkerSeen(1, 1, exited_at=10.3),
        WorkerSeen(2, 3, exited_at=10.0),
        WorkerSeen(3, None),
    )
    seen = Seen(gave_up, last=READY_NO_RECOVERY, now=READY_NO_RECOVERY)
    assert decide(seen).worker == 2
    assert decide(dataclasses.replace(seen, max_restarts=1, now=READY)) == Decision(
        Action.RESTART, 2
    )


def test_a_worker_that_died_of_the_job_s_failure_is_not_the_cause_of_it() -> None:
    """Rank 0 died of JobFailedError and was seen first (its exit raced rank 2's): rank 2,
    which exited with no such line, is the cause; the earliest of several."""
    told = "cluster: JobFailedError: job failed: rank 2 died"
    exits = (
        WorkerSeen(0, 1, exited_at=5.0),
        WorkerSeen(1, 3, exited_at=5.2),
        WorkerSeen(2, 3, exited_at=5.1),
    )
    assert cause(exits, first=0, errors={0: told, 1: None, 2: None}) == 2
    assert cause(exits, first=0, errors={0: told, 1: None, 2: told}) == 1
    # A first whose exit is no consequence stays the cause; so does one nobody else explains.
    assert cause(exits, first=1, errors={0: told, 1: None, 2: None}) == 1
    assert cause(exits, first=0, errors={0: told, 1: told, 2: told}) == 0


def test_exits_are_described_in_words() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(KILLED) == "was killed by SIGKILL"
    assert describe_exit(-200) == "was killed by signal 200"


codes = st.one_of(st.none(), st.integers(-15, 3))
jobs = st.one_of(
    st.none(),
    st.builds(JobSeen, st.sampled_from(list(Phase)), st.booleans(), st.text(max_size=5)),
)


@st.composite
def seens(draw: st.DrawFn) -> Seen:
    """What the launcher may have seen: workers' exits and restarts, its own scheduler's, the
    scheduler's answers."""
    exits = st.tuples(codes, st.integers(0, 3), st.booleans())
    codes_and_restarts = draw(st.lists(exits, min_size=1, max_size=5))
    own = draw(st.booleans())
    sched_exit = draw(st.one_of(st.none(), st.integers(-9, 2)))
    return Seen(
        tuple(WorkerSeen(i, c, r, finished=f) for i, (c, r, f) in enumerate(codes_and_restarts)),
        max_restarts=draw(st.integers(0, 3)),
        own_scheduler=own,
        scheduler_exit=sched_exit if own else None,
        scheduler_restarts=draw(st.integers(0, 3)),
        recovery=draw(st.booleans()),
        standbys=draw(st.booleans()),
        ended=draw(st.booleans()),
        last=draw(jobs),
        now=draw(jobs),
        unreachable=draw(st.sampled_from(["", "Connection refused"])),
        unread=draw(st.sampled_from(["", "refused"])),
        scheduler_silent_s=draw(st.one_of(st.none(), st.floats(0, 100))) if own else None,
        scheduler_start_s=draw(st.floats(0, 100)),
    )


@given(seens())
def test_decisions_respect_the_rules(seen: Seen) -> None:
    own, sched_exit, max_restarts = seen.own_scheduler, seen.scheduler_exit, seen.max_restarts
    last, now = seen.last, seen.now
    decision = decide(seen)
    if decision.action is Action.RESTART_SCHEDULER:
        assert own  # only our own,
        assert seen.recovery  # and only when it can resume the job
        assert sched_exit is not None
        # It died, or left the job to resume (exit 0 before its end, no standby to take it).
        assert sched_exit < 0 or (sched_exit == 0 and not seen.ended and not seen.standbys)
        assert seen.scheduler_restarts < max_restarts  # never beyond --max-restarts
        assert last is None or last.phase not in (Phase.FAILED, Phase.FINISHED)
    if decision.action is Action.RESTART:
        assert decision.worker is not None
        worker = seen.workers[decision.worker]
        assert worker.failed  # only a failed worker is started again,
        assert not worker.finished  # never one whose node finished (a node finishes once)
        assert worker.restarts < max_restarts  # never beyond --max-restarts
        assert now is None or now.phase not in (Phase.FAILED, Phase.FINISHED)
    if decision.action is Action.FAIL and decision.worker is not None:
        assert not seen.workers[decision.worker].finished  # its part was done: no failure
    if decision.action is Action.FINISH:
        assert all(w.exit_code == 0 or (w.finished and w.failed) for w in seen.workers)
    if decision.action is Action.ASK:  # an answer waited for: our scheduler's, within its bound
        assert decision.worker is not None
        assert seen.workers[decision.worker].failed
        assert seen.workers[decision.worker].restarts < max_restarts
        assert own
        assert sched_exit is None
        assert now is None
        assert seen.unreachable
        assert not seen.unread
        assert seen.scheduler_silent_s is not None
        assert seen.scheduler_silent_s < seen.scheduler_start_s
    if any(w.failed and not w.finished for w in seen.workers):  # a failure is never waited out
        assert decision.action in (
            Action.RESTART,
            Action.RESTART_SCHEDULER,
            Action.FAIL,
            Action.ASK,
        )
    if own and sched_exit not in (None, 0):  # nor is a dead scheduler of ours
        assert decision.action is not Action.WAIT
    if own and sched_exit == 0 and seen.recovery and not seen.standbys and not seen.ended:
        assert decision.action is not Action.WAIT  # nor one that left the job to resume


# -- spares (issue #15) -----------------------------------------------------------------------


def test_a_failed_spare_never_fails_the_job() -> None:
    spare = WorkerSeen(2, KILLED, spare=True)
    seen = Seen((*workers(None, None), spare), max_restarts=0, last=READY, now=READY)
    assert decide(seen) == Decision(Action.WAIT)


def test_a_killed_worker_whose_rank_a_spare_took_is_restarted_to_come_back_as_a_spare() -> None:
    replaced = WorkerSeen(1, KILLED, spare=True)
    seen = Seen((WorkerSeen(0, None), replaced), max_restarts=2, last=READY, now=READY)
    assert decide(seen) == Decision(Action.RESTART, 1)
    # With no restarts left, it is left alone: the job has its rank.
    used_up = Seen((WorkerSeen(0, None), replaced), max_restarts=0, last=READY, now=READY)
    assert decide(used_up) == Decision(Action.WAIT)


def test_the_job_finishes_when_its_ranked_workers_exited_0_whatever_the_spares_do() -> None:
    ranked = workers(0, 0)
    for code in (None, 0, KILLED):
        done = Seen((*ranked, WorkerSeen(2, code, spare=True)), own_scheduler=True, now=READY)
        assert decide(done) == Decision(Action.FINISH)


# -- a node that finished its part --------------------------------------------------------------


def test_a_worker_failed_after_its_finish_is_neither_restarted_nor_a_failure() -> None:
    """Rank 1 called finalize() (the scheduler counts its node finished) and was killed in its
    teardown while rank 0 trains: a new process of it would be refused (a node id finishes
    once), and the job does not need it."""
    after_finish = WorkerSeen(1, KILLED, finished=True)
    seen = Seen(
        (WorkerSeen(0, None), after_finish),
        max_restarts=3,
        own_scheduler=True,
        recovery=True,
        last=READY,
        now=READY,
    )
    assert after_finish.failed_after_finishing
    assert decide(seen) == Decision(Action.WAIT)
    # With no restarts asked for, or without recovery, the same: it is no failure of the job.
    assert decide(dataclasses.replace(seen, max_restarts=0)) == Decision(Action.WAIT)
    no_recovery = dataclasses.replace(seen, recovery=False, last=READY_NO_RECOVERY, now=None)
    assert decide(no_recovery) == Decision(Action.WAIT)
    # Rank 0 completes its training: the job is over.
    trained = dataclasses.replace(seen, workers=(WorkerSeen(0, 0), after_finish))
    assert decide(trained) == Decision(Action.FINISH)
    # Not finished (killed before its finalize() was heard): restarted as before.
    unfinished = dataclasses.replace(seen, workers=workers(None, KILLED))
    assert decide(unfinished) == Decision(Action.RESTART, 1)


def test_a_worker_that_failed_after_it_finished_is_never_the_cause_of_a_failure() -> None:
    """Rank 0 then fails on its own: it is the cause, not rank 1 killed after its finish."""
    exits = (WorkerSeen(0, 3, exited_at=9.0), WorkerSeen(1, KILLED, exited_at=2.0, finished=True))
    seen = Seen(exits, max_restarts=0, last=READY, now=READY)
    assert decide(seen) == Decision(Action.FAIL, 0, "no restarts left (--max-restarts 0)")
    assert cause(exits, first=0) == 0


NCCL_FAILURE = """\
epoch: 1 step: 1, loss is 0.5
Traceback (most recent call last):
  File "train_torch.py", line 90, in <module>
    main()
    ~~~~^^
ValueError: the first error
\x20
During handling of the above exception, another exception occurred:
\x20
Traceback (most recent call last):
  File "train_torch.py", line 97, in _data_parallel
    cluster.torch.init_process_group("nccl")
torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage
ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
Last error:
Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1a000
[rank0]:[W ProcessGroupNCCL.cpp:1476] Warning: destroy_process_group() was not called
"""


def test_the_error_line_is_the_first_line_of_the_last_traceback_s_error() -> None:
    assert error_line(NCCL_FAILURE.splitlines()) == (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, "
        "invalid usage"
    )


# What torch 2.11 and NCCL 2.28.9 printed on an H100 (two ranks on one GPU): torch's excepthook
# starts every line with the rank.
NCCL_FAILURE_RANKED = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "nccl_one_gpu.py", line 17, in <module>
[rank1]:     dist.all_reduce(tensor)
[rank1]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank1]: torch.distributed.DistBackendError: NCCL error in: NCCLUtils.cpp:93, invalid usage
[rank1]: ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
[rank1]: Last error:
[rank1]: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60
"""


def test_the_error_line_of_a_traceback_torch_prefixed_with_the_rank() -> None:
    assert error_line(NCCL_FAILURE_RANKED.splitlines()) == (
        "torch.distributed.DistBackendError: NCCL error in: NCCLUtils.cpp:93, invalid usage"
    )


def test_the_error_line_of_an_uncaught_cluster_error() -> None:
    lines = ["training", "cluster: PeerFailedError: rank 1 failed: it was killed", "bye"]
    assert error_line(lines) == "cluster: PeerFailedError: rank 1 failed: it was killed"


def test_no_error_line_without_an_error() -> None:
    assert error_line(["epoch: 1 step: 1, loss is 0.5", "Killed"]) is None
    assert error_line([]) is None
    assert error_line(["Traceback (most recent call last):", '  File "x.py"']) is None


def joined(*states: tuple[int | None, bool | None]) -> tuple[WorkerSeen, ...]:
    """Workers by (exit code, joined)."""
    return tuple(WorkerSeen(i, code, joined=j) for i, (code, j) in enumerate(states))


def test_workers_that_exit_0_without_joining_end_the_job_at_once() -> None:
    """A script that never calls cluster.init(): every worker exits 0, none joined. Not a
    finished job: the job cannot form, and the launcher says so rather than wait for its
    scheduler."""
    both = (
        WorkerSeen(0, 0, exited_at=2.0, joined=False),
        WorkerSeen(1, 0, exited_at=1.0, joined=False),
    )
    seen = Seen(both, own_scheduler=True, last=WAITING)
    assert decide(seen) == Decision(Action.UNJOINED, 1)  # the first to exit
    assert [w.index for w in unjoined(seen.workers)] == [0, 1]  # named in their order


def test_one_worker_that_exits_0_without_joining_ends_the_job_the_other_waits_for() -> None:
    """Its peer blocks in init() until the job forms, which it never will: the launcher knows
    the worker exited, so it ends the job rather than wait until MS_TOPO_TIMEOUT."""
    seen = Seen(joined((None, True), (0, False)), own_scheduler=True, last=WAITING)
    assert decide(seen) == Decision(Action.UNJOINED, 1)


def test_an_exit_0_not_yet_known_to_have_joined_waits_for_an_answer() -> None:
    """No answer since its exit (the scheduler not listening yet): not known, not decided."""
    assert decide(Seen(joined((None, None), (0, None)))) == Decision(Action.WAIT)
    assert decide(Seen(joined((0, None), (0, None)))) == Decision(Action.FINISH)


def test_a_job_whose_workers_joined_finishes_as_before() -> None:
    assert decide(Seen(joined((0, True), (0, True)))) == Decision(Action.FINISH)


def test_a_failed_exit_without_joining_is_decided_as_a_failure_with_its_own_error() -> None:
    seen = Seen(joined((None, True), (3, False)), now=WAITING)
    assert decide(seen) == Decision(Action.FAIL, 1, "no restarts left (--max-restarts 0)")
    assert unjoined(seen.workers) == []


def test_a_spare_that_exits_without_joining_is_no_loss_to_the_job() -> None:
    spare = WorkerSeen(2, 0, spare=True, joined=False)
    seen = Seen((*joined((0, True), (0, True)), spare))
    assert decide(seen) == Decision(Action.FINISH)


def test_the_unjoined_line_names_each_worker_its_exit_the_remedy_and_the_logs() -> None:
    one = unjoined_line([("worker 1 (node id '1')", 0, "logs/worker_1.log")])
    assert one == (
        "worker 1 (node id '1') exited with code 0 without joining the job: the script must "
        "call cluster.init() (it ended without calling it, or called it under another "
        "environment than the MS_* variables it was started with); see logs/worker_1.log"
    )
    both = unjoined_line([("worker 0", 0, "w0.log"), ("worker 1", 0, "w1.log")])
    assert both.startswith("worker 0 and worker 1 exited with code 0 without joining the job: ")
    assert both.endswith("; see w0.log, w1.log")
    mixed = unjoined_line([("worker 0", 0, "w0.log"), ("worker 1", 3, "w1.log")])
    assert mixed.startswith("worker 0 exited with code 0 and worker 1 exited with code 3 without")


def test_the_end_waits_for_our_scheduler_to_say_whether_the_workers_joined() -> None:
    """Every worker exited 0 before the scheduler of this launcher listened: its answer (or
    its exit) decides, within JOINING_ANSWER_S of silence; one that ended (exited) or is not
    ours does not hold the end."""
    unknown = joined((0, None), (0, None))
    starting = Seen(unknown, own_scheduler=True, scheduler_silent_s=1.0)
    assert decide(starting) == Decision(Action.WAIT)
    silent = dataclasses.replace(starting, scheduler_silent_s=JOINING_ANSWER_S)
    assert decide(silent) == Decision(Action.FINISH)
    exited = dataclasses.replace(starting, scheduler_exit=0, scheduler_silent_s=None)
    assert decide(exited) == Decision(Action.FINISH)
    assert decide(Seen(unknown)) == Decision(Action.FINISH)
    known = Seen(joined((0, True), (0, True)), own_scheduler=True, scheduler_silent_s=1.0)
    assert decide(known) == Decision(Action.FINISH)


def test_a_worker_listed_while_the_job_forms_is_not_known_to_be_in_it_after_its_exit() -> None:
    """The scheduler forgets a node whose connection closes while the job forms: an answer
    asked after the exit that still lists it (the close not seen yet) says nothing, and one
    that no longer lists it says the worker left. A job that formed keeps its nodes listed."""
    waiting, ready = Phase.WAITING, Phase.READY
    assert joined_by_answers(True, waiting, (waiting, True)) is None
    assert joined_by_answers(True, waiting, (waiting, False)) is False
    assert joined_by_answers(True, ready, (ready, True)) is True
    assert joined_by_answers(True, Phase.FINISHED, (Phase.FINISHED, True)) is True
    # No answer since its exit: listed in a job that had formed, it joined; while it formed,
    # the next answer decides.
    assert joined_by_answers(True, ready, None) is True
    assert joined_by_answers(True, waiting, None) is None
    assert joined_by_answers(False, None, None) is None
    # Never listed, and not in an answer asked after its exit: it never registered.
    assert joined_by_answers(False, waiting, (waiting, False)) is False


def test_a_worker_that_registered_and_left_before_the_job_formed_ends_it() -> None:
    """Listed, then exited 0 while the job formed, and forgotten by the scheduler: nothing
    takes its place (no spare, no restart of an exit 0), so the job ends rather than wait
    for it until MS_TOPO_TIMEOUT; its peer is still in init()."""
    left = WorkerSeen(0, 0, exited_at=1.0, joined=False, registered=True)
    seen = Seen((left, WorkerSeen(1, None, joined=None)), own_scheduler=True, last=WAITING)
    assert decide(seen) == Decision(Action.UNJOINED, 0)
    assert decide(dataclasses.replace(seen, max_restarts=3)) == Decision(Action.UNJOINED, 0)
    # Still listed after its exit: the scheduler has not forgotten it yet, nothing decided.
    doubt = dataclasses.replace(
        seen, workers=(dataclasses.replace(left, joined=None), seen.workers[1])
    )
    assert decide(doubt) == Decision(Action.WAIT)


def test_the_line_for_workers_that_left_says_they_left_before_the_job_formed() -> None:
    one = unjoined_line([("worker 0 (node id '0')", 0, "logs/worker_0.log")], left=True)
    assert one == (
        "worker 0 (node id '0') exited with code 0 after it registered, leaving the job before "
        "it formed: the script must wait for cluster.init() to return and call "
        "cluster.finalize() before it ends (it ended while init() waited for the other "
        "workers: os._exit(), or init() in a thread it did not wait for); see logs/worker_0.log"
    )
    both = unjoined_line([("worker 0", 0, "w0.log"), ("worker 1", 0, "w1.log")], left=True)
    assert both.startswith("worker 0 and worker 1 exited with code 0 after they registered, ")


def test_a_failed_worker_that_had_not_joined_says_so_in_its_report() -> None:
    assert not_joined_note(WorkerSeen(1, 3, joined=False)) == " before it joined the job"
    left = WorkerSeen(1, 3, joined=False, registered=True)
    assert not_joined_note(left) == " after it registered, before the job formed"
    assert not_joined_note(WorkerSeen(1, 3, joined=True)) == ""
    assert not_joined_note(WorkerSeen(1, 3, joined=None)) == ""


def test_a_failure_report_waits_for_our_running_scheduler_to_say_whether_it_joined() -> None:
    unknown = WorkerSeen(1, 3, joined=None)
    ours = Seen((unknown,), own_scheduler=True)
    assert awaits_joined(unknown, ours)
    assert not awaits_joined(unknown, dataclasses.replace(ours, scheduler_exit=1))
    assert not awaits_joined(unknown, Seen((unknown,)))
    assert not awaits_joined(WorkerSeen(1, 3, joined=False), ours)
