"""A host's relay serves the workers of its own job only: a worker whose CLUSTER_RELAY names
another job's relay is refused there, and says what to do, instead of joining that job."""

from __future__ import annotations

from pathlib import Path

from cluster.testing import free_port
from tests.procs import MSCLUSTER, ROOT, Procs, example_error_line, job_env

EXAMPLE = str(ROOT / "examples" / "allgather_check.py")


def test_a_worker_of_another_job_is_refused_by_the_relay_and_says_what_to_do(
    processes: Procs, short_dir: Path
) -> None:
    """Two jobs' schedulers, A and B, and A's relay (`mscluster relay`), all real processes. A
    worker of B whose CLUSTER_RELAY names A's relay (a shared socket path) does not join A: the
    relay refuses its calls, and it exits with one line that names the relay's socket, both
    schedulers and the fix; the relay says it in its log. A's own worker then runs through the
    same relay."""
    a_port, b_port = free_port(), free_port()
    for name, port in (("sched-a", a_port), ("sched-b", b_port)):
        processes.start(name, [*MSCLUSTER, "scheduler"], job_env(1, port, MS_ROLE="MS_SCHED"))
    relay_address = f"unix:{short_dir / 'r.sock'}"
    relay = processes.start(
        "relay", [*MSCLUSTER, "relay", "--socket", relay_address], job_env(1, a_port)
    )
    relay.wait_for_output("mscluster relay: serving", 30)

    b_worker = job_env(1, b_port, MS_ROLE="MS_WORKER", CLUSTER_RELAY=relay_address)
    line = example_error_line(b_worker)
    assert f"this worker is for the scheduler at 127.0.0.1:{b_port}" in line, line
    assert f"the relay at {relay_address} (CLUSTER_RELAY)" in line, line
    assert f"forwards to the scheduler at 127.0.0.1:{a_port}: it is another job's relay" in line
    assert "Point CLUSTER_RELAY at this job's relay, or unset it" in line, line
    relay.wait_for_output(
        f"mscluster relay: refused a worker's calls (the scheduler at 127.0.0.1:{b_port}): this "
        f"relay forwards to the scheduler at 127.0.0.1:{a_port}",
        10,
    )

    a_worker = job_env(1, a_port, MS_ROLE="MS_WORKER", CLUSTER_RELAY=relay_address)
    worker = processes.start("worker-a", [*MSCLUSTER[:1], EXAMPLE], a_worker)
    assert worker.wait(60) == 0, worker.output
    assert "allgather rank=0 size=1 result=[0]" in worker.output
    assert "relay" not in worker.output  # through it, not direct: nothing said of it
