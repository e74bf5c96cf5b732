"""Headless Chromium (Debian's chromium and chromium-driver) driven by Selenium.

Selenium is given /usr/bin/chromedriver and /usr/bin/chromium explicitly, so Selenium Manager
never runs (it would try to download a driver: this machine reaches no such site). The flags
keep Chromium off the network it cannot reach anyway (no QUIC, no background networking,
component updates, sync or proxy) and every run gets a fresh profile (`--user-data-dir` in the
test's temporary directory). As root, Chromium needs `--no-sandbox`.

Fixture: `browser` yields a WebDriver, always quit after the test; when the test failed, a
screenshot of the page is saved first (see `save_screenshot`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _pytest.nodes import Node  # what request.node is

if TYPE_CHECKING:
    # Imported when a browser starts: a machine without selenium (the GPU machine's image) still
    # collects the suite, whose plugins include this module.
    from selenium import webdriver
    from selenium.webdriver.remote.webdriver import WebDriver

from tests.procs import processes_running
from tests.servers import require
from tests.servers.plugin import attach_log, failed

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS_ENV = "CLUSTER_TEST_ARTIFACTS"
PAGE_LOAD_TIMEOUT_S = 30
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-proxy-server",
    "--disable-breakpad",
    "--disable-crash-reporter",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
]


def why_unavailable() -> str | None:
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return (
                f"browser tests need {path} (Debian package {package}; "
                "scripts/setup installs it when run as root)"
            )
    return None


def start_chromium(profile: Path, driver_log: Path) -> webdriver.Chrome:
    """A headless Chromium with a fresh profile in `profile`; chromedriver's log in
    `driver_log`. The caller must `quit()` it."""
    from selenium import webdriver  # noqa: PLC0415 (see the imports)
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(driver_log))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
    return driver


def artifact_dir(node: Node, tmp_path: Path) -> Path:
    """Where a test's artifacts go: $CLUSTER_TEST_ARTIFACTS/<test> when set (to keep them after
    the run), else the test's temporary directory."""
    root = os.environ.get(ARTIFACTS_ENV)
    if not root:
        return tmp_path
    target = Path(root) / re.sub(r"[^A-Za-z0-9_.-]+", "_", node.nodeid)
    target.mkdir(parents=True, exist_ok=True)
    return target


def save_screenshot(driver: WebDriver, directory: Path, name: str) -> Path:
    """Save what the page shows as `directory/name.png`; its path."""
    path = directory / f"{name}.png"
    if not driver.save_screenshot(str(path)):
        raise AssertionError(f"Chromium could not save a screenshot to {path}")
    return path


@pytest.fixture
def browser(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[webdriver.Chrome]:
    require(why_unavailable())
    driver_log = tmp_path / "chromedriver.log"
    attach_log(request.node, "chromedriver", driver_log)
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    driver: webdriver.Chrome | None = None
    try:
        driver = start_chromium(profile, driver_log)
        yield driver
        if failed(request.node):
            path = save_screenshot(driver, artifact_dir(request.node, tmp_path), "on-failure")
            print(f"screenshot of the failed test's page: {path}")
    finally:
        try:
            if driver is not None:
                driver.quit()
        finally:
            # Whatever of this Chromium outlived quit() (a crashed driver leaves its browser).
            for pid in processes_running(str(profile)):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(profile, ignore_errors=True)
