"""Readers of a job with a secret, many at once, against a real scheduler process
(docs/design/security.md, "Reading the job"): every challenge is its own, so readers holding the
right secret never make the same proof and none is refused as a replay, while a captured proof
sent again still is."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from cluster.protocol import auth
from cluster.testing import free_port
from cluster.tools.secret import write_job_secret
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.credentials import read_metadata, secret_of
from tests.integration.test_hostile import env_for, start_scheduler
from tests.integration.test_outsider import CALL_S, outsider
from tests.procs import PYTHON, ROOT, Procs, reader_env

pytestmark = pytest.mark.slow

READER = ROOT / "tests" / "integration" / "scripts" / "concurrent_reader.py"
READERS, ROUNDS, WIDTH = 3, 20, 4


def test_readers_with_the_secret_at_once_are_never_refused_and_a_replay_always_is(
    processes: Procs, tmp_path: Path
) -> None:
    port, secret_file = free_port(), write_job_secret(tmp_path)
    env = env_for(port, tmp_path, None, CLUSTER_JOB_SECRET_FILE=str(secret_file))
    start_scheduler(processes, env)
    address = f"127.0.0.1:{port}"
    readers = [
        processes.start(
            f"reader{i}",
            [PYTHON, str(READER), address, str(ROUNDS), str(WIDTH)],
            reader_env(secret_file, env),
        )
        for i in range(READERS)
    ]
    for reader in readers:
        assert reader.wait(120) == 0, reader.output
        said = json.loads(reader.output.strip().splitlines()[-1])
        assert said["reads"] == 2 * ROUNDS * WIDTH
        assert said["refused"] == [], said["refused"][:3]
    secret = secret_of(env)
    with outsider(port) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        captured = read_metadata(channel, secret, "Status")
        assert stub.Status(pb.StatusRequest(), timeout=CALL_S, metadata=captured)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as replayed:
                stub.Status(pb.StatusRequest(), timeout=CALL_S, metadata=captured)
            assert replayed.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            assert auth.READ_REPLAYED in replayed.value.details()  # type: ignore[attr-defined]
