"""The picture of a chaos run, in a real headless Chromium: a real `mscluster chaos --count 3`
run of train_mlp.py writes chaos-report.html beside its JSON, and the page shows one lane per
rank and one marker per fault. A screenshot is saved with the test's artifacts; with
CLUSTER_UPDATE_DOCS=1 it also replaces docs/chaos-report.png (docs/howto/chaos.md shows it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.procs import PYTHON, ROOT, private_copy, processes_running
from tests.servers.browser import artifact_dir, save_screenshot

pytestmark = pytest.mark.slow

WORKERS = 4
FAULTS = 3
DOCS_SCREENSHOT = ROOT / "docs" / "chaos-report.png"


def test_chaos_report_page_has_a_lane_per_rank_and_a_marker_per_fault(
    browser: WebDriver, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    script = private_copy(tmp_path, ROOT / "examples" / "train_mlp.py")
    logs = tmp_path / "logs"
    done = subprocess.run(
        [
            PYTHON, "-m", "cluster", "chaos", "--seed", "1", "--every", "3",
            "--count", str(FAULTS), "--",
            "--worker-num", str(WORKERS), "--local-worker-num", str(WORKERS),
            "--log-dir", str(logs), str(script),
            "--steps", "1000", "--step-delay", "0.02", "--out", str(tmp_path / "out"),
        ],
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not processes_running(str(script))
    report = json.loads((logs / "chaos-report.json").read_text())
    assert len(report["faults"]) == FAULTS
    page = logs / "chaos-report.html"
    assert f"report written to {logs / 'chaos-report.json'} and {page}" in done.stderr

    browser.set_window_size(1100, 1000)
    browser.get(page.as_uri())
    WebDriverWait(browser, 20).until(
        lambda driver: driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "yes"
    )
    lanes = browser.find_elements(By.CSS_SELECTOR, "#timeline g.lane")
    assert [lane.get_attribute("data-rank") for lane in lanes] == [str(r) for r in range(WORKERS)]
    markers = browser.find_elements(By.CSS_SELECTOR, "#timeline g.fault")
    assert [m.get_attribute("data-kind") for m in markers] == [f["kind"] for f in report["faults"]]
    assert all(m.is_displayed() for m in markers)
    rows = browser.find_elements(By.CSS_SELECTOR, "#faults tbody tr")
    assert len(rows) == FAULTS
    # The killed worker's lane shows it failed, waited out the guard and rejoined.
    killed = next((f for f in report["faults"] if f["kind"] == "kill"), None)
    if killed is not None:
        rank = killed["target"].split()[-1]
        lane = browser.find_element(By.CSS_SELECTOR, f'#timeline g.lane[data-rank="{rank}"]')
        assert lane.find_elements(By.CSS_SELECTOR, "rect.failed")
        assert lane.find_elements(By.CSS_SELECTOR, "path.rejoin")
    assert browser.find_elements(By.CSS_SELECTOR, "#steps polyline.steps")

    shot = save_screenshot(browser, artifact_dir(request.node, tmp_path), "chaos-report")
    assert shot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("CLUSTER_UPDATE_DOCS") == "1":
        shutil.copy(shot, DOCS_SCREENSHOT)
