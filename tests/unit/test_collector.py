"""A server's own process (the scheduler's, a relay's) freezes what it imported once it is up,
and garbage made later is still collected as before. Run in a fresh process: the collector's
settings are the whole process's."""

from __future__ import annotations

import json
import subprocess
import sys

SERVER = """
import gc, json, weakref
from cluster.transport import collector

class Node:
    pass

before = gc.get_threshold()
collector.tune_for_server()
frozen = gc.get_freeze_count()
# A cycle of garbage made after the server is up, then allocations: no explicit collect.
node = Node()
node.self = node
gone = weakref.ref(node)
del node
kept = [[] for _ in range(10 * before[0])]
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": frozen,
                  "cycle_collected": gone() is None}))
"""


def test_a_server_freezes_what_it_imported_and_still_collects_later_garbage() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SERVER], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(run.stdout)
    assert seen["frozen"] > 1_000  # what the interpreter and the imports made
    assert seen["after"] == seen["before"]  # Python's thresholds: see the module
    assert seen["cycle_collected"]
