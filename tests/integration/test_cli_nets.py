"""`mscluster`'s last nets: Ctrl-C is its exit code without a traceback, and an OSError no
command turned into a sentence is one line naming the file and the cause."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

from tests.procs import MSCLUSTER, ROOT


def test_ctrl_c_during_a_one_shot_status_exits_130_without_a_traceback() -> None:
    """The scheduler's port takes the connection and never answers: Ctrl-C while it asks."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(30)
        port = silent.getsockname()[1]
        status = subprocess.Popen(
            [*MSCLUSTER, "status", "--addr", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            conn, _ = silent.accept()  # it is asking now
            with conn:
                status.send_signal(signal.SIGINT)
                _, err = status.communicate(timeout=30)
        finally:
            status.kill()
            status.wait(10)
    assert status.returncode == 130, err
    assert "Traceback" not in err, err


def test_an_oserror_no_command_said_is_one_line(tmp_path: Path) -> None:
    """The previous run's event log is a directory here: removing it before the run fails."""
    logs = tmp_path / "logs"
    (logs / "events.jsonl").mkdir(parents=True)
    script = ROOT / "examples" / "train_mlp.py"
    run = ["--worker-num", "2", "--local-worker-num", "2", "--log-dir", str(logs), str(script)]
    done = subprocess.run(
        [*MSCLUSTER, "chaos", "--", *run],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line == f"mscluster: {logs / 'events.jsonl'}: Is a directory"
