"""Each process imports only what its role and its options use (issue 26, "Cheap to start").

Starting is most of a small job's life, and a module nobody uses costs every process of every
restart its import. These tests look at what a fresh interpreter holds in `sys.modules` after
importing what a role needs, options off; the time it takes is `benchmarks/startup.py`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cluster

ROOT = Path(cluster.__file__).resolve().parent.parent

# What a worker imports for `cluster.init()`: the package, the names the tutorial's script
# touches, and the session that init() imports before it connects (benchmarks/startup.py).
WORKER = """
import cluster
cluster.init, cluster.get_rank, cluster.get_group_size, cluster.is_rejoin
cluster.allgather_object, cluster.finalize
import cluster.worker.session
"""
# What `python -m cluster scheduler` (the launcher's scheduler) imports before it serves, and
# what a script's `cluster.init()` imports in the scheduler's role (the tutorial's).
SCHEDULER = "import cluster.tools.cli, cluster.scheduler.server"
SCRIPT_SCHEDULER = "import cluster\ncluster.init\nimport cluster.scheduler.server"
# Options off: none of these may be imported.
OPTIONAL = ("cryptography", "prometheus_client", "rich", "aetcd", "etcd3", "numpy", "torch")
# Nor these, which no role uses without its options (recovery files, an event log, a mistyped
# option, --version): gRPC imports none of them, and each costs every process 1-10 ms.
UNUSED = (
    "json",  # an event log, its followers, allreduce's header, recovery files
    "tempfile",  # recovery files
    "shutil",
    "secrets",
    "random",
    "uuid",  # and platform: 3.6 ms for a job id
    "platform",
    "ctypes.util",  # find_library ran ldconfig
    "xxhash",  # the recovery directory's key-value log
    "difflib",
    "importlib.metadata",  # --version: email, zipfile, csv
)
# Parts of the package that only an option uses.
OPTION_MODULES = (
    "cluster.transport.tls",  # TLS
    "cluster.transport.server_tls",
    "cluster.scheduler.ha",  # standby schedulers (etcd)
    "cluster.scheduler.etcd_election",
    "cluster.scheduler.etcd_client",
    "cluster.storage.directory_store",  # recovery
    "cluster.storage.recovery_dir",
    "cluster.worker.node_file",
    "cluster.scheduler.event_file",  # an event log
    "cluster.transport.table_file",  # a large table behind a relay (and mmap, array)
    "mmap",
)


def modules_after(code: str) -> set[str]:
    """What `code` leaves in sys.modules (this test's own json imported after looking)."""
    look = "import sys\nnames = sorted(sys.modules)\nimport json\nprint(json.dumps(names))"
    return set(_run(f"{code}\n{look}"))


def _run(code: str, environ: dict[str, str] | None = None) -> list[str]:
    """The JSON list the last line of `code`'s output holds, run in a fresh interpreter."""
    base = os.environ if environ is None else environ
    env = {k: v for k, v in base.items() if not k.startswith(("MS_", "CLUSTER_"))}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,  # `-c` puts the working directory first on sys.path
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return list(json.loads(out.splitlines()[-1]))


def packages(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in names)


def unused(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m in UNUSED or m in OPTION_MODULES)


@pytest.mark.slow  # starts a Python process
def test_a_worker_without_options_imports_no_optional_package() -> None:
    loaded = modules_after(WORKER)
    assert "grpc" in loaded  # the worker is all there
    assert "cluster.worker.agent" in loaded
    assert packages(loaded, OPTIONAL) == []
    assert unused(loaded) == []


@pytest.mark.slow  # starts a Python process
def test_waiting_for_the_schedulers_port_looks_its_host_up_without_the_idna_codec() -> None:
    """Every direct worker waits for the scheduler's port at start: its host, given as a str,
    would import encodings.idna (about 1 ms) on the way to getaddrinfo."""
    wait = (
        "import asyncio, socket\n"
        "from cluster.transport.channel import await_listening\n"
        "held = socket.socket()\n"
        "held.bind(('127.0.0.1', 0))\n"
        "for host in ('127.0.0.1', 'localhost'):\n"
        "    asyncio.run(await_listening(host, held.getsockname()[1], 0.05, 0.01))\n"
    )
    assert "encodings.idna" not in modules_after(wait)


@pytest.mark.slow  # starts a Python process
def test_a_worker_imports_neither_hmac_without_a_job_secret_nor_the_generated_grpc_module() -> None:
    """hmac only makes and checks job-secret proofs; the stub reads its methods from the
    service's descriptor (the generated module is the servicer's): a millisecond and a half of
    every worker's start between them."""
    loaded = modules_after(WORKER)
    assert sorted(loaded & {"hmac", "cluster.v1.scheduler_pb2_grpc", "grpc._utilities"}) == []


@pytest.mark.slow  # starts a Python process
def test_a_worker_without_a_job_secret_hashes_nothing_at_its_start() -> None:
    """hashlib builds a constructor for each of OpenSSL's algorithms when imported (1-4 ms):
    only a job secret's proof and a compressed peer table need a digest. Nor does a worker
    import unicodedata (only text that is not all printable is escaped with it) or bisect (a
    lookup its rank's row does not answer)."""
    loaded = modules_after(WORKER)
    assert sorted(loaded & {"hashlib", "_hashlib", "unicodedata", "bisect"}) == []


@pytest.mark.slow  # starts a Python process
def test_a_worker_builds_its_many_records_with_shared_methods() -> None:
    """Import-time work stays out of module bodies: a dataclass compiles its methods from
    source at import (about 0.5 ms a class), so the worker's many records (its core's events
    and actions, the wire records, topology, settings, config) are `@frozen` or `@mutable`
    (shared methods): none of its classes is a dataclass of dataclasses' making."""
    code = WORKER + (
        "import dataclasses, json, sys\n"
        "compiled = sorted(f'{n}.{k}' for n, m in list(sys.modules.items())"
        " if n.startswith('cluster') for k, v in vars(m).items()"
        " if isinstance(v, type) and v.__module__ == n and dataclasses.is_dataclass(v)"
        " and '__value_specs__' not in vars(v))\n"
        "print(json.dumps(compiled))\n"
    )
    assert _run(code) == []


@pytest.mark.slow  # starts a Python process
def test_a_worker_imports_no_checkpoint_or_tool_code() -> None:
    loaded = modules_after(WORKER)
    unwanted = [
        m
        for m in loaded
        if m.startswith(("cluster.tools", "cluster.scheduler", "cluster.api.checkpoint"))
        or m == "cluster.protocol.settings"  # the scheduler's JobSettings
    ]
    assert sorted(unwanted) == []


@pytest.mark.slow  # starts Python processes
@pytest.mark.parametrize("code", [SCHEDULER, SCRIPT_SCHEDULER], ids=["cli", "script"])
def test_the_scheduler_imports_neither_the_training_api_nor_optional_packages(code: str) -> None:
    loaded = modules_after(code)
    assert "cluster.scheduler.core" in loaded
    training = [m for m in ("cluster.api.collective", "cluster.api.training") if m in loaded]
    assert training == []
    assert packages(loaded, OPTIONAL) == []
    assert unused(loaded) == []


@pytest.mark.slow  # starts a Python process
def test_import_cluster_alone_imports_no_grpc() -> None:
    # grpc reads its TLS cipher list when first imported: set_ps_context() must come first.
    loaded = modules_after("import cluster")
    assert packages(loaded, ("grpc", "cryptography")) == []
    # protobuf's packages are found, not run, to defer its pure-Python messages.
    assert packages(loaded, ("google",)) == [
        "google",
        "google.protobuf",
        "google.protobuf.internal",
        "google.protobuf.internal.python_message",
    ]


PURE_PYTHON_STATE = (
    "import json, sys\n"
    "module = sys.modules['google.protobuf.internal.python_message']\n"
    "print(json.dumps([type(module).__name__, 'google.protobuf.text_format' in sys.modules]))\n"
)


@pytest.mark.slow  # starts a Python process
def test_a_worker_never_runs_protobufs_pure_python_messages() -> None:
    """With upb (the default backend) the module protobuf imports for the pure-Python backend is
    registered and never executed, and text_format with it stays out, yet messages work."""
    code = WORKER + (
        "from cluster.v1 import scheduler_pb2 as pb\n"
        "request = pb.WatchRequest(table_by_digest=True)\n"
        "assert pb.WatchRequest.FromString(request.SerializeToString()) == request\n"
    )
    assert _run(code + PURE_PYTHON_STATE) == ["_LazyModule", False]


@pytest.mark.slow  # starts a Python process
def test_the_pure_python_backend_still_loads_what_it_uses() -> None:
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    code = (
        "import cluster\n"
        "from cluster.v1 import scheduler_pb2 as pb\n"
        "from google.protobuf.internal import api_implementation\n"
        "assert api_implementation.Type() == 'python'\n"
        "request = pb.WatchRequest(table_by_digest=True)\n"
        "assert pb.WatchRequest.FromString(request.SerializeToString()) == request\n"
        "assert str(request) == 'table_by_digest: true\\n'\n"
    )
    assert _run(code + PURE_PYTHON_STATE, env) == ["module", True]


@pytest.mark.parametrize("name", cluster.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(cluster, name) is not None
    assert name in dir(cluster)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        cluster.no_such_name
