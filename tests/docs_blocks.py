"""The examples of the README and of the docs pages that the tests run, found by their marks.

A fenced block is run by the tests when the line before it (blank lines aside) is a mark, an
HTML comment that neither GitHub nor MkDocs shows:

    <!-- test: file NAME -->   the block is written to NAME (a script the next commands run)
    <!-- test: run -->         the block is run by bash, as written, in the reader's checkout
    <!-- test: output -->      what the last `run` block printed: each line of it appears among
                               the lines it printed (stdout and stderr), in any order; `...`
                               in a line stands for any text (a duration, a pid)
    <!-- test: demo-output --> what `bash scripts/demo` ends with (tests/integration/test_docs.py)

One mark stands alone, with no block after it: `<!-- test: needs SERVER -->` says that the page's
commands need a server the reader runs (its address in an environment variable the page names):
the test starts one (tests/servers/) and sets that variable (tests/integration/test_docs.py,
SERVERS).

`tests/integration/test_docs.py` walks README.md and docs/**/*.md: each page with a `run` block
is one test, its marked blocks taken in order in one fresh copy of the checkout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!-- test: ([a-z-]+)(?: (\S+))? -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
KINDS = frozenset({"file", "run", "output", "demo-output"})
NEEDS = "needs"  # the page-level mark, without a block


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the mark, 1-based
    kind: str
    argument: str  # the file's name for `file`, else ""
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README and every docs page (generated pages are made at build time: not here)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The marked blocks of `page`, in order; a mark without a block after it is an error."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    for number, line in enumerate(lines):
        mark = MARK.match(line.strip())
        if mark is None:
            continue
        kind, argument = mark.group(1), mark.group(2) or ""
        where = f"{page.relative_to(ROOT)}:{number + 1}"
        if kind == NEEDS:
            continue
        if kind not in KINDS:
            kinds = sorted(KINDS | {NEEDS})
            raise ValueError(f"{where}: unknown mark {kind!r} (one of {kinds})")
        start = number + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        fence = FENCE.match(lines[start]) if start < len(lines) else None
        if fence is None:
            raise ValueError(f"{where}: the mark {kind!r} is not followed by a fenced block")
        end = lines.index("```", start + 1)
        text = "\n".join(lines[start + 1 : end]) + "\n"
        found.append(Block(page, number + 1, kind, argument, fence.group(1), text))
    return found


def needs(page: Path) -> list[str]:
    """The servers that `page`'s commands need (its `<!-- test: needs SERVER -->` marks)."""
    found = []
    for number, line in enumerate(page.read_text().splitlines()):
        mark = MARK.match(line.strip())
        if mark is not None and mark.group(1) == NEEDS:
            if not mark.group(2):
                raise ValueError(f"{page.relative_to(ROOT)}:{number + 1}: `needs` names no server")
            found.append(mark.group(2))
    return found


def shows(expected: str, printed: str) -> list[str]:
    """The lines of `expected` (an `output` block) that `printed` lacks."""
    lines = printed.splitlines()
    missing = []
    for want in filter(None, (line.strip() for line in expected.splitlines())):
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")))
        if not any(pattern.search(line) for line in lines):
            missing.append(want)
    return missing
