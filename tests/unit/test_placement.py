"""Where a host's part of a job comes from: the options, else the Slurm allocation, else the
defaults; and the plan of processes that `mscluster run` (and --dry-run) makes from it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.errors import ConfigError
from cluster.tools import launch_plan, launch_setup, placement, slurm
from cluster.tools.launch_plan import LaunchOptions
from cluster.tools.placement import Requested

STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "3",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_JOB_NODELIST": "gpu[05-08]",
    "SLURMD_NODENAME": "gpu08",
}
# The batch script of a two-node job, outside srun (what Slurm 22.05 sets there).
BATCH = {
    "SLURM_JOB_ID": "17",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "node[1-2]",
}

# An salloc shell of a two-node job: no SLURM_NODEID (it runs on the login node, outside srun).
SALLOC = {
    "SLURM_JOB_ID": "18",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NNODES": "2",
}


def allocation(**changes: str) -> slurm.Allocation:
    found = slurm.allocation_from_env({**STEP, **changes})
    assert found is not None
    return found


def test_outside_slurm_there_is_no_allocation() -> None:
    assert slurm.allocation_from_env({"HOME": "/root"}) is None


def test_a_step_is_read_from_the_steps_variables_not_the_jobs() -> None:
    # `srun -N2` inside a four-node allocation: the job of this launcher has two nodes.
    found = allocation()
    assert (found.job_id, found.step_id, found.node_rank) == (4242, 3, 1)
    assert (found.node_count, found.nodelist, found.first_node) == (2, "gpu[07-08]", "gpu07")
    assert found.describe() == "Slurm job 4242 step 3, node 1 of 2 (gpu[07-08])"
    assert found.secret_path == Path(".mscluster/slurm-4242.3.r0.secret")
    assert found.default_port == 10000 + (4242 + 7919 * 3) % 20000


def test_concurrent_steps_and_neighbouring_jobs_get_different_default_ports() -> None:
    # `srun ... mscluster run ... &` twice in one job: each step's scheduler on its own port;
    # every node of a step (and the same step of a requeued job) computes the same one.
    steps = [allocation(SLURM_STEP_ID=str(step)).default_port for step in range(8)]
    batch = slurm.allocation_from_env(BATCH)
    assert batch is not None
    neighbours = [allocation(SLURM_JOB_ID=str(4242 + d)).default_port for d in range(1, 8)]
    assert len({*steps, *neighbours}) == len(steps) + len(neighbours)
    assert allocation(SLURM_NODEID="0").default_port == allocation().default_port
    assert all(10000 <= port < 30000 for port in [*steps, *neighbours, batch.default_port])
    batch_step0 = slurm.allocation_from_env(
        {
            **BATCH,
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "node[1-2]",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "2",
        }
    )
    assert batch_step0 is not None
    assert batch.default_port != batch_step0.default_port


def test_the_batch_script_is_read_from_the_jobs_variables() -> None:
    found = slurm.allocation_from_env(BATCH)
    assert found is not None
    assert (found.step_id, found.node_count, found.first_node) == (None, 2, "node1")
    assert found.describe() == "Slurm job 17 batch script, node 0 of 2 (node[1-2])"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x' is not an integer"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not below the node count"),
        ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST is not set"),
        ({"SLURM_STEP_NUM_TASKS": "4"}, "srun started 4 tasks on 2 nodes"),
        ({"SLURM_STEP_ID": ""}, "SLURM_STEP_ID is not set although SLURM_JOB_ID is"),
        ({"SLURM_GPUS_ON_NODE": "two"}, "SLURM_GPUS_ON_NODE='two' is not an integer"),
    ],
)
def test_a_broken_allocation_is_a_config_error_naming_the_variable(
    changes: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        slurm.allocation_from_env({**STEP, **changes})


def test_the_defaults_outside_slurm_are_todays() -> None:
    where = placement.place(Requested(), None)
    assert (where.worker_num, where.local_worker_num, where.node_rank) == (8, 8, -1)
    assert (where.master_addr, where.master_port) == ("127.0.0.1", 8118)
    assert where.log_dir == Path("logs")
    where = placement.place(Requested(worker_num=4, local_worker_num=2, node_rank=1), None)
    assert (where.worker_num, where.local_worker_num, where.node_rank) == (4, 2, 1)


def test_each_host_of_a_job_that_spans_hosts_has_its_own_default_log_dir() -> None:
    """Hosts that share a working directory (a shared home) never share a log directory by
    default: `logs/node<R>`, or `logs/<host>` without --node-rank; one typed is kept, and a
    job of this host alone keeps `logs`."""
    spans = Requested(worker_num=4, local_worker_num=2)
    assert placement.place(replace(spans, node_rank=1), None, "h1").log_dir == Path("logs/node1")
    assert placement.place(replace(spans, node_rank=0), None, "h0").log_dir == Path("logs/node0")
    assert placement.place(spans, None, "gpu08").log_dir == Path("logs/gpu08")
    assert placement.place(spans, None, "").log_dir == Path("logs")
    assert placement.place(spans, None, "..").log_dir == Path("logs")
    typed = replace(spans, node_rank=1, log_dir=Path("mine"))
    assert placement.place(typed, None, "h1").log_dir == Path("mine")
    alone = Requested(worker_num=4, local_worker_num=4, node_rank=0)
    assert placement.place(alone, None, "h0").log_dir == Path("logs")


def test_slurm_gives_what_was_not_typed() -> None:
    where = placement.place(Requested(), allocation(SLURM_GPUS_ON_NODE="4"))
    assert (where.worker_num, where.local_worker_num, where.node_rank) == (8, 4, 1)
    assert (where.master_addr, where.master_port) == ("gpu07", 17999)
    assert where.master_is_node
    # Each job step logs apart, and the nodes share the working directory: each node apart too.
    assert where.log_dir == Path("logs/4242.3/node1")
    # Without GPUs, one worker per node.
    assert placement.place(Requested(), allocation()).local_worker_num == 1


def test_explicit_options_win_over_slurm() -> None:
    typed = Requested(
        worker_num=6,
        local_worker_num=3,
        master_addr="10.0.0.1",
        master_port=9000,
        node_rank=0,
        log_dir=Path("/var/log/job"),
    )
    where = placement.place(typed, allocation(SLURM_GPUS_ON_NODE="4"))
    assert (where.worker_num, where.local_worker_num, where.node_rank) == (6, 3, 0)
    assert (where.master_addr, where.master_port) == ("10.0.0.1", 9000)
    assert not where.master_is_node
    assert where.log_dir == Path("/var/log/job/node0")


def test_a_typed_worker_num_is_spread_over_the_nodes() -> None:
    where = placement.place(Requested(worker_num=4), allocation(SLURM_GPUS_ON_NODE="8"))
    assert (where.worker_num, where.local_worker_num) == (4, 2)
    with pytest.raises(ConfigError, match="--worker-num 5 does not divide among the 2 nodes"):
        placement.place(Requested(worker_num=5), allocation())


def test_each_job_step_has_its_own_default_log_dir_and_a_typed_one_is_kept() -> None:
    # Jobs started from one working directory: none resumes or overwrites another's state
    # (recovery/, job.secret, pids, logs); a requeued job (same ids) finds its own again.
    one = allocation(SLURM_NODEID="0", SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1")
    where = placement.place(Requested(worker_num=2, local_worker_num=2), one)
    assert (where.worker_num, where.node_rank, where.log_dir) == (2, 0, Path("logs/4242.3"))
    dirs = {
        placement.place(Requested(), allocation(**changes)).log_dir
        for changes in ({}, {"SLURM_JOB_ID": "4243"}, {"SLURM_STEP_ID": "4"}, {"SLURM_NODEID": "0"})
    }
    assert len(dirs) == 4
    again = allocation(SLURM_RESTART_COUNT="1")
    assert placement.place(Requested(), again).log_dir == Path("logs/4242.3/node1")
    typed = placement.place(Requested(log_dir=Path("runs/a")), allocation())
    assert typed.log_dir == Path("runs/a/node1")
    typed = placement.place(Requested(worker_num=2, local_worker_num=2, log_dir=Path("b")), one)
    assert typed.log_dir == Path("b")
    batch = slurm.allocation_from_env(BATCH)
    assert placement.place(Requested(worker_num=2), batch).log_dir == Path("logs/17.batch/node0")


def test_the_batch_script_of_several_nodes_asks_for_srun() -> None:
    batch = slurm.allocation_from_env(BATCH)
    with pytest.raises(ConfigError, match="srun --ntasks-per-node=1 mscluster run"):
        placement.place(Requested(), batch)
    # With --worker-num, a job of the batch node alone.
    where = placement.place(Requested(worker_num=2), batch)
    assert (where.worker_num, where.local_worker_num, where.node_rank) == (2, 2, 0)


def test_in_an_salloc_shell_explicit_options_win_and_a_missing_rank_asks_for_srun() -> None:
    shell = slurm.allocation_from_env(SALLOC)
    assert shell is not None
    assert shell.node_rank is None
    typed = Requested(worker_num=2, local_worker_num=2, master_addr="127.0.0.1", node_rank=0)
    where = placement.place(typed, shell)
    assert (where.worker_num, where.local_worker_num, where.node_rank) == (2, 2, 0)
    assert where.master_addr == "127.0.0.1"
    assert where.allocation is not None
    assert where.allocation.node_rank == 0
    with pytest.raises(ConfigError, match=r"SLURM_NODEID is not set .*srun --ntasks-per-node=1"):
        placement.place(Requested(worker_num=2, local_worker_num=2), shell)
    # Inside srun SLURM_NODEID is required as before.
    with pytest.raises(ConfigError, match="SLURM_NODEID is not set although SLURM_JOB_ID is"):
        slurm.allocation_from_env({**STEP, "SLURM_NODEID": ""})


def options(**changes: Any) -> LaunchOptions:
    base = LaunchOptions(
        script=Path("train.py"),
        script_args=("--lr", "0.1"),
        worker_num=4,
        local_worker_num=2,
        master_addr="gpu07",
        master_port=14242,
        node_rank=1,
        log_dir=Path("logs/node1"),
        python="/usr/bin/python3",
        allocation=allocation(),
    )
    return dataclasses.replace(base, **changes)


def plan(opts: LaunchOptions, *, with_scheduler: bool = False) -> launch_plan.Plan:
    return launch_plan.make_plan(
        opts,
        ip="10.1.1.7",
        with_scheduler=with_scheduler,
        hostname="gpu08",
        launcher_pid=99,
        tls_env={"CLUSTER_TLS_CONFIG": "/etc/ssl.json"},
    )


def test_the_plan_names_each_process_its_node_id_rank_and_log() -> None:
    made = plan(options(enable_recovery=True, job_secret_file=Path("/j/job.secret")))
    assert made.scheduler is None
    assert made.address == "10.1.1.7:14242"
    assert [(p.name, p.node_id, p.rank, p.log) for p in made.workers] == [
        ("worker 0", "2", 2, Path("logs/node1/worker_2.log")),  # by rank, as msrun names it
        ("worker 1", "3", 3, Path("logs/node1/worker_3.log")),
    ]
    env = made.workers[1].env
    assert env["MS_ROLE"] == "MS_WORKER"
    assert env["MS_NODE_ID"] == "3"
    # msrun's, for user scripts: the planned rank, the index on this host.
    assert (env["RANK_ID"], env["RANK"], env["RANK_SIZE"]) == ("3", "3", "4")
    assert (env["LOCAL_RANK"], env["DEVICE_ID"]) == ("1", "1")
    assert env["MS_SCHED_HOST"] == "10.1.1.7"
    assert env["MS_ENABLE_RECOVERY"] == "1"
    assert env["MS_RECOVERY_PATH"].endswith("logs/node1/recovery")
    assert env["CLUSTER_JOB_SECRET_FILE"] == "/j/job.secret"
    assert env["CLUSTER_TLS_CONFIG"] == "/etc/ssl.json"
    assert made.workers[0].args == ("/usr/bin/python3", "train.py", "--lr", "0.1")


def test_node_zero_plans_the_scheduler_without_the_script() -> None:
    made = plan(options(node_rank=0, log_dir=Path("logs/node0")), with_scheduler=True)
    assert made.scheduler is not None
    assert made.scheduler.args == ("/usr/bin/python3", "-m", "cluster", "scheduler")
    assert made.scheduler.env["MS_ROLE"] == "MS_SCHED"
    assert made.scheduler.log == Path("logs/node0/scheduler.log")
    assert [p.node_id for p in made.workers] == ["0", "1"]


def test_without_a_node_rank_a_multi_host_job_gets_host_unique_ids() -> None:
    made = plan(options(node_rank=-1, allocation=None, spares=1, enable_recovery=True))
    name = launch_plan.launcher_name(options(), "gpu08")
    assert re.fullmatch(r"gpu08-[0-9a-f]{8}", name)
    assert [(p.node_id, p.rank) for p in made.workers] == [
        (f"{name}-0000", None),
        (f"{name}-0001", None),
        (f"spare-{name}-0", None),
    ]
    # Ranked at registration: no RANK_ID (cluster.get_rank() says it); a spare has no place.
    ranks = ("RANK_ID", "RANK", "LOCAL_RANK", "DEVICE_ID", "RANK_SIZE")
    assert [[p.env.get(k) for k in ranks] for p in made.workers] == [
        [None, None, "0", "0", "4"],
        [None, None, "1", "1", "4"],
        [None, None, None, None, "4"],
    ]
    inherited = {"RANK_ID": "0", "LOCAL_RANK": "0"}  # exported for a single-process run
    env = launch_plan.child_environment(inherited, made.workers[2])
    assert "RANK_ID" not in env
    assert "LOCAL_RANK" not in env


def test_a_spares_log_is_named_by_its_node_id_so_hosts_never_share_one() -> None:
    """The logs (and the names in LOG_DIR/pids) of the spares of several hosts gathered in one
    place: `spare_<i>` on the one host of a job, unique per host across hosts, as the workers'
    `worker_<rank>` are with --node-rank."""
    name = launch_plan.launcher_name(options(), "gpu08")

    def spare_logs(**changes: Any) -> list[str]:
        return [p.log.name for p in plan(options(spares=2, **changes)).workers if p.spare]

    assert spare_logs(worker_num=2, node_rank=-1) == ["spare_0.log", "spare_1.log"]
    assert spare_logs(node_rank=0) == ["spare_0-0.log", "spare_0-1.log"]
    assert spare_logs(node_rank=1) == ["spare_1-0.log", "spare_1-1.log"]
    assert spare_logs(node_rank=-1, allocation=None) == [
        f"spare_{name}-0.log",
        f"spare_{name}-1.log",
    ]


def test_a_launcher_run_again_names_its_workers_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ids are the launcher's host and log directory's, never its pid: a launcher started
    # again (its host rebooted) gets its workers' ranks back in a job that recovers. Another
    # log directory is another launcher of the job on this host (one launcher per directory).
    monkeypatch.chdir(tmp_path)

    def ids(log_dir: Path, pid: int) -> list[str | None]:
        opts = options(node_rank=-1, allocation=None, log_dir=log_dir)
        made = launch_plan.make_plan(
            opts,
            ip="10.1.1.7",
            with_scheduler=False,
            hostname="gpu08",
            launcher_pid=pid,
            tls_env={},
        )
        return [p.node_id for p in made.workers]

    assert ids(Path("logs"), 99) == ids(Path("logs"), 4242) == ids(tmp_path / "logs", 7)
    assert set(ids(Path("logs"), 99)).isdisjoint(ids(Path("other-logs"), 99))


def test_a_log_directory_that_is_not_utf8_names_the_launcher_by_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--log-dir of bytes that are not UTF-8 was a UnicodeEncodeError traceback; a UTF-8 one
    keeps the name it had (its workers rejoin their ranks after an upgrade)."""
    here = tmp_path.resolve()
    monkeypatch.chdir(here)
    name = launch_plan.launcher_name(options(log_dir=Path(os.fsdecode(b"logs-\xff"))), "gpu08")
    digest = hashlib.sha256(bytes(here / os.fsdecode(b"logs-\xff"))).hexdigest()[:8]
    assert name == f"gpu08-{digest}"
    kept = hashlib.sha256(str(here / "logs-\u00e9").encode()).hexdigest()[:8]
    assert launch_plan.launcher_name(options(log_dir=Path("logs-\u00e9")), "gpu08") == (
        f"gpu08-{kept}"
    )


