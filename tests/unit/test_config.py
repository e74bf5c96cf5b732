"""Unit tests of cluster.config: the launch environment parsed into a frozen ClusterConfig."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from cluster.protocol.config import (
    DEFAULT_COLLECTIVE_MAX_BYTES,
    DEFAULT_KV_MAX_BYTES,
    DEFAULT_KV_MAX_KEYS,
    ClusterConfig,
    JobSecretSource,
    Limits,
    LogRotation,
    RecoveryConfig,
    Role,
    secret_mode_ok,
    silence_limit,
)
from cluster.protocol.environment import from_env, job_settings, read_job_secret
from cluster.protocol.errors import ClusterError, ConfigError
from cluster.protocol.parse import is_decimal, lookup_name, split_address
from cluster.scheduler.metrics import MetricsServer
from cluster.scheduler.server import check_bindable
from cluster.storage.recovery_dir import check_recovery_path
from cluster.tools import cli_commands
from cluster.tools.cli import build_parser
from cluster.transport.channel import KEEPALIVE_MIN_MS, KEEPALIVE_SLACK_MS, keepalive_options
from cluster.worker.scheduler_link import channel_options
from tests.procs import MSCLUSTER


def env(**overrides: str | None) -> dict[str, str]:
    """A minimal valid worker environment, with overrides (None removes a variable)."""
    base = {
        "MS_ROLE": "MS_WORKER",
        "MS_WORKER_NUM": "4",
        "MS_SCHED_HOST": "10.0.0.1",
        "MS_SCHED_PORT": "8118",
    }
    for name, value in overrides.items():
        if value is None:
            base.pop(name, None)
        else:
            base[name] = value
    return base


# -- valid environments -----------------------------------------------------------------------


def test_minimal_environment_gets_the_mindspore_defaults() -> None:
    cfg = from_env(env())
    assert cfg == ClusterConfig(
        role=Role.WORKER,
        worker_num=4,
        server_num=0,
        sched_host="10.0.0.1",
        sched_port=8118,
        node_id=None,
        recovery=None,
        topo_timeout_s=1800.0,
        node_timeout_s=30.0,
        heartbeat_enabled=True,
        heartbeat_interval_s=5.0,
    )
    assert cfg.sched_address == "10.0.0.1:8118"
    assert cfg.expected_nodes == 4


def test_full_environment(tmp_path: Path) -> None:
    cfg = from_env(
        {
            "MS_ROLE": "MS_SCHED",
            "MS_WORKER_NUM": "8",
            "MS_SERVER_NUM": "2",
            "MS_SCHED_HOST": "sched.example",
            "MS_SCHED_PORT": "65535",
            "MS_NODE_ID": "scheduler-0",
            "MS_ENABLE_RECOVERY": "1",
            "MS_RECOVERY_PATH": str(tmp_path / "state"),
            "MS_TOPO_TIMEOUT": "120",
            "MS_NODE_TIMEOUT": "2.5",
            "MS_DISABLE_HEARTBEAT": "0",
            "CLUSTER_HEARTBEAT_INTERVAL": "0.25",
        }
    )
    assert cfg.role is Role.SCHEDULER
    assert cfg.worker_num == 8
    assert cfg.server_num == 2
    assert cfg.expected_nodes == 10
    assert cfg.sched_host == "sched.example"
    assert cfg.sched_port == 65535
    assert cfg.node_id == "scheduler-0"
    assert cfg.recovery == RecoveryConfig(tmp_path / "state")
    assert cfg.topo_timeout_s == 120.0
    assert cfg.node_timeout_s == 2.5
    assert cfg.heartbeat_enabled is True
    assert cfg.heartbeat_interval_s == 0.25


def test_config_is_frozen() -> None:
    cfg = from_env(env())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.worker_num = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("role", "expected"),
    [("MS_SCHED", Role.SCHEDULER), ("MS_WORKER", Role.WORKER), ("MS_PSERVER", Role.SERVER)],
)
def test_roles(role: str, expected: Role) -> None:
    cfg = from_env(env(MS_ROLE=role, MS_SERVER_NUM="1"))
    assert cfg.role is expected


def test_disable_heartbeat() -> None:
    assert from_env(env(MS_DISABLE_HEARTBEAT="1")).heartbeat_enabled is False
    assert from_env(env(MS_DISABLE_HEARTBEAT="true")).heartbeat_enabled is False
    assert from_env(env(MS_DISABLE_HEARTBEAT="off")).heartbeat_enabled is True


def test_default_heartbeat_interval_follows_short_node_timeout() -> None:
    # At most 5 s, and at least 5 heartbeats per node timeout.
    assert from_env(env(MS_NODE_TIMEOUT="2")).heartbeat_interval_s == pytest.approx(0.4)
    assert from_env(env(MS_NODE_TIMEOUT="30")).heartbeat_interval_s == 5.0
    assert from_env(env(MS_NODE_TIMEOUT="100")).heartbeat_interval_s == 5.0


@pytest.mark.parametrize(
    ("workers", "node_timeout", "interval", "silence"),
    [
        ("256", "30", 5.0, 30.0),  # 51 beats a second: the usual interval
        ("1024", "30", 10.24, 30.72),  # at most 100 beats a second
        ("1024", "100", 10.24, 100.0),
        # 100 a second at 8,192 workers: a node is taken for hung after 3 silent intervals
        # (gRPC's pings find a stopped one within MS_NODE_TIMEOUT meanwhile)
        ("8192", "30", 81.92, 245.76),
    ],
)
def test_large_jobs_beat_less_often(
    workers: str, node_timeout: str, interval: float, silence: float
) -> None:
    config = from_env(env(MS_WORKER_NUM=workers, MS_NODE_TIMEOUT=node_timeout))
    assert config.heartbeat_interval_s == pytest.approx(interval)
    assert silence_limit(config.node_timeout_s, interval) == pytest.approx(silence)
    settings = job_settings(config)
    assert settings.silence_limit_s == pytest.approx(silence)


@pytest.mark.parametrize("node_timeout", [3.0, 30.0, 600.0])
def test_grpc_pings_find_a_silent_peer_after_the_node_timeout_and_at_most_a_third_more(
    node_timeout: float,
) -> None:
    options = dict(keepalive_options(node_timeout))
    every, answer = options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"]
    assert every >= KEEPALIVE_MIN_MS  # never more often than the scheduler allows
    assert answer > node_timeout * 1000  # after the heartbeats' own limit, in a small job
    assert every + answer <= node_timeout * 1000 * 4 / 3 + KEEPALIVE_SLACK_MS
    assert options["grpc.http2.max_pings_without_data"] == 0


def test_without_heartbeats_grpc_does_not_ping_either() -> None:
    """MS_DISABLE_HEARTBEAT: no silence is looked for, by the heartbeats or by gRPC's pings."""
    assert keepalive_options(None) == []
    config = from_env(env(MS_DISABLE_HEARTBEAT="1"))
    assert not any(
        key.startswith("grpc.keepalive_time")
        for key, _ in channel_options(config.expected_nodes, None)
    )


