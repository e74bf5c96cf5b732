"""The scheduler's pure machine: every decision of the control plane, no I/O.

`state` (`SchedulerState`: who is in the job, with which rank, what happens next) owns its parts:
`admission` (who may join, which call is admitted), `registrar` (what a registration does to the
job), `liveness` (silence and the guard), `spares` (the spare pool), `rollback` (the step every
worker holds) and `ranks` (placement). Its output goes through `ready` (`Outbox`: raft's
Ready/Advance, what is saved before what is told). The collectives' rounds (`rounds`) and the
key-value store (`kv`) are pure tables beside it, and `events` words what happened for the
journal.

No clock (it is injected), no asyncio, threads, sockets, processes, grpc or wire format: the
import-linter contracts in pyproject.toml say so. `cluster.scheduler` around it does the I/O.
"""