def test_a_child_gets_the_launchers_environment_without_the_variables_it_sets() -> None:
    made = plan(options())
    inherited = {
        "PATH": "/bin",
        "MS_ROLE": "MS_SCHED",
        "MS_NODE_ID": "7",
        "MS_NODE_TIMEOUT": "60",  # --node-timeout's value (`launch_setup.settle`), not passed on
        "MS_ALLOC_CONF": "enable_vmm:true",  # MindSpore's own: passed on
    }
    env = launch_plan.child_environment(inherited, made.workers[0])
    assert env["PATH"] == "/bin"
    assert (env["MS_ROLE"], env["MS_NODE_ID"]) == ("MS_WORKER", "2")
    assert "MS_NODE_TIMEOUT" not in env
    assert env["MS_ALLOC_CONF"] == "enable_vmm:true"
    scheduler = plan(options(node_rank=0), with_scheduler=True).scheduler
    assert scheduler is not None
    assert "MS_NODE_ID" not in launch_plan.child_environment(inherited, scheduler)


def test_dry_run_shows_the_plan_and_hides_every_secret() -> None:
    opts = options(job_secret_file=Path("/j/job.secret"))
    inherited = {
        "CLUSTER_JOB_SECRET": "s3cr3t",
        "CLUSTER_TLS_CLIENT_PASSWORD": "pa55",
        "CLUSTER_TLS_CLIENT_PASSWORD_FILE": "/etc/client.pass",
        "MS_ROLE": "MS_WORKER",
        "MS_ALLOC_CONF": "enable_vmm:true",
        "HOME": "/root",
    }
    text = launch_plan.render(plan(opts), opts, inherited)
    assert "placement: Slurm job 4242 step 3, node 1 of 2 (gpu[07-08])" in text
    assert "not started here: this is node rank 1, node 0 starts it" in text
    row = next(line for line in text.splitlines() if line.startswith("worker 1 "))
    assert row.split()[:6] == ["worker", "1", "MS_WORKER", "3", "3", "logs/node1/worker_3.log"]
    assert "CLUSTER_JOB_SECRET_FILE=/j/job.secret" in text
    assert "CLUSTER_JOB_SECRET=<hidden>" in text
    assert "CLUSTER_TLS_CLIENT_PASSWORD=<hidden>" in text
    assert "CLUSTER_TLS_CLIENT_PASSWORD_FILE=/etc/client.pass" in text
    assert "s3cr3t" not in text
    assert "pa55" not in text
    assert "HOME" not in text  # the rest of the environment is passed on, not listed
    assert "not passed on (mscluster run sets its own): MS_ROLE" in text
    passed = text.partition("passed on from this environment")[2]
    assert "  MS_ALLOC_CONF=enable_vmm:true" in passed.partition("not passed on")[0]


