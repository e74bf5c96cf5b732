"""A job over two hosts (network namespaces on one machine, tests/netns.py: one host name, two
addresses) started without `--node-rank`: each launcher names its workers itself."""

from __future__ import annotations

import os
import secrets
import signal
from pathlib import Path

from cluster.testing import free_port, wait_until
from cluster.tools.processes import alive, launched_pids
from tests.netns import two_hosts
from tests.procs import Procs, private_copy, processes_running, run_args


def test_a_launcher_run_again_on_its_host_gets_its_workers_back_into_the_job(
    processes: Procs, tmp_path: Path
) -> None:
    """The workers of a launcher were named after its pid: host b's launcher started again
    (its node rebooted) named its worker anew, and the formed job, recovering, refused it as
    one too many. The same command now names them the same, and the worker rejoins its rank."""
    script, port = private_copy(tmp_path), free_port()
    secret = tmp_path / "job.secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    env = {**os.environ, "CLUSTER_JOB_SECRET_FILE": str(secret)}
    with two_hosts() as (a, b):

        def launcher(name: str) -> list[str]:
            return run_args(
                *("--enable-recovery", "--master-addr", a.ip, "--node-timeout", "2"),
                *(script, "--hold", "12"),
                worker_num=2,
                local_worker_num=1,
                master_port=port,
                log_dir=tmp_path / name,
            )

        first = processes.start("a", a.command(launcher("a")), env, tmp_path)
        host_b = processes.start("b", b.command(launcher("b")), env, tmp_path)
        first.wait_for_output("2/2 registered (ready)", 30)
        everyone = list(launched_pids(tmp_path / "b").values())
        for pid in everyone:  # host b's launcher and worker, as a reboot ends them
            os.kill(pid, signal.SIGKILL)
        host_b.wait(10)
        wait_until(lambda: not any(alive(pid) for pid in everyone), 10, "host b's part gone")

        again = processes.start("b-again", b.command(launcher("b")), env, tmp_path)
        assert again.wait(60) == 0, again.output
        assert first.wait(60) == 0, first.output
    assert "rejoined rank=1 size=2" in (tmp_path / "b" / "worker_0.log").read_text()
    assert not processes_running(str(script))
