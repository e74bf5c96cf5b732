"""Each value of the launch environment is read one way, whoever reads it: integers and seconds
in ASCII digits, hosts to their last character, bad values quoted short, seconds bounded,
secrets and passwords as the bytes given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.protocol.config import (
    DEFAULT_PINNED_MAX_BYTES,
    MAX_SECONDS,
    MIN_HEARTBEAT_INTERVAL_S,
    MIN_NODE_TIMEOUT_S,
    JobSecretSource,
    parse_int,
    parse_seconds,
    valid_node_id,
)
from cluster.protocol.environment import (
    MAX_SOCKET_PATH,
    from_env,
    job_secret_from_env,
    read_job_secret,
    relay_from_env,
    tls_options_from_env,
)
from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import check_host
from cluster.protocol.state_url import parse_lease, parse_state_url
from cluster.transport.channel import keepalive_options


def env(**overrides: str) -> dict[str, str]:
    """A minimal valid worker environment, with overrides."""
    return {
        "MS_ROLE": "MS_WORKER",
        "MS_WORKER_NUM": "4",
        "MS_SCHED_HOST": "10.0.0.1",
        "MS_SCHED_PORT": "8118",
        **overrides,
    }


# -- one reading of a number ------------------------------------------------------------------

# What int() and float() take but no other reader of the same value does (a port in
# CLUSTER_SCHED_ADDRS or in an etcd URL is ASCII digits only).
NOT_PLAIN_INTEGERS = ["\uff15", "\u0663", "1_000", "+4", "0x10", "4 4"]


@pytest.mark.parametrize("value", NOT_PLAIN_INTEGERS)
@pytest.mark.parametrize("name", ["MS_WORKER_NUM", "MS_SCHED_PORT", "MS_SERVER_NUM"])
def test_an_integer_is_ascii_digits_only(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}=.* is not an integer: it must be "):
        from_env(env(**{name: value}))


def test_the_port_is_read_as_the_addresses_read_it() -> None:
    """8118 in fullwidth digits was port 8118 in MS_SCHED_PORT, and no port in
    CLUSTER_SCHED_ADDRS."""
    with pytest.raises(ConfigError, match="MS_SCHED_PORT"):
        from_env(env(MS_SCHED_PORT="\uff18\uff11\uff11\uff18"))
    with pytest.raises(ConfigError, match="CLUSTER_SCHED_ADDRS"):
        from_env(env(CLUSTER_SCHED_ADDRS="h1:1,h2:\uff12"))


@pytest.mark.parametrize(("value", "number"), [(" 4 ", 4), ("4\n", 4), ("0004", 4)])
def test_space_around_an_integer_and_leading_zeros_are_kept(value: str, number: int) -> None:
    assert from_env(env(MS_WORKER_NUM=value)).worker_num == number


@pytest.mark.parametrize("value", ["-1", "-0009", "9" * 21, "9" * 5000, "-" + "9" * 5000])
def test_a_negative_or_overlong_integer_is_out_of_range(value: str) -> None:
    with pytest.raises(ConfigError, match="is out of range: it must be between 1 and 1000000"):
        parse_int("MS_WORKER_NUM", value, minimum=1, maximum=1_000_000)


def test_leading_zeros_do_not_make_a_number_too_long() -> None:
    assert parse_int("X", "0" * 40 + "7", minimum=0) == 7


@pytest.mark.parametrize("value", ["\uff13\uff10", "1_0", "3\u0660", "\u0663"])
@pytest.mark.parametrize("name", ["MS_NODE_TIMEOUT", "MS_TOPO_TIMEOUT"])
def test_seconds_are_ascii_only(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}=.* is not a number"):
        from_env(env(**{name: value}))


@pytest.mark.parametrize(("value", "seconds"), [("2.5", 2.5), ("1e2", 100.0), (" 30 ", 30.0)])
def test_plain_seconds_are_read(value: str, seconds: float) -> None:
    assert parse_seconds("MS_NODE_TIMEOUT", value) == seconds


@pytest.mark.parametrize("value", ["\uff15", "1_0", "\u0665"])
def test_a_lease_is_ascii_only(value: str) -> None:
    with pytest.raises(ConfigError, match="is not a whole number of seconds"):
        parse_lease(value)
    scheduler = env(MS_ROLE="MS_SCHED", CLUSTER_STATE_URL="etcd://h:2379/j", CLUSTER_LEASE_S=value)
    with pytest.raises(ConfigError, match="CLUSTER_LEASE_S"):
        from_env(scheduler)


# -- a host to its end ------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["host\n", "host\nevil", "10.0.0.1\n"])
def test_a_host_is_checked_to_its_last_character(host: str) -> None:
    with pytest.raises(ConfigError, match="is not a host name or IP address"):
        check_host("CLUSTER_TLS_SERVER_NAME", host)


@pytest.mark.parametrize("node_id", ["node\n", "7\n", "a\nb"])
def test_a_node_id_is_checked_to_its_last_character(node_id: str) -> None:
    """From the wire a node id is not stripped: a newline at its end is no node id."""
    assert not valid_node_id(node_id)
    assert valid_node_id(node_id.rstrip("\n").replace("\n", ""))


# -- bytes as given ---------------------------------------------------------------------------

# What a process gets for a variable (or an argument) whose bytes are not UTF-8: lone
# surrogates (surrogateescape), which str.encode() refuses with a traceback.
NOT_UTF8 = b" \xffab\xc3( \n"


def test_a_secret_that_is_not_utf8_is_its_bytes_in_both_forms(tmp_path: Path) -> None:
    """CLUSTER_JOB_SECRET of bytes that are not UTF-8 was a UnicodeEncodeError traceback in
    every process; the variable and the file of the same bytes are the same secret."""
    source = job_secret_from_env({"CLUSTER_JOB_SECRET": os.fsdecode(NOT_UTF8)})
    assert source is not None
    path = tmp_path / "job.secret"
    path.write_bytes(NOT_UTF8)
    path.chmod(0o600)
    from_file = read_job_secret(JobSecretSource(path=path))
    assert read_job_secret(source) == from_file == b"\xffab\xc3("


def test_a_tls_password_that_is_not_utf8_is_its_bytes() -> None:
    given = {
        "CLUSTER_TLS_CONFIG": "ssl.json",
        "CLUSTER_TLS_CLIENT_PASSWORD": os.fsdecode(b"pw\xff"),
        "CLUSTER_TLS_SERVER_PASSWORD": os.fsdecode(b"\xfe "),
    }
    options = tls_options_from_env(given)
    assert options is not None
    assert (options.client_password, options.server_password) == (b"pw\xff", b"\xfe ")


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        (b"/" + b"\xff" * MAX_SOCKET_PATH, f"must be at most {MAX_SOCKET_PATH} bytes"),
        (b"/run/\xff.sock", "is not UTF-8: gRPC names a unix socket in UTF-8 only"),
    ],
)
def test_a_relay_path_that_is_not_utf8_is_one_clear_error(path: bytes, rule: str) -> None:
    """Its length was a UnicodeEncodeError traceback; gRPC cannot name such a socket at all."""
    with pytest.raises(ConfigError, match=rf"^CLUSTER_RELAY='unix:/.*{rule}"):
        relay_from_env({"CLUSTER_RELAY": "unix:" + os.fsdecode(path)})


# -- a bad value quoted short -----------------------------------------------------------------

HUGE = "x" * 100_000
# Every variable whose bad value is quoted in the message, with a long bad value of it.
LONG_VALUES = [
    {"MS_ROLE": HUGE},
    {"MS_WORKER_NUM": HUGE},
    {"MS_SERVER_NUM": HUGE},
    {"MS_SCHED_PORT": HUGE},
    {"MS_SCHED_HOST": "h1,," + HUGE},
    {"MS_NODE_ID": HUGE},
    {"MS_NODE_ID": "1" * 100_000},
    {"MS_NODE_TIMEOUT": HUGE},
    {"MS_TOPO_TIMEOUT": HUGE},
    {"MS_ENABLE_RECOVERY": HUGE},
    {"MS_DISABLE_HEARTBEAT": HUGE},
    {"CLUSTER_HEARTBEAT_INTERVAL": "1" * 100_000},
    {"CLUSTER_SCHED_ADDRS": "h:1,," + HUGE},
    {"CLUSTER_RELAY": "unix:/" + HUGE},
    {"CLUSTER_METRICS_PORT": HUGE},
    {"CLUSTER_KV_MAX_BYTES": HUGE},
    {"MS_ROLE": "MS_SCHED", "CLUSTER_STATE_URL": HUGE},
    {"MS_ROLE": "MS_SCHED", "CLUSTER_STATE_URL": "etcd://" + HUGE + "/p"},
    {"MS_ROLE": "MS_SCHED", "CLUSTER_STATE_URL": HUGE + "://h:1/p"},
    {"MS_ROLE": "MS_SCHED", "CLUSTER_STATE_URL": "etcd://h:1/p", "CLUSTER_LEASE_S": HUGE},
    {
        "MS_ROLE": "MS_SCHED",
        "CLUSTER_STATE_URL": "etcd://h:1/p",
        "CLUSTER_ETCD_USER": HUGE,
    },
    {
        "MS_ROLE": "MS_SCHED",
        "CLUSTER_STATE_URL": "etcd://h:1/p",
        "CLUSTER_ETCD_COMPACTION": HUGE,
    },
]


@pytest.mark.parametrize("overrides", LONG_VALUES, ids=",".join)
def test_a_long_bad_value_is_quoted_short(overrides: dict[str, str]) -> None:
    """A 100,000-character value made a 100 KB error line: it is cut to 64 characters and
    says how long it was."""
    with pytest.raises(ConfigError) as info:
        from_env(env(**overrides))
    message = str(info.value)
    assert len(message) < 600, message[:600]
    assert "chars)" in message, message


@pytest.mark.parametrize("name", ["MS_WORKER_NUM", "MS_SCHED_PORT", "CLUSTER_KV_MAX_KEYS"])
def test_a_long_number_is_out_of_range_not_no_number(name: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"^{name}='9{{64}}\.\.\.\(5000 chars\)' is out of range"
    ):
        from_env(env(**{name: "9" * 5000}))


# -- seconds within bounds --------------------------------------------------------------------

SECONDS = ["MS_NODE_TIMEOUT", "MS_TOPO_TIMEOUT", "CLUSTER_COLLECTIVE_TIMEOUT_S"]


@pytest.mark.parametrize("value", ["2000001", "2147483", "3e6", "1e20", "1e300"])
@pytest.mark.parametrize("name", SECONDS)
def test_seconds_past_the_maximum_are_refused(name: str, value: str) -> None:
    """MS_NODE_TIMEOUT=2147483 passed, then the scheduler died of an OverflowError making
    gRPC's keepalive options (a C int of milliseconds)."""
    with pytest.raises(ConfigError, match=rf"^{name}='{value}' is out of range: .*at most 2000000"):
        from_env(env(**{name: value}))


