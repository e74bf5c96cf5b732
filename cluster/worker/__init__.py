"""The worker's side of the protocol.

Here: the asynchronous agent (`agent`: register, watch, heartbeat, calls), its synchronous
session on a background loop (`session`), the node's identity (with its credential), its
signed registration (`registration`) and saved node file, and the watch on the launcher
(`orphan`).

May import: `cluster.protocol`, `cluster.transport`, `cluster.storage`, `cluster.v1`, grpc and
asyncio. Never the scheduler, the training API or the tools.
"""
