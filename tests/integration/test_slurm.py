"""`mscluster run` under a real Slurm (tests/servers/slurm.py: munged, slurmctld and two slurmd
on this host): srun starts one launcher per node, and each reads its part of the job from the
allocation."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from cluster.testing import wait_until
from tests.procs import PYTHON, ROOT, Procs, launched, processes_running
from tests.servers.slurm import Slurm

EXAMPLE = ROOT / "examples" / "allgather_check.py"
TRAIN = ROOT / "examples" / "train_mlp.py"
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
MSCLUSTER = str(Path(PYTHON).parent / "mscluster")
SRUN_TIMEOUT_S = 90


def job_dir(tmp_path: Path) -> Path:
    """The job's working directory, with its own copy of the script (to find its processes)."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLE, work / EXAMPLE.name)
    return work


def step_logs(work: Path, step: int = 0) -> Path:
    """The default log directory of the job's step `step`: logs/<job>.<step>/ (one job here)."""
    (found,) = (d for d in (work / "logs").iterdir() if d.name.endswith(f".{step}"))
    assert found.name.split(".")[0].isdigit()
    return found


def by_task(output: str) -> dict[str, str]:
    """srun --label output, split per task: {"0": "...", "1": "..."}."""
    tasks: dict[str, list[str]] = {}
    for line in output.splitlines():
        task, sep, text = line.partition(": ")
        if sep:
            tasks.setdefault(task.strip(), []).append(text)
    return {task: "\n".join(lines) for task, lines in tasks.items()}