@pytest.mark.parametrize("name", SECONDS)
def test_the_maximum_itself_is_taken(name: str) -> None:
    config = from_env(env(**{name: str(MAX_SECONDS)}))
    taken = {
        "MS_NODE_TIMEOUT": config.node_timeout_s,
        "MS_TOPO_TIMEOUT": config.topo_timeout_s,
        "CLUSTER_COLLECTIVE_TIMEOUT_S": config.limits.collective_timeout_s,
    }
    assert taken[name] == MAX_SECONDS


def test_the_longest_node_timeout_fits_grpcs_keepalive() -> None:
    options = dict(keepalive_options(float(MAX_SECONDS)))
    assert all(value <= 2**31 - 1 for value in options.values())  # a C int each
    assert options["grpc.keepalive_timeout_ms"] > MAX_SECONDS * 1000


@pytest.mark.parametrize("value", ["0.01", "0.999", "1e-300"])
def test_a_node_timeout_below_a_second_is_refused(value: str) -> None:
    """MS_NODE_TIMEOUT=0.01 failed a healthy job."""
    with pytest.raises(
        ConfigError, match=rf"^MS_NODE_TIMEOUT='{value}' is out of range: .*at least 1 and"
    ):
        from_env(env(MS_NODE_TIMEOUT=value))


