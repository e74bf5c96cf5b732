"""The protocol core: what a job is and how it changes, with no I/O.

Here: the error tree (`errors`), the launch environment turned into frozen settings (`config`,
with its two checks of outside text in `parse`: a decimal number, host:port) and the job's
parameters as the scheduler uses them (`settings`), the scheduler's state machine (`state`, an
injected clock, effects returned, never sent; its records in `records`, who may make a call in
`admission`), node credentials and job-secret proofs (`auth`), who serves state to peers and
how a request proves membership (`peer_state`), the job's history as events (`events`), what a
worker knows of the job (`topology`), text from outside made safe to show to a person
(`display`), and for standby schedulers the state URL (`state_url`) and whether this
scheduler leads (`leadership`, an injected clock).

May import: the standard library and itself. Never grpc, asyncio or the generated protobuf
code (import-linter contracts in pyproject.toml enforce it): everything here is tested without a
network.
"""
