"""The MkDocs hook that puts the generated pages in the site (`hooks:` in mkdocs.yml).

- reference/cli.md, errors.md, metrics.md and protocol.md are made from the code (`refgen`);
- reference/environment.md keeps its hand-written table of meanings, and the build fails when
  that table and the variables the code reads disagree; the page gets where each variable is
  read and the defaults the code computes in place of its `<!-- generated: ... -->` marks;
- results.md, development.md, changelog.md and certs.md are benchmarks/RESULTS.md,
  CONTRIBUTING.md, CHANGELOG.md and certs/README.md, whose links into docs/ are made relative to
  the site. A page of docs/ links to those files where they are in the checkout
  (`../benchmarks/RESULTS.md#measured`), so that the link works there too; in the site it goes
  to their page (`results.md#measured`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the reference is this checkout's code, whatever is installed
    sys.path.insert(0, str(ROOT))

import refgen  # noqa: E402 - MkDocs puts this folder on sys.path while it loads the hook

PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": refgen.cli_page,
    "reference/errors.md": refgen.errors_page,
    "reference/metrics.md": refgen.metrics_page,
    "reference/protocol.md": refgen.protocol_page,
}
# Pages that are files of the repository outside docs/, and how their links into docs/ start.
COPIES: dict[str, tuple[Path, str]] = {
    "results.md": (ROOT / "benchmarks" / "RESULTS.md", "../docs/"),
    "development.md": (ROOT / "CONTRIBUTING.md", "docs/"),
    "changelog.md": (ROOT / "CHANGELOG.md", "docs/"),
    "certs.md": (ROOT / "certs" / "README.md", "../docs/"),
}
DOCS = ROOT / "docs"
# A Markdown link's target: a path, then an anchor or nothing.
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
MARKS: dict[str, Callable[[], str]] = {
    "<!-- generated: environment-where -->": refgen.environment_where,
    "<!-- generated: environment-defaults -->": refgen.environment_defaults,
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for uri, (source, prefix) in COPIES.items():
        text = source.read_text().replace(f"]({prefix}", "](")
        files.append(File.generated(config, uri, content=text))
    return files


def to_copies(markdown: str, src_uri: str) -> str:
    """`markdown`, of the page docs/`src_uri`, with its links to a file that the site shows as a
    page of its own (COPIES) made links to that page."""
    here = (DOCS / src_uri).parent
    pages = {os.path.normpath(source): uri for uri, (source, _) in COPIES.items()}

    def swap(link: re.Match[str]) -> str:
        uri = pages.get(os.path.normpath(here / link[1]))
        if uri is None:
            return link[0]
        return f"]({os.path.relpath(DOCS / uri, here)}{link[2] or ''})"

    return _LINK.sub(swap, markdown)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if not page.file.generated_by:
        markdown = to_copies(markdown, page.file.src_uri)
    if page.file.src_uri != "reference/environment.md":
        return markdown
    problems = refgen.environment_check(markdown)
    if problems:
        raise PluginError("reference/environment.md: " + "; ".join(problems))
    for mark, make in MARKS.items():
        if mark not in markdown:
            raise PluginError(f"reference/environment.md lacks its mark {mark}")
        markdown = markdown.replace(mark, make())
    return markdown
