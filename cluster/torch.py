"""`cluster.torch`: the public path of `cluster.api.torch`, where it lives (see there)."""

from cluster.api.torch import *  # noqa: F403
