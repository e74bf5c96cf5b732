"""`cluster.init()`'s argument: MindSpore's is the backend name (`init(backend_name=None)`), so
a ported script keeps `cluster.init("nccl")`. That joins the job of the environment, saying in
one line that the name is ignored; an argument that is neither a ClusterConfig nor such a name
(another string: a typo, a config file's path) is one ConfigError line naming it. Real
processes: a scheduler and two workers."""

from __future__ import annotations

import subprocess

from cluster.testing import free_port
from tests.procs import PYTHON, Procs, job_env

LIMIT_S = 60
IGNORED = (
    "cluster: init('nccl'): MindSpore's backend name is ignored: cluster forms the job, and the "
    "data plane's backend is the script's (cluster.torch's init_process_group(backend), or the "
    "framework's)"
)
PORTED = (
    "import cluster; cluster.init('nccl'); "
    "print('rank', cluster.get_rank(), 'of', cluster.get_group_size(), flush=True); "
    "cluster.finalize()"
)


def test_a_ported_scripts_init_with_a_backend_name_joins_the_job(processes: Procs) -> None:
    """It crashed with AttributeError: 'str' object has no attribute 'tls', a traceback from
    inside init()."""
    env = job_env(2, free_port())
    started = [processes.start_role("sched", "MS_SCHED", ["-c", PORTED], env)]
    started += [processes.start_role(f"w{i}", "MS_WORKER", ["-c", PORTED], env) for i in (0, 1)]
    for proc in started:
        assert proc.wait(LIMIT_S) == 0, proc.output
        assert "Traceback" not in proc.output, proc.output
        assert proc.output.count(IGNORED) == 1, proc.output
    said = {line for worker in started[1:] for line in worker.output.splitlines()}
    assert {"rank 0 of 2", "rank 1 of 2"} <= said, said


def refused_line(argument: str) -> str:
    """The one line a worker that calls `cluster.init(ARGUMENT)` exits 1 with."""
    env = job_env(2, free_port(), MS_ROLE="MS_WORKER")
    done = subprocess.run(
        [PYTHON, "-c", f"import cluster; cluster.init({argument})"],
        env=env,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    return line


def test_an_argument_neither_a_config_nor_a_name_is_one_line_naming_its_type() -> None:
    assert refused_line("8") == (
        "cluster: ConfigError: cluster.init() takes a ClusterConfig (or MindSpore's backend "
        "name, which it ignores), not int: call cluster.init() to read the MS_* environment"
    )


def test_a_string_that_is_not_a_backend_name_is_one_line_naming_it() -> None:
    """`init("ssl.json")` was taken for a backend name and ignored: the job ran without what the
    script meant to give it."""
    assert refused_line("'ssl.json'") == (
        "cluster: ConfigError: cluster.init('ssl.json'): a string is MindSpore's backend name, "
        "one of hccl, nccl, mccl, which cluster ignores; call cluster.init() to read the MS_* "
        "environment, or give a ClusterConfig"
    )
