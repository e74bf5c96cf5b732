"""`cluster.certs`: the public path of `cluster.transport.certs`, where it lives (see there)."""

from cluster.transport.certs import *  # noqa: F403
