"""The docs' links work where they are read: in the checkout (on a forge, in an editor) and in the
built site. A page of docs/ links to benchmarks/RESULTS.md, CONTRIBUTING.md and CHANGELOG.md
where they are; the site's hook (docs/hooks/reference.py) makes those links to the pages it
makes of them (results.md, development.md, changelog.md), which are not in the checkout."""

from __future__ import annotations

import importlib.util
import os
import re
from types import ModuleType

import pytest

from tests.procs import ROOT

LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
PAGES = [
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "certs" / "README.md",
]


def hook(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    pytest.importorskip("mkdocs", reason="the site's hook needs mkdocs (the dev extra)")
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "hooks"))  # its `import refgen`
    where = ROOT / "docs" / "hooks" / "reference.py"
    spec = importlib.util.spec_from_file_location("reference_hook", where)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_relative_link_of_the_pages_finds_its_file_in_the_checkout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generated = {os.path.normpath(ROOT / "docs" / uri) for uri in hook(monkeypatch).PAGES}
    broken = []
    for page in PAGES:
        for link in LINK.finditer(page.read_text()):
            target = link[1]
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            where = os.path.normpath(page.parent / target)
            if not os.path.exists(where) and where not in generated:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_site_links_to_the_page_it_makes_of_a_file_outside_docs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    to_copies = hook(monkeypatch).to_copies
    measured = "see [Measured](../../benchmarks/RESULTS.md#measured)."
    assert to_copies(measured, "howto/tls.md") == "see [Measured](../results.md#measured)."
    home = "[Benchmark results](../benchmarks/RESULTS.md) | [Development](../CONTRIBUTING.md)"
    assert (
        to_copies(home, "index.md")
        == "[Benchmark results](results.md) | [Development](development.md)"
    )
    certs = "see [Certificates](../../certs/README.md)"
    assert to_copies(certs, "howto/tls.md") == "see [Certificates](../certs.md)"
    others = "[TLS](howto/tls.md), [a script](../examples/train_mlp.py), [x](https://x.org/a.md)"
    assert to_copies(others, "index.md") == others


# A dotted name of the package in code spans of the pages (`cluster.scheduler.SchedulerServer`,
# `cluster.torch.init_process_group(backend)`).
NAME = re.compile(r"`(cluster(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`")


def _resolves(name: str) -> bool:
    """Whether `name` is a module of the package or a name in one; in cluster.v1, a service
    or message of the protos (protos/cluster/v1/*.proto) counts."""
    parts = name.split(".")
    if parts[:2] == ["cluster", "v1"] and len(parts) == 3:
        protos = "".join(p.read_text() for p in (ROOT / "protos/cluster/v1").glob("*.proto"))
        if re.search(rf"^(service|message) {parts[2]} ", protos, re.MULTILINE):
            return True
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


@pytest.mark.slow  # imports every module named, cluster.torch's torch among them (about 6 s)
def test_every_name_of_the_package_the_pages_give_is_there() -> None:
    """`cluster.protocol.settings.JobSettings.from_config` was named for a function that does
    not exist: a name the pages give is one a reader can import."""
    missing = sorted(
        f"{page.relative_to(ROOT)}: {found[1]}"
        for page in PAGES
        for found in NAME.finditer(page.read_text())
        if not _resolves(found[1])
    )
    assert missing == []
