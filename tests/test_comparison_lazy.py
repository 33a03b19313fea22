"""A failing comparison's report computed when read: the same figures as at once, copies,
pickles, summaries, and a mismatch message made on first read."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from dpverify import ParallelMismatch, Tolerance
from dpverify.core import comparison
from dpverify.core.comparison import (
    NOT_KEPT,
    PER_ELEMENT,
    TensorComparison,
    TensorId,
    compare_tensors,
)
from tests.test_comparison import _hard_pair


def _read_late(actual: torch.Tensor, expected: torch.Tensor, anchor: torch.Tensor) -> TensorComparison:
    """A failing comparison, checked to hold its per-element statistics unread."""
    row = compare_tensors(TensorId("grad", "w"), actual, expected, anchor, Tolerance())
    assert "_statistics" in row.__dict__
    assert not row.ok
    assert row.ratio > 1
    assert row.max_abs > row.allowed
    assert "_statistics" in row.__dict__
    assert set(comparison.PER_ELEMENT).isdisjoint(row.__dict__)
    return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [41, 200_003])
def test_a_failing_tensor_read_late_has_the_figures_of_its_float64_report(dtype: torch.dtype, numel: int) -> None:
    actual, rounded = _hard_pair(dtype, numel, numel)
    anchor = rounded.to(torch.float64)
    row = _read_late(actual, rounded, anchor)
    report = comparison._detailed_finite(row.id, actual, rounded, row.allowed, row.reference_error)
    for name in ("mismatched", "max_abs", "max_abs_index", "max_rel", "max_rel_index", "size", "allowed", "nonfinite"):
        assert getattr(row, name) == getattr(report, name), name
    assert report.mismatched > 0
    assert row.ratio == max(report.ratio, row.norm_gap / row.norm_allowed)
    assert "_statistics" not in row.__dict__  # computed once, the tensors let go


def test_the_greatest_difference_is_taken_in_float64_where_float32_rounds_it() -> None:
    # 1 - 2**-30 and 1 - 2**-31 both round to 1.0 in float32: the first is not the greatest
    actual = torch.tensor([1.0, 1.0, 0.5])
    rounded = torch.tensor([2.0**-30, 2.0**-31, 0.0])
    row = _read_late(actual, rounded, rounded.to(torch.float64))
    assert row.max_abs == 1 - 2.0**-31 != float((actual - rounded).abs().max())
    assert row.max_abs_index == (1,)
    assert row.ratio == row.max_abs / row.allowed or row.ratio == row.norm_gap / row.norm_allowed


def test_a_comparison_read_late_copies_pickles_and_renames_as_one_read_at_once() -> None:
    actual, rounded = _hard_pair(torch.float32, 5000, 5000)
    anchor = rounded.to(torch.float64)
    pending = [_read_late(actual, rounded, anchor) for _ in range(4)]
    read = pending[0]
    assert read.mismatched > 0
    assert pickle.loads(pickle.dumps(pending[1])) == read
    assert copy.deepcopy(pending[2]) == read
    renamed = pending[3].renamed(TensorId("grad", "w", variant="accumulated"))
    assert "_statistics" in renamed.__dict__
    assert "_statistics" in pending[3].__dict__
    assert renamed.mismatched == read.mismatched
    assert renamed.id != read.id
    assert pending[3].__dict__["_statistics"].actual is None  # the two share one computation
    assert pending[3] == read
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        read.nothing  # noqa: B018


def test_a_mismatch_message_given_as_a_function_is_made_once_when_first_read() -> None:
    made: list[int] = []

    def message() -> str:
        made.append(1)
        return "grad 'w' differs"

    error = ParallelMismatch(message, report=3)
    assert made == []
    assert error.report == 3
    assert str(error) == "grad 'w' differs"
    assert error.args == ("grad 'w' differs",)
    assert made == [1]
    assert repr(error) == "ParallelMismatch(\"grad 'w' differs\")"
    assert made == [1]
    again = pickle.loads(pickle.dumps(ParallelMismatch(message, report=3)))
    assert str(again) == "grad 'w' differs"
    assert again.report == 3
    with pytest.raises(ParallelMismatch, match=r"^plain$"):
        raise ParallelMismatch("plain")


def test_a_summary_keeps_the_verdict_and_no_tensor() -> None:
    actual, rounded = _hard_pair(torch.float32, 5000, 5000)
    anchor = rounded.to(torch.float64)
    full = _read_late(actual, rounded, anchor)
    summary = _read_late(actual, rounded, anchor).summary()
    assert not summary.ok
    assert (summary.ratio, summary.max_abs, summary.allowed) == (full.ratio, full.max_abs, full.allowed)
    kept = summary.__dict__["_statistics"]
    assert not hasattr(kept, "actual")
    assert not hasattr(kept, "rounded")
    with pytest.raises(AttributeError, match=r"mismatched, max_abs_index, max_rel, max_rel_index\) of this comparison were not kept"):
        summary.mismatched  # noqa: B018
    assert "mismatched=<not kept>" in repr(summary)
    assert summary != full
    assert summary == copy.deepcopy(summary)
    again = pickle.loads(pickle.dumps(summary))
    assert again == summary
    assert not again.ok
    assert all(getattr(again, name, NOT_KEPT) is NOT_KEPT for name in PER_ELEMENT)
    assert full.summary() is full  # computed: nothing to drop
    passing = compare_tensors(TensorId("g"), rounded, rounded, anchor, Tolerance())
    assert passing.summary() is passing
    assert passing.ok


def test_a_parallel_result_in_another_dtype_gets_the_float64_greatest_difference_too() -> None:
    # float64 parallel values rounded to float32 before the subtraction: no monotonic bound, every element taken
    actual, rounded = _hard_pair(torch.float32, 200_003, 7)
    wide = actual.double() * (1 + 1e-9)
    row = _read_late(wide, rounded, rounded.to(torch.float64))
    report = comparison._detailed_finite(row.id, wide, rounded, row.allowed, row.reference_error)
    assert row.max_abs == report.max_abs
    assert row.mismatched == report.mismatched
    assert row.max_abs_index == report.max_abs_index