def test_an_ascii_host_is_looked_up_as_bytes_without_the_idna_codec() -> None:
    assert lookup_name("127.0.0.1") == b"127.0.0.1"
    assert lookup_name("node-7.example") == b"node-7.example"
    assert lookup_name("::1") == b"::1"
    assert lookup_name("bücher.example") == "bücher.example"  # IDNA is getaddrinfo's to do


def test_ipv6_scheduler_address_is_bracketed() -> None:
    assert from_env(env(MS_SCHED_HOST="::1")).sched_address == "[::1]:8118"


@pytest.mark.parametrize(("raw", "canonical"), [("007", "7"), ("0", "0"), ("3", "3")])
def test_numeric_node_id_is_canonicalised(raw: str, canonical: str) -> None:
    assert from_env(env(MS_NODE_ID=raw, MS_WORKER_NUM="8")).node_id == canonical


@pytest.mark.parametrize(
    "node_id", ["worker-a", "host.example:1", "a@b", "w_1", "x" * 128, "A0", "9lives"]
)
def test_valid_non_numeric_node_ids_are_kept(node_id: str) -> None:
    assert from_env(env(MS_NODE_ID=node_id)).node_id == node_id


def test_node_id_surrounding_whitespace_is_stripped() -> None:
    assert from_env(env(MS_NODE_ID="  worker-a  ")).node_id == "worker-a"


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_node_id_means_generated(value: str) -> None:
    # MindSpore reads unset and empty variables alike (common::GetEnv returns ""), so an empty
    # MS_NODE_ID means "no id given", as for every other optional variable here.
    assert from_env(env(MS_NODE_ID=value)).node_id is None


def test_scheduler_numeric_node_id_is_not_bounded_by_worker_num() -> None:
    assert from_env(env(MS_ROLE="MS_SCHED", MS_NODE_ID="99")).node_id == "99"


def test_server_numeric_node_id_is_bounded_by_server_num() -> None:
    assert from_env(env(MS_ROLE="MS_PSERVER", MS_SERVER_NUM="2", MS_NODE_ID="1")).node_id == "1"


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_recovery_truthy_values(value: str, tmp_path: Path) -> None:
    cfg = from_env(env(MS_ENABLE_RECOVERY=value, MS_RECOVERY_PATH=str(tmp_path), MS_NODE_ID="w1"))
    assert cfg.recovery == RecoveryConfig(tmp_path)


