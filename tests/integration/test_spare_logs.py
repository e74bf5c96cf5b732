"""The spares of a job over two hosts (two launchers on one machine, `--node-rank 0` and `1`, as
tests/integration/test_launcher.py runs them): each host's spare log and its name in
`LOG_DIR/pids` are its own, so the logs of both hosts gathered in one place do not collide."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

from cluster.testing import free_port, processes_running
from cluster.tools.processes import launched_pids
from tests.procs import Procs, job_env, private_copy, run_args

LIMIT_S = 90


def test_the_spares_of_two_hosts_write_logs_of_their_own(processes: Procs, tmp_path: Path) -> None:
    script = private_copy(tmp_path)
    port = free_port()
    node_args = functools.partial(
        run_args, "--spares", "1", "--enable-recovery", worker_num=2, local_worker_num=1
    )
    runs = [
        processes.start(
            f"node{rank}",
            node_args(
                # The job holds a while after its gather: the spares have registered by then.
                *("--node-rank", str(rank), script, "--hold", "8"),
                master_port=port,
                log_dir=tmp_path / f"node{rank}",
            ),
            job_env(2, 0),
        )
        for rank in (0, 1)
    ]
    # Each launcher's pids, read while its job runs (it rewrites the file at each start).
    for run in runs:
        run.wait_for_output("started 1 of 2 workers and 1 spares", LIMIT_S)
    names = [set(launched_pids(tmp_path / f"node{rank}")) for rank in (0, 1)]
    for run in runs:
        assert run.wait(LIMIT_S) == 0, run.output
    assert {"worker_0", "spare_0-0"} <= names[0], names
    assert {"worker_1", "spare_1-0"} <= names[1], names
    assert not {n for n in names[0] & names[1] if n.startswith(("worker_", "spare_"))}

    gathered = tmp_path / "gathered"  # both hosts' logs in one place: none replaces another
    gathered.mkdir()
    for rank in (0, 1):
        for log in (tmp_path / f"node{rank}").glob("*_*.log"):
            assert not (gathered / log.name).exists(), log.name
            shutil.copy(log, gathered / log.name)
    assert sorted(p.name for p in gathered.iterdir()) == [
        "spare_0-0.log",
        "spare_1-0.log",
        "worker_0.log",
        "worker_1.log",
    ]
    for rank in (0, 1):  # each the log of its own host's spare
        said = (gathered / f"spare_{rank}-0.log").read_text()
        assert said.startswith(f"cluster[spare-{rank}-0]: "), said
    assert not processes_running(str(script))