def test_srun_one_node_runs_both_workers(slurm: Slurm, tmp_path: Path) -> None:
    # The acceptance command, as a user types it: no address, port or rank.
    work = job_dir(tmp_path)
    args = ["srun", "-N1", MSCLUSTER, "run", "--worker-num", "2", "--local-worker-num", "2"]
    done = slurm.run([*args, EXAMPLE.name], cwd=work, timeout_s=SRUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        line = f"allgather rank={rank} size=2 result=[0, 1]"
        assert line in (step_logs(work) / f"worker_{rank}.log").read_text()
    assert "job finished: 2 local workers exited 0" in done.stderr
    assert not processes_running(str(work / EXAMPLE.name))


def test_srun_two_nodes_form_one_job_with_a_shared_secret(slurm: Slurm, tmp_path: Path) -> None:
    # One worker per node (no GPUs): node 0 runs the scheduler at node1's address, which does
    # not resolve here (NodeAddr 127.0.0.1, from scontrol); each node logs under
    # logs/<job>.0/node<R>.
    work = job_dir(tmp_path)
    args = ["srun", "-N2", "--label", MSCLUSTER, "run", "--join", EXAMPLE.name]
    done = slurm.run(args, cwd=work, timeout_s=SRUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        log = step_logs(work) / f"node{rank}" / f"worker_{rank}.log"  # by rank, as msrun
        assert f"allgather rank={rank} size=2 result=[0, 1]" in log.read_text()
    assert (step_logs(work) / "node0" / "scheduler.log").exists()
    assert not (step_logs(work) / "node1" / "scheduler.log").exists()
    # The job secret: the same on both nodes, readable by the user only; the shared copy gone.
    secrets = [step_logs(work) / f"node{rank}" / "job.secret" for rank in range(2)]
    assert secrets[0].read_text() == secrets[1].read_text()
    assert len(secrets[0].read_text().strip()) == 64
    assert all(stat.S_IMODE(s.stat().st_mode) == 0o600 for s in secrets)
    assert list((work / ".mscluster").iterdir()) == []
    assert not processes_running(str(work / EXAMPLE.name))


def test_srun_dry_run_shows_each_nodes_part_and_starts_nothing(
    slurm: Slurm, tmp_path: Path
) -> None:
    work = job_dir(tmp_path)
    args = ["srun", "-N2", "--label", MSCLUSTER, "run", "--dry-run", EXAMPLE.name]
    done = slurm.run(args, cwd=work, timeout_s=SRUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    tasks = by_task(done.stdout)
    assert "node 0 of 2 (node[1-2])" in tasks["0"]
    assert "node 1 of 2 (node[1-2])" in tasks["1"]
    assert "started here" in tasks["0"]
    assert "not started here: this is node rank 1, node 0 starts it" in tasks["1"]
    for task in tasks.values():
        assert "node node1 does not resolve: NodeAddr 127.0.0.1 (scontrol)" in task
        assert "MS_WORKER_NUM=2" in task
        assert "job secret: node 0 writes .mscluster/slurm-" in task
    assert re.search(r" logs/\d+\.0/node1/worker_1\.log ", tasks["1"])
    assert not (work / "logs").exists()
    assert not (work / ".mscluster").exists()


def test_srun_with_two_tasks_on_a_node_is_refused_in_one_line(slurm: Slurm, tmp_path: Path) -> None:
    work = job_dir(tmp_path)
    args = ["srun", "-N1", "-n2", "--label", MSCLUSTER, "run", EXAMPLE.name]
    done = slurm.run(args, cwd=work, timeout_s=SRUN_TIMEOUT_S, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if "mscluster:" in line]
    assert len(lines) == 2  # one per task, no traceback
    assert all("srun started 2 tasks on 1 nodes" in line for line in lines)
    assert "Traceback" not in done.stderr
    assert not (work / "logs").exists()


def test_in_an_salloc_shell_explicit_options_are_enough(slurm: Slurm, tmp_path: Path) -> None:
    # salloc runs its command outside srun, without SLURM_NODEID: everything given, the job runs;
    # the node rank missing, one line says to use srun.
    work = job_dir(tmp_path)
    typed = ["--worker-num", "2", "--local-worker-num", "2", "--master-addr", "127.0.0.1"]
    args = ["salloc", "-N1", MSCLUSTER, "run", *typed, "--node-rank", "0", EXAMPLE.name]
    done = slurm.run(args, cwd=work, timeout_s=SRUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "job finished: 2 local workers exited 0" in done.stderr
    args = ["salloc", "-N1", MSCLUSTER, "run", *typed, EXAMPLE.name]
    done = slurm.run(args, cwd=work, timeout_s=SRUN_TIMEOUT_S, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("mscluster")]
    assert line.startswith("mscluster: ConfigError: SLURM_NODEID is not set")
    assert "srun --ntasks-per-node=1 mscluster run" in line
    assert not processes_running(str(work / EXAMPLE.name))


# A worker that, once in its job, waits (bounded) until a worker of the other step is in its own:
# the two steps' jobs run at the same time.
SIDE_BY_SIDE = """
import os
from pathlib import Path
import cluster
from cluster.testing import wait_until

cluster.init()
step = os.environ["SLURM_STEP_ID"]
print(f"step {step} rank {cluster.get_rank()} of {cluster.get_group_size()}", flush=True)
Path(f"up-{step}-{cluster.get_rank()}").touch()
other = "1" if step == "0" else "0"
wait_until(lambda: any(Path().glob(f"up-{other}-*")), 30, f"step {other} to run beside {step}")
cluster.finalize()
"""


def test_two_steps_side_by_side_on_one_node_run_apart(slurm: Slurm, tmp_path: Path) -> None:
    # `srun ... mscluster run ... &` twice in one job, recovery on: each step has its own
    # default port and its own logs/<job>.<step>/ (logs, pids, job secret, recovery state).
    work = tmp_path / "work"
    work.mkdir()
    (work / "side.py").write_text(SIDE_BY_SIDE)
    step = "srun --overlap -N1 mscluster run --worker-num 2 --local-worker-num 2 --enable-recovery"
    both = f"{step} side.py & first=$!; {step} side.py; second=$?; wait $first; echo rc=$?,$second"
    done = run_in_job(slurm, work, "salloc", "-N1", "bash", "-c", both)
    assert "rc=0,0" in done.stdout, done.stdout + done.stderr
    for number in (0, 1):
        logs = step_logs(work, number)
        for rank in (0, 1):
            assert f"step {number} rank {rank} of 2" in (logs / f"worker_{rank}.log").read_text()
        assert (logs / "recovery").is_dir()
        assert (logs / "job.secret").exists()
    assert not processes_running(str(work / "side.py"))


def batch_env(slurm: Slurm) -> dict[str, str]:
    """Slurm's environment with this venv's `mscluster` on the PATH, as after `source
    .venv/bin/activate` (sbatch passes the environment on to the job)."""
    return {**slurm.env, "PATH": f"{Path(PYTHON).parent}:{os.environ['PATH']}"}


def run_in_job(slurm: Slurm, work: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """`command` (salloc, sbatch ...) in `work` with `batch_env`, run to its end (bounded)."""
    return subprocess.run(
        list(command),
        cwd=work,
        env=batch_env(slurm),
        capture_output=True,
        text=True,
        timeout=SRUN_TIMEOUT_S,
        check=False,
    )


def run_batch(slurm: Slurm, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_in_job(slurm, work, "sbatch", "--wait", str(SBATCH), *args)


def job_output(work: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(work.glob("slurm-*.out")))


@pytest.mark.slow
def test_the_example_sbatch_trains_through_a_killed_worker(
    slurm: Slurm, tmp_path: Path, processes: Procs
) -> None:
    # examples/slurm/train.sbatch on both nodes, recovery on: worker 1 (node 1) is SIGKILLed
    # mid-run; its node's launcher starts it again, it rejoins after the guard, every worker
    # rolls back, and the job ends with the parameters of the same job without the kill.
    work = tmp_path / "work"
    work.mkdir()
    script = work / TRAIN.name
    shutil.copy(TRAIN, script)
    train = [str(script), "--steps", "120", "--step-delay", "0.05", "--save-every", "5"]
    clean = run_batch(slurm, work, "--log-dir", "clean-logs", *train, "--out", "clean")
    assert clean.returncode == 0, clean.stdout + clean.stderr + job_output(work)

    args = ["sbatch", "--wait", str(SBATCH), "--node-timeout", "2", "--log-dir", "logs"]
    batch = processes.start("sbatch", [*args, *train, "--out", "faulty"], batch_env(slurm), work)
    log = work / "logs" / "node1" / "worker_1.log"
    # Steps are numbered within an epoch of 16: epoch 3 is step 32 on.
    wait_until(lambda: log.exists() and "epoch: 3 " in log.read_text(), 60, "step 32 on node 1")
    os.kill(launched(log.parent, "worker_1"), signal.SIGKILL)  # node 1's launcher's worker
    assert batch.wait(SRUN_TIMEOUT_S) == 0, batch.output + job_output(work)

    output = job_output(work)
    assert "worker 0 (rank 1, node id '1') was killed by SIGKILL; restarting it" in output
    final = (work / "faulty" / "final.sha256").read_text()
    assert final == (work / "clean" / "final.sha256").read_text()
