"""msrun launch lines as MindSpore's users write them, run by `mscluster run` with `msrun`
replaced: `--join True` with its value a word of its own (msrun reads it as `--join=True`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from cluster.testing import free_port
from tests.procs import MSCLUSTER, private_copy, processes_running


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
    result = subprocess.run(
        [*MSCLUSTER, "run", *line.split()], capture_output=True, text=True, timeout=90, check=False
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[rank {rank}] allgather rank={rank} size=2 result=[0, 1]" in result.stderr
    assert not processes_running(str(script))
