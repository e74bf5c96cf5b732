"""examples/train_torch.py, where rank 1 (its first process) lingers after its loop, before
cluster.finalize(), until it is killed (as writing outputs would keep it): a worker killed after
the final barrier, once rank 0 has finished the job.

    mscluster run --enable-recovery ... torch_late_death.py [train_torch.py's arguments]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import cluster

sys.path.insert(0, str(Path(cluster.__file__).resolve().parent.parent / "examples"))
import train_torch  # from the examples, found through the path above

LINGER_S = 120.0
finalize = cluster.finalize


def lingering_finalize() -> None:
    if cluster.get_rank() == 1 and not cluster.is_rejoin():
        print("rank 1 lingers after its loop", flush=True)
        time.sleep(LINGER_S)  # sleep-ok: the fault itself; the test kills this process
    finalize()


cluster.finalize = lingering_finalize

if __name__ == "__main__":
    train_torch.main()
