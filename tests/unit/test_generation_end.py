"""The agent's word that a generation is over (`cluster.worker.generation_end`): each ender is
told once per generation, on a thread of its own, never the caller's; one that fails is said,
and the others are still told."""

from __future__ import annotations

import threading

from cluster.worker.generation_end import GenerationEnd

BOUND_S = 10.0


def join_enders() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("cluster-generation-"):
            thread.join(BOUND_S)
            assert not thread.is_alive(), thread.name


def test_each_generation_is_told_once_off_the_callers_thread() -> None:
    told: list[tuple[int, str]] = []
    said: list[str] = []
    end = GenerationEnd(said.append)
    end.heard(1)  # nobody registered yet: told to nobody, and not again
    end.add(lambda g: told.append((g, threading.current_thread().name)))
    for generation in (1, 2, 2, 1, 4):  # a peer failed, then the new generation: one end
        end.heard(generation)
        join_enders()
    assert told == [(2, "cluster-generation-2-over"), (4, "cluster-generation-4-over")]
    assert said == []


def test_an_ender_that_fails_is_said_and_the_others_are_told() -> None:
    told: list[int] = []
    said: list[str] = []
    end = GenerationEnd(said.append)

    def failing(generation: int) -> None:
        raise RuntimeError("ncclCommAbort failed")

    end.add(failing)
    end.add(told.append)
    end.heard(3)
    join_enders()
    assert told == [3]
    assert said == ["letting go of generation 3's resources failed: ncclCommAbort failed"]
