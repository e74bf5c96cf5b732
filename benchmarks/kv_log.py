"""Key-value log benchmark: how large MS_RECOVERY_PATH/kv.log grows, and how long a scheduler
takes to start again on a full store.

Part 1, rewrites (in this process, `cluster.storage.kv_log.KvLog`): one key of
`--value-bytes` rewritten `--rewrites` times, one append (write + fsync) each, as a member
setting one key again and again does. Measured: the largest file seen, the file at the end,
what the log holds (`live`, its compacted size), and the time per rewrite. Before the fix the
file grew by one record per rewrite (issue 25: 1.84 GB in 40 s for one 4 MiB key); the bound is
max(COMPACT_MIN_BYTES, 2 x live).

Part 2, restart on a full store (real processes): a job of one worker
(examples/allgather_check.py --hold) with recovery on forms; the scheduler is SIGKILLed and
started again, first on an empty store, then after `--store-mb` MB of live keys (64 KiB
values) were written to its kv.log, and `--rewrite-mb` more MB of rewrites of one 4 MiB key.
Measured: from the spawn of the new scheduler to every worker back (Status), and the size of
kv.log. The difference between the two restarts is what loading the store costs. Target: well
under 1 s per 100 MB of live keys.

Usage: python benchmarks/kv_log.py [--rewrites 20000] [--value-bytes 1024] [--store-mb 100]
       [--rewrite-mb 400] [--json PATH]
Run it with PYTHONPATH pointing at the tree to measure (another checkout gives the "before").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.storage.kv_log import FILE_NAME, KvLog
from cluster.tools.testing import LocalJob

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "allgather_check.py"
MIB = 1024 * 1024
STORE_VALUE_BYTES = 64 * 1024
BIG_VALUE_BYTES = 4 * MIB
BATCH_KEYS = 64


def bench_rewrites(rewrites: int, value_bytes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cluster-kv-bench-") as tmp:
        directory = Path(tmp)
        log = KvLog(directory)
        log.load("job")
        largest = 0
        started = time.perf_counter()
        for i in range(rewrites):
            log.append("job", {"key": i.to_bytes(8, "big") + bytes(value_bytes - 8)})
            largest = max(largest, (directory / FILE_NAME).stat().st_size)
        elapsed = time.perf_counter() - started
        final = (directory / FILE_NAME).stat().st_size
        values = KvLog(directory).load("job")
        live = sum(len(k) + len(v) for k, v in values.items())
    return {
        "rewrites": rewrites,
        "value_bytes": value_bytes,
        "appended_bytes": rewrites * value_bytes,
        "largest_file_bytes": largest,
        "final_file_bytes": final,
        "live_payload_bytes": live,
        "us_per_rewrite": elapsed / rewrites * 1e6,
    }


def fill(directory: Path, store_mb: int, rewrite_mb: int) -> None:
    """`store_mb` MB of distinct keys, then `rewrite_mb` MB of rewrites of one 4 MiB key."""
    path = directory / FILE_NAME
    job = path.read_bytes().split(b"\n", 1)[0].split(b" ", 2)[2].decode()
    log = KvLog(directory)
    log.load(job)
    keys = store_mb * MIB // STORE_VALUE_BYTES
    for first in range(0, keys, BATCH_KEYS):
        batch = range(first, min(first + BATCH_KEYS, keys))
        log.append(job, {f"key-{k}": bytes(STORE_VALUE_BYTES) for k in batch})
    for i in range(rewrite_mb * MIB // BIG_VALUE_BYTES):
        log.append(job, {"big": i.to_bytes(8, "big") + bytes(BIG_VALUE_BYTES - 8)})


def restart(job: LocalJob) -> float:
    scheduler = job.scheduler
    assert scheduler is not None
    job.kill_scheduler()
    return job.restart_scheduler()


def bench_restart(store_mb: int, rewrite_mb: int) -> dict[str, Any]:
    with LocalJob(EXAMPLE, ["--hold", "600"], workers=1, timeout_s=120) as job:
        job.wait_formed()
        directory = job.workdir / "state"
        empty_s = restart(job)
        job.kill_scheduler()
        fill(directory, store_mb, rewrite_mb)
        size = (directory / FILE_NAME).stat().st_size
        job.restart_scheduler(wait=False)
        started = time.monotonic()
        job.wait_formed()
        full_s = time.monotonic() - started
    return {
        "store_mb": store_mb,
        "rewrite_mb": rewrite_mb,
        "kv_log_bytes": size,
        "restart_empty_s": empty_s,
        "restart_full_s": full_s,
        "store_cost_s": full_s - empty_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rewrites", type=int, default=20000)
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--store-mb", type=int, default=100)
    parser.add_argument("--rewrite-mb", type=int, default=400)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    import cluster  # noqa: PLC0415 - only to say which tree was measured

    results = {
        "tree": str(Path(cluster.__file__).parent.parent),
        "rewrites": bench_rewrites(args.rewrites, args.value_bytes),
        "restart": bench_restart(args.store_mb, args.rewrite_mb),
    }
    json.dump(results, sys.stdout, indent=1)
    print()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
