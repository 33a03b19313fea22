"""The float64-anchored tolerance and the mismatch messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify import InvalidArgument, ParallelMismatch, Tolerance
from dpverify._comparison import compare_tensors
from dpverify.mutants import TinyErrorDataParallel

SCALES = [1e-8, 1e-4, 1.0, 1e4, 1e8]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def _batch(rows: int = 13, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def _scaled(scale: float) -> Callable[[Any, Any], torch.Tensor]:
    return lambda output, target: scale * F.mse_loss(output, target)


@pytest.mark.parametrize("scale", SCALES)
def test_correct_parallel_passes_at_every_gradient_scale(scale: float) -> None:
    x, y = _batch()
    result = dpverify.assert_dp_grads_match(_model(), x, y, loss_fn=_scaled(scale), device_ids=[0, 1, 2, 3])
    assert result.ok
    assert result.worst_ratio < 1.0


@pytest.mark.parametrize("scale", SCALES)
def test_a_1e4_relative_error_in_one_parameter_is_caught_at_every_scale(scale: float) -> None:
    x, y = _batch()
    with pytest.raises(ParallelMismatch, match=r"grad '0\.weight': tensors are not close"):
        dpverify.assert_dp_grads_match(
            _model(), x, y, loss_fn=_scaled(scale), device_ids=[0, 1, 2], parallel=TinyErrorDataParallel
        )


def _grads(module: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float, parallel: bool) -> list[torch.Tensor]:
    model = _model()
    runner = dpverify.VirtualDataParallel(model, [0, 1, 2]) if parallel else model
    (scale * F.mse_loss(runner(x), y)).backward()
    return [p.grad for p in model.parameters()]


def test_assert_close_defaults_miss_the_bug_at_small_scale() -> None:
    # What the anchored tolerance is for: at gradient scale 1e-8 atol=1e-5 hides any bug.
    x, y = _batch()
    model = _model()
    wrong = TinyErrorDataParallel(model, [0, 1, 2])
    (1e-8 * F.mse_loss(wrong(x), y)).backward()
    reference = _grads(_model(), x, y, 1e-8, parallel=False)
    torch.testing.assert_close(next(model.parameters()).grad, reference[0])  # passes: missed


def test_assert_close_defaults_fail_correct_code_at_large_scale() -> None:
    x, y = _batch()
    parallel = _grads(_model(), x, y, 1e8, parallel=True)
    single = _grads(_model(), x, y, 1e8, parallel=False)
    failures = []
    for got, want in zip(parallel, single, strict=True):
        try:
            torch.testing.assert_close(got, want)
        except AssertionError as error:
            failures.append(str(error))
    assert failures
    assert "Tensor-likes are not close" in failures[0]


def test_anchored_rule_allows_factor_times_reference_error() -> None:
    anchor = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    expected = (anchor + torch.tensor([0.0, 1e-3, 0.0], dtype=torch.float64)).float()
    tol = Tolerance(factor=2.0, floor_ulps=0.0, norm_factor=1e6)  # the elementwise test alone
    ok = compare_tensors("t", (anchor + 1.9e-3).float(), expected, anchor, tol)
    bad = compare_tensors("t", (anchor + 2.1e-3).float(), expected, anchor, tol)
    assert ok.ok
    assert not bad.ok
    assert bad.mismatched == 3
    assert bad.reference_error == pytest.approx(1e-3, rel=1e-3)
    assert bad.allowed == pytest.approx(2e-3, rel=1e-3)


def test_floor_applies_when_the_reference_is_exact() -> None:
    anchor = torch.tensor([4.0, 1.0], dtype=torch.float64)
    tol = Tolerance(factor=8.0, floor_ulps=32.0, norm_floor_ulps=1e6)  # the elementwise test alone
    u = torch.finfo(torch.float32).eps / 2
    floor = 8.0 * 32.0 * u * 4.0
    assert compare_tensors("t", (anchor + 0.9 * floor).float(), anchor.float(), anchor, tol).ok
    assert not compare_tensors("t", (anchor + 1.1 * floor).float(), anchor.float(), anchor, tol).ok


def test_explicit_tolerance_is_assert_close_rule() -> None:
    expected = torch.tensor([1.0, 100.0])
    tol = Tolerance(rtol=0.01, atol=0.1)
    assert compare_tensors("t", expected + torch.tensor([0.1, 1.0]), expected, None, tol).ok
    result = compare_tensors("t", expected + torch.tensor([0.12, 1.0]), expected, None, tol)
    assert result.mismatched == 1
    assert result.max_abs_index == (1,)


def test_index_and_relative_difference_are_reported() -> None:
    anchor = torch.zeros(2, 3, dtype=torch.float64)
    anchor[1, 2] = 2.0
    actual = anchor.clone().float()
    actual[1, 2] = 3.0
    actual[0, 1] = 0.5
    result = compare_tensors("grad 'w'", actual, anchor.float(), anchor, Tolerance())
    assert result.max_abs_index == (1, 2)
    assert result.max_rel_index == (0, 1)  # 0.5 over 0: infinite relative difference
    assert result.mismatched == 2
    text = result.details()
    assert "Mismatched elements: 2 / 6 (33.3%)" in text
    assert "Greatest absolute difference: 1 at index (1, 2)" in text


def test_none_gradients() -> None:
    zeros = torch.zeros(3)
    assert compare_tensors("g", None, None, None, Tolerance()).ok
    assert compare_tensors("g", zeros, None, None, Tolerance()).ok  # DP materialises zeros
    result = compare_tensors("g", None, torch.ones(3), torch.ones(3, dtype=torch.float64), Tolerance())
    assert not result.ok
    assert result.problem == "is None in the parallel step but has nonzero values in the single-device step"


def test_nan_in_parallel_only_is_a_mismatch() -> None:
    anchor = torch.ones(2, dtype=torch.float64)
    result = compare_tensors("g", torch.tensor([1.0, float("nan")]), anchor.float(), anchor, Tolerance())
    assert result.mismatched == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rtol": 1e-3}, "pass both or neither"), ({"atol": 1e-3}, "pass both or neither"), ({"rtol": -1.0, "atol": 0.0}, "rtol=-1.0 must be a finite number >= 0")],
)
def test_bad_tolerances(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        Tolerance(**kwargs)
    x, y = _batch()
    with pytest.raises(InvalidArgument, match=match):
        dpverify.assert_dp_grads_match(_model(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1], **kwargs)  # type: ignore[arg-type]


def test_message_has_everything_assert_close_has_and_more() -> None:
    x, y = _batch(rows=5)
    with pytest.raises(ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(_model(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], parallel=TinyErrorDataParallel)
    text = str(caught.value)
    lines = text.splitlines()
    assert lines[0] == "DataParallel outputs and gradients must match the single-device step: 1 of 8 compared tensors do not match."
    assert "grad '0.weight': tensors are not close!" in text
    assert "Mismatched elements:" in text
    assert "Greatest absolute difference:" in text
    assert "allowed)" in text
    assert "Greatest relative difference:" in text
    assert "chunk sizes [2, 2, 1]" in text
    assert "device_ids [0, 1, 2, 3]" in text
    assert "device 3 idle" in text
    table = lines[lines.index("Every compared tensor, worst first:") + 2 :]
    assert table[0].split()[0:2] == ["grad", "'0.weight'"]  # worst first
    assert len(table) == 8
    report = caught.value.report
    assert isinstance(report, dpverify.StepComparison)
    assert [t.name for t in report.tensors if not t.ok] == ["grad '0.weight'"]


def test_msg_replaces_or_rewrites_the_message() -> None:
    x, y = _batch(rows=5)
    kwargs: dict[str, Any] = {"loss_fn": F.mse_loss, "device_ids": [0, 1], "parallel": TinyErrorDataParallel}
    with pytest.raises(ParallelMismatch, match=r"^custom$"):
        dpverify.assert_dp_grads_match(_model(), x, y, msg="custom", **kwargs)
    with pytest.raises(ParallelMismatch, match=r"^context: DataParallel outputs"):
        dpverify.assert_dp_grads_match(_model(), x, y, msg=lambda m: f"context: {m}", **kwargs)
