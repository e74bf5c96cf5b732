"""A server a test needs but cannot start skips the test, except in CI, where it fails it."""

from __future__ import annotations

import pytest

from tests.servers import REQUIRE_ENV, require


def test_an_available_server_lets_the_test_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    require(None)


def test_a_missing_server_skips_the_test_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="`etcd` is not installed"):
        require("`etcd` is not installed")


def test_a_missing_server_fails_the_test_when_servers_are_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"`etcd` is not installed.*forbids skipping"):
        require("`etcd` is not installed")
