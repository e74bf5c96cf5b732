"""Transport and security: how a process reaches the scheduler, and who it trusts.

Here: the gRPC channel with its reconnect policy and the scheduler check (`channel`), lazily
made stub methods (`stub`), the one table from a gRPC status to a `ClusterError` and back
(`failures`), gRPC's own log lines (`grpc_log`), how a server's own process keeps its memory
(`allocator`, `collector`), TLS from PKCS#12, CA, CRL and a cipher list
(`tls`), a mutual-TLS server's credentials and per-call certificate check (`server_tls`), the
certificates for tests and first trials (`certs`), a node's credential as call metadata
(`membership`), and the bounded HTTP server of a /metrics port (`bounded_http`).

May import: `cluster.protocol`, `cluster.v1`, grpc and cryptography. Never the scheduler, the
worker or anything above them.
"""
