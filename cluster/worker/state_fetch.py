"""Fetching a checkpoint from live peers' state servers (`cluster.worker.state_server`).

`fetch(loop, holders, wanted, path)` asks each holder in turn for the checkpoint `wanted`, and
stores the first one that arrives whole as `path`, the way every checkpoint is written
(`cluster.storage.atomic`: a temporary file, fsync, rename, fsync of the directory), after the
ordinary reader has verified it (its XXH3 checksum and step) in the temporary file. With
`store=False` the state is only read: the temporary is removed instead of renamed, and nothing
is left at `path` (a process killed meanwhile leaves a temporary of `path`, which the rank's
next checkpoint write removes, as it does one of a killed save). A transfer
that breaks (the peer killed, the stream cut, a peer silent for `PIECE_WAIT_S`), that brings
more or fewer bytes than announced, or whose bytes do not verify, leaves no file behind, and
the next holder is asked. The bytes are stored as they were sent: a replica's file fetched from
rank 3 keeps rank 3 in its head, which the reader then does not check (it checks the step and the
checksum, and the checksum covers the head); a file asked for without `any_rank` must be of the
rank asked for, or it is refused as one that does not verify.

The transfer runs on the state server's event loop (a `BackgroundLoop`); the caller's thread
writes nothing until it has the bytes' verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from cluster.protocol import auth, peer_state
from cluster.protocol.errors import CheckpointError, NoPeerStateError, PeerStateError
from cluster.storage import atomic, checkpoint_files
from cluster.storage.served import PIECE_BYTES
from cluster.transport import channel, tls
from cluster.v1 import peer_state_pb2 as pb
from cluster.v1 import peer_state_pb2_grpc as pb_grpc
from cluster.worker.session import BackgroundLoop

# A peer that sends nothing for this long (a hung process, a silent network) is given up on.
PIECE_WAIT_S = 10.0
# Written bytes are handed to the disk (fdatasync on a helper thread) every this many.
SYNC_EVERY_BYTES = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", PIECE_BYTES + 4096),
    ("grpc.max_send_message_length", 4096),
    ("grpc.use_local_subchannel_pool", 1),
]


@dataclass(frozen=True)
class Holder:
    """A live peer that may hold the checkpoint, and where its state server is."""

    rank: int
    node_id: str
    published: peer_state.Published

    def __str__(self) -> str:
        return f"rank {self.rank} (node {self.node_id!r} at {self.published.address})"


@dataclass(frozen=True)
class Client:
    """How this process reaches state servers: plaintext, or mutual TLS with its client
    certificate, taking the server certificate for `server_name` (the name the job's server
    certificate carries: the peer's own address need not be in it)."""

    identity: tls.Identity | None = None
    server_name: str | None = None

    def open(self, address: str) -> grpc.aio.Channel:
        identity = self.identity
        if identity is not None and self.server_name:
            identity = dataclasses.replace(identity, server_name=self.server_name)
        return channel.open_channel(address, identity, CHANNEL_OPTIONS)


PeerFailure = PeerStateError  # one holder could not give the checkpoint
NotFetched = NoPeerStateError  # none could


@dataclass
class Fetched:
    state: dict[str, Any]
    holder: Holder
    nbytes: int
    failures: list[str]  # the holders asked before, and why each could not give it


def fetch(
    loop: BackgroundLoop,
    holders: list[Holder],
    wanted: peer_state.Request,
    path: Path,
    client: Client | None = None,
    *,
    store: bool = True,
) -> Fetched:
    """The checkpoint `wanted` from the first holder that gives it whole, verified and stored
    as `path` (with `store=False`: verified only, nothing stored); `NotFetched` (with each
    holder's reason) when none does. A failure to write `path` or its temporary itself is a
    CheckpointError at once (another peer would not help)."""
    client = client or Client()
    failures: list[str] = []
    for holder in holders:
        try:
            state, nbytes = _fetch_from(loop, holder, wanted, path, client, store)
        except PeerFailure as exc:
            failures.append(f"{holder}: {exc}")
            continue
        return Fetched(state, holder, nbytes, failures)
    raise NotFetched(failures)


def _fetch_from(
    loop: BackgroundLoop,
    holder: Holder,
    wanted: peer_state.Request,
    path: Path,
    client: Client,
    store: bool,
) -> tuple[dict[str, Any], int]:
    result: list[tuple[dict[str, Any], int]] = []
    rank = None if wanted.any_rank else wanted.rank  # a replica may come from any rank

    def write(fd: int) -> None:
        nbytes = loop.run(receive(holder, wanted, fd, client))
        try:  # verified in the temporary file, before the rename makes it this rank's
            state = checkpoint_files.read(path, wanted.step, fd, rank=rank)
            result.append((state, nbytes))
        except CheckpointError as exc:
            raise PeerFailure(f"what it sent does not verify: {exc}") from None

    def failed(exc: OSError) -> CheckpointError:
        return CheckpointError(
            f"cannot store the checkpoint of step {wanted.step} fetched from {holder} as "
            f"{path} ({exc.strerror}); give the checkpoint directory room or a writable disk"
        )

    if store:
        atomic.write_atomically(path, write, failed)
    else:
        _read_through_temporary(path, write, failed)
    return result[0]


def _read_through_temporary(
    path: Path, write: Callable[[int], None], fail: Callable[[OSError], CheckpointError]
) -> None:
    """`write(fd)` into a new temporary of `path` (`atomic.create_temporary`), removed before
    this returns, whatever happens: what it reads there is never kept. `fail(exc)` is the error
    raised for an OSError."""
    try:
        fd, temporary = atomic.create_temporary(path)
    except OSError as exc:
        raise fail(exc) from None
    try:
        write(fd)
    except OSError as exc:
        raise fail(exc) from None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            temporary.unlink()


async def receive(
    holder: Holder, wanted: peer_state.Request, fd: int, client: Client | None = None
) -> int:
    """Write the checkpoint file `wanted` from `holder` into `fd`; the bytes written.
    PeerFailure when the transfer does not complete."""
    nonce = auth.new_nonce()
    request = pb.FetchRequest(
        prefix=wanted.prefix,
        rank=wanted.rank,
        step=wanted.step,
        any_rank=wanted.any_rank,
        nonce=nonce,
        proof=wanted.prove(holder.published.token, nonce),
    )
    async with (client or Client()).open(holder.published.address) as chan:
        call = pb_grpc.PeerStateStub(chan).Fetch(request)
        try:
            return await _read_into(call, fd)
        except grpc.aio.AioRpcError as exc:
            raise PeerFailure(f"{exc.code().name}: {exc.details()}") from None
        except (TimeoutError, asyncio.TimeoutError):  # not builtin TimeoutError before 3.11
            raise PeerFailure(f"it sent nothing for {PIECE_WAIT_S:.0f} s") from None
        finally:
            call.cancel()


async def _read_into(call: Any, fd: int) -> int:
    expected: int | None = None
    received = 0
    # The disk writes back what has arrived while the rest arrives: the fsync before the
    # rename then has only the tail to wait for, not the whole file.
    syncing: asyncio.Future[None] | None = None
    synced = 0
    loop = asyncio.get_running_loop()
    try:
        while True:
            chunk = await asyncio.wait_for(call.read(), PIECE_WAIT_S)
            if chunk is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from grpc-stubs
                break
            if expected is None:
                expected = chunk.file_bytes
            received += len(chunk.data)
            if received > expected:
                raise PeerFailure(f"it sent more than the {expected} bytes it announced")
            atomic.write_all(fd, chunk.data)
            if received - synced >= SYNC_EVERY_BYTES and (syncing is None or syncing.done()):
                syncing, synced = loop.run_in_executor(None, _write_back, fd), received
    finally:
        if syncing is not None:
            await asyncio.shield(syncing)  # before the caller closes fd
    if expected is None or received != expected:
        raise PeerFailure(
            f"the transfer ended after {received} of {expected or 0} bytes: it was cut off"
        )
    return received


def _write_back(fd: int) -> None:
    """Have the disk take what is written so far; an error here is the final fsync's to
    report (a file that cannot be synced, such as /dev/null, is just not synced early)."""
    with contextlib.suppress(OSError):
        os.fdatasync(fd)
