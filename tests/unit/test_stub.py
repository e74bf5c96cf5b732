"""LazyStub makes the generated stub's methods, the same ones, on first use."""

from __future__ import annotations

import grpc
import pytest

from cluster.transport.stub import LazyStub, methods
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc


class RecordingChannel:
    """Answers every multicallable request with what was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, dict[str, object]]] = []

    def __getattr__(self, kind: str) -> object:
        def make(path: str, **options: object) -> tuple[str, str, dict[str, object]]:
            self.asked.append((kind, path, options))
            return (kind, path, options)

        return make


def test_each_method_is_made_once_on_first_use_as_the_generated_stub_makes_it() -> None:
    generated = vars(pb_grpc.SchedulerStub(RecordingChannel()))
    channel = RecordingChannel()
    stub = LazyStub(channel)  # type: ignore[arg-type]  # a stand-in channel
    assert channel.asked == []
    for name, made in generated.items():
        assert getattr(stub, name) == made
        assert getattr(stub, name) == made  # kept: asked once
    assert len(channel.asked) == len(generated)
    assert set(methods()) == set(generated)  # read from the descriptor: none left out, none more
    assert {name for name in generated} >= {"Watch", "Heartbeat", "Finish", "Exchange"}
    assert generated["Watch"][0] == "unary_stream"
    assert generated["Heartbeat"][2]["request_serializer"] == pb.HeartbeatRequest.SerializeToString


async def test_it_calls_through_a_real_channel() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await LazyStub(channel).Status(pb.StatusRequest(), timeout=0.5)
        assert info.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    finally:
        await channel.close()


def test_an_unknown_method_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="no method 'Nope'"):
        LazyStub(RecordingChannel()).Nope  # type: ignore[arg-type]
