"""Two workers make a gloo group with cluster.torch; rank 1 then posts a recv from rank 0 and
waits in it; rank 0 never sends but releases its group (what a TrainingLoop does when its
generation is over): rank 1 prints how long its recv took to fail (the group's timeout is 30 s).

Meanwhile a thread of rank 0's program opens a TCP connection of its own while the group is
being made (telemetry, a data source): the release leaves it open, and rank 0 says so."""

from __future__ import annotations

import socket
import threading
import time

import torch
import torch.distributed as dist

import cluster
import cluster.torch

cluster.init()
rank = cluster.get_rank()
listener = socket.create_server(("127.0.0.1", 0))
own: list[socket.socket] = []
make_group = dist.init_process_group


def while_a_thread_connects(*args: object, **kwargs: object) -> None:
    """torch's init_process_group, with a connection of the program's opened as it begins."""
    thread = threading.Thread(
        target=lambda: own.append(socket.create_connection(listener.getsockname()))
    )
    thread.start()
    thread.join()
    make_group(*args, **kwargs)  # type: ignore[arg-type]


if rank == 0:
    dist.init_process_group = while_a_thread_connects  # type: ignore[assignment]
cluster.torch.init_process_group(timeout_s=30)
dist.init_process_group = make_group
tensor = torch.zeros(4, dtype=torch.float64)
dist.all_reduce(tensor)  # every connection is up
if rank == 0:
    cluster.barrier()  # rank 1's recv is posted
    cluster.torch.release_process_group()
    print(f"rank 0 released; group left: {dist.is_initialized()}", flush=True)
    accepted, _ = listener.accept()
    try:
        own[0].sendall(b"x")
        print(f"its own connection still carries: {accepted.recv(1)!r}", flush=True)
    except OSError as exc:
        print(f"its own connection was cut: {exc!r}", flush=True)
else:
    pending = dist.irecv(tensor, src=0)
    start = time.monotonic()
    cluster.barrier()
    try:
        pending.wait()
        print("recv returned", flush=True)
    except Exception as exc:
        print(f"recv failed after {time.monotonic() - start:.2f} s: {exc}", flush=True)
cluster.barrier()
cluster.finalize()
