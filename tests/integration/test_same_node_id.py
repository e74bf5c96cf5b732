"""Two hand-started workers given the same MS_NODE_ID (a slip in a MindSpore-style launch loop),
with real processes: the second is told that the id is held by a live process and that two
processes of the job have the same MS_NODE_ID, naming both. It was told only "node id '1' was
last seen alive 0.0 s ago ... (retry in 30.0 s)", the wait pushed back at every try while the
first lived, until its MS_TOPO_TIMEOUT ended it with nothing said of a duplicate."""

from __future__ import annotations

import re

from cluster.testing import free_port
from tests.procs import ROOT, Procs, job_env

EXAMPLE = [str(ROOT / "examples" / "allgather_check.py")]
DUPLICATE = re.compile(
    r"node id '1' is held by a live process \(at 127\.0\.0\.1:\d+, incarnation \d+, heard "
    r"\d+\.\d s ago\), and this process \(at 127\.0\.0\.1:\d+, incarnation \d+\) registers with "
    r"it too: two processes of this job have the same MS_NODE_ID\? give each its own; a "
    r"restarted worker is taken once the old one has been silent for MS_NODE_TIMEOUT=30 s"
)


def test_a_second_worker_with_the_same_node_id_is_told_the_id_is_given_twice(
    processes: Procs,
) -> None:
    env = job_env(2, free_port())
    scheduler = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, env)
    first = processes.start_role("worker1", "MS_WORKER", EXAMPLE, {**env, "MS_NODE_ID": "1"})
    first.wait_for_output("waiting for the job to form: 1 of 2 nodes registered", 30)
    # The slip: a second worker given the same id; it gives up after its MS_TOPO_TIMEOUT.
    twin = {**env, "MS_NODE_ID": "1", "MS_TOPO_TIMEOUT": "4"}
    second = processes.start_role("worker1-again", "MS_WORKER", EXAMPLE, twin)
    second.wait_for_output("registration refused for now: node id '1' is held by a live", 15)
    assert second.wait(30) == 1, second.output
    assert DUPLICATE.search(second.output), second.output
    (line,) = [line for line in second.output.splitlines() if "TopologyTimeoutError" in line]
    assert DUPLICATE.search(line), line
    # The first is not disturbed: with the id the second should have had, the job forms.
    other = processes.start_role("worker0", "MS_WORKER", EXAMPLE, {**env, "MS_NODE_ID": "0"})
    for worker in (first, other):
        assert worker.wait(30) == 0, worker.output
    assert "allgather rank=1 size=2 result=[0, 1]" in first.output, first.output
    assert scheduler.wait(30) == 0, scheduler.output
