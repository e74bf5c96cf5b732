"""The simulated control plane (`tests/sim/control_plane.py`): many seeded schedules keep every
invariant, the same seed replays the same run, and each planted bug (`tests/sim/plants.py`) is
caught within 2,000 seeds, by a replay command that finds it again."""

from __future__ import annotations

from collections import Counter

import pytest

from cluster.protocol.records import Phase
from tests.sim.control_plane import PLANT_SPARES, PLANTS, Violation, run_seed
from tests.sim.run import main, schedulers, worker_cores


def test_schedules_keep_every_invariant() -> None:
    """They end their jobs too (`tests/sim/finishing.py`): most end well, with faults as they
    end, and a Finish is refused while the job waits for its node to rejoin."""
    ended = heard = faults = 0
    refused: Counter[str] = Counter()
    for seed in range(300):
        sim = run_seed(seed)
        ended += sim.state.phase is Phase.FINISHED
        heard += len(sim.finishes.heard)
        faults += sim.finishes.end_faults
        refused += sim.finishes.refused
    assert ended > 150
    assert heard > 150
    assert faults > 100
    assert refused["rejoin_first"] > 0


def test_schedules_with_standbys_keep_every_invariant() -> None:
    """A leader and a standby on the simulated etcd (three schedulers for a third of them)."""
    leaderships = 0
    for seed in range(300):
        sim = run_seed(seed, schedulers=3 if seed % 3 == 0 else 2)
        leaderships += sim.restarts
    assert leaderships > 300  # the job changed hands, many times over


def test_schedules_of_worker_cores_keep_every_invariant() -> None:
    """The workers run by the real worker core, through the wire's converters; some hold their
    Finish for a scheduler that went away."""
    holds = 0
    for seed in range(200):
        sim = run_seed(seed, schedulers=1 + seed % 2, worker_cores=True)
        assert sim.cores is not None
        holds += sim.finishes.holds_made
    assert holds > 10  # a Finish held for a scheduler that went away (and heard once back)


def test_a_crash_point_that_fires_as_the_job_settles_kills_the_scheduler() -> None:
    """Seed 6029 arms its crash point late: no round completes before the faults stop, and the
    first to complete as the job settles is answered to one of its three callers. The
    scheduler then dies there, and its successor re-forms the job for the others (before, the
    scheduler lived on with them never answered: a liveness violation of the simulation's own
    making, found by seed 2804 of an earlier schedule)."""
    sim = run_seed(6029, finishing=False)
    assert sim.trace[-1] == "the scheduler answers s0 of round (2, 1) and dies"
    assert sim.trace[-2] == "faults stop"


@pytest.mark.parametrize(("schedulers", "cores"), [(1, False), (2, False), (2, True)])
def test_the_same_seed_replays_the_same_run(schedulers: int, cores: bool) -> None:
    first = run_seed(7, schedulers=schedulers, worker_cores=cores)
    again = run_seed(7, schedulers=schedulers, worker_cores=cores)
    assert first.trace == again.trace
    assert first.stored == again.stored
    assert (first.clock.now, first.net.seq, first.told) == (
        again.clock.now,
        again.net.seq,
        again.told,
    )
    assert first.files == again.files
    assert first.finishes.heard == again.finishes.heard


def first_caught(plant: str, seeds: int = 2000) -> tuple[int, str]:
    """The first seed whose schedule catches `plant`, and what it said."""
    for seed in range(seeds):
        try:
            run_seed(
                seed,
                plant=plant,
                spares=max(1, PLANT_SPARES.get(plant, 0)),
                schedulers=schedulers(seed),
                worker_cores=worker_cores(seed),
            )
        except Violation as exc:
            return seed, str(exc)
    raise AssertionError(f"the plant {plant!r} ({PLANTS[plant]}) was not caught in {seeds} seeds")


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_bug_is_caught_and_replays(
    plant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seed, said = first_caught(plant)
    assert main(["--seed", str(seed), "--plant", plant]) == 1
    replayed = capsys.readouterr().out
    assert said.splitlines()[0] in replayed
    assert f"replay: python tests/sim/run.py --seed {seed} " in replayed


def test_a_failing_seed_is_shrunk_and_its_replay_fails_alike(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--seeds", "5", "--plant", "eager-spare"]) == 1
    said = capsys.readouterr().out
    assert said.startswith("violated: one-holder\n")
    assert "shrunk to" in said
    replay = said.split("replay: python tests/sim/run.py ")[1].split()
    assert main(replay) == 1
    assert capsys.readouterr().out.startswith("violated: one-holder\n")


def test_the_command_line_says_what_it_found(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "20"]) == 0
    assert "20 schedules, 0 violations" in capsys.readouterr().out
    assert main(["--seeds", "20", "--plant", "early-release"]) == 1
    said = capsys.readouterr().out
    assert "told revision" in said
    assert "replay: python tests/sim/run.py --seed 0" in said
    assert main(["--list-plants"]) == 0
    listed = capsys.readouterr().out
    assert all(f"{name}: " in listed for name in PLANTS)


# Seeds that found bugs in the real code, kept as regressions: 2375, a worker told to keep only
# steps newer than the rollback step of a generation decided but not yet told (and a report
# overtaken by an older one); 7389, a new process of a node id taking its old rank from the
# generation told before its new one was saved.
@pytest.mark.parametrize(("seed", "steps"), [(2375, 288), (7389, 300)])
def test_seeds_that_found_bugs_keep_every_invariant(seed: int, steps: int) -> None:
    run_seed(seed, workers=2, spares=1, steps=steps, finishing=False)


def test_a_finish_that_timed_out_as_the_stream_was_lost_is_held_for_the_nodes_return() -> None:
    """Seed 331 (worker cores, a standby): node 0's Finish timed out (DEADLINE_EXCEEDED) while
    a partition cut its stream too; it was given up, the process exited as done unheard, and
    the job failed MS_TOPO_TIMEOUT later though every rank had finished (`finish-held`)."""
    run_seed(331, workers=3, spares=1, schedulers=2, worker_cores=True, steps=200)


def test_a_generation_decided_while_the_workers_put_a_step_back_names_no_step_they_remove() -> None:
    """Seed 93 (two spares, a standby): generation 3 rolls back to step 20 while the ranks'
    reports, some arriving late, still name the abandoned run's steps up to 60; generation 4,
    decided as the ranks discard those to put step 20 back (a spare takes a failed rank), rolls
    back to 20 again. The rule before (`uncapped-rollback`) named 60, which they removed."""
    run_seed(93, steps=131, spares=2, schedulers=2, finishing=False)
    with pytest.raises(Violation, match="generation 4 rolls back to step 60, which rank 1"):
        run_seed(93, steps=131, spares=2, schedulers=2, plant="uncapped-rollback", finishing=False)


def test_a_disk_is_lost_only_where_a_peer_holds_a_copy_of_its_files() -> None:
    """A lost disk takes a rank's checkpoints with it; its next process fetches them from a
    peer (`tests/sim/disks.py`). A job of one worker has no peer: seed 61 of one worker lost
    its disk, the scheduler rolled back to the step the rank last reported, and the invariant
    (on disk, or held by a peer) could not hold, whatever the scheduler decided."""
    alone = run_seed(61, steps=67, workers=1, spares=0, schedulers=2, finishing=False)
    assert not any("with its disk" in line for line in alone.trace)
    pairs = [run_seed(seed, workers=2, spares=0) for seed in range(30)]
    assert any(sim.wiped is not None for sim in pairs)