def test_the_state_url_and_lease_go_to_the_scheduler_alone() -> None:
    url = "etcd://e1:2379,e2:2379/jobs/a"
    made = plan(options(enable_recovery=True, state_url=url, lease_s=3), with_scheduler=True)
    assert made.scheduler is not None
    assert made.scheduler.env["CLUSTER_STATE_URL"] == url
    assert made.scheduler.env["CLUSTER_LEASE_S"] == "3"
    for worker in made.workers:
        assert "CLUSTER_STATE_URL" not in worker.env
        assert worker.env["MS_ENABLE_RECOVERY"] == "1"


def test_dry_run_lists_the_schedulers_own_variables_apart_from_every_processs() -> None:
    url = "etcd://e1:2379/jobs/a"
    opts = options(node_rank=0, state_url=url, lease_s=3, metrics_port=9100)
    text = launch_plan.render(plan(opts, with_scheduler=True), opts, {})
    rest = text.partition("environment of every process")[2]
    shared, _, own = rest.partition("the scheduler's own:")
    own = own.partition("passed on from")[0]
    assert "MS_WORKER_NUM=4" in shared
    assert "CLUSTER_TLS_CONFIG=/etc/ssl.json" in shared
    for variable in (
        "CLUSTER_EVENT_LOG=",
        "CLUSTER_LOG_FILE=",
        "CLUSTER_METRICS_PORT=9100",
        f"CLUSTER_STATE_URL={url}",
        "CLUSTER_LEASE_S=3",
    ):
        assert variable not in shared, variable
        assert variable in own, variable
    assert "MS_WORKER_NUM" not in own
    # A host that starts no scheduler has no line of its own.
    opts = options()
    assert "the scheduler's own" not in launch_plan.render(plan(opts), opts, {})


