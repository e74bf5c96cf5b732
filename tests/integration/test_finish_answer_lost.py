"""A Finish counted by the scheduler whose answer is lost just as the job finishes, with real
processes: rank 1 reaches the scheduler through a proxy that drops everything the scheduler
sends from the moment rank 1 finalizes (rank 0 has finished). The scheduler counts the Finish,
ends the job and exits 0; rank 1 hears neither the answer nor the job's end, and holds its
Finish for a scheduler that does not come back. Where its MS_RECOVERY_PATH holds the
scheduler's saved state (the scheduler's host), that state shows the Finish counted: rank 1
exits 0 at once. Where it does not (another host), rank 1 cannot know: at the end of its
reconnect window it exits 1 saying what is unknown, not that something failed. Without
recovery there is no saved state to read: rank 1 holds its Finish for MS_NODE_TIMEOUT and
exits 1 saying the same, not that the scheduler is overloaded or hung.

Where the scheduler sees rank 1's connection break before its Finish is answered (the answer
waits for a full disk to take the count, and the link is down meanwhile), it knows the answer
was lost: once the job's end is saved it serves on, up to MS_NODE_TIMEOUT, until rank 1 asks
again, and tells it that the job finished and its finish counted. Rank 1, on another host
(its MS_RECOVERY_PATH is not the scheduler's), exits 0. The scheduler stopped at once, and
rank 1 waited out its reconnect window and exited 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.testing import Process, free_port
from tests import tmpfs
from tests.procs import ROOT, Procs, job_env
from tests.proxy import Proxy

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "finish_on_cue.py")
WINDOW_S = 10  # MS_TOPO_TIMEOUT: the reconnect window, with recovery
EXIT_S = 30


def rank0_finished(
    processes: Procs, env: dict[str, str], proxy: Proxy, go: list[Path], rank1_env: dict[str, str]
) -> tuple[Process, Process]:
    """The scheduler and rank 1 (through `proxy`, with `rank1_env` over `env`) of the job
    above, once rank 0 has finished and exited."""
    scheduler = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, "-"], env)
    rank0 = processes.start_role(
        "worker0", "MS_WORKER", [SCRIPT, str(go[0])], env | {"MS_NODE_ID": "0"}
    )
    rank1_env = env | {"MS_NODE_ID": "1", "MS_SCHED_PORT": str(proxy.port)} | rank1_env
    rank1 = processes.start_role("worker1", "MS_WORKER", [SCRIPT, str(go[1])], rank1_env)
    for worker in (rank0, rank1):
        worker.wait_for_output("in rank=", EXIT_S)
    go[0].touch()
    assert rank0.wait(EXIT_S) == 0, rank0.output
    return scheduler, rank1


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
        own = {"MS_RECOVERY_PATH": str(tmp_path / "elsewhere")} if own_path else {}
        scheduler, rank1 = rank0_finished(processes, env, proxy, go, own)
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


def test_a_finish_whose_answer_was_lost_with_its_connection_hears_the_end_from_the_scheduler(
    processes: Procs, tmp_path: Path
) -> None:
    port, go = free_port(), [tmp_path / "go0", tmp_path / "go1"]
    with tmpfs.mounted("4m") as disk:
        saved = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(disk)}
        env = job_env(2, port, MS_NODE_TIMEOUT="10", MS_TOPO_TIMEOUT=str(WINDOW_S), **saved)
        proxy = Proxy(("127.0.0.1", port))
        try:
            elsewhere = {"MS_RECOVERY_PATH": str(tmp_path / "elsewhere")}  # another host's
            scheduler, rank1 = rank0_finished(processes, env, proxy, go, elsewhere)
            filler = tmpfs.fill(disk)  # rank 1's finish, and the job's end, wait for space
            go[1].touch()
            scheduler.wait_for_output("cannot save the recovery state", EXIT_S)
            proxy.down()  # its answer is lost with the connection
            rank1.wait_for_output("this node's finish waits ", EXIT_S)
            filler.unlink()
            scheduler.wait_for_output("was lost with its connection: serving up to", EXIT_S)
            proxy.up()
            assert rank1.wait(EXIT_S) == 0, rank1.output
            assert scheduler.wait(EXIT_S) == 0, scheduler.output
        finally:
            proxy.close()
    assert "job finished: all 2 nodes finished" in scheduler.output, scheduler.output
    assert "this node's finish counted" in rank1.output, rank1.output
    assert "finalized" in rank1.output, rank1.output
    assert "did not ask again" not in scheduler.output, scheduler.output
