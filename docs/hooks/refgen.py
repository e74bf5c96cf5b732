"""The reference pages, made from the code when the site is built, so that they cannot drift.

Each function returns a page's Markdown (or a part of one): the command line from the argparse
parsers of `cluster.tools.cli`, the metrics from their prometheus_client definitions, the wire
protocol from the comments of `protos/cluster/v1/*.proto`, the errors from the class tree of
`cluster.protocol.errors`, and the environment variables from the names the code reads and the
defaults `cluster.protocol.environment` computes. `reference.py` (the MkDocs hook) puts them in the
site. Nothing here changes what it reads.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cluster"
PROTOS = ROOT / "protos" / "cluster" / "v1"
VARIABLE = re.compile(r"^(?:MS|CLUSTER)_[A-Z_]+$")
GENERATED = "*Generated from the code when the site is built; do not edit.*"


def cell(text: str) -> str:
    """`text` as one cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


# --- the command line ----------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:  # argparse keeps no public list of them
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
        if action.option_strings and action.nargs != 0:
            names += f" `{action.metavar or action.dest.upper()}`"
        help_text = (action.help or "").replace("%%", "%")
        yield f"| {names} | {cell(help_text)} | {_default(action)} |"


def _default(action: argparse.Action) -> str:
    """An option's default as the page shows it: none for a flag (a store_true's False and a
    store_false's True say only that it was not given: `--no-relay`'s True is "a relay"), nor
    for an option with none; any other value, 0 and "" too, as it is."""
    default = action.default
    if action.nargs == 0 or default is None or default is False or default is argparse.SUPPRESS:
        return ""
    return f"`{default}`"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_page() -> str:
    from cluster.tools.cli import build_parser  # noqa: PLC0415 - imported at build time

    parser = build_parser()
    lines = [
        "# Command line: `mscluster`",
        "",
        GENERATED,
        f"It is `cluster.tools.cli.build_parser()` as it stands. {parser.description}",
        "`python -m cluster` is the same command. A mistyped option is answered with the",
        "closest known one.",
        "",
    ]
    for name, command in _commands(parser).items():
        lines += [f"## `mscluster {name}`", "", cell(command.description or ""), ""]
        lines += [f"    {command.format_usage().strip()}", ""]
        lines += ["| option | what | default |", "|---|---|---|", *_options(command), ""]
    return "\n".join(lines)


# --- the errors ------------------------------------------------------------------------------


def _tree(cls: type, depth: int) -> Iterator[tuple[int, type]]:
    yield depth, cls
    subclasses: list[type] = cls.__subclasses__()
    for sub in sorted(subclasses, key=lambda c: c.__name__):
        yield from _tree(sub, depth + 1)


def _status(cls: type) -> str:
    from cluster.transport.failures import status_of  # noqa: PLC0415

    try:
        error = cls("example")
    except TypeError:
        return ""
    code, _ = status_of(error)
    return f"`{code.name}`"


def errors_page() -> str:
    from cluster.protocol import errors  # noqa: PLC0415

    lines = [
        "# Errors",
        "",
        GENERATED,
        "Every failure of `cluster` is a `cluster.ClusterError`: the tree of",
        "`cluster/protocol/errors.py`, one docstring per class. An uncaught one is printed as one",
        "line (`cluster: ConfigError: ...`) and the process exits 1. On the wire the scheduler",
        "ends a refused call with the status code below and the class's name in the trailing",
        "metadata `cluster-error` (`cluster.transport.failures`); a `CollectiveMismatchError`",
        "and a `PeerFinishedError` go as `CollectiveError` with their reason in",
        "`cluster-exchange-refusal-bin`.",
        "",
        "| error | what it means | gRPC status |",
        "|---|---|---|",
    ]
    for depth, cls in _tree(errors.ClusterError, 0):
        name = "&nbsp;&nbsp;" * 2 * depth + f"`{cls.__name__}`"
        where = "" if cls.__module__ == errors.__name__ else f" (`{cls.__module__}`)"
        lines.append(f"| {name}{where} | {cell(inspect.getdoc(cls) or '')} | {_status(cls)} |")
    return "\n".join(lines) + "\n"


