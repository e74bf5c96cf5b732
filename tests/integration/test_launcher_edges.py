"""`mscluster run` at its edges: a terminal that goes away, options it cannot use, signals."""

from __future__ import annotations

import subprocess
from pathlib import Path

from cluster.testing import free_port
from tests.procs import MSCLUSTER, processes_running

# A worker that prints far more than a pipe holds (64 KiB) once it is in the job.
CHATTY = """
import cluster

cluster.init()
for line in range({lines}):
    print(f"line {{line}} " + "x" * 90, flush=True)
cluster.finalize()
"""
CHATTY_LINES = 3000


def chatty_script(tmp_path: Path) -> Path:
    script = tmp_path / "job" / "chatty.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(CHATTY.format(lines=CHATTY_LINES))
    return script


def test_join_whose_reader_went_away_finishes_the_job_with_whole_logs(tmp_path: Path) -> None:
    """`mscluster run --join train.py 2>&1 | head -1`: the echo stops, the job does not."""
    script = chatty_script(tmp_path)
    logs = tmp_path / "logs"
    args = [*MSCLUSTER, "run", "--join", "--worker-num", "2", "--master-port", str(free_port())]
    run = subprocess.Popen(
        [*args, "--log-dir", str(logs), str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert run.stdout is not None
        assert run.stdout.readline()
        run.stdout.close()  # the reader goes away
        code = run.wait(60)
    finally:
        run.kill()
        run.wait(10)
    assert code == 0
    for worker in ("worker_0", "worker_1"):
        text = (logs / f"{worker}.log").read_text()
        assert f"line {CHATTY_LINES - 1} " in text, text[-300:]
    assert not processes_running(str(script))