def test_the_shortest_node_timeout_is_taken_with_its_default_interval() -> None:
    config = from_env(env(MS_NODE_TIMEOUT=str(MIN_NODE_TIMEOUT_S)))
    assert config.node_timeout_s == MIN_NODE_TIMEOUT_S
    assert config.heartbeat_interval_s >= MIN_HEARTBEAT_INTERVAL_S


@pytest.mark.parametrize("value", ["1e-9", "0.05", "0.0999"])
def test_a_heartbeat_interval_below_a_tenth_of_a_second_is_refused(value: str) -> None:
    """CLUSTER_HEARTBEAT_INTERVAL=1e-9 made every worker beat as fast as it could."""
    with pytest.raises(
        ConfigError,
        match=rf"^CLUSTER_HEARTBEAT_INTERVAL='{value}' is out of range: .*at least 0\.1 and",
    ):
        from_env(env(CLUSTER_HEARTBEAT_INTERVAL=value))


def test_the_shortest_heartbeat_interval_is_taken() -> None:
    interval = str(MIN_HEARTBEAT_INTERVAL_S)
    assert from_env(env(CLUSTER_HEARTBEAT_INTERVAL=interval)).heartbeat_interval_s == 0.1


# -- the pinned memory bound, read with the rest ----------------------------------------------