# --- the metrics -----------------------------------------------------------------------------


def _sample_gauges() -> Any:
    from cluster.scheduler.job_gauges import JobGauges, NodeGauge  # noqa: PLC0415

    node = NodeGauge("0", "0", alive=True, heartbeat_age_s=0.0, checkpoint_step=-1)
    return JobGauges(
        "job", "running", 1, 0, 1, 0, 30.0, 5.0, {}, (0.0,), (node,), 0, 0, 1, 1, 0, 0, 0
    )


def _families() -> Iterator[tuple[str, Any]]:
    from cluster.api.worker_metrics import WorkerMetrics  # noqa: PLC0415
    from cluster.scheduler import metrics  # noqa: PLC0415

    scheduler = metrics.SchedulerMetrics()
    for family in scheduler.registry.collect():
        if family.name.startswith("cluster_"):
            yield "scheduler", family
    reading = metrics.Reading(True, _sample_gauges(), registration_refusals={}, edge_refusals={})
    for family in metrics.SchedulerCollector(lambda: reading).collect():
        yield "scheduler (leadership, refusals and job gauges, computed at each scrape)", family
    for family in WorkerMetrics(0, "0").registry.collect():
        yield "worker (`CLUSTER_WORKER_METRICS_PORT`)", family


def metrics_page() -> str:
    lines = [
        "# Metrics",
        "",
        GENERATED,
        "Every metric as its prometheus_client definition has it: the scheduler's",
        "(`CLUSTER_METRICS_PORT`, `cluster.scheduler.metrics`, `rpc_metrics`, `job_gauges`) and",
        "a worker's (`cluster.api.worker_metrics`). Counters get `_total` in the exposition;",
        "the scheduler also serves prometheus_client's `process_*` metrics. Series per node",
        "(`cluster_member_*`) exist only in jobs of at most 64 nodes.",
        "",
    ]
    section = ""
    for where, family in _families():
        if where != section:
            section = where
            lines += [
                "",
                f"## The {where}",
                "",
                "| metric | type | labels | what |",
                "|---|---|---|---|",
            ]
        labels = sorted({k for s in family.samples for k in s.labels if k not in ("le",)})
        shown = ", ".join(f"`{label}`" for label in labels)
        lines.append(
            f"| `{family.name}` | {family.type} | {shown} | {cell(family.documentation)} |"
        )
    return "\n".join(lines) + "\n"


# --- the protocol ----------------------------------------------------------------------------

_RPC = re.compile(r"^\s*rpc (\w+)\((stream )?(\w+)\) returns \((stream )?(\w+)\)")
_FIELD = re.compile(r"^\s*(?:repeated |optional )?([\w.]+) (\w+) = (\d+);\s*(?://\s*(.*))?$")
_BLOCK = re.compile(r"^\s*(service|message|enum|oneof) (\w+) \{")


def _proto_rows(lines: list[str]) -> Iterator[str]:
    comment: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith("//"):
            comment.append(text.lstrip("/ ").strip())
            continue
        block, rpc, field = _BLOCK.match(line), _RPC.match(line), _FIELD.match(line)
        said = " ".join(comment)
        comment = []
        if block and block.group(1) != "oneof":
            yield f"\n### {block.group(1)} `{block.group(2)}`\n\n{said}\n"
        elif block:
            yield f"| *oneof* `{block.group(2)}` | | | {cell(said)} |"
        elif rpc:
            request = ("stream " if rpc.group(2) else "") + rpc.group(3)
            response = ("stream " if rpc.group(4) else "") + rpc.group(5)
            yield f"- `{rpc.group(1)}({request}) returns ({response})`: {said}"
        elif field:
            kind, name, number, trailing = field.groups()
            what = " ".join(filter(None, [said, trailing or ""]))
            yield f"| `{name}` | `{kind}` | {number} | {cell(what)} |"
        elif re.match(r"^\s*(\w+) = (\d+);", line):
            value = re.match(r"^\s*(\w+) = (\d+);\s*(?://\s*(.*))?", line)
            assert value is not None
            yield f"| `{value.group(1)}` | | {value.group(2)} | {cell(value.group(3) or said)} |"


