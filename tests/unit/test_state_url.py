"""CLUSTER_STATE_URL and CLUSTER_LEASE_S: parsed in one place, every bad value a ConfigError that
names the variable, the value and the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.protocol.config import from_env
from cluster.protocol.errors import ConfigError
from cluster.protocol.state_url import (
    DEFAULT_LEASE_S,
    EtcdTLS,
    parse_lease,
    parse_state_url,
    state_url_from_env,
)


def test_a_url_names_its_endpoints_and_its_prefix() -> None:
    url = parse_state_url("etcd://10.0.0.1:2379,etcd-b:2379,[::1]:2380/jobs//a/")
    assert url.endpoints == (("10.0.0.1", 2379), ("etcd-b", 2379), ("::1", 2380))
    assert (url.prefix, url.tls) == ("/jobs/a/", False)
    assert str(url) == "etcd://10.0.0.1:2379,etcd-b:2379,[::1]:2380/jobs/a"
    assert parse_state_url("etcds://h:1/j").tls


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("h:2379/job", "is no URL"),
        ("http://h:2379/job", "no known scheme"),
        ("etcd://h:2379", "no key prefix"),
        ("etcd://h:2379/", "no key prefix"),
        ("etcd://h/job", "without HOST:PORT"),
        ("etcd://h:0/job", "port is not in 1-65535"),
        ("etcd://h:99999/job", "port is not in 1-65535"),
        ("etcd://::1:2379/job", "without HOST:PORT"),
        ("etcd://h:1,h:1/job", "names an endpoint twice"),
        ("etcd://h:1/a b", "spaces or control characters"),
    ],
)
def test_a_bad_url_is_refused_naming_the_variable_the_value_and_the_rule(
    value: str, rule: str
) -> None:
    with pytest.raises(ConfigError, match=rule) as raised:
        parse_state_url(value)
    assert f"CLUSTER_STATE_URL={value!r}" in str(raised.value)
    assert "etcd://HOST:PORT[,HOST:PORT...]/PREFIX" in str(raised.value)


@pytest.mark.parametrize("value", ["1", "1.5", "0", "-3", "abc", "nan", "inf", "3601"])
def test_a_lease_is_whole_seconds_in_range(value: str) -> None:
    with pytest.raises(ConfigError, match=r"CLUSTER_LEASE_S="):
        parse_lease(value)


def test_a_lease_in_range_is_taken() -> None:
    assert (parse_lease("2"), parse_lease(" 30 "), parse_lease("5.0")) == (2, 30, 5)


def test_the_etcd_tls_files_need_etcds_and_go_together() -> None:
    url = state_url_from_env({"CLUSTER_STATE_URL": "etcds://h:1/j", "CLUSTER_ETCD_CA_FILE": "ca"})
    assert url is not None
    assert url.tls_files == EtcdTLS(ca_file=Path("ca"))
    with pytest.raises(ConfigError, match="go together"):
        state_url_from_env({"CLUSTER_STATE_URL": "etcds://h:1/j", "CLUSTER_ETCD_KEY_FILE": "k"})
    with pytest.raises(ConfigError, match="plaintext"):
        state_url_from_env({"CLUSTER_STATE_URL": "etcd://h:1/j", "CLUSTER_ETCD_CA_FILE": "ca"})
    with pytest.raises(ConfigError, match="--state-url="):
        state_url_from_env({}, given="etcd://h/j")
    assert state_url_from_env({"CLUSTER_STATE_URL": " "}) is None


def scheduler_env(**extra: str) -> dict[str, str]:
    env = {"MS_ROLE": "MS_SCHED", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1"}
    return {**env, "MS_SCHED_PORT": "8118", **extra}


def test_a_scheduler_with_a_state_url_needs_no_recovery_path() -> None:
    config = from_env(
        scheduler_env(CLUSTER_STATE_URL="etcd://h:1/j", MS_ENABLE_RECOVERY="1", CLUSTER_LEASE_S="3")
    )
    assert config.state_url is not None
    assert (config.recovery, config.lease_s) == (None, 3)
    plain = from_env(scheduler_env())
    assert (plain.state_url, plain.lease_s) == (None, DEFAULT_LEASE_S)


def test_a_worker_ignores_the_state_url() -> None:
    env = scheduler_env(MS_ROLE="MS_WORKER", CLUSTER_STATE_URL="not a url")
    assert from_env(env).state_url is None
