"""What the scheduler last answered a node's registration attempts, for the error of a deadline
passed (`Joining._registration_timeout`, a part of the worker core).

A node that gives up registering was not always kept out by a wrong address or a scheduler that
is down: the scheduler may have refused every try (its guard: the node id is still alive in
another process) or taken the registration and held its answer (it answers once it has saved
what the registration changes, and its saves fail: a full disk). `Answers` is told every event
of the core (`note`) and keeps the last such answer since the attempts began (the node started,
or its stream ended), until a try shows the scheduler answering no more; `why` says it, "" when
nothing answered.
"""

from __future__ import annotations

from cluster.protocol.value import mutable
from cluster.worker.machine import steps

# A registration unanswered this long has its answer held; one cut off sooner (the node's
# deadline came while the call was on its way) says nothing of the scheduler's answers.
HELD_AFTER_S = 1.0


def held(event: steps.AnswerLate) -> bool:
    """Whether `event` tells of an answer held, not of a call cut off on its way."""
    return event.waited_s >= HELD_AFTER_S


@mutable
class Answers:
    refusal: str = ""  # the last refusal's message, while the tries since were refused too
    refusals: int = 0  # how many tries in a row were refused, up to the last
    refused_since: float = 0.0  # when the first of them was
    held_s: float | None = None  # how long the last registration's answer was held
    quiet: bool = False  # a try since the attempts began got no answer
    cut_off: bool = False  # the try on its way was cut off by the node's deadline

    def begin(self) -> None:
        """Forget every answer: none is kept from before the attempts began."""
        self.refusal, self.refusals, self.held_s, self.quiet = "", 0, None, False

    def note(self, event: steps.Event, now: float) -> None:
        """Keep what `event` says of the scheduler's answers."""
        cut_off, self.cut_off = self.cut_off, False
        match event:
            case steps.Unanswered() if cut_off:
                pass  # the end of a try the deadline cut off on its way: it says nothing
            case steps.Refused(transient=True, stale_challenge=False):
                if not self.refusals:
                    self.refused_since = now
                self.refusal, self.refusals, self.held_s = event.message, self.refusals + 1, None
            case steps.AnswerLate() if held(event):
                self.refusal, self.refusals, self.held_s = "", 0, event.waited_s
            case steps.AnswerLate():
                self.cut_off = True  # given up at once: what comes next is its end
            case steps.Unanswered():
                # The end of an attempt whose answer was held, too: the hold is kept.
                self.refusal, self.refusals, self.quiet = "", 0, True
            case steps.Checked(ok=False) | steps.ListeningAwaited(refused=True):
                self.begin()
                self.quiet = True
            case steps.Start() | steps.StreamLost() | steps.Accepted():
                self.begin()  # the attempts begin, or end
            case _:
                pass

    def why(self, now: float) -> str:
        """What the scheduler answered, as the error of a deadline passed says it: "" when no
        refusal or hold is the last thing it said."""
        if self.refusals:
            tries = "try" if self.refusals == 1 else f"{self.refusals} tries"
            span = (
                f"for the whole wait ({tries})"
                if not self.quiet
                else f"at its last {tries}, over the last {now - self.refused_since:.0f} s"
            )
            return f"it refused this node {span}, the last time because {self.refusal}"
        if self.held_s is not None:
            return (
                f"it took this node's registration but held its answer for {self.held_s:.0f} s: "
                "it answers once it has saved what the registration changes, so it cannot save "
                "its state (is MS_RECOVERY_PATH full or read-only, or etcd out of reach? see its "
                "log), or it is overloaded"
            )
        return ""