def _with_headers(rows: Iterator[str]) -> Iterator[str]:
    """A table header before the first row of each message or enum."""
    in_table = False
    for row in rows:
        if row.startswith("|") and not in_table:
            yield "| field | type | number | what |\n|---|---|---|---|"
        in_table = row.startswith("|")
        yield row


def protocol_page() -> str:
    lines = [
        "# Protocol",
        "",
        GENERATED,
        "The wire contract, `protos/cluster/v1/*.proto`, with its comments. The Python code",
        "under `cluster/v1/` is generated from it by `python scripts/gen_protos.py`, and a test",
        "fails when the checked-in code is not what that command makes.",
    ]
    for proto in sorted(PROTOS.glob("*.proto")):
        source = proto.read_text().splitlines()
        header = [s.lstrip("/ ") for s in source[: _first_code(source)] if s.startswith("//")]
        lines += ["", f"## `{proto.name}`", "", " ".join(h for h in header if h) or ""]
        lines += list(_with_headers(_proto_rows(source[_first_code(source) :])))
    return "\n".join(lines) + "\n"


def _first_code(source: list[str]) -> int:
    return next(i for i, line in enumerate(source) if line.startswith("syntax"))


# --- the environment -------------------------------------------------------------------------


def variables_in_code() -> dict[str, set[str]]:
    """Each MS_* / CLUSTER_* name that the code spells as a string, and the modules that do."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "v1" in path.relative_to(PACKAGE).parts:
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and VARIABLE.match(text):
                found.setdefault(text, set()).add(module.removesuffix(".__init__"))
    return found


def variables_in_table(page: str) -> set[str]:
    """The names in the first column of the page's environment table."""
    names: set[str] = set()
    for row in page.splitlines():
        if row.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1]))
    return names


def environment_check(page: str) -> list[str]:
    """What disagrees between the page's table and the code (empty: nothing)."""
    code, table = variables_in_code(), variables_in_table(page)
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", page))  # a role's value is named in a row
    problems = [
        f"{name} is in the code ({', '.join(sorted(code[name]))}) but not on the page"
        for name in sorted(set(code) - named)
    ]
    problems += [
        f"{name} is in the table but the code never reads it"
        for name in sorted(table - set(code))
        if VARIABLE.match(name)
    ]
    return problems


def environment_where() -> str:
    rows = ["| variable | read in |", "|---|---|"]
    for name, modules in sorted(variables_in_code().items()):
        rows.append(f"| `{name}` | {', '.join(f'`{m}`' for m in sorted(modules))} |")
    return "\n".join(rows) + "\n"


def environment_defaults() -> str:
    """The settings `cluster.protocol.environment.from_env` makes from the least a job needs."""
    from cluster.protocol import environment  # noqa: PLC0415

    least = {"MS_ROLE": "MS_SCHED", "MS_WORKER_NUM": "8"}
    least |= {"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118"}
    made = environment.from_env(least)
    rows = ["| setting | value |", "|---|---|"]
    for name, value in _flat(made):
        rows.append(f"| `{name}` | `{value!r}` |")
    return "\n".join(rows) + "\n"


def _flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for item in dataclasses.fields(value):
        inner = getattr(value, item.name)
        if dataclasses.is_dataclass(inner) and not isinstance(inner, type):
            yield from _flat(inner, f"{prefix}{item.name}.")
        elif item.repr:
            yield f"{prefix}{item.name}", getattr(inner, "value", inner)