def test_several_master_hosts_give_the_workers_every_scheduler() -> None:
    made = plan(options(master_addr="gpu07, gpu09"))
    assert {p.env["MS_SCHED_HOST"] for p in made.workers} == {"10.1.1.7,gpu09"}
    assert launch_plan.master_host("gpu07, gpu09") == "gpu07"
    with pytest.raises(ConfigError, match="--master-addr 'gpu07,' has an empty entry"):
        launch_setup.validate(options(master_addr="gpu07,"))


def test_a_bracketed_ipv6_master_address_is_taken_as_the_bare_one() -> None:
    assert launch_plan.master_host("[::1]") == launch_plan.master_host(" ::1 ") == "::1"
    assert launch_plan.standby_hosts("gpu07,[fd00::7], ::1") == ["fd00::7", "::1"]
    assert launch_setup.resolve_host("[::1]") == launch_setup.resolve_host("::1") == "::1"
    assert launch_setup.at("[::1]", 8118) == launch_setup.at("::1", 8118) == "[::1]:8118"
    launch_setup.validate(options(master_addr="[::1],[fd00::7]", script=Path(__file__)))
    made = plan(options(master_addr="gpu07,[fd00::7]"))
    assert {p.env["MS_SCHED_HOST"] for p in made.workers} == {"10.1.1.7,fd00::7"}


