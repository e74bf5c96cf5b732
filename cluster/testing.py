"""`cluster.testing`: the public path of `cluster.tools.testing`, where it lives (see there)."""

from cluster.tools.testing import *  # noqa: F403
