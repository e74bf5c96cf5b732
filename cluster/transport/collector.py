"""The garbage collector of a process that serves and is ours alone: the scheduler's, a relay's.

Python's cyclic collector now and then runs a full collection that walks every object the
process holds, and a server's heap is mostly what it imported: grpc, protobuf and asyncio make
tens of thousands of objects that live as long as the process. Once the server is up,
`tune_for_server` freezes what is alive (`gc.freeze`): no collection walks it again, and it is
never freed before the process ends, which it would not have been anyway. Measured with 16,384
workers forming behind 16 relays (`benchmarks/rendezvous.py --sizes 16384 --relays 16`, one run
each): the scheduler's loop spent 1.65 s of CPU in the collector, 1.40 s frozen.

The collector's thresholds stay Python's. A young collection every 20,000 allocations instead
of 700 cut the scheduler's collector time to 0.37 s, but young collections are also what frees
the refused messages that cycles of garbage hold: under a flood of 4 MiB key-value sets the
scheduler then peaked at 2.5 GiB (`tests/integration/test_hostile.py`).

A worker's process is the training script's: its collector is left alone (the script's own
cycles may be made before `init()` and die long after).
"""

from __future__ import annotations

import gc


def tune_for_server() -> None:
    """Freeze what is alive (see the module). Call it in a process that is the server's alone,
    once the server is up."""
    gc.freeze()
