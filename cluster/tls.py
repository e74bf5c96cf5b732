"""`cluster.tls`: the public path of `cluster.transport.tls`, where it lives (see there)."""

from cluster.transport.tls import *  # noqa: F403
