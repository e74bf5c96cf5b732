"""msrun launch lines as MindSpore's users write them, run by `mscluster run` with `msrun`
replaced: `--join True` with its value a word of its own (msrun reads it as `--join=True`), and
msrun's options that have no counterpart here, each refused or noted in one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

from cluster.testing import free_port
from tests.procs import MSCLUSTER, private_copy, processes_running


def mscluster_run(*words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MSCLUSTER, "run", *words], capture_output=True, text=True, timeout=90, check=False
    )


def test_join_with_its_value_apart_streams_the_workers_and_runs_the_script(
    tmp_path: Path,
) -> None:
    """`--join True train.py` ran the script 'True' (ConfigError: script 'True' does not
    exist), train.py its argument; `--join=1` was refused."""
    script = private_copy(tmp_path)
    logs = tmp_path / "logs"
    line = (
        f"--worker_num=2 --local_worker_num=2 --master_port={free_port()} --log_dir={logs} "
        f"--join True {script}"
    )
    result = mscluster_run(*line.split())
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[rank {rank}] allgather rank={rank} size=2 result=[0, 1]" in result.stderr
    assert not processes_running(str(script))


def test_msruns_other_options_are_refused_or_noted_in_one_line(tmp_path: Path) -> None:
    """They were "unrecognized arguments" under the top-level usage, --worker_log_name with
    "(did you mean --worker_num?)". A refused one starts nothing and makes no directory."""
    logs = tmp_path / "logs"
    start = ["--worker_num=2", "--local_worker_num=2", f"--log_dir={logs}"]
    script = str(private_copy(tmp_path))
    refused = mscluster_run(*start, "--sim_level", "1", "--join", "True", script)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.splitlines()
    assert line.startswith("mscluster run: error: msrun's --sim_level is not supported by "), line
    assert not logs.exists()
    ignored = mscluster_run(
        *start, "--dry-run", "--worker_log_name=w.log", "--tail_worker_log", "0", script
    )
    assert ignored.returncode == 0, ignored.stderr
    assert ignored.stderr.splitlines() == [
        "mscluster run: note: msrun's --worker_log_name is ignored: the workers' logs are "
        "worker_<i>.log in --log-dir",
        "mscluster run: note: msrun's --tail_worker_log is ignored: with --join every local "
        "worker's output is streamed, prefixed by rank, and each one's log is worker_<i>.log in "
        "--log-dir",
    ]
    assert f"{script}\n" in ignored.stdout  # the workers' command: the script, no argument
