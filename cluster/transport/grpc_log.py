"""gRPC's own log lines: errors only, unless the user asks for more.

gRPC's core logs through absl, and since gRPC replaced its own logger with absl's, a process
that does not set GRPC_VERBOSITY gets absl's default: every INFO line on stderr. In a job that is
a line per refused TLS handshake (`ssl_transport_security.cc ... Handshake failed`: a port
scanner, a status probe in plaintext, a worker of another CA), in the scheduler's log, for
events that are not errors of this job. gRPC's old default was ERROR; `quiet_by_default` restores
it when the user has not chosen, before anything imports grpc (`import cluster` calls it; grpc
reads the variable once). Errors still show (e.g. `File descriptor limit reached`), and
`GRPC_VERBOSITY=INFO` brings everything back. It imports nothing of grpc.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

VERBOSITY_ENV = "GRPC_VERBOSITY"
DEFAULT_VERBOSITY = "ERROR"


def quiet_by_default(env: MutableMapping[str, str] = os.environ) -> None:
    """Set GRPC_VERBOSITY to ERROR unless it is set (also for the processes started from here)."""
    if not env.get(VERBOSITY_ENV, "").strip():
        env[VERBOSITY_ENV] = DEFAULT_VERBOSITY
