"""A Finish counted by the scheduler whose answer is lost just as the job finishes, with real
processes: rank 1 reaches the scheduler through a proxy that drops everything the scheduler
sends from the moment rank 1 finalizes (rank 0 has finished). The scheduler counts the Finish,
ends the job and exits 0; rank 1 hears neither the answer nor the job's end, and holds its
Finish for a scheduler that does not come back. Where its MS_RECOVERY_PATH holds the
scheduler's saved state (the scheduler's host), that state shows the Finish counted: rank 1
exits 0 at once. Where it does not (another host), rank 1 cannot know: at the end of its
reconnect window it exits 1 saying what is unknown, not that something failed. Without
recovery there is no saved state to read: rank 1 holds its Finish for MS_NODE_TIMEOUT and
exits 1 saying the same, not that the scheduler is overloaded or hung."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.testing import Process, free_port
from tests.procs import ROOT, Procs, job_env
from tests.proxy import Proxy

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "finish_on_cue.py")
WINDOW_S = 10  # MS_TOPO_TIMEOUT: the reconnect window, with recovery
EXIT_S = 30


def finish_with_its_answer_lost(
    processes: Procs, tmp_path: Path, own_path: bool, recovery: bool = True
) -> Process:
    """The job above, `recovery` on or off; rank 1's process once its Finish is held
    (`own_path`: its MS_RECOVERY_PATH is not the scheduler's)."""
    port, go = free_port(), [tmp_path / "go0", tmp_path / "go1"]
    saved = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(tmp_path / "recovery")}
    env = job_env(
        2,
        port,
        MS_NODE_TIMEOUT="3",
        MS_TOPO_TIMEOUT=str(WINDOW_S),
        **(saved if recovery else {}),
    )
    proxy = Proxy(("127.0.0.1", port))
    try:
        scheduler = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, "-"], env)
        rank0 = processes.start_role(
            "worker0", "MS_WORKER", [SCRIPT, str(go[0])], env | {"MS_NODE_ID": "0"}
        )
        own = {"MS_RECOVERY_PATH": str(tmp_path / "elsewhere")} if own_path else {}
        rank1_env = env | {"MS_NODE_ID": "1", "MS_SCHED_PORT": str(proxy.port)} | own
        rank1 = processes.start_role("worker1", "MS_WORKER", [SCRIPT, str(go[1])], rank1_env)
        for worker in (rank0, rank1):
            worker.wait_for_output("in rank=", EXIT_S)
        go[0].touch()
        assert rank0.wait(EXIT_S) == 0, rank0.output
        proxy.hold_replies()
        go[1].touch()
        assert scheduler.wait(EXIT_S) == 0, scheduler.output
        assert "job finished: all 2 nodes finished" in scheduler.output, scheduler.output
        rank1.wait_for_output("this node's finish waits ", EXIT_S)
        return rank1
    finally:
        proxy.close()


def test_a_finish_whose_answer_was_lost_is_known_counted_from_the_saved_state(
    processes: Procs, tmp_path: Path
) -> None:
    rank1 = finish_with_its_answer_lost(processes, tmp_path, own_path=False)
    assert rank1.wait(EXIT_S) == 0, rank1.output
    assert "lists this node's finish as counted and the job as finished" in rank1.output
    assert "finalized" in rank1.output, rank1.output


@pytest.mark.parametrize("recovery", [True, False])
def test_a_finish_whose_answer_was_lost_with_no_saved_state_to_read_says_what_is_unknown(
    processes: Procs, tmp_path: Path, recovery: bool
) -> None:
    # With recovery, its MS_RECOVERY_PATH is not the scheduler's; without, it has none.
    rank1 = finish_with_its_answer_lost(processes, tmp_path, own_path=recovery, recovery=recovery)
    assert rank1.wait(WINDOW_S + EXIT_S) == 1, rank1.output
    assert (
        "did not answer whether it counted this node's finish before it went away, so this "
        "worker cannot know whether the job finished: if it did (the scheduler's log ends with "
        '"job finished"), nothing is lost; if not, '
    ) in rank1.output, rank1.output
    assert "could not tell" not in rank1.output, rank1.output
