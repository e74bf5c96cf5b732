"""`mscluster`'s parsing: msrun's spelling, suggestions for a mistyped option, --version, the
default of --max-restarts, and the exit status of `events --follow`. Nothing is started."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cluster
from cluster.protocol.events import JobEvent
from cluster.testing import free_port
from cluster.tools import cli, cli_args
from cluster.tools.launch_plan import RESTARTS_WITH_RECOVERY, max_restarts_for
from tests import docs_blocks
from tests.procs import MSCLUSTER

MSRUN_LINE = (
    "--worker_num=8 --local_worker_num=8 --master_addr=127.0.0.1 --master_port=8118 "
    "--node_rank=0 --log_dir=logs --join=True --cluster_time_out=300 net.py --lr 0.1"
)
OUR_LINE = (
    "--worker-num 8 --local-worker-num 8 --master-addr 127.0.0.1 --master-port 8118 "
    "--node-rank 0 --log-dir logs --join --cluster-time-out 300 net.py --lr 0.1"
)


def parse(line: str) -> argparse.Namespace:
    return cli_args.parse(cli.build_parser(), ["run", *line.split()])


def test_an_msrun_line_parses_as_the_same_run_in_our_spelling() -> None:
    assert vars(parse(MSRUN_LINE)) == vars(parse(OUR_LINE))
    args = parse(MSRUN_LINE)
    assert (args.worker_num, args.master_port, args.log_dir, args.join) == (8, 8118, "logs", True)
    assert (args.script, args.script_args) == ("net.py", ["--lr", "0.1"])


@pytest.mark.parametrize("options", ["", "--join True"])
def test_a_run_without_its_script_asks_for_the_script_alone(
    options: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's arguments are optional: the error names only the script (msrun's `--join
    True` is no script either)."""
    with pytest.raises(SystemExit) as exit_:
        parse(options)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("error: the following arguments are required: script\n"), err
    assert parse("net.py").script_args == []


@pytest.mark.parametrize(
    ("options", "join"),
    [
        ("", False),
        ("--join", True),
        ("--join=True", True),
        ("--join=true", True),
        ("--join=False", False),
        ("--join=false", False),
        ("--join=1", True),
        ("--join=0", False),
        ("--join True", True),
        ("--join true", True),
        ("--join 1", True),
        ("--join False", False),
        ("--join 0", False),
        ("--worker_num=2 --join True --log_dir=logs", True),
    ],
)
def test_join_takes_msrun_values_and_a_bare_join_leaves_the_script(
    options: str, join: bool
) -> None:
    args = parse(f"{options} net.py")
    assert (args.join, args.script, args.script_args) == (join, "net.py", [])


def test_msruns_join_with_its_value_apart_leaves_the_script_and_its_arguments() -> None:
    """msrun takes `--join True` as `--join=True`: True is not the script, train.py not its
    argument; a `--join True` after the script is the script's."""
    args = parse("--worker_num=2 --local_worker_num=2 --join True train.py --join True --lr 1")
    assert (args.join, args.worker_num, args.script) == (True, 2, "train.py")
    assert args.script_args == ["--join", "True", "--lr", "1"]