@pytest.mark.parametrize("value", ["0", "false", "no", "off", ""])
def test_recovery_falsy_values_ignore_the_path(value: str, tmp_path: Path) -> None:
    assert from_env(env(MS_ENABLE_RECOVERY=value, MS_RECOVERY_PATH=str(tmp_path))).recovery is None


@pytest.mark.parametrize("port", ["1", "65535", " 8118 "])
def test_port_bounds_inclusive(port: str) -> None:
    assert from_env(env(MS_SCHED_PORT=port)).sched_port == int(port)


# -- bad environments -------------------------------------------------------------------------

# (overrides, variable, value shown in the message, words of the rule)
BAD: list[tuple[dict[str, str | None], str, str, tuple[str, ...]]] = [
    ({"MS_ROLE": None}, "MS_ROLE", "not set", ("MS_SCHED", "MS_WORKER", "MS_PSERVER")),
    ({"MS_ROLE": ""}, "MS_ROLE", "not set", ("MS_SCHED", "MS_WORKER", "MS_PSERVER")),
    ({"MS_ROLE": "MS_BOSS"}, "MS_ROLE", "'MS_BOSS'", ("MS_SCHED", "MS_WORKER", "MS_PSERVER")),
    ({"MS_ROLE": "ms_worker"}, "MS_ROLE", "'ms_worker'", ("one of",)),
    ({"MS_SCHED_PORT": "abc"}, "MS_SCHED_PORT", "'abc'", ("integer", "1", "65535")),
    ({"MS_SCHED_PORT": "70000"}, "MS_SCHED_PORT", "'70000'", ("1", "65535")),
    ({"MS_SCHED_PORT": "0"}, "MS_SCHED_PORT", "'0'", ("1", "65535")),
    ({"MS_SCHED_PORT": "-1"}, "MS_SCHED_PORT", "'-1'", ("1", "65535")),
    ({"MS_SCHED_PORT": "80.5"}, "MS_SCHED_PORT", "'80.5'", ("integer",)),
    ({"MS_SCHED_PORT": None}, "MS_SCHED_PORT", "not set", ("1-65535",)),
    ({"MS_SCHED_HOST": None}, "MS_SCHED_HOST", "not set", ("host",)),
    ({"MS_WORKER_NUM": "0"}, "MS_WORKER_NUM", "'0'", ("between 1 and 1000000",)),
    ({"MS_WORKER_NUM": "x"}, "MS_WORKER_NUM", "'x'", ("integer", "between 1 and 1000000")),
    ({"MS_WORKER_NUM": "-3"}, "MS_WORKER_NUM", "'-3'", ("between 1 and 1000000",)),
    ({"MS_WORKER_NUM": None}, "MS_WORKER_NUM", "not set", (">= 1",)),
    ({"MS_WORKER_NUM": str(10**12)}, "MS_WORKER_NUM", "'1000000000000'", ("out of range",)),
    ({"MS_WORKER_NUM": str(10**8)}, "MS_WORKER_NUM", "'100000000'", ("1000000",)),
    ({"MS_SERVER_NUM": "-1"}, "MS_SERVER_NUM", "'-1'", ("between 0 and 1000000",)),
    ({"MS_SERVER_NUM": "two"}, "MS_SERVER_NUM", "'two'", ("integer",)),
    ({"MS_SERVER_NUM": str(10**7)}, "MS_SERVER_NUM", "'10000000'", ("out of range",)),
    (
        {"MS_WORKER_NUM": "600000", "MS_SERVER_NUM": "600000"},
        "MS_WORKER_NUM",
        "1200000 nodes",
        ("at most 1000000",),
    ),
    ({"MS_SCHED_HOST": "a\x1b[2J"}, "MS_SCHED_HOST", "'a\\x1b[2J'", ("host name or IP",)),
    ({"MS_SCHED_HOST": "h1,b\nc"}, "MS_SCHED_HOST", "'b\\nc'", ("host name or IP",)),
    ({"MS_SCHED_HOST": "a" * 254}, "MS_SCHED_HOST", "...(254 chars)", ("at most 253",)),
    ({"MS_SCHED_HOST": "x y"}, "MS_SCHED_HOST", "'x y'", ("host name or IP",)),
    (
        {"CLUSTER_SCHED_ADDRS": "h1:1,h\u202e2:2"},
        "CLUSTER_SCHED_ADDRS",
        "'h\\u202e2'",
        ("host name or IP",),
    ),
    (
        {"CLUSTER_TLS_CONFIG": "ssl.json", "CLUSTER_TLS_SERVER_NAME": "a\x07"},
        "CLUSTER_TLS_SERVER_NAME",
        "'a\\x07'",
        ("host name or IP",),
    ),
    *[
        ({name: value}, name, repr(value), ("positive number of seconds",))
        for name in ("MS_TOPO_TIMEOUT", "MS_NODE_TIMEOUT")
        for value in ("-1", "0", "-0.5", "abc", "nan", "inf", "-inf", "1e999")
    ],
    (
        {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": None},
        "MS_RECOVERY_PATH",
        "MS_ENABLE_RECOVERY=1",
        ("directory",),
    ),
    (
        {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": "  "},
        "MS_RECOVERY_PATH",
        "MS_ENABLE_RECOVERY=1",
        ("directory",),
    ),
    (
        {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": "/tmp/r"},
        "MS_NODE_ID",
        "MS_ENABLE_RECOVERY=1",
        ("restarted process is taken back by its node id", "mscluster run"),
    ),
    ({"MS_ENABLE_RECOVERY": "maybe"}, "MS_ENABLE_RECOVERY", "'maybe'", ("1/0", "true/false")),
    ({"MS_ENABLE_RECOVERY": "2"}, "MS_ENABLE_RECOVERY", "'2'", ("1/0",)),
    ({"MS_DISABLE_HEARTBEAT": "sometimes"}, "MS_DISABLE_HEARTBEAT", "'sometimes'", ("1/0",)),
    ({"MS_NODE_ID": "node 1"}, "MS_NODE_ID", "'node 1'", ("1-128 characters",)),
    ({"MS_NODE_ID": "a\tb"}, "MS_NODE_ID", "'a\\tb'", ("1-128 characters",)),
    ({"MS_NODE_ID": "x" * 129}, "MS_NODE_ID", "...(129 chars)'", ("1-128 characters",)),
    ({"MS_NODE_ID": "-lead"}, "MS_NODE_ID", "'-lead'", ("starting with a letter or digit",)),
    ({"MS_NODE_ID": "a/b"}, "MS_NODE_ID", "'a/b'", ("1-128 characters",)),
    ({"MS_NODE_ID": "4"}, "MS_NODE_ID", "'4'", ("MS_WORKER_NUM=4", "below")),
    ({"MS_NODE_ID": "0010"}, "MS_NODE_ID", "'0010'", ("MS_WORKER_NUM=4", "below")),
    (
        {"MS_ROLE": "MS_PSERVER", "MS_SERVER_NUM": "2", "MS_NODE_ID": "2"},
        "MS_NODE_ID",
        "'2'",
        ("MS_SERVER_NUM=2", "below"),
    ),
    ({"MS_ROLE": "MS_PSERVER"}, "MS_SERVER_NUM", "MS_PSERVER", ("MS_SERVER_NUM >= 1", "is 0")),
    (
        {"MS_ROLE": "MS_PSERVER", "MS_SERVER_NUM": "0"},
        "MS_SERVER_NUM",
        "MS_PSERVER",
        ("MS_SERVER_NUM >= 1",),
    ),
    (
        {"MS_NODE_TIMEOUT": "2", "CLUSTER_HEARTBEAT_INTERVAL": "2"},
        "CLUSTER_HEARTBEAT_INTERVAL",
        "'2'",
        ("shorter than", "MS_NODE_TIMEOUT", "2 s"),
    ),
    (
        {"CLUSTER_HEARTBEAT_INTERVAL": "45"},
        "CLUSTER_HEARTBEAT_INTERVAL",
        "'45'",
        ("shorter than", "MS_NODE_TIMEOUT", "30 s"),
    ),
    (
        {"CLUSTER_HEARTBEAT_INTERVAL": "0"},
        "CLUSTER_HEARTBEAT_INTERVAL",
        "'0'",
        ("positive number of seconds",),
    ),
    ({"CLUSTER_JOB_SECRET": ""}, "CLUSTER_JOB_SECRET", "empty", ("proves nothing",)),
    ({"CLUSTER_JOB_SECRET": "  "}, "CLUSTER_JOB_SECRET", "empty", ("same secret",)),
    *[
        ({name: value}, name, repr(value), (">= 1",))
        for name in ("CLUSTER_KV_MAX_BYTES", "CLUSTER_KV_MAX_KEYS", "CLUSTER_COLLECTIVE_MAX_BYTES")
        for value in ("0", "-5", "1GiB", "2.5")
    ],
]


@pytest.mark.parametrize(
    ("overrides", "variable", "value", "rule"),
    BAD,
    ids=[f"{case[1]}={case[2]}-{i}" for i, case in enumerate(BAD)],
)
def test_bad_value_names_variable_value_and_rule(
    overrides: dict[str, str | None], variable: str, value: str, rule: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as info:
        from_env(env(**overrides))
    message = str(info.value)
    assert variable in message
    assert value in message
    for words in rule:
        assert words in message


def test_config_error_is_a_cluster_error() -> None:
    with pytest.raises(ClusterError):
        from_env({})


# -- the recovery path on disk ----------------------------------------------------------------


def test_check_recovery_path_creates_the_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "state"
    check_recovery_path(RecoveryConfig(target))
    assert target.is_dir()
    assert list(target.iterdir()) == []  # the probe file is gone


def test_check_recovery_path_accepts_an_existing_directory(tmp_path: Path) -> None:
    (tmp_path / "keep").write_text("x")
    check_recovery_path(RecoveryConfig(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]


@pytest.mark.parametrize("below", ["", "sub"])
def test_check_recovery_path_under_a_regular_file_is_refused(tmp_path: Path, below: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    target = blocker / below if below else blocker
    with pytest.raises(ConfigError) as info:
        check_recovery_path(RecoveryConfig(target))
    message = str(info.value)
    assert message.startswith(f"MS_RECOVERY_PATH={str(target)!r} ")
    under = f"lies under {str(blocker)!r}, which is " if below else "is "
    assert f"{under}a file, not a directory: move that file away, or point it at a" in message


# -- job secret and caps ----------------------------------------------------------------------


def test_no_job_secret_and_default_caps() -> None:
    config = from_env(env())
    assert config.job_secret is None
    assert config.limits == Limits(
        DEFAULT_KV_MAX_BYTES, DEFAULT_KV_MAX_KEYS, DEFAULT_COLLECTIVE_MAX_BYTES
    )
    assert (DEFAULT_KV_MAX_BYTES, DEFAULT_KV_MAX_KEYS) == (256 * 2**20, 100_000)


def test_caps_from_the_environment() -> None:
    config = from_env(
        env(
            CLUSTER_KV_MAX_BYTES="1048576",
            CLUSTER_KV_MAX_KEYS="10",
            CLUSTER_COLLECTIVE_MAX_BYTES="2048",
        )
    )
    assert config.limits == Limits(1048576, 10, 2048)


def test_job_secret_from_the_variable_is_never_shown() -> None:
    config = from_env(env(CLUSTER_JOB_SECRET=" s3cret-value "))
    assert config.job_secret is not None
    assert read_job_secret(config.job_secret) == b"s3cret-value"
    assert "s3cret" not in repr(config)


def test_job_secret_file_is_preferred_and_read_apart(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    config = from_env(env(CLUSTER_JOB_SECRET="ignored", CLUSTER_JOB_SECRET_FILE=str(path)))
    assert config.job_secret == JobSecretSource(path=path)  # parsing opens nothing
    path.write_bytes(b"from-the-file\n")
    path.chmod(0o600)
    assert read_job_secret(config.job_secret) == b"from-the-file"


@pytest.mark.parametrize(
    ("content", "mode", "words"),
    [
        (None, 0o600, "cannot be read"),
        (b"\n", 0o600, "is empty"),
        (b"secret", 0o644, "chmod 600"),
        (b"secret", 0o602, "chmod 600"),
        (b"secret", 0o620, "chmod 600"),
        (b"secret", 0o610, "chmod 600"),
    ],
)
def test_bad_job_secret_file_is_one_clear_error(
    tmp_path: Path, content: bytes | None, mode: int, words: str
) -> None:
    path = tmp_path / "job.secret"
    if content is not None:
        path.write_bytes(content)
        path.chmod(mode)
    with pytest.raises(ConfigError, match="CLUSTER_JOB_SECRET_FILE=") as info:
        read_job_secret(JobSecretSource(path=path))
    assert words in str(info.value)
    assert "secret\n" not in str(info.value)


@pytest.mark.parametrize(
    ("mode", "uid", "ok"),
    [
        (0o600, 1000, True),
        (0o400, 1000, True),
        (0o640, 1000, False),  # group-readable: refused
        (0o440, 1000, False),
        (0o604, 1000, False),
        (0o640, 0, True),  # root's, read by its group: Kubernetes' Secret for an fsGroup
        (0o440, 0, True),
        (0o660, 0, False),  # but never writable by the group
        (0o644, 0, False),  # nor readable by every user
    ],
)
def test_a_secret_file_is_0600_or_stricter_unless_root_gives_it_to_a_group(
    mode: int, uid: int, ok: bool
) -> None:
    assert secret_mode_ok(0o100000 | mode, uid) is ok


def test_a_group_readable_secret_file_says_chmod_600(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    path.write_bytes(b"secret")
    path.chmod(0o640)
    if os.geteuid() == 0:  # root's own may be read by its group: this one is another user's
        os.chown(path, 1000, -1)
    with pytest.raises(ConfigError, match=r"mode 640: .*`chmod 600 .*job.secret`$"):
        read_job_secret(JobSecretSource(path=path))


# -- observing (CLUSTER_METRICS_PORT, CLUSTER_EVENT_LOG, CLUSTER_WORKER_METRICS_PORT) ----------


def test_observing_is_off_by_default() -> None:
    observe = from_env(env()).observe
    assert (observe.metrics_port, observe.event_log, observe.worker_metrics_port) == (
        None,
        None,
        None,
    )


def test_observing_variables_are_parsed() -> None:
    observe = from_env(
        env(
            CLUSTER_METRICS_PORT="0",
            CLUSTER_EVENT_LOG="logs/events.jsonl",
            CLUSTER_WORKER_METRICS_PORT=" 9100 ",
        )
    ).observe
    assert observe.metrics_port == 0  # any free port, logged
    assert observe.event_log == Path("logs/events.jsonl")
    assert observe.worker_metrics_port == 9100
    assert observe.metrics_host is None  # the scheduler's own host


def test_the_metrics_host_is_a_host_of_its_own() -> None:
    assert from_env(env(CLUSTER_METRICS_HOST=" 10.0.0.9 ")).observe.metrics_host == "10.0.0.9"
    assert from_env(env(CLUSTER_METRICS_HOST="[::1]")).observe.metrics_host == "::1"
    with pytest.raises(ConfigError, match=r"^CLUSTER_METRICS_HOST 'a b' is not a host name"):
        from_env(env(CLUSTER_METRICS_HOST="a b"))


@pytest.mark.parametrize(
    ("name", "value", "rule"),
    [
        ("CLUSTER_METRICS_PORT", "http", "is not an integer: it must be between 0 and 65535"),
        ("CLUSTER_METRICS_PORT", "70000", "is out of range: it must be between 0 and 65535"),
        ("CLUSTER_WORKER_METRICS_PORT", "0", "is out of range: it must be between 1 and 65535"),
    ],
)
def test_a_bad_observing_port_names_the_variable(name: str, value: str, rule: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}='{value}' {rule}$"):
        from_env(env(**{name: value}))


def test_log_rotation_defaults_and_variables() -> None:
    observe = from_env(env()).observe
    assert observe.rotation == LogRotation(64 * 1024 * 1024, 3)
    assert observe.log_file is None
    observe = from_env(
        env(CLUSTER_LOG_MAX_BYTES="4096", CLUSTER_LOG_KEEP="1", CLUSTER_LOG_FILE="s.log")
    ).observe
    assert observe.rotation == LogRotation(4096, 1)
    assert observe.log_file == Path("s.log")


@pytest.mark.parametrize(
    ("name", "value", "rule"),
    [
        (
            "CLUSTER_LOG_MAX_BYTES",
            "64M",
            "is not an integer: it must be between 1024 and 1099511627776",
        ),
        (
            "CLUSTER_LOG_MAX_BYTES",
            "10",
            "is out of range: it must be between 1024 and 1099511627776",
        ),
        ("CLUSTER_LOG_KEEP", "0", "is out of range: it must be between 1 and 100"),
        ("CLUSTER_LOG_KEEP", "1000", "is out of range: it must be between 1 and 100"),
    ],
)
def test_a_bad_log_rotation_is_one_line_naming_the_variable(
    name: str, value: str, rule: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}='{value}' {rule}$"):
        from_env(env(**{name: value}))


def test_a_spare_is_a_worker_of_a_job_with_recovery(tmp_path: Path) -> None:
    recovery = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(tmp_path), "MS_NODE_ID": "s0"}
    assert from_env(env(CLUSTER_SPARE="1", **recovery)).spare
    assert not from_env(env(**recovery)).spare
    with pytest.raises(ConfigError, match="CLUSTER_SPARE=1 needs MS_ENABLE_RECOVERY=1"):
        from_env(env(CLUSTER_SPARE="1"))
    with pytest.raises(ConfigError, match="for workers only"):
        from_env(env(CLUSTER_SPARE="1", MS_ROLE="MS_SCHED", **recovery))
    with pytest.raises(ConfigError, match="CLUSTER_SPARE"):
        from_env(env(CLUSTER_SPARE="maybe", **recovery))


def test_the_spares_cap() -> None:
    assert from_env(env()).limits.max_spares == 8
    assert from_env(env(CLUSTER_MAX_SPARES="0")).limits.max_spares == 0
    with pytest.raises(ConfigError, match="CLUSTER_MAX_SPARES"):
        from_env(env(CLUSTER_MAX_SPARES="-1"))


@pytest.mark.parametrize(
    ("text", "decimal"),
    [
        ("7", True),
        ("007", True),
        ("", False),
        ("\u00b2", False),
        ("\u0663", False),
        (" 7", False),
        ("+7", False),
        ("-1", False),
        ("7.0", False),
    ],
)
def test_the_one_digit_check_takes_ascii_digits_only(text: str, decimal: bool) -> None:
    assert is_decimal(text) is decimal


def test_an_address_is_split_once_for_every_caller() -> None:
    assert split_address("--addr", "10.0.0.1:8118") == ("10.0.0.1", 8118)
    assert split_address("--addr", "[::1]:8118") == ("::1", 8118)
    for bad in ("8118", ":8118", "host:", "host:0", "host:65536", "host:\u00b2", "host:+1"):
        with pytest.raises(
            ConfigError, match=r"^--addr .* must be HOST:PORT with a port in 1-65535$"
        ):
            split_address("--addr", bad)


# -- several scheduler addresses (issue #14) -----------------------------------------------------


def test_one_scheduler_host_keeps_one_address() -> None:
    cfg = from_env(env())
    assert cfg.sched_addresses == ()
    assert cfg.addresses == (cfg.sched_address,)


def test_several_scheduler_hosts_share_the_port() -> None:
    cfg = from_env(env(MS_SCHED_HOST="h1, h2,::1", MS_SCHED_PORT="8118"))
    assert cfg.addresses == ("h1:8118", "h2:8118", "[::1]:8118")
    assert (cfg.sched_host, cfg.sched_port) == ("h1", 8118)


def test_cluster_sched_addrs_gives_each_its_port() -> None:
    cfg = from_env(env(CLUSTER_SCHED_ADDRS="h1:8118,h2:9000", MS_SCHED_HOST=None))
    assert cfg.addresses == ("h1:8118", "h2:9000")
    assert (cfg.sched_host, cfg.sched_port) == ("h1", 8118)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"MS_SCHED_HOST": "h1,,h2"}, "MS_SCHED_HOST='h1,,h2' has an empty entry"),
        ({"CLUSTER_SCHED_ADDRS": "h1:8118,"}, "CLUSTER_SCHED_ADDRS='h1:8118,' has an empty"),
        ({"CLUSTER_SCHED_ADDRS": "h1"}, "CLUSTER_SCHED_ADDRS entry 'h1' must be HOST:PORT"),
        ({"CLUSTER_SCHED_ADDRS": "h1:0"}, "CLUSTER_SCHED_ADDRS entry 'h1:0' must be HOST:PORT"),
        ({"CLUSTER_SCHED_ADDRS": "h1:x"}, "CLUSTER_SCHED_ADDRS entry 'h1:x' must be HOST:PORT"),
    ],
)
def test_bad_scheduler_address_lists_are_one_line(overrides: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_env(env(**overrides))
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)


def scheduler_env(**overrides: str | None) -> dict[str, str]:
    return env(MS_ROLE="MS_SCHED", MS_SCHED_HOST="127.0.0.1", **overrides)


def test_the_schedulers_metrics_port_is_refused_on_its_own_port() -> None:
    """Its metrics server, started first, would hold the port its gRPC then fails to bind,
    with an error that blames MS_SCHED_HOST / MS_SCHED_PORT."""
    rule = (
        r"^CLUSTER_METRICS_PORT=8118 is MS_SCHED_PORT, where the scheduler itself listens: give "
        r"the metrics another port \(0: any free one\)$"
    )
    for host in (None, "127.0.0.1", "0.0.0.0"):
        with pytest.raises(ConfigError, match=rule):
            from_env(scheduler_env(CLUSTER_METRICS_PORT="8118", CLUSTER_METRICS_HOST=host))
    # Another port, or the same one on another address of the host; a worker serves no
    # scheduler metrics.
    assert from_env(scheduler_env(CLUSTER_METRICS_PORT="8119")).observe.metrics_port == 8119
    apart = scheduler_env(CLUSTER_METRICS_PORT="8118", CLUSTER_METRICS_HOST="10.0.0.2")
    assert from_env(apart).observe.metrics_host == "10.0.0.2"
    assert from_env(env(CLUSTER_METRICS_PORT="8118")).observe.metrics_port == 8118


def mscluster_scheduler_refusal(*options: str, **environment: str) -> list[str]:
    """What `mscluster scheduler` with `options`, in an environment of no MS_ or CLUSTER_
    variable but `environment`, says as it exits 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    result = subprocess.run(
        [*MSCLUSTER, "scheduler", *options],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**env, **environment},
    )
    assert result.returncode == 2, result.stderr
    return result.stderr.splitlines()


def test_mscluster_scheduler_port_and_metrics_port_alike_is_one_line() -> None:
    said = mscluster_scheduler_refusal(
        "--port", "8118", "--metrics-port", "8118", "--worker-num", "1"
    )
    assert said == [
        "mscluster: ConfigError: --metrics-port=8118 is --port, where the scheduler itself "
        "listens: give the metrics another port (0: any free one)"
    ]


def test_scheduler_port_0_is_no_port_the_metrics_are_refused_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`mscluster scheduler --port 0` (any free port) is parsed with a stand-in port: never
    the metrics port's."""
    for name in [k for k in os.environ if k.startswith(("MS_", "CLUSTER_"))]:
        monkeypatch.delenv(name)
    for metrics in ("1", "2", "0"):
        args = build_parser().parse_args(
            ["scheduler", "--port", "0", "--metrics-port", metrics, "--worker-num", "1"]
        )
        config = cli_commands._scheduler_config(args)
        assert (config.sched_port, config.observe.metrics_port) == (0, int(metrics))


@pytest.mark.parametrize(
    ("options", "environment", "said"),
    [
        (
            ["--port", "8118", "--worker-num", "0"],
            {},
            "--worker-num='0' is out of range: it must be between 1 and 1000000",
        ),
        (
            ["--port", "8118"],
            {},
            "--worker-num is not given and MS_WORKER_NUM is not set: it is required",
        ),
        (
            ["--worker-num", "2"],
            {},
            "--port is not given and MS_SCHED_PORT is not set: it is required",
        ),
        (["--port", "70000", "--worker-num", "2"], {}, "--port='70000' is out of range"),
        (
            ["--port", "8118", "--worker-num", "2", "--node-timeout", "0"],
            {},
            "--node-timeout='0' is out of range",
        ),
        (
            ["--port", "8118", "--worker-num", "2", "--recovery-path", "FILE"],
            {},
            "--recovery-path='FILE' is a file, not a directory: move that file away",
        ),
        # A value of the environment is the variable's.
        (["--port", "8118"], {"MS_WORKER_NUM": "0"}, "MS_WORKER_NUM='0' is out of range"),
        (["--worker-num", "2"], {"MS_SCHED_PORT": "x"}, "MS_SCHED_PORT='x' is not an integer"),
        # Each variable of a value given by an option is said as the option, the others as
        # they are.
        (
            ["--port", "8118", "--worker-num", "2", "--metrics-port", "8118"],
            {},
            "--metrics-port=8118 is --port, where",
        ),
        (
            ["--worker-num", "2", "--metrics-port", "8118"],
            {"MS_SCHED_PORT": "8118"},
            "--metrics-port=8118 is MS_SCHED_PORT, where",
        ),
    ],
)
def test_mscluster_scheduler_names_the_option_of_a_value_it_refuses(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    options: list[str],
    environment: dict[str, str],
    said: str,
) -> None:
    """`mscluster scheduler --worker-num 0` said `MS_WORKER_NUM='0' is out of range`, and
    without --port `MS_SCHED_PORT is not set`: the variable, where the person typed (or must
    type) an option."""
    for name in [k for k in os.environ if k.startswith(("MS_", "CLUSTER_"))]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    a_file = tmp_path / "file"
    a_file.write_text("")
    said = said.replace("FILE", str(a_file))
    args = build_parser().parse_args(
        ["scheduler", *(str(a_file) if o == "FILE" else o for o in options)]
    )
    with pytest.raises(ConfigError) as refused:
        cli_commands._scheduler_config(args)
    assert str(refused.value).startswith(said), str(refused.value)


def test_a_scheduler_on_a_taken_port_names_its_setting_as_it_was_given() -> None:
    """What the scheduler's bind refuses names the setting as the scheduler was given it: the
    variables of the launch contract (`cluster.init()` as MS_SCHED, `mscluster run`'s
    scheduler), and `mscluster scheduler`'s option where one gave the value. It named
    `mscluster scheduler`'s options to everyone, who could not give them."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as refused:
            check_bindable("127.0.0.1", port)
        assert str(refused.value).endswith("choose another MS_SCHED_PORT")
        with pytest.raises(ConfigError) as refused:
            MetricsServer(CollectorRegistry(), "127.0.0.1", port).start()
        said = str(refused.value)
        assert said.startswith(f"CLUSTER_METRICS_PORT={port}: "), said
        assert said.endswith("CLUSTER_METRICS_HOST an address of this host")
        in_use = f"127.0.0.1:{port}: the port is already in use (another scheduler still running?)"
        options = ("--worker-num", "1", "--host", "127.0.0.1")
        assert mscluster_scheduler_refusal("--port", str(port), *options) == [
            f"mscluster: ConfigError: the scheduler cannot listen on {in_use}; free it or "
            "choose another --port"
        ]
        assert mscluster_scheduler_refusal(*options, MS_SCHED_PORT=str(port)) == [
            f"mscluster: ConfigError: the scheduler cannot listen on {in_use}; free it or "
            "choose another MS_SCHED_PORT"
        ]
        metrics = ("--port", "0", "--metrics-port", str(port), *options)
        said = mscluster_scheduler_refusal(*metrics)[-1]
        assert said.startswith(f"mscluster: ConfigError: --metrics-port={port}: "), said
        assert said.endswith("and CLUSTER_METRICS_HOST an address of this host"), said
