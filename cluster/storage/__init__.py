"""Storage: bytes that must survive a crash.

Here: the recovery state files under MS_RECOVERY_PATH (`store`: atomic, versioned,
checksummed, with the directory lock).

May import: `cluster.protocol` and the standard library. Never grpc, the scheduler, the worker or
anything above them.
"""
