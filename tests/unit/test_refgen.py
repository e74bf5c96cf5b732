"""The docs site's generated reference pages (docs/hooks/refgen.py, run by `mkdocs build`)
build from the code as it is: a renamed or moved class fails here, in the suite, not only in
the site's build."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.procs import ROOT


def refgen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("refgen", ROOT / "docs" / "hooks" / "refgen.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_metrics_page_lists_every_metric_family_the_scheduler_exports() -> None:
    page = refgen().metrics_page()
    for name in (
        "cluster_leader",
        "cluster_registration_refusals",
        "cluster_edge_refusals",
        "cluster_generation",
        "cluster_rpc_requests",
    ):
        assert name in page, name


def test_the_other_generated_pages_build() -> None:
    module = refgen()
    assert "mscluster" in module.cli_page()
    assert "ClusterError" in module.errors_page()
    assert "Register" in module.protocol_page()


def test_every_variable_the_code_reads_is_on_the_environment_page() -> None:
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    assert refgen().environment_check(page) == []


def test_the_cli_page_shows_a_default_only_where_it_is_a_value() -> None:
    """A flag has none to show: `--no-relay` (store_false) defaults to True, which reads as "no
    relay by default", the opposite of what it means. A default of 0 is a value: `--seed`'s."""
    page = refgen().cli_page()
    rows = {line.split(" | ")[0]: line for line in page.splitlines() if line.startswith("| `--")}
    assert rows["| `--no-relay`"].endswith("|  |"), rows["| `--no-relay`"]
    assert rows["| `--seed` `SEED`"].endswith("| `0` |"), rows["| `--seed` `SEED`"]
    assert all(not row.endswith("| `True` |") for row in rows.values()), page
