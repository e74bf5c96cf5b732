"""A node's Finish, pure: whether it is on its way, held until the node is back, or heard; when
it is sent again, and when it is given up. The rules are the worker core's (see
`cluster.worker.machine.core`); `WorkerCore` holds one `Finish` and tells it what the node is
doing (registering again, finished) where a decision depends on it.

A Finish is made again only when it never reached the scheduler or was cut off with its
connection (a finish counts once, so a repeat is harmless: the status codes FINISH_RETRIED, and
a call whose answer did not come in time while the node lost its stream too), while the node's
stream is up, or once it is back after registering again (`pacing`: how long it waits, and for
how long in all): with recovery its scheduler may come back; without, its registration learns
whether the job failed as the node lost its stream (it fails), so that the node never exits as
finished with its Finish unheard there. A failure heard while it is on its way waits for its
answer (`takes`); a Finish that ends unheard (`Unheard`) has the core say so and report that
failure. Whether a Finish that got no answer was counted is known only from the scheduler: its
word when the node is back, the job's end heard on the stream (a job ends well only once every
rank's finish was counted), or its saved state showing it counted (`steps.FinishCounted`);
failing those, a held Finish that ends says that it is unknown. A Finish the scheduler refuses
because the job failed before it came (FINISH_TOO_LATE) ends with that failure: the node never
exits as finished from a failed job.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from cluster.protocol.config import ClusterConfig
from cluster.protocol.errors import ClusterError, JobFailedError, SchedulerUnreachableError
from cluster.protocol.value import frozen
from cluster.worker.machine import steps
from cluster.worker.machine.pacing import FINISH_RETRY, FINISH_SLACK_S

FINISH_RETRIED = ("UNAVAILABLE", "CANCELLED")
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the status code of a call whose own deadline passed
# What holds a Finish while its node registers again (`Finish.failed`): a call that never
# reached the scheduler, and one whose answer did not come in time as the node lost its stream
# too (a partition cut both). With the stream up, a late answer means the scheduler took the
# Finish and has not saved it yet: that one is not sent again.
FINISH_HELD = (*FINISH_RETRIED, DEADLINE_EXCEEDED)
# The status code of a Finish the scheduler refused as the job failed before it came
# (JobFailedError): the node fails with that failure, whatever it was doing.
FINISH_TOO_LATE = "ABORTED"
# The status code of a Finish a scheduler refused as from a node it does not know
# (UnknownNodeError): while the node registers again, one started since (a new job without
# recovery) may be answering; held like FINISH_HELD, so that the registration says whose job
# it is, and the node never exits as finished on it.
FINISH_UNKNOWN_NODE = "NOT_FOUND"

Actions = list[steps.Action]


class Sending(enum.Enum):
    NOT_SENT = "not sent"
    SENT = "sent"  # on its way, or sent again after a pause
    HELD = "held"  # until the node is accepted again (its scheduler restarts)
    HEARD = "heard"


HOLD_AGAIN_S = 1.0  # a hold woken at the end of the node's reconnect window: it fails then


@frozen
class Away:
    """The node registers again with a scheduler that went away (`why`), until `until` (the end
    of its reconnect window, on the core's clock)."""

    why: str
    until: float


@frozen
class Unheard:
    """The Finish ended without the scheduler's word: `timed_out` (its answer did not come in
    time), after `waited_s`, and why (`details`); `held`: it was held for a scheduler that went
    away, perhaps after counting it, and did not come back; `failure`: the scheduler's word
    that the job failed before it came (reported unless a failure was held meanwhile)."""

    timed_out: bool
    waited_s: float
    details: str
    held: bool = False
    failure: ClusterError | None = None


class Finish:
    """One node's Finish (see the module docstring)."""

    def __init__(self, config: ClusterConfig, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._recovery = config.recovery is not None
        # The longest it is kept asking, from its first send.
        self.wait_s = max(config.node_timeout_s, FINISH_SLACK_S) + FINISH_SLACK_S
        self.sending = Sending.NOT_SENT
        self._since = 0.0  # when it was first sent
        self._pause = FINISH_RETRY.backoff()  # between the sends of one Finish
        self._held: ClusterError | None = None  # a failure heard while it is on its way

    @property
    def heard(self) -> bool:
        return self.sending is Sending.HEARD

    @property
    def out(self) -> bool:
        """On its way, or held until the node is back."""
        return self.sending in (Sending.SENT, Sending.HELD)

    def send(self) -> Actions:
        self.sending = Sending.SENT
        self._since = self._clock()
        self._pause = FINISH_RETRY.backoff()
        return [steps.SendFinish(self.wait_s)]

    def hear(self) -> None:
        self.sending = Sending.HEARD
        self._held = None

    def takes(self, error: ClusterError) -> bool | Unheard:
        """A failure of the node: kept for the answer of the Finish on its way (True); the end
        of a Finish held for a scheduler that will not take the node back now (Unheard); or
        nothing to do with it, none being out (False)."""
        if self.sending is Sending.SENT:
            self._held = self._held or error  # decided by the Finish's answer
            return True
        if self.sending is Sending.HELD:  # whether a scheduler counted it, none will say now
            self._held = error
            return Unheard(False, self._clock() - self._since, str(error), held=True)
        return False

    def failed(
        self,
        event: steps.FinishFailed,
        *,
        away: Away | None,
        released: bool,
        finished: bool,
        where: str,
    ) -> Actions | Unheard:
        """Send it again only when it never reached the scheduler or was cut off with its
        connection: after a pause while the node's stream is up, not past its give-up time;
        while the node registers again (`away`), once it is back, however long that takes
        within the node's reconnect window, as long as a training node waits for its scheduler
        (unless a failure waits for the Finish's answer: then that is the answer). The job's end
        heard meanwhile (`finished`) says it was counted: heard."""
        if self.sending is not Sending.SENT:
            return []
        if finished:  # every rank's finish was counted, this one's too
            self.hear()
            return []
        now = self._clock()
        if event.code == FINISH_TOO_LATE:
            failure = JobFailedError(event.details)
            return Unheard(False, now - self._since, event.details, failure=failure)
        held = event.code in (*FINISH_HELD, FINISH_UNKNOWN_NODE) and self._held is None
        if held and not released and away is not None and now < away.until:  # may come back
            self.sending = Sending.HELD
            return [
                self._holding(where, away, away.until - now),
                steps.HoldFinish(away.until - now),
            ]
        give_up = self._since + self.wait_s
        pause_s = self._pause.next_s()
        again = event.code in FINISH_RETRIED and not released
        if again and event.stream_up and now + pause_s < give_up:
            return [steps.RetryFinish(pause_s)]
        return Unheard(event.code == DEADLINE_EXCEEDED, now - self._since, event.details)

    def _holding(self, where: str, away: Away, left_s: float) -> steps.Say:
        if self._recovery:
            return steps.Say(
                f"{where} is away ({away.why}): this node's finish waits for it to take this "
                f"node back, up to {left_s:.0f} s more, as long as a training node waits for it "
                "(recovery is on)"
            )
        return steps.Say(
            f"{where} is away ({away.why}): this node's finish waits to reach it, up to "
            f"{left_s:.0f} s more (MS_NODE_TIMEOUT; recovery is off): this node exits as "
            "finished only once its finish is heard"
        )

    def retry_due(self, *, finished: bool, away: Away | None) -> Actions | Unheard:
        """Send it again: after its pause, or once the node it was held for is back (with a
        give-up time afresh). Held while the job `finished`: heard; while the node is still
        `away`: held on (its reconnect window's end fails the node, which ends the hold:
        `takes`)."""
        if not self.out:
            return []
        now = self._clock()
        if self.sending is Sending.HELD:
            if finished:  # the job finished meanwhile: every finish was heard
                self.hear()
                return []
            if away is not None:  # not back yet
                return [steps.HoldFinish(max(away.until - now, HOLD_AGAIN_S))]
            self.sending = Sending.SENT
            self._since = now
        left = self._since + self.wait_s - now
        if left <= 0:
            why = f"this node was not back with it within {self.wait_s:g} s"
            return Unheard(False, now - self._since, why)
        return [steps.SendFinish(left)]

    def answered(self, event: steps.FinishAnswered) -> Actions | Unheard:
        if not self.out:
            return []  # answered already (a cancelled Finish's owner reports it once more)
        if event.heard:
            self.hear()
            return []
        return Unheard(event.timed_out, event.waited_s, event.details)

    def counted(self) -> bool:
        """The scheduler's saved state shows it counted (`steps.FinishCounted`): heard, when it
        was out."""
        if not self.out:
            return False
        self.hear()
        return True

    def unheard(self, end: Unheard, where: str) -> tuple[Actions, ClusterError | None]:
        """It was not heard: what to say, and the failure to report (held meanwhile, or the
        job's that the scheduler refused it with)."""
        self.sending = Sending.NOT_SENT
        held, self._held = self._held, None
        if end.failure is not None:  # its line says what happened: nothing more to say
            return [], held or end.failure
        if end.held and (self._recovery or isinstance(held, SchedulerUnreachableError)):
            # Unknown, not failed: the scheduler may have counted it, ended the job and exited,
            # with recovery or without. (Without recovery, a scheduler that answers refuses a
            # node that lost its stream as the job failed: the refusal's line says so.)
            said = steps.Say(f"{where} did not answer whether it counted this node's finish")
            if not isinstance(held, SchedulerUnreachableError):
                return [said], held
            held = SchedulerUnreachableError(
                f"{where} did not answer whether it counted this node's finish before it went "
                "away, so this worker cannot know whether the job finished: if it did (the "
                f'scheduler\'s log ends with "job finished"), nothing is lost; if not, {held}'
            )
            return [said], held
        if end.timed_out and self._recovery:
            # The scheduler answers once the finish is saved: its saves are failing.
            said = steps.Say(
                f"{where} did not confirm within {end.waited_s:g} s that it saved this node's "
                "finish (is its MS_RECOVERY_PATH full or read-only? see its log); this node "
                "exits anyway, and the scheduler ends the job once it can save"
            )
        elif end.held and held is not None:  # the failure that ended the hold says why
            said = steps.Say(f"could not tell {where} that this node finished")
        else:
            said = steps.Say(f"could not tell {where} that this node finished: {end.details}")
        return [said], held
