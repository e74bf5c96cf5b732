"""allreduce's reduction of the gathered arrays (`reduced`): numpy's dtype rule, in rank order,
the arrays' shape kept. The whole call in real workers is tests/integration/test_api_edges.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cluster.api.collective import reduced, reduced_dtypes


def three(value: Any, dtype: Any = None) -> list[Any]:
    """The same array from each of three ranks."""
    return [np.array(value, dtype=dtype) for _ in range(3)]


def test_a_sum_of_bools_counts_them_and_their_mean_is_a_fraction() -> None:
    flags = [np.array([True, False]), np.array([True, True]), np.array([True, False])]
    total = reduced(flags, "sum")
    assert total.dtype == np.int64
    assert total.tolist() == [3, 1]
    mean = reduced(flags, "mean")
    assert mean.dtype == np.float64
    assert mean.tolist() == pytest.approx([1.0, 1 / 3])


def test_max_and_min_of_bools_are_any_and_all() -> None:
    flags = [np.array([True, False]), np.array([False, False])]
    assert reduced(flags, "max").tolist() == [True, False]
    assert reduced(flags, "min").tolist() == [False, False]
    assert reduced(flags, "max").dtype == np.bool_


def test_small_integers_are_summed_and_averaged_without_wrapping() -> None:
    assert reduced(three([100], np.int8), "sum").tolist() == [300]
    assert reduced(three([100], np.int8), "sum").dtype == np.int64
    assert reduced(three([100], np.int8), "mean").tolist() == [100.0]
    assert reduced(three([200], np.uint8), "sum").dtype == np.uint64
    assert reduced(three([200], np.uint8), "sum").tolist() == [600]
    assert reduced(three([100], np.int8), "prod").tolist() == [1_000_000]
    assert reduced(three([-100], np.int8), "min").dtype == np.int8


def test_a_float16_mean_is_taken_in_float32_and_given_as_float16() -> None:
    mean = reduced(three([60000.0], np.float16), "mean")
    assert mean.dtype == np.float16
    assert mean.tolist() == [60000.0]  # the sum of three is past float16's largest
    assert reduced(three([1.5], np.float32), "sum").dtype == np.float32
    assert reduced(three([1.5], np.float32), "mean").dtype == np.float32


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize(
    "dtype",
    [
        *(np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64),
        *(np.float16, np.float32, np.float64, np.complex64, np.complex128),
    ],
)
def test_the_dtype_is_numpys_for_the_same_reduction(op: str, dtype: Any) -> None:
    stacked = np.ones((3, 2), dtype=dtype)
    numpy_op = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}
    expected = numpy_op[op](stacked, axis=0).dtype
    assert reduced_dtypes(np.dtype(dtype), op)[1] == expected
    assert reduced(list(stacked), op).dtype == expected


def test_floats_are_added_in_rank_order() -> None:
    big, small = np.float64(1e16), np.float64(1.0)
    arrays = [np.array(big), np.array(small), np.array(-big)]
    assert reduced(arrays, "sum") == (big + small) - big  # 0.0, not 1.0


def test_a_0d_array_stays_0d() -> None:
    result = reduced(three(1.5), "sum")
    assert isinstance(result, np.ndarray)
    assert result.shape == ()
    assert result == 4.5
    assert reduced(three(True), "mean").shape == ()
