"""The house rules a reader can check without running anything: every function in `cluster/`
(generated `cluster/v1` aside) is short enough to read on one screen, and every module short
enough to hold one responsibility."""

from __future__ import annotations

import ast
from pathlib import Path

import cluster

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 700
PACKAGE = Path(cluster.__file__).parent


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function and method in one file."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                found.append((f"{prefix}{child.name}", child.lineno, length))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def _sources() -> list[Path]:
    generated = PACKAGE / "v1"
    return [p for p in sorted(PACKAGE.rglob("*.py")) if generated not in p.parents]


def test_the_walk_sees_the_package() -> None:
    sources = _sources()
    assert PACKAGE / "worker" / "machine" / "core.py" in sources
    assert not any("v1" in p.relative_to(PACKAGE).parts for p in sources)
    names = {name for name, _, _ in _functions(PACKAGE / "worker" / "machine" / "core.py")}
    assert "WorkerCore.__init__" in names


def test_the_length_counts_the_def_line_to_the_last_line(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("class A:\n    def f(self):\n        x = 1\n        return x\n")
    assert _functions(source) == [("A.f", 2, 3)]


def test_no_function_in_cluster_is_over_60_lines() -> None:
    too_long = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {name} is {length} lines"
        for path in _sources()
        for name, line, length in _functions(path)
        if length > MAX_FUNCTION_LINES
    ]
    assert too_long == [], (
        f"functions over {MAX_FUNCTION_LINES} lines (split them along their responsibilities): "
        + "; ".join(too_long)
    )


def test_no_module_in_cluster_is_over_700_lines() -> None:
    too_long = [
        f"{path.relative_to(PACKAGE.parent)} is {lines} lines"
        for path in _sources()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert too_long == [], (
        f"modules over {MAX_MODULE_LINES} lines (move a cohesive part into a module of its "
        "own): " + "; ".join(too_long)
    )
