"""A promoted spare whose checkpoint directory is its own (as on another host) gets its state from
the survivors' state servers, with real processes: two workers of replicated_counter.py and a
spare; node '1' dies where the test says, and every other process of the job must exit 0 with
the final state on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.testing import Process, free_port
from tests.procs import ROOT, Procs, job_env

pytest.importorskip("numpy")

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "replicated_counter.py"
EXIT_S = 60


@dataclass
class SpareJob:
    """A scheduler, workers '0' and '1' and spare 'spare-0' of replicated_counter.py, each with
    a checkpoint directory of its own."""

    scheduler: Process
    workers: list[Process]
    spare: Process

    @classmethod
    def start(cls, processes: Procs, tmp: Path, *args: str) -> SpareJob:
        env = job_env(
            2,
            free_port(),
            MS_ENABLE_RECOVERY="1",
            MS_RECOVERY_PATH=str(tmp / "recovery"),
            MS_NODE_TIMEOUT="2",
        )
        scheduler = processes.start_role("sched", "MS_SCHED", ["-m", "cluster", "scheduler"], env)

        def start(node: str, **extra: str) -> Process:
            script = [str(SCRIPT), str(tmp / f"host-{node}"), *args]
            return processes.start_role(
                node, "MS_WORKER", script, {**env, "MS_NODE_ID": node, **extra}
            )

        return cls(scheduler, [start("0"), start("1")], start("spare-0", CLUSTER_SPARE="1"))

    def finished_by_the_spare(self, steps: int) -> None:
        """Node '1' died, the spare took rank 1, and every other process exited 0, rank 0 and
        the spare with the state of `steps`."""
        assert self.workers[1].wait(EXIT_S) == 1, self.workers[1].output
        for proc in (self.spare, self.workers[0], self.scheduler):
            assert proc.wait(EXIT_S) == 0, proc.output
        assert "promoted: this spare takes rank 1" in self.spare.output, self.spare.output
        final = f"rank {{}} final w {float(steps)}"
        assert final.format(0) in self.workers[0].output, self.workers[0].output
        assert final.format(1) in self.spare.output, self.spare.output


def test_a_manager_made_before_init_serves_its_step_in_memory_before_its_first_save(
    processes: Procs, tmp_path: Path
) -> None:
    """The managers are made before cluster.init() and save every 100 steps: node '1' dies in
    step 5, before anything is saved. The job resumes from step 5, which rank 0 holds in
    memory only: the spare fetches it from rank 0's state server, which a manager made before
    init starts once the TrainingLoop connects it, not at its first save."""
    job = SpareJob.start(processes, tmp_path, "--early", "--die-in-step", "5")
    job.finished_by_the_spare(10)
    assert "fetched the checkpoint of step 5 (" in job.spare.output, job.spare.output
    assert "serving this worker's checkpoints to peers at" in job.workers[0].output