def test_a_loopback_first_node_of_several_needs_another_node_to_find_its_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Node 0's own name resolves to loopback here. Other nodes on this host: loopback serves
    # them. No other node that resolves (and no scontrol to ask): give --master-addr.
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    script = tmp_path / "train.py"
    script.write_text("")
    same_host = allocation(SLURM_NODEID="0", SLURM_STEP_NODELIST="localhost,127.0.0.5")
    opts = options(
        script=script,
        master_addr="localhost",
        master_is_node=True,
        node_rank=0,
        allocation=same_host,
    )
    made = launch_setup.plan_job(opts)
    assert (made.ip, made.scheduler is not None) == ("127.0.0.1", True)
    nowhere = allocation(SLURM_NODEID="0", SLURM_STEP_NODELIST="localhost,nowhere.invalid")
    with pytest.raises(ConfigError) as caught:
        launch_setup.plan_job(dataclasses.replace(opts, allocation=nowhere))
    message = str(caught.value)
    assert "the scheduler's node 'localhost' resolves to 127.0.0.1 (loopback) here" in message
    assert message.endswith(
        "give --master-addr with an address of localhost that every node reaches"
    )
    # Given by the user, a loopback address is used as it is.
    typed = dataclasses.replace(opts, allocation=nowhere, master_is_node=False)
    assert launch_setup.plan_job(typed).ip == "127.0.0.1"
