"""The TrainingLoop's end barrier: which refusal says the other workers finished the job
already (`TrainingLoop._finished_before`), so that this worker finishes too, and which is a
failure it raises."""

from __future__ import annotations

import pytest

from cluster.api.training import TrainingLoop
from cluster.protocol.errors import CollectiveError, PeerFinishedError


def loop_at_the_end(*, resumed_at_the_end: bool) -> tuple[TrainingLoop, list[str]]:
    """A TrainingLoop at its end barrier (only what the rule reads), and what it says."""
    said: list[str] = []
    loop = object.__new__(TrainingLoop)
    loop._resumed_at_the_end = resumed_at_the_end
    loop._say = said.append  # type: ignore[method-assign]
    return loop, said


@pytest.mark.parametrize("resumed_at_the_end", [True, False])
def test_a_peer_finished_refusal_of_the_end_barrier_finishes_this_worker(
    resumed_at_the_end: bool,
) -> None:
    """In any generation: peers finish only past an end barrier every rank reached, so a
    barrier made again after its answer was lost (with a scheduler that restarted as it told
    it) and refused as a rank has finished means that this worker is done too."""
    loop, said = loop_at_the_end(resumed_at_the_end=resumed_at_the_end)
    assert loop._finished_before(PeerFinishedError("barrier failed: rank 0 has finished"))
    assert said == [
        "the other workers finished the job before this one came back (barrier failed: rank 0 "
        "has finished)"
    ]


def test_a_plain_collective_error_finishes_only_a_generation_resumed_at_the_end() -> None:
    """A CollectiveError without a reason (a round that timed out, say) is a failure, unless
    the generation resumed at the end, where only a finished peer makes the barrier fail."""
    loop, _ = loop_at_the_end(resumed_at_the_end=False)
    assert not loop._finished_before(CollectiveError("barrier failed: rank 1 never came"))
    loop, _ = loop_at_the_end(resumed_at_the_end=True)
    assert loop._finished_before(CollectiveError("barrier failed: rank 0 has finished"))
