"""deploy/kubernetes passes checkov, a maintained policy scanner (issue 24, item 6): no failed
check, and each skipped one justified in place (a `checkov.io/skipN: CKV_...=why` annotation).

checkov lives in a virtual environment of its own, `.venv-checkov` (scripts/setup makes it):
it pins packaging<24 and networkx<2.7, which would move the dev environment's. Found there, or
at $CLUSTER_CHECKOV, or on PATH; missing, the test skips, and fails under
CLUSTER_REQUIRE_SERVERS=1 (CI), as the server tests do."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.procs import ROOT
from tests.servers import require

DEPLOY = ROOT / "deploy" / "kubernetes"
# What scripts/setup installs: pyproject.toml's `scan` extra, "checkov==X.Y.Z".
CHECKOV_VERSION = re.findall(
    r'^scan = \["checkov==([0-9.]+)"\]$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
)[0]


def checkov() -> str | None:
    given = os.environ.get("CLUSTER_CHECKOV", "")
    local = ROOT / ".venv-checkov" / "bin" / "checkov"
    if given:
        return given
    return str(local) if local.exists() else shutil.which("checkov")


def scan() -> dict[str, Any]:
    binary = checkov()
    require(
        None
        if binary
        else "checkov is not installed: scripts/setup makes .venv-checkov (or set CLUSTER_CHECKOV)"
    )
    assert binary is not None
    done = subprocess.run(
        [binary, "-d", str(DEPLOY), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert isinstance(report, dict), report  # one framework: one report
    return report


def test_the_manifests_pass_checkov_with_every_skip_justified_in_place() -> None:
    report = scan()
    summary, results = report["summary"], report["results"]
    assert summary["checkov_version"] == CHECKOV_VERSION
    assert summary["parsing_errors"] == 0  # a file checkov cannot read is no file it passed
    failed = [
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})"
        for c in results["failed_checks"]
    ]
    assert not failed, "\n".join(failed)
    scanned = {
        Path(c["file_path"].lstrip("/"))  # relative to the directory scanned
        for kind in ("passed_checks", "skipped_checks")
        for c in results[kind]
    }
    manifests = {
        p.relative_to(DEPLOY) for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml"
    }
    # Every file with a container was checked (claims and network policies have no checks).
    with_containers = {p for p in manifests if "containers:" in (DEPLOY / p).read_text()}
    assert with_containers <= scanned <= manifests
    for check in results["skipped_checks"]:
        why = check["check_result"].get("suppress_comment", "")
        assert len(why) > 20, f"{check['check_id']} on {check['resource']} is skipped unexplained"
    assert summary["passed"] >= 300
