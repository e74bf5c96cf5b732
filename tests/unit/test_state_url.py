"""CLUSTER_STATE_URL, CLUSTER_LEASE_S and CLUSTER_ETCD_COMPACTION: parsed in one place, every bad
value a ConfigError that names the variable, the value and the rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.protocol.environment import from_env
from cluster.protocol.errors import ConfigError
from cluster.protocol.state_url import (
    DEFAULT_LEASE_S,
    EtcdAuth,
    EtcdTLS,
    etcd_auth_from_env,
    parse_lease,
    parse_state_url,
    state_url_from_env,
)
from cluster.scheduler.stores import etcd_login


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


def test_compaction_is_off_unless_auto_is_asked_for() -> None:
    """A compaction drops every key's history, other users' too: never by default."""
    modes = {}
    for given in ("", " ", "off", "OFF", "auto", " Auto "):
        url = state_url_from_env({**URL, "CLUSTER_ETCD_COMPACTION": given})
        assert url is not None
        modes[given] = url.compaction
    assert modes == {
        "": "off",
        " ": "off",
        "off": "off",
        "OFF": "off",
        "auto": "auto",
        " Auto ": "auto",
    }
    url = state_url_from_env(URL, given="etcd://h:1/k")  # --state-url: the variable still counts
    assert url is not None
    assert url.compaction == "off"


@pytest.mark.parametrize("value", ["sometimes", "on", "1", "periodic", "auto,off"])
def test_a_bad_compaction_is_one_line_naming_the_variable_and_the_modes(value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        from_env(scheduler_env(**URL, CLUSTER_ETCD_COMPACTION=value))
    message = str(raised.value)
    assert message.startswith(f"CLUSTER_ETCD_COMPACTION={value!r} is not a compaction mode: ")
    assert "it must be off (" in message
    assert ") or auto (" in message
    assert "\n" not in message


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


URL = {"CLUSTER_STATE_URL": "etcd://h:1/j"}


def test_an_etcd_login_is_a_user_and_a_password_file_on_either_scheme() -> None:
    for scheme in ("etcd", "etcds"):
        env = {
            "CLUSTER_STATE_URL": f"{scheme}://h:1/j",
            "CLUSTER_ETCD_USER": " job-a ",
            "CLUSTER_ETCD_PASSWORD_FILE": "/run/pw",
        }
        url = state_url_from_env(env)
        assert url is not None
        assert url.auth == EtcdAuth("job-a", Path("/run/pw"))
    url = state_url_from_env(URL)
    assert url is not None
    assert url.auth is None
    assert etcd_auth_from_env({}) is None


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"CLUSTER_ETCD_USER": "a"}, "CLUSTER_ETCD_USER='a' needs its password: set "),
        ({"CLUSTER_ETCD_PASSWORD_FILE": "/pw"}, "CLUSTER_ETCD_PASSWORD_FILE='/pw' is set without"),
        (
            {"CLUSTER_ETCD_USER": "a b", "CLUSTER_ETCD_PASSWORD_FILE": "/pw"},
            "CLUSTER_ETCD_USER='a b' is no etcd user name",
        ),
        (
            {"CLUSTER_ETCD_USER": "a\x1b[2J", "CLUSTER_ETCD_PASSWORD_FILE": "/pw"},
            "is no etcd user name",
        ),
        ({"CLUSTER_ETCD_PASSWORD": "hunter2"}, "CLUSTER_ETCD_PASSWORD is not read"),
    ],
)
def test_a_bad_etcd_login_is_one_line_naming_the_variable(env: dict[str, str], said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        state_url_from_env({**URL, **env})
    message = str(raised.value)
    assert said in message
    assert "\n" not in message
    assert "hunter2" not in message


def test_a_password_file_is_read_when_only_its_owner_may(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("s3cret\n")
    for mode in (0o600, 0o400):
        path.chmod(mode)
        assert etcd_login(EtcdAuth("job", path)) == ("job", "s3cret")
    assert etcd_login(None) is None


@pytest.mark.parametrize(
    ("mode", "content", "said"),
    [
        (0o644, "s3cret", "is open to other users (mode 0644)"),
        (0o604, "s3cret", "is open to other users (mode 0604)"),
        (0o660, "s3cret", "chmod 600"),
        (0o600, "\n", "is empty"),
        (None, "", "cannot be read (No such file or directory)"),
    ],
)
def test_a_password_file_open_to_others_empty_or_missing_is_refused(
    tmp_path: Path, mode: int | None, content: str, said: str
) -> None:
    path = tmp_path / "pw"
    if mode is not None:
        path.write_text(content)
        path.chmod(mode)
    with pytest.raises(ConfigError) as raised:
        etcd_login(EtcdAuth("job", path))
    assert str(raised.value).startswith(f"CLUSTER_ETCD_PASSWORD_FILE={str(path)!r} ")
    assert said in str(raised.value)
    assert "s3cret" not in str(raised.value)


def test_a_password_file_behind_a_link_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "pw"
    target.write_text("s3cret\n")
    target.chmod(0o600)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ConfigError, match="cannot be read"):
        etcd_login(EtcdAuth("job", tmp_path / "link"))


def test_a_password_file_of_root_readable_by_our_group_is_a_kubernetes_secret(
    tmp_path: Path,
) -> None:
    """The kubelet mounts a Secret for the pod's fsGroup as root:fsGroup 0440: taken when the
    group is this process's; any other group, or a group that may write, is refused."""
    path = tmp_path / "pw"
    path.write_text("s3cret\n")
    os.chown(path, 0, os.getegid())
    path.chmod(0o440)
    if os.geteuid() == 0:  # root may chown: the file's group is ours
        assert etcd_login(EtcdAuth("job", path)) == ("job", "s3cret")
    path.chmod(0o460)
    with pytest.raises(ConfigError, match="mode 0460"):
        etcd_login(EtcdAuth("job", path))
