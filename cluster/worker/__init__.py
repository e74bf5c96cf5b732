"""The worker's side of the protocol: a pure core and its I/O shell.

Here: the pure machine (`machine.core` decides: what happened in, what to do out, with an
injected clock; `machine.steps` holds those events and actions); the shell that carries its
actions out: the
asynchronous agent (`agent`: the channel, registration, the watch stream, heartbeats, calls),
its timers (`timers`), protobuf turned into the core's events (`convert`), the synchronous
session on a background loop (`session`), how the process ends when the job is over for it
(`ending`: the error raised in the main thread, os._exit only as the last resort), the node's
identity (with its credential) and saved node file
(`node_file`), the watch on the launcher (`orphan`), and state from peers: the worker's state
server (`state_server`) and the fetcher (`state_fetch`).

May import: `cluster.protocol`, `cluster.transport`, `cluster.storage`, `cluster.v1`, grpc and
asyncio; `machine` only `cluster.protocol` (no grpc, asyncio, wire format or transport:
an import-linter contract). Never the scheduler, the training API or the tools.
"""
