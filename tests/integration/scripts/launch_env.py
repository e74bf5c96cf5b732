"""A worker that prints, once in the job, its rank and the variables named on its command line
as the launcher gave them (JSON: `{"rank": r, "env": {name: value or null}}`); then finishes."""

from __future__ import annotations

import json
import os
import sys

import cluster

cluster.init()
seen = {name: os.environ.get(name) for name in sys.argv[1:]}
print("launch_env " + json.dumps({"rank": cluster.get_rank(), "env": seen}), flush=True)
cluster.finalize()
