"""The README's examples run, and its environment table is complete."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from cluster.testing import free_port
from tests.integration.test_demo import run_demo
from tests.procs import PYTHON, ROOT, Procs, job_env

README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_readme_training_script_runs_as_a_job(processes: Procs, tmp_path: Path) -> None:
    (script,) = [b for b in code_blocks("python") if "cluster.init()" in b]
    path = tmp_path / "train.py"
    path.write_text(script)
    base = job_env(2, free_port())
    sched = processes.start_role("scheduler", "MS_SCHED", [str(path)], base)
    workers = [processes.start_role(f"w{i}", "MS_WORKER", [str(path)], base) for i in range(2)]
    for proc in [*workers, sched]:
        assert proc.wait(30) == 0, proc.output


def test_readme_launch_loop_runs(tmp_path: Path) -> None:
    (loop,) = [b for b in code_blocks("bash") if "for ((i" in b]
    port = str(free_port())
    script = (
        loop.replace("8118", port)
        .replace("python ", f"{PYTHON} ")
        .replace("examples/", f"{ROOT}/examples/")
    )
    (tmp_path / "logs").mkdir()
    result = subprocess.run(
        ["bash", "-c", f"set -e\n{script}"],
        cwd=tmp_path,
        env=job_env(1, 1),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [
        (tmp_path / "logs" / f"worker_{i}.log").read_text().strip().splitlines()[-1]
        for i in range(8)
    ]
    assert sorted(lines) == [f"allgather rank={r} size=8 result={list(range(8))}" for r in range(8)]


def test_readme_names_every_environment_variable() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "cluster").rglob("*.py"))
    names = set(re.findall(r'"((?:MS|CLUSTER)_[A-Z_]+)"', source))
    assert names, "no variable names found in the source"
    missing = sorted(n for n in names if f"`{n}`" not in README)
    assert not missing, f"README's environment table lacks {missing}"


def test_readme_launcher_command_runs(tmp_path: Path) -> None:
    (command,) = [
        line
        for block in code_blocks("bash")
        for line in block.splitlines()
        if line.startswith("mscluster run --worker-num 4 --local-worker-num 4")
    ]
    args = command.split()
    args[-1] = str(ROOT / args[-1])
    result = subprocess.run(
        [PYTHON, "-m", "cluster", args[1], "--master-port", str(free_port()), *args[2:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "allgather rank=3" in (tmp_path / "logs" / "worker_3.log").read_text()


def test_readme_recovery_example_script_runs(tmp_path: Path) -> None:
    assert "examples/run_recovery.sh" in README
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "run_recovery.sh")],
        env={
            **job_env(2, free_port()),
            "LOG_DIR": str(tmp_path),
            "PYTHON": PYTHON,
            "HOLD": "10",
            "MS_NODE_TIMEOUT": "3",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rejoined rank=1 size=2" in result.stdout
    assert "every node is back after the scheduler's restart" in result.stdout
    assert "job exit status: 0" in result.stdout


def test_readme_demo_ends_as_the_readme_says(tmp_path: Path) -> None:
    """The quick start's demo (without its set-up step): both runs end with the README's hash."""
    (shown,) = re.findall(r"```\n(final parameters without faults.*?)```", README, re.DOTALL)
    result = run_demo(tmp_path, sizes={})
    assert result.returncode == 0, result.stdout + result.stderr
    for line in shown.strip().splitlines():
        assert line in result.stdout, result.stdout
