"""The worker's pure machine: events in, actions out (`core`, with `steps`: what it is told and
what it answers), with an injected clock; no asyncio, grpc, wire format or transport (the
import-linter contracts say so). `cluster.worker.agent` carries its actions out.
"""