def test_options_after_the_script_are_the_scripts() -> None:
    args = parse("net.py --join=True --worker_num=2")
    assert (args.join, args.worker_num) == (False, None)
    assert args.script_args == ["--join=True", "--worker_num=2"]


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("--wokrer-num 2", "--worker-num"),
        ("--worker_nums=2", "--worker_num"),
        ("--master-adr=h", "--master-addr"),
        ("--cluster_timeout=300", "--cluster_time_out"),
        ("--max-restrats 1", "--max-restarts"),
    ],
)
def test_a_mistyped_option_names_the_right_one(
    typed: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(f"{typed} net.py")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"(did you mean {meant}?)" in err, err


@pytest.mark.parametrize("option", ["--sim_level 1", "--sim_rank_id=0", "--rank_table_file r.json"])
def test_msruns_options_without_a_counterpart_here_are_refused_in_one_line(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(f"--worker_num=2 {option} net.py")
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    name = re.split("[ =]", option, maxsplit=1)[0]
    assert line.startswith(f"mscluster run: error: msrun's {name} is not supported by "), line
    assert "did you mean" not in line


@pytest.mark.parametrize(
    "option", ["--bind_core True", "--worker_log_name=w.log", "--tail_worker_log 0"]
)
def test_msruns_options_the_job_runs_the_same_without_are_ignored_with_a_note(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Said once, though `--join True` has the line parsed twice."""
    args = parse(f"--worker_num=2 {option} --join True net.py --lr 1")
    (note,) = capsys.readouterr().err.splitlines()
    name = re.split("[ =]", option, maxsplit=1)[0]
    assert note.startswith(f"mscluster run: note: msrun's {name} is ignored: "), note
    assert vars(args) == vars(parse("--worker_num=2 --join net.py --lr 1"))
    assert (args.join, args.script, args.script_args) == (True, "net.py", ["--lr", "1"])


def test_a_mistyped_option_of_another_command_is_suggested_from_that_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli_args.parse(cli.build_parser(), ["events", "--folow"])
    assert "(did you mean --follow?)" in capsys.readouterr().err


def test_version_prints_the_distribution_and_its_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    name, version = capsys.readouterr().out.split()
    assert name == cli.DISTRIBUTION == "mscluster-grpc"
    # From a checkout the package's own; installed, the same release.
    assert version == cluster.__version__


def test_max_restarts_defaults_to_one_with_recovery_and_keeps_what_is_given() -> None:
    assert parse("net.py").max_restarts is None  # not given: decided with recovery
    assert max_restarts_for(None, recovery=True) == RESTARTS_WITH_RECOVERY == 1
    assert max_restarts_for(None, recovery=False) == 0
    assert max_restarts_for(0, recovery=True) == 0
    assert max_restarts_for(3, recovery=False) == 3


def test_status_looks_where_the_job_environment_points_else_at_the_local_default() -> None:
    assert cli.default_scheduler_addr({}) == "127.0.0.1:8118"
    env = {"MS_SCHED_HOST": "10.0.0.7", "MS_SCHED_PORT": "9000"}
    assert cli.default_scheduler_addr(env) == "10.0.0.7:9000"
    assert cli.default_scheduler_addr({"MS_SCHED_HOST": "::1"}) == "[::1]:8118"
    # A job with standbys names them all, as its processes read them.
    two = {"MS_SCHED_HOST": "h1,h2", "MS_SCHED_PORT": "9000"}
    assert cli.default_scheduler_addr(two) == "h1:9000,h2:9000"
    assert cli.default_scheduler_addr({"CLUSTER_SCHED_ADDRS": "a:1,b:2"}) == "a:1,b:2"
    assert cli.build_parser().parse_args(["status"]).addr is None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def test_every_chaos_command_in_the_docs_takes_its_options_where_it_gives_them() -> None:
    """`mscluster chaos` takes its own options before `--` and `mscluster run`'s after it (the
    job's: --worker-num, --spares, --state-url, ...): every such command in the README and the
    docs, in a block or in the text, gives each option on its side, up to the script."""
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sides = {
        "before --": _options(commands.choices["chaos"]),
        "after --": _options(commands.choices["run"]),
    }
    found = 0
    for page in docs_blocks.pages():
        text = page.read_text().replace("\\\n", " ")  # a block's continued lines, as bash reads
        for shown in re.findall(r"mscluster chaos[^`\n]*", text):
            found += 1
            side = "before --"
            for word in shown.split()[2:]:
                if word == "--":
                    side = "after --"
                elif word.endswith(".py"):
                    break  # the script: its own arguments follow
                elif word.startswith("--"):
                    where = f"{page.relative_to(docs_blocks.ROOT)}: {shown!r}"
                    assert word.split("=")[0] in sides[side], f"{where}: {word} {side}"
    assert found >= 4


@pytest.mark.parametrize(
    ("last", "follow", "code"),
    [("job_failed", True, 1), ("finished", True, 0), ("job_failed", False, 0)],
)
def test_a_follow_exits_1_when_the_followed_job_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], last: str, follow: bool, code: int
) -> None:
    log = tmp_path / "events.jsonl"
    kinds = ("started", "formed", last)
    events = [JobEvent(seq, 1.7e9 + seq, kind, {}) for seq, kind in enumerate(kinds, 1)]
    log.write_text("".join(f"{event.to_json()}\n" for event in events))
    assert cli.main(["events", "--file", str(log), *(["--follow"] if follow else [])]) == code
    assert last in capsys.readouterr().out.splitlines()[-1]


def test_a_command_whose_reader_went_away_exits_quietly(tmp_path: Path) -> None:
    """`mscluster events --json | head -1` said `mscluster: Broken pipe` on stderr and exited
    2: it now exits as a tool SIGPIPE ended does, saying nothing."""
    path = tmp_path / "events.jsonl"
    path.write_text(
        "".join(JobEvent(i, 1e9 + i, "formed", {}).to_json() + "\n" for i in range(9999))
    )
    events = subprocess.Popen(
        [*MSCLUSTER, "events", "--json", "--file", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert events.stdout is not None
        assert events.stderr is not None
        assert events.stdout.readline().startswith(b'{"time":')
        events.stdout.close()  # the reader goes away
        assert (events.wait(60), events.stderr.read()) == (141, b"")
        assert cli.EXIT_BROKEN_PIPE == 141  # 128 + SIGPIPE
    finally:
        events.kill()
        events.wait(10)
        if events.stderr is not None:
            events.stderr.close()


@pytest.mark.parametrize("follow", [False, True], ids=["list", "follow"])
@pytest.mark.parametrize("secret", [False, True], ids=["open", "secret"])
def test_events_of_a_dead_address_is_one_clear_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    follow: bool,
    secret: bool,
) -> None:
    """Nothing listens at --addr: `mscluster events` says so as `mscluster status` does, in one
    line naming the address and the refusal (not gRPC's account of it) and what to check; with
    a secret, its first call (the challenge) is the one refused."""
    monkeypatch.chdir(tmp_path)  # no logs/job.secret here
    monkeypatch.delenv("CLUSTER_JOB_SECRET_FILE", raising=False)
    monkeypatch.delenv("CLUSTER_JOB_SECRET", raising=False)
    secret_file = tmp_path / "job.secret"
    secret_file.write_text("ab" * 32)
    secret_file.chmod(0o600)
    port = free_port()
    args = ["events", "--addr", f"127.0.0.1:{port}", *(["--follow"] if follow else [])]
    assert cli.main([*args, *(["--secret-file", str(secret_file)] if secret else [])]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"mscluster: no scheduler answers at 127.0.0.1:{port}: connection refused: is the job "
        "running, with a scheduler at that --addr?"
    ]


@pytest.mark.parametrize("node_rank", ["0", "1"])
def test_a_run_whose_scheduler_needs_the_etcd_extra_is_refused_before_it_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    node_rank: str,
) -> None:
    """Without the etcd client, `mscluster run --state-url etcd://...` started the job, and
    only its scheduler's log said what to install as the job failed. The host that starts the
    scheduler is refused at once (a dry run too), naming the option and the extra; a host
    that starts workers alone needs no etcd client."""
    monkeypatch.setitem(sys.modules, "aetcd", None)  # as where the extra is not installed
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    placed = ["--worker-num", "2", "--local-worker-num", "1", "--node-rank", node_rank]
    state = ["--state-url", "etcd://127.0.0.1:2379/jobs/a"]
    code = cli.main(["run", "--dry-run", *placed, *state, "train.py"])
    err = capsys.readouterr().err
    if node_rank == "1":
        assert code == 0, err
        return
    assert code == 2
    assert err.splitlines()[-1] == (
        "mscluster: ConfigError: --state-url names etcd, but the etcd client is not installed: "
        "pip install 'mscluster-grpc[etcd]' (it adds aetcd)"
    )


@pytest.mark.parametrize("command", ["run", "scheduler"])
def test_a_lease_without_a_state_store_is_refused_naming_what_to_give(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """`--lease` is the leader's hold on a state store in etcd: given without one (no
    --state-url, and for `mscluster scheduler` no CLUSTER_STATE_URL either) it was ignored
    without a word; it is refused, naming what to give, and nothing starts."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_STATE_URL", raising=False)
    (tmp_path / "train.py").write_text("")
    if command == "run":
        argv = ["run", "--dry-run", "--worker-num", "1", "--lease", "5", "train.py"]
        give = "--state-url"
    else:
        argv = ["scheduler", "--port", "0", "--worker-num", "1", "--lease", "5"]
        give = "--state-url (or CLUSTER_STATE_URL)"
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines()[-1] == (
        "mscluster: ConfigError: --lease is the leader's hold on a state store in etcd, and "
        f"this job has none: give {give} with it, or leave --lease out"
    )
