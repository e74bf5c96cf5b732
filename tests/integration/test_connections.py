"""Connections: idle sockets do not keep a job from forming, and a worker that cannot connect
says why (refused, timed out, or taken and dropped by an overloaded scheduler).

Real processes, real sockets: a scheduler whose open-files limit the test lowers (as on a host
with 1,024 files), flooded with raw TCP connections that never speak.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
from collections.abc import Iterator

from cluster.testing import free_port
from cluster.tools.testing import wait_until
from tests.procs import PYTHON, ROOT, Procs, job_env

EXAMPLE = [str(ROOT / "examples" / "allgather_check.py")]
FILES = 256
IDLE_SOCKETS = 400


def low_open_files() -> None:
    """In the scheduler's process: soft and hard limit FILES, so it cannot raise them."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES))


@contextlib.contextmanager
def idle_sockets(port: int, count: int) -> Iterator[list[socket.socket]]:
    """`count` TCP connections to `port` that never send a byte."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def dropped(socks: list[socket.socket]) -> int:
    """How many of `socks` the other side has closed."""
    count = 0
    for sock in socks:
        try:
            if sock.recv(1) == b"":
                count += 1
        except BlockingIOError:
            continue
        except OSError:
            count += 1
    return count


def test_idle_connections_are_dropped_and_the_job_forms(processes: Procs) -> None:
    port = free_port()
    env = {**job_env(2, port, MS_TOPO_TIMEOUT="90"), "MS_ROLE": "MS_SCHED"}
    log = processes.tmp / "scheduler.log"
    with log.open("wb") as out:
        scheduler = subprocess.Popen(
            [PYTHON, "-m", "cluster", "scheduler"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=low_open_files,  # noqa: PLW1509 - setrlimit only, before exec
        )
    try:
        wait_until(lambda: "listening on" in log.read_text(), 30, "the scheduler listening")
        assert f"open-files limit {FILES}: room for about {FILES - 100} nodes" in log.read_text()
        with idle_sockets(port, IDLE_SOCKETS) as socks:
            workers = [
                processes.start_role(f"worker{i}", "MS_WORKER", EXAMPLE, job_env(2, port))
                for i in range(2)
            ]
            for worker in workers:
                assert worker.wait(60) == 0, worker.output
            # The scheduler dropped the idle sockets it had taken (those the kernel still holds
            # for it are taken, and dropped, in turn).
            wait_until(lambda: dropped(socks) >= FILES // 2, 30, "idle sockets dropped")
        assert scheduler.wait(30) == 0, log.read_text()
    finally:
        if scheduler.poll() is None:
            scheduler.kill()
            scheduler.wait(10)
    # Past the reserve it shut down the connections that carried no member's stream, at once
    # rather than after their handshake's timeout (`cluster.scheduler.descriptors`).
    assert "connections that carry no member's stream, to keep 66 free" in log.read_text()
    for worker in workers:
        assert "allgather rank=" in worker.output
        for line in worker.output.splitlines():
            if "waiting for the scheduler" in line and ": " in line.split("waiting for", 1)[1]:
                # While the idle sockets held it, the worker said why it could not get in.
                assert "overloaded" in line, line
    assert "Traceback" not in log.read_text()


def one_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("cluster: ")]
    assert len(lines) == 1, output
    return lines[0]


def start_lonely_worker(processes: Procs, port: int) -> str:
    worker = processes.start_role(
        "worker", "MS_WORKER", EXAMPLE, job_env(2, port, MS_TOPO_TIMEOUT="4")
    )
    assert worker.wait(60) != 0
    assert "Traceback" not in worker.output
    return worker.output


def test_a_worker_says_nothing_listens_when_the_connection_is_refused(processes: Procs) -> None:
    output = start_lonely_worker(processes, free_port())
    error = one_error(output)
    assert "did not accept this node in time: nothing took the connection" in error
    assert "(connection refused)" in error
    assert "MS_SCHED_HOST / MS_SCHED_PORT" in error


def test_a_worker_says_the_scheduler_is_overloaded_when_it_takes_and_never_answers(
    processes: Procs,
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)  # the kernel takes connections; nothing ever answers on them
        output = start_lonely_worker(processes, listener.getsockname()[1])
    error = one_error(output)
    assert "it accepts connections but did not answer on one" in error
    assert "overloaded (out of open files? see its log)" in error
    assert "it accepts connections but did not answer" in output.split(error)[0]  # meanwhile
