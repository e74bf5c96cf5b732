"""A real Prometheus server (Debian's prometheus 2.42) scraping loopback targets.

It runs on a free loopback port with a generated config and a storage directory of its own, and
is ready when /-/ready answers 200. The scrape interval is short (1 s by default) so that a test
sees a change within a second or two; `set_targets` rewrites the config and reloads it
(/-/reload), so a test can point Prometheus at a server it started after the fixture.

Fixtures: `prometheus` (started, no targets yet; `prometheus.set_targets([...])`) and
`make_prometheus(targets, scrape_interval_s=1.0)`; both stopped after the test.
"""

from __future__ import annotations

import json
import math
import shutil
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import require
from tests.servers._process import (
    ServerError,
    ServerProcess,
    bind_failed,
    free_ports,
    http_get,
    http_post,
    wait_for,
)
from tests.servers.plugin import attach_log

START_TIMEOUT_S = 30.0
BIND_ATTEMPTS = 3
JOB = "cluster"


def why_unavailable() -> str | None:
    if shutil.which("prometheus") is None:
        return (
            "Prometheus tests need `prometheus` (Debian package prometheus; "
            "scripts/setup installs it when run as root)"
        )
    return None


@dataclass(frozen=True)
class Sample:
    """One element of a query's instant vector (or its scalar, with no labels)."""

    metric: dict[str, str]
    value: float
    timestamp: float


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class Prometheus:
    """Prometheus scraping `targets` (`host:port`, path /metrics) every `scrape_interval_s`."""

    def __init__(
        self, base_dir: Path, targets: Sequence[str] = (), scrape_interval_s: float = 1.0
    ) -> None:
        self.base_dir = base_dir
        self.targets = list(targets)
        self.scrape_interval_s = scrape_interval_s
        self.config = base_dir / "prometheus.yml"
        self.port = 0
        self.process = ServerProcess("prometheus", [], base_dir / "prometheus.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self.port = free_ports(1)[0]
            self.process.args = [
                "prometheus",
                f"--config.file={self.config}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.path={self.base_dir / 'data'}",
                "--web.enable-lifecycle",  # /-/reload, for set_targets
                "--log.level=info",
            ]
            self.process.start()
            try:
                wait_for(self.ready, timeout_s, "Prometheus's /-/ready", [self.process])
                return
            except ServerError:
                lost_race = bind_failed(self.process)
                self.process.stop()
                if not lost_race or attempt == BIND_ATTEMPTS:
                    raise

    def ready(self) -> bool:
        answer = http_get(f"{self.url}/-/ready", timeout_s=1.0)
        return answer is not None and answer[0] == 200

    def close(self) -> None:
        self.process.stop()

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_targets(self, targets: Sequence[str]) -> None:
        """Scrape `targets` from now on (the config is rewritten and reloaded)."""
        self.targets = list(targets)
        self._write_config()
        answer = http_post(f"{self.url}/-/reload")
        if answer is None or answer[0] != 200:
            raise ServerError(
                f"Prometheus did not reload its config: {answer}\n{self.process.describe()}"
            )

    def query(self, promql: str) -> list[Sample]:
        """The instant value of `promql` now (/api/v1/query); a scalar is one unlabelled
        sample. A query Prometheus refuses raises ServerError with its error."""
        answer = http_get(
            f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}", timeout_s=10
        )
        if answer is None:
            raise ServerError(f"Prometheus did not answer the query {promql!r}")
        body = json.loads(answer[1])
        if body.get("status") != "success":
            raise ServerError(f"Prometheus refused {promql!r}: {body.get('error', body)}")
        data = body["data"]
        if data["resultType"] == "vector":
            return [
                Sample(dict(item["metric"]), float(item["value"][1]), float(item["value"][0]))
                for item in data["result"]
            ]
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]), float(data["result"][0]))]
        raise ServerError(f"{promql!r} is a {data['resultType']}, not an instant vector")

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[Sample]], bool],
        timeout_s: float = 30.0,
    ) -> list[Sample]:
        """Query `promql` until `predicate` holds for its samples; those samples. ServerError
        after `timeout_s`, with the last samples and what Prometheus says of its targets."""
        last: list[Sample] = []

        def holds() -> bool:
            nonlocal last
            last = self.query(promql)
            return predicate(last)

        try:
            wait_for(holds, timeout_s, f"{promql!r} to satisfy the predicate", [self.process])
        except ServerError as exc:
            raise ServerError(
                f"{exc}\nlast samples: {last}\ntargets: {self.target_health()}"
            ) from None
        return last

    def target_health(self) -> list[dict[str, str]]:
        """Each active target's scrape URL, health and last error (/api/v1/targets)."""
        answer = http_get(f"{self.url}/api/v1/targets", timeout_s=10)
        if answer is None or answer[0] != 200:
            return []
        return [
            {
                "scrapeUrl": t.get("scrapeUrl", ""),
                "health": t.get("health", ""),
                "lastError": t.get("lastError", ""),
            }
            for t in json.loads(answer[1])["data"]["activeTargets"]
        ]

    def _write_config(self) -> None:
        interval = _duration(self.scrape_interval_s)
        config = {
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": interval,
            },
            "scrape_configs": [
                {"job_name": JOB, "static_configs": [{"targets": self.targets}]},
            ],
        }
        # JSON is YAML: no YAML writer needed.
        self.config.write_text(json.dumps(config, indent=2) + "\n")


def value_is(expected: float) -> Callable[[list[Sample]], bool]:
    """A predicate for `wait_for`: exactly one sample, of value `expected`."""
    return lambda samples: len(samples) == 1 and math.isclose(samples[0].value, expected)


@pytest.fixture
def make_prometheus(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Prometheus]]:
    require(why_unavailable())
    made: list[Prometheus] = []

    def make(targets: Sequence[str] = (), scrape_interval_s: float = 1.0) -> Prometheus:
        server = Prometheus(tmp_path / f"prometheus{len(made)}", targets, scrape_interval_s)
        made.append(server)
        attach_log(request.node, f"prometheus {len(made)}", server.process.log)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in made:
            server.close()


@pytest.fixture
def prometheus(make_prometheus: Callable[..., Prometheus]) -> Prometheus:
    return make_prometheus()
