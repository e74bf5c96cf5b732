"""Rank 1 ends after init() as argv[1] says, without cluster.finalize(); rank 0 waits in a
barrier, which the failure of rank 1 ends (recovery on: it prints the PeerFailedError).

sys_exit: sys.exit(1). message: sys.exit("loss is NaN"). builtin_exit: exit(3) (site's).
argparse: a command line argparse refuses (status 2). hook: the program replaced
sys.excepthook (as rich.traceback.install() does) and dies of an uncaught RuntimeError.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from types import TracebackType

import cluster


def own_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    traceback.print_exception(kind, value, tb)


cluster.init()
if cluster.get_rank() == 1:
    mode = sys.argv[1]
    if mode == "sys_exit":
        sys.exit(1)
    if mode == "message":
        sys.exit("loss is NaN")
    if mode == "builtin_exit":
        exit(3)  # noqa: PLR1722 - site's exit(), which scripts call too
    if mode == "argparse":
        argparse.ArgumentParser(prog="train").parse_args(["--no-such-flag"])
    if mode == "hook":
        sys.excepthook = own_hook
        raise RuntimeError("CUDA out of memory")
    raise SystemExit(f"unknown mode {mode!r}")
try:
    cluster.barrier()
except cluster.PeerFailedError as error:  # recovery on: the job goes on without rank 1
    print(f"barrier: {error}", flush=True)
