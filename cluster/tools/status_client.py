"""Status calls from synchronous code (tests, benchmarks, `mscluster chaos`): `StatusClient`,
re-exported by `cluster.testing`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from cluster.protocol.errors import ClusterError, NotLeaderAnswer
from cluster.protocol.leader_search import LeaderSearch


class StatusClient:
    """Status calls from synchronous code: grpc.aio channels to every scheduler address on a
    background loop, each reconnecting every `reconnect_ms` while its scheduler is down. The
    leader answers: the address that answered last is asked first, then the leader a standby
    names (one of `addresses`), then the others in turn (`cluster.protocol.leader_search`)."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        reconnect_ms: int = 50,
        secret: bytes | None = None,
        identity: Any = None,
    ) -> None:
        """`secret`: the job secret (a job with one answers Status to its holders only);
        `identity`: this client's TLS identity (`tls.Identity`) for a job with TLS."""
        from cluster.worker.session import BackgroundLoop  # noqa: PLC0415 - grpc on demand

        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.address = self.addresses[0]  # the one that answered last
        self._loop = BackgroundLoop("cluster-testing-status")
        self._reconnect_ms = reconnect_ms
        self._channels: dict[str, Any] = {}
        self._secret = secret
        self._identity = identity

    def _channel(self, address: str) -> Any:
        from cluster.transport import channel  # noqa: PLC0415 - grpc only for those who ask

        if address not in self._channels:
            # Reconnect often while the scheduler is down, so that the status after a restart
            # is seen at once (grpc's default backoff reaches seconds).
            options = channel.reconnect_options(self._reconnect_ms, self._reconnect_ms)

            async def make() -> Any:
                return channel.open_channel(address, self._identity, options)

            self._channels[address] = self._loop.run(make())
        return self._channels[address]

    def fetch(self) -> Any:
        """The leader's view (`cluster.status.JobView`), or None when none answers."""
        from cluster.tools import status  # noqa: PLC0415

        search = LeaderSearch(self.addresses, self.address, listed_only=True)
        while (address := search.next_address()) is not None:
            try:
                view = self._loop.run(
                    status.fetch(self._channel(address), address, 1.0, self._secret)
                )
            except NotLeaderAnswer as exc:
                search.standby(exc.leader)
                continue
            except ClusterError:
                continue
            self.address = address
            return view
        return None

    def close(self) -> None:
        for opened in self._channels.values():
            with contextlib.suppress(Exception):
                self._loop.run(opened.close(), timeout_s=5.0)
        self._channels.clear()
        self._loop.stop()
