"""A training loop that survives worker failures: checkpoints, and a cluster-wide rollback.

A plain loop becomes recoverable with two lines:

    loop = cluster.TrainingLoop(steps, checkpoints, get_state, set_state)
    for step in loop:            # was: for step in range(steps):
        with loop.step():        # a peer's failure inside is handled, not raised
            train_one_step(step)

Every generation of the job names a rollback step (the newest checkpoint every worker holds).
The loop starts from it, saves checkpoints when they are due (a save costs the loop a copy of
the state into memory; the file is written in the background, and the loop waits for the last
one before it ends), and when a peer fails (a
`PeerFailedError` in a collective) or the job moves to a new generation between two steps, it
waits for the new generation, puts the state of its rollback step back with `set_state`, and
goes on from that step. Every worker does the same, the restarted one from its start, so a job
with faults ends with exactly the parameters of the same job without faults, provided a step
depends only on the state and the step number (derive the batch from the step; initialise every
rank the same way).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from cluster.api import runtime, worker_metrics
from cluster.api.collective import barrier
from cluster.protocol.errors import ClusterError, PeerFailedError

if TYPE_CHECKING:
    from cluster.api.checkpoint import CheckpointManager


class TrainingLoop:
    """`for step in loop:` with `with loop.step():` around the step's work; see the module."""

    def __init__(
        self,
        steps: int,
        checkpoints: CheckpointManager,
        get_state: Callable[[], Mapping[str, Any]],
        set_state: Callable[[dict[str, Any]], None],
        *,
        say: Callable[[str], None] | None = None,
    ) -> None:
        """`get_state()`: what a checkpoint holds (parameters, optimizer state, ...);
        `set_state(state)`: put such a state back. The state at construction is the state of
        step 0."""
        if steps < 0:
            raise ClusterError(f"TrainingLoop steps={steps} must be >= 0")
        self.steps = steps
        self.checkpoints = checkpoints
        if checkpoints.report is None:  # made before cluster.init(): the scheduler must know
            checkpoints.report = runtime.report_checkpoints
        self._get_state = get_state
        self._set_state = set_state
        self._say = say or _say
        self._initial = copy.deepcopy(dict(get_state()))
        self._generation = 0
        self._interrupted: PeerFailedError | None = None
        self._furthest = 0
        self.rollbacks = 0
        # Steps this worker computed again after rollbacks (work lost to failures).
        self.steps_redone = 0
        worker_metrics.start()  # CLUSTER_WORKER_METRICS_PORT: off unless set

    # -- the loop ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        step = self._start()
        while True:
            if runtime.topology().generation != self._generation:
                step = self._roll_back(waited=False)
            elif step < self.steps:
                self._interrupted = None
                started = time.perf_counter()
                yield step
                if self._interrupted is not None:
                    step = self._roll_back(waited=True)
                else:
                    step += 1
                    worker_metrics.step_done(started)
                    self._furthest = max(self._furthest, step)
                    if self.checkpoints.should_save(step) or step == self.steps:
                        with worker_metrics.checkpoint(step):
                            self.checkpoints.save(step, self._get_state())
            elif self._agree_on_the_end():
                return
            else:
                step = self._roll_back(waited=True)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's work: a peer's failure in it ends the step early, for a rollback.

        That is a PeerFailedError from a cluster collective, or any other error (from gloo,
        NCCL, ...) when the scheduler confirms, within MS_NODE_TIMEOUT, that a peer of this
        generation failed; other errors are raised as they are.
        """
        session = runtime.session()
        # The step's collectives belong to the generation it began in: if the job moves on
        # meanwhile, they fail (a PeerFailedError) instead of joining the new generation's.
        session.generation_pin = self._generation
        try:
            yield
        except PeerFailedError as exc:
            self._interrupted = exc
        except Exception as exc:
            if not runtime.peer_failed(self._generation, runtime.failure_wait_s()):
                raise
            self._interrupted = PeerFailedError(f"a peer failed during the step: {exc}")
        finally:
            session.generation_pin = None

    def run(self, train_step: Callable[[int], None]) -> None:
        """The whole loop: `train_step(step)` for each step, rolled back as needed."""
        for step in self:
            with self.step():
                train_step(step)

    # -- rollback ----------------------------------------------------------------------------

    def _start(self) -> int:
        topology = runtime.topology()
        self._generation = topology.generation
        if topology.rollback_step == 0 and not runtime.is_rejoin():
            return 0  # a first start: the state as constructed
        restored = self._restore(topology.rollback_step, topology.generation, topology.reason)
        return self._roll_back(waited=True) if restored is None else restored

    def _roll_back(self, *, waited: bool) -> int:
        while True:
            if waited:
                self._say(
                    "a peer failed; waiting for the job's next generation"
                    if self._interrupted is not None
                    else "waiting for the job's next generation"
                )
                runtime.wait_for_generation(self._generation)
            topology = runtime.topology()
            self._generation = topology.generation
            self.rollbacks += 1
            lost = max(self._furthest - topology.rollback_step, 0)
            self.steps_redone += lost
            worker_metrics.rolled_back(lost)
            self._say(
                f"rolled back from step {self._furthest} to step {topology.rollback_step} "
                f"({lost} steps to compute again)"
            )
            restored = self._restore(topology.rollback_step, topology.generation, topology.reason)
            if restored is not None:
                return restored
            waited = True  # a peer failed while the state was put back: the next generation

    def _restore(self, step: int, generation: int, reason: str) -> int | None:
        """Put the state of `step` back; None when a peer failed meanwhile (set_state may
        make a process group, which needs every peer)."""
        state = copy.deepcopy(self._initial) if step == 0 else self.checkpoints.load(step)
        try:
            self._set_state(state)
        except PeerFailedError as exc:
            self._interrupted = exc
            return None
        except Exception as exc:
            if not runtime.peer_failed(generation, runtime.failure_wait_s()):
                raise
            self._interrupted = PeerFailedError(f"a peer failed while restoring: {exc}")
            return None
        self.checkpoints.discard_newer(step)
        self._furthest = max(self._furthest, step)
        self._say(f"generation {generation} ({reason}): resuming from step {step}")
        return step

    def _agree_on_the_end(self) -> bool:
        """True once every worker holds the final state; False after a peer failed first."""
        self.checkpoints.flush()  # the final state on disk and reported, before the barrier
        if runtime.topology().rollback_step >= self.steps:
            return True  # every worker saved the final state already: nothing to wait for
        session = runtime.session()
        session.generation_pin = self._generation
        try:
            barrier()
        except PeerFailedError as exc:
            self._interrupted = exc
            return False
        finally:
            session.generation_pin = None
        return True


def _say(message: str) -> None:
    sys.stderr.write(f"cluster[rank {runtime.get_rank()}]: {message}\n")  # one write: see
    sys.stderr.flush()  # cluster.worker.session._say
