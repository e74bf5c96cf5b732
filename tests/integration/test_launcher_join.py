"""`mscluster run --join`: whatever the workers print and wherever it goes, the output is
drained, the logs written, and the job ends (a line of any length, a progress bar, a full disk,
a terminal that does not read)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.testing import free_port, wait_until
from tests.procs import Procs, run_args
from tests.tmpfs import mounted

# Rank 0 prints a 1 MB line with no newline, a tqdm-style bar over it (rewritten with '\r', its
# newline at its close), then more than a pipe holds; rank 1 ends with a 1 MB line with no
# newline at all. Both finish.
LONG_LINES = """\
import sys
import cluster

cluster.init()
rank = cluster.get_rank()
if rank == 0:
    sys.stdout.write("x" * 1_000_000)
    sys.stdout.flush()
    for i in range(2000):
        sys.stderr.write(f"\\repoch 0: {i / 20:5.1f}%|" + "#" * 40 + f"| {i}/2000")
        sys.stderr.flush()
    sys.stderr.write("\\n")
    for i in range(2000):
        print(f"step {i} " + "y" * 200)
print("rank", rank, "done", flush=True)
cluster.barrier()
if rank == 1:
    sys.stdout.write("w" * 1_000_000)
"""

# Every rank prints without end (2 KB lines), until it is stopped.
CHATTY = """\
import cluster

cluster.init()
rank = cluster.get_rank()
i = 0
while True:
    print(f"rank {rank} step {i} " + "z" * 2000, flush=True)
    i += 1
"""

# Rank 0 fills its log's filesystem (the launcher's log directory), then prints more than a
# pipe holds; both finish.
FILLS_THE_DISK = """\
import sys
from pathlib import Path
import cluster

cluster.init()
rank = cluster.get_rank()
if rank == 0:
    with open(Path(sys.argv[1]) / "filler", "ab") as filler:
        try:
            while True:
                filler.write(b"\\0" * 65536)
                filler.flush()
        except OSError:
            pass
    for i in range(2000):
        print(f"step {i} " + "y" * 200, flush=True)
print("rank", rank, "done", flush=True)
cluster.barrier()
"""


def test_a_line_of_a_megabyte_and_a_progress_bar_are_logged_whole_and_echoed_cut(
    processes: Procs, tmp_path: Path
) -> None:
    script = tmp_path / "long_lines.py"
    script.write_text(LONG_LINES)
    logs = tmp_path / "logs"
    run = processes.start(
        "run",
        run_args("--join", script, worker_num=2, master_port=free_port(), log_dir=logs),
        os.environ,
    )
    assert run.wait(60) == 0, run.output[-3000:]
    log = (logs / "worker_0.log").read_bytes()
    assert b"x" * 1_000_000 + b"\repoch 0:" in log
    assert b"| 1999/2000\nstep 0 " in log
    assert b"step 1999 " + b"y" * 200 + b"\n" in log
    assert (logs / "worker_1.log").read_bytes().endswith(b"rank 1 done\n" + b"w" * 1_000_000)
    output = run.output
    # The bar over the long line, in its last state, as a terminal shows it.
    assert "[rank 0] epoch 0: 100.0%|" + "#" * 40 + "| 1999/2000\n" in output
    # A long line, cut for the terminal.
    cut = f" [... 995904 more bytes of this line in {logs / 'worker_1.log'}]\n"
    assert "[rank 1] " + "w" * 4096 + cut in output
    assert "[rank 0] step 1999 " in output
    assert "[rank 1] rank 1 done" in output
    assert "job finished" in output


def test_a_full_disk_under_the_logs_is_said_and_the_job_ends(
    processes: Procs, tmp_path: Path
) -> None:
    script = tmp_path / "fills.py"
    script.write_text(FILLS_THE_DISK)
    with mounted("2m") as logs:
        args = run_args("--join", script, logs, worker_num=2, master_port=free_port(), log_dir=logs)
        run = processes.start("run", args, os.environ)
        code = run.wait(60)
        try:
            assert code in (0, 1), run.output[-3000:]
            assert (
                f"mscluster: cannot write {logs / 'worker_0.log'} (No space left on device, "
                "ENOSPC): the rest of worker 0's output is shown here only" in run.output
            ), run.output[-3000:]
            assert "[rank 0] step 1999 " in run.output
        finally:
            (logs / "filler").unlink(missing_ok=True)


@pytest.fixture
def unread(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Launchers whose standard output and error go to a pipe that nobody reads (a terminal
    reader that paused); each is killed, with its group, at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for popen in started:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(10)
        assert popen.stdout is not None
        popen.stdout.close()


def start_unread(
    started: list[subprocess.Popen[bytes]], args: list[str]
) -> subprocess.Popen[bytes]:
    popen = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    started.append(popen)
    return popen


def test_a_terminal_that_does_not_read_stops_neither_the_job_nor_a_signal(
    unread: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    finishing = tmp_path / "long_lines.py"
    finishing.write_text(LONG_LINES)
    done = start_unread(
        unread,
        run_args(
            "--join", finishing, worker_num=2, master_port=free_port(), log_dir=tmp_path / "done"
        ),
    )
    assert done.wait(60) == 0
    assert b"step 1999 " in (tmp_path / "done" / "worker_0.log").read_bytes()

    endless = tmp_path / "chatty.py"
    endless.write_text(CHATTY)
    logs = tmp_path / "stopped"
    stopped = start_unread(
        unread, run_args("--join", endless, worker_num=2, master_port=free_port(), log_dir=logs)
    )

    def logged(name: str) -> int:
        path = logs / name
        return path.stat().st_size if path.exists() else 0

    # Far more than the pipe holds has been printed, and logged: nothing blocks.
    wait_until(lambda: min(logged("worker_0.log"), logged("worker_1.log")) > 2 << 20, 60, "logs")
    stopped.send_signal(signal.SIGINT)
    assert stopped.wait(30) == 128 + signal.SIGINT
