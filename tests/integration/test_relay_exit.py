"""A relay started by hand (`mscluster relay`, as a host whose workers are started otherwise runs
it) ends by itself once the job has ended and its workers have closed: a shell loop that ends in
`wait` ends with the job (a job that finished: `test_relay_stop.py`). A scheduler lost is not
the job's end: the relay serves on."""

from __future__ import annotations

import signal
from pathlib import Path

from cluster.testing import free_port
from tests.integration.test_relay import EXAMPLE, start_relayed_job
from tests.procs import MSCLUSTER, Procs, job_env


def test_a_relay_started_by_hand_exits_0_once_the_job_failed(
    processes: Procs, short_dir: Path
) -> None:
    """A worker killed, recovery off: the job fails, the others exit, and so does the relay."""
    sched, relay, workers = start_relayed_job(processes, short_dir / "r.sock", 3)
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    workers[0].popen.send_signal(signal.SIGKILL)
    for proc in [sched, *workers[1:]]:
        assert proc.wait(30) != 0, proc.output
    assert relay.wait(30) == 0, relay.output
    assert "the job failed: rank " in relay.output, relay.output


def test_a_relay_serves_on_while_its_scheduler_is_restarted_to_resume(
    processes: Procs, short_dir: Path
) -> None:
    """The scheduler SIGTERMed (the job left to resume) is no end of the job: the relay keeps
    serving, its workers go on through it with the scheduler started again, and it exits once
    they finished."""
    port = free_port()
    env = job_env(2, port, MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(short_dir / "state"))
    sock = short_dir / "r.sock"
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, env)
    relay = processes.start("relay", [*MSCLUSTER, "relay", "--socket", f"unix:{sock}"], env)
    relay.wait_for_output("mscluster relay: serving", 30)
    relayed = {**env, "CLUSTER_RELAY": f"unix:{sock}"}
    workers = [
        processes.start_role(
            f"w{i}", "MS_WORKER", [*EXAMPLE, "--hold", "6"], {**relayed, "MS_NODE_ID": str(i)}
        )
        for i in range(2)
    ]
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    sched.popen.send_signal(signal.SIGTERM)
    assert sched.wait(15) == 0, sched.output
    assert relay.running, relay.output
    again = processes.start_role("scheduler-again", "MS_SCHED", EXAMPLE, env)
    for proc in [*workers, again]:
        assert proc.wait(60) == 0, proc.output
        assert "lost the relay" not in proc.output, proc.output
    assert relay.wait(30) == 0, relay.output
    assert "the job finished: " in relay.output, relay.output


def test_a_relay_whose_workers_all_finished_exits_while_the_job_goes_on(
    processes: Procs, short_dir: Path
) -> None:
    """Its host's part is over though the job's is not (a worker of another host, here one
    direct, still holds): once every worker it carried finished and closed, it exits 0."""
    port = free_port()
    env = job_env(3, port)
    sock = short_dir / "r.sock"
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, env)
    relay = processes.start("relay", [*MSCLUSTER, "relay", "--socket", f"unix:{sock}"], env)
    relay.wait_for_output("mscluster relay: serving", 30)
    relayed = {**env, "CLUSTER_RELAY": f"unix:{sock}"}
    here = [processes.start_role(f"w{i}", "MS_WORKER", EXAMPLE, relayed) for i in range(2)]
    elsewhere = processes.start_role("w2", "MS_WORKER", [*EXAMPLE, "--hold", "60"], env)
    for w in here:
        assert w.wait(60) == 0, w.output
        assert "relay" not in w.output, w.output  # through it
    assert relay.wait(30) == 0, relay.output
    said = "every worker it carried (2) finished and has closed: exiting"
    assert said in relay.output, relay.output
    assert elsewhere.running
    assert sched.running