def test_the_pinned_memory_bound_is_read_with_the_environment() -> None:
    assert from_env(env()).pinned_max_bytes == DEFAULT_PINNED_MAX_BYTES == 4 << 30
    assert from_env(env(CLUSTER_PINNED_MAX_BYTES="0")).pinned_max_bytes == 0
    assert from_env(env(CLUSTER_PINNED_MAX_BYTES=" 1048576 ")).pinned_max_bytes == 1 << 20


@pytest.mark.parametrize("value", ["4GiB", "\uff14", "-1", "1e9", "9" * 30])
@pytest.mark.parametrize("role", ["MS_WORKER", "MS_SCHED"])
def test_a_bad_pinned_memory_bound_is_refused_with_the_environment(role: str, value: str) -> None:
    with pytest.raises(ConfigError, match=r"^CLUSTER_PINNED_MAX_BYTES=.* it must be >= 0"):
        from_env(env(MS_ROLE=role, CLUSTER_PINNED_MAX_BYTES=value))


# -- a scheduler's address is its own ---------------------------------------------------------


def test_a_scheduler_does_not_read_the_workers_address_list() -> None:
    listed = "127.0.0.1:18600,127.0.0.2:18601"
    scheduler = from_env(env(MS_ROLE="MS_SCHED", MS_SCHED_PORT="18599", CLUSTER_SCHED_ADDRS=listed))
    assert (scheduler.sched_host, scheduler.sched_port) == ("10.0.0.1", 18599)
    worker = from_env(env(CLUSTER_SCHED_ADDRS=listed))
    assert worker.addresses == ("127.0.0.1:18600", "127.0.0.2:18601")


def test_a_scheduler_needs_its_own_port_with_only_the_workers_list() -> None:
    with pytest.raises(ConfigError, match="MS_SCHED_PORT is not set"):
        from_env({**env(MS_ROLE="MS_SCHED", CLUSTER_SCHED_ADDRS="h:1"), "MS_SCHED_PORT": ""})


@pytest.mark.parametrize("endpoint", ["h h:2379", "h\n:2379", "h@x:2379", "[h\x1b]:2379"])
def test_an_etcd_endpoint_is_a_host_and_a_port(endpoint: str) -> None:
    """The same rule as every other host: a space, a newline or an escape was taken."""
    with pytest.raises(ConfigError, match="whose host is not a host name or IP address"):
        parse_state_url(f"etcd://{endpoint}/jobs/a")
