"""The scheduler: a grpc.aio server around the state machine of `cluster.state`."""

from cluster.scheduler.core import CoreSettings, SchedulerCore
from cluster.scheduler.server import SchedulerServer, run, serve, settings_from_config

__all__ = [
    "CoreSettings",
    "SchedulerCore",
    "SchedulerServer",
    "run",
    "serve",
    "settings_from_config",
]
