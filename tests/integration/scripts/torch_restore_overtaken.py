"""examples/train_torch.py, with rank 0's set_state in generation 2 held until the job has moved
on to generation 3 (as a slow load or a slow DDP wrap would be while the peer it restores with
fails): the process group it then makes belongs to a generation that is over.

    mscluster run --spares 2 ... torch_restore_overtaken.py [train_torch.py's arguments]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import cluster

sys.path.insert(0, str(Path(cluster.__file__).resolve().parent.parent / "examples"))
import train_torch  # from the examples, found through the path above

HOLD_S = 90.0
restore = train_torch.Trainer.set_state


def held_set_state(self: train_torch.Trainer, saved: dict[str, Any]) -> None:
    if cluster.get_generation() == 2 and cluster.get_rank() == 0:
        print("set_state held in generation 2", flush=True)
        deadline = time.monotonic() + HOLD_S
        while cluster.get_generation() == 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # sleep-ok: the fault itself, until the job has moved on (bounded)
        print(f"set_state goes on; the job is at generation {cluster.get_generation()}", flush=True)
    restore(self, saved)


train_torch.Trainer.set_state = held_set_state  # type: ignore[method-assign]

if __name__ == "__main__":
    train_torch.main()
