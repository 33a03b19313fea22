"""The float64-anchored tolerance and the mismatch messages."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify import InvalidArgument, ParallelMismatch, Tolerance
from dpverify.core.comparison import TensorId, compare_tensors
from dpverify.core.numerics import largest_abs, magnitudes
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
    anchor = torch.linspace(1.0, 4.0, 16, dtype=torch.float64)
    bump = torch.zeros(16, dtype=torch.float64)
    bump[5] = 1e-6
    expected = (anchor + bump).float()
    tol = Tolerance(factor=2.0, floor_ulps=0.0, norm_factor=1e6)  # the elementwise test alone
    reference_error = float((expected.double() - anchor.float().double()).abs().max())
    u = torch.finfo(torch.float32).eps / 2
    assert reference_error / (u * 4.0) < 64  # well conditioned: the plain factor applies
    assert tol.reference_factor(16, reference_error / (u * 4.0)) == 2.0
    ok = compare_tensors(TensorId("t"), (anchor + 1.9 * reference_error).float(), expected, anchor, tol)
    bad = compare_tensors(TensorId("t"), (anchor + 2.3 * reference_error).float(), expected, anchor, tol)
    assert ok.ok
    assert not bad.ok
    assert bad.mismatched == 16
    assert bad.reference_error == pytest.approx(reference_error)
    assert bad.allowed == pytest.approx(2 * reference_error)


def test_ill_conditioned_tensors_get_a_larger_factor() -> None:
    tol = Tolerance()
    assert tol.reference_factor(16, 64.0) == 8.0
    assert tol.reference_factor(16, 640.0) == pytest.approx(12.0)
    assert tol.reference_factor(16, 64_000.0) == pytest.approx(20.0)


def test_few_elements_get_a_larger_factor_on_the_reference_error() -> None:
    tol = Tolerance()
    assert tol.reference_factor(1) == 32.0
    assert tol.reference_factor(4) == 16.0
    assert tol.reference_factor(16) == tol.reference_factor(10_000) == 8.0


def test_floors_shrink_with_the_number_of_elements() -> None:
    tol = Tolerance()
    assert tol.floors(torch.float32, 1) == (16.0, 8.0)
    assert tol.floors(torch.float32, 256) == (4.0, 0.5)
    assert tol.floors(torch.float32, 10**8) == (2.0, 0.5)
    assert tol.floors(torch.bfloat16, 10**8) == (4.0, 4.0)


def test_floor_applies_when_the_reference_is_exact() -> None:
    anchor = torch.tensor([4.0, 1.0], dtype=torch.float64)
    tol = Tolerance(norm_floor_ulps=1e6)  # the elementwise test alone
    u = torch.finfo(torch.float32).eps / 2
    floor = 8.0 * tol.floors(torch.float32, 2)[0] * u * 4.0
    assert compare_tensors(TensorId("t"), (anchor + 0.9 * floor).float(), anchor.float(), anchor, tol).ok
    assert not compare_tensors(TensorId("t"), (anchor + 1.1 * floor).float(), anchor.float(), anchor, tol).ok


def test_float16_values_near_zero_are_allowed_a_few_subnormal_steps() -> None:
    # float16 numbers below 6.1e-5 are spaced 6e-8 apart: rounding moves them by whole steps.
    anchor = torch.tensor([2.0e-7, -1.0e-7, 3.0e-7], dtype=torch.float64)
    expected = anchor.half()
    step = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps
    assert compare_tensors(TensorId("g"), expected + step, expected, anchor, Tolerance()).ok
    assert not compare_tensors(TensorId("g"), expected + 40 * step, expected, anchor, Tolerance()).ok


def test_explicit_tolerance_is_assert_close_rule() -> None:
    expected = torch.tensor([1.0, 100.0])
    tol = Tolerance(rtol=0.01, atol=0.1)
    assert compare_tensors(TensorId("t"), expected + torch.tensor([0.1, 1.0]), expected, None, tol).ok
    result = compare_tensors(TensorId("t"), expected + torch.tensor([0.12, 1.0]), expected, None, tol)
    assert result.mismatched == 1
    assert result.max_abs_index == (1,)


def test_index_and_relative_difference_are_reported() -> None:
    anchor = torch.zeros(2, 3, dtype=torch.float64)
    anchor[1, 2] = 2.0
    actual = anchor.clone().float()
    actual[1, 2] = 3.0
    actual[0, 1] = 0.5
    result = compare_tensors(TensorId("grad", "w"), actual, anchor.float(), anchor, Tolerance())
    assert result.max_abs_index == (1, 2)
    assert result.max_rel_index == (0, 1)  # 0.5 over 0: infinite relative difference
    assert result.mismatched == 2
    text = result.details()
    assert "Mismatched elements: 2 / 6 (33.3%)" in text
    assert "Greatest absolute difference: 1 at index (1, 2)" in text


def test_none_gradients() -> None:
    zeros = torch.zeros(3)
    assert compare_tensors(TensorId("g"), None, None, None, Tolerance()).ok
    assert compare_tensors(TensorId("g"), zeros, None, None, Tolerance()).ok  # DP materialises zeros
    result = compare_tensors(TensorId("g"), None, torch.ones(3), torch.ones(3, dtype=torch.float64), Tolerance())
    assert not result.ok
    assert result.problem == "is None in the parallel step but has nonzero values in the single-device step"


def test_nan_in_parallel_only_is_a_mismatch() -> None:
    anchor = torch.ones(2, dtype=torch.float64)
    result = compare_tensors(TensorId("g"), torch.tensor([1.0, float("nan")]), anchor.float(), anchor, Tolerance())
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


# --- Non-finite values never pass silently ---------------------------------------------


def test_a_nan_in_the_batch_is_refused_naming_the_tensor() -> None:
    x, y = _batch(rows=6)
    x[2, 1] = float("nan")
    with pytest.raises(dpverify.NonFiniteReference, match=r"^output is not finite in the single-device step \(3 NaN"):
        dpverify.assert_dp_grads_match(_model(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1])


def test_a_non_finite_reference_is_refused_before_any_comparison() -> None:
    anchor = torch.tensor([1.0, 2.0], dtype=torch.float64)
    with pytest.raises(dpverify.NonFiniteReference, match="grad 'w' is not finite in the single-device step"):
        compare_tensors(TensorId("grad", "w"), torch.ones(2), torch.tensor([1.0, math.inf]), anchor, Tolerance())
    with pytest.raises(dpverify.NonFiniteReference):
        compare_tensors(TensorId("t"), torch.ones(2), torch.tensor([1.0, math.nan]), None, Tolerance(rtol=0.1, atol=0.1))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_parallel_value_is_a_mismatch_and_says_so(bad: float) -> None:
    anchor = torch.tensor([1.0, 5.0], dtype=torch.float64)
    for tolerance in (Tolerance(), Tolerance(rtol=1e-3, atol=1e-3)):
        result = compare_tensors(TensorId("g"), torch.tensor([1.0, bad]), anchor.float(), anchor, tolerance)
        assert not result.ok
        assert result.mismatched == 1
        assert result.nonfinite == 1
        assert result.max_abs_index == (1,)
        assert "Non-finite values: 1 NaN or inf entries in the parallel step" in result.details()


def test_explicit_tolerance_follows_isclose() -> None:
    expected = torch.tensor([1.0, 5.0, 100.0])
    tol = Tolerance(rtol=1e-2, atol=1e-3)
    actual = torch.tensor([1.0, 5.04, 101.5])
    result = compare_tensors(TensorId("t"), actual, expected, None, tol)
    assert result.mismatched == int((~torch.isclose(actual, expected, rtol=1e-2, atol=1e-3)).sum()) == 1
    assert result.max_abs_index == (2,)


class _NaNGradDataParallel(dpverify.VirtualDataParallel):  # type: ignore[type-arg]
    """Correct, except the reduced gradient of the first parameter turns NaN in one entry."""

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None) -> None:
        super().__init__(module, device_ids, output_device)

        def poison(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad.view(-1)[0] = math.nan
            return grad

        next(module.parameters()).register_hook(poison)


def test_a_parallel_gradient_that_turns_nan_is_caught() -> None:
    x, y = _batch(rows=6)
    with pytest.raises(ParallelMismatch, match=r"(?s)grad '0\.weight': tensors are not close.*Non-finite values: 1 NaN"):
        dpverify.assert_dp_grads_match(_model(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=_NaNGradDataParallel)


# --- Sensitivity: systematic errors far below the elementwise floor -------------------


def _off_by(relative: float, fraction: float) -> type[dpverify.VirtualDataParallel]:  # type: ignore[type-arg]
    class OffBy(dpverify.VirtualDataParallel):  # type: ignore[type-arg]
        """Correct, except the first parameter's gradient is off by ``relative`` in
        ``fraction`` of its elements: the largest ones, so the error is in entries that
        carry the gradient rather than in ones that are zero to begin with."""

        def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None) -> None:
            super().__init__(module, device_ids, output_device)

            def off(grad: torch.Tensor) -> torch.Tensor:
                flat = grad.reshape(-1).clone()
                chosen = flat.abs().topk(max(1, round(fraction * flat.numel()))).indices
                flat[chosen] *= 1 + relative
                return flat.view_as(grad)

            next(module.parameters()).register_hook(off)

    return OffBy


@pytest.mark.parametrize("input_scale", [1e-6, 1e-3, 1.0, 1e3, 1e6])
@pytest.mark.parametrize("fraction", [1.0, 0.01])
def test_a_1e5_error_in_a_whole_tensor_or_one_percent_of_it_is_caught(input_scale: float, fraction: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3)) * input_scale
    y = torch.randn(16, 4, generator=torch.Generator().manual_seed(4))
    kwargs: dict[str, Any] = {"loss_fn": F.mse_loss, "device_ids": [0, 1, 2]}
    passed = dpverify.assert_dp_grads_match(model, x, y, **kwargs)
    # The premise of the claim: the single-device step is within 1e-6 of float64 there.
    grad = next(t for t in passed.tensors if t.name == "grad '0.weight'")
    assert grad.reference_error is not None
    assert grad.reference_error <= 1e-6 * _largest_grad(model, x, y)
    with pytest.raises(ParallelMismatch, match=r"grad '0\.weight': tensors are not close"):
        dpverify.assert_dp_grads_match(model, x, y, parallel=_off_by(1e-5, fraction), **kwargs)


def _largest_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    twin = copy.deepcopy(model).double()
    F.mse_loss(twin(x.double()), y.double()).backward()
    return float(next(twin.parameters()).grad.abs().max())  # type: ignore[union-attr]


def test_one_element_off_by_1e4_stays_caught() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    x, y = _batch(rows=16)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    y = torch.randn(16, 4, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ParallelMismatch, match=r"Mismatched elements: 1 / 512"):
        dpverify.assert_dp_grads_match(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=_off_by(1e-4, 1 / 512))


def test_a_saturated_float32_probe_is_not_trusted_for_a_float64_model() -> None:
    anchor = torch.linspace(1.0, 2.0, 32, dtype=torch.float64)
    expected = anchor.clone()  # a float64 step is its own anchor: no rounding visible
    u64, u32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps
    calm = (anchor * (1 + 4 * u32)).float()
    saturated = (anchor * 1.5).float()  # float32 lost every digit: an ill-conditioned model
    jitter = anchor + 1e-9
    trusted = compare_tensors(TensorId("g"), anchor, expected, anchor, Tolerance(), probe=calm)
    assert trusted.reference_error == pytest.approx(float((calm.double() - anchor).abs().max()) * u64 / u32, rel=1e-6)
    distrusted = compare_tensors(TensorId("g"), anchor, expected, anchor, Tolerance(), probe=saturated, jitter=jitter)
    assert distrusted.reference_error == pytest.approx(1e-9, rel=1e-3)
    # what the jitter measured is what the parallel step may deviate by
    allowed = distrusted.allowed
    assert allowed == pytest.approx(Tolerance().reference_factor(32, 1e-9 / (u64 / 2 * 2.0)) * 1e-9)
    assert compare_tensors(TensorId("g"), anchor + 0.9 * allowed, expected, anchor, Tolerance(), probe=saturated, jitter=jitter).ok
    assert not compare_tensors(TensorId("g"), anchor + 1.1 * allowed, expected, anchor, Tolerance(), probe=saturated, jitter=jitter).ok


# --------------------------------------------------------------------------- the detailed report of a finite tensor


def _hard_pair(dtype: torch.dtype, numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A parallel result and a rounded reference with every case the report must get
    right: equal elements, zeros in the reference (with and without a difference), signed
    zeros, ties for the greatest differences, and far-apart magnitudes."""
    g = torch.Generator().manual_seed(seed)
    reference = (torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 3, (numel,), generator=g)).to(dtype)
    actual = (reference.double() * (1 + 1e-3 * torch.randn(numel, generator=g, dtype=torch.float64))).to(dtype)
    k = numel // 10
    actual[:k] = reference[:k]  # equal
    reference[k : 2 * k] = 0.0  # zero reference: infinite relative difference where they differ
    actual[k] = 0.0
    reference[2 * k] = -0.0
    actual[2 * k] = 0.0
    far = reference.double().abs().max().item() * 4
    actual[3 * k], reference[3 * k] = far, 0.0  # the greatest difference, twice (ties keep the first)
    actual[numel - 1], reference[numel - 1] = far, 0.0
    return actual, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [41, 5000, 200_003])
@pytest.mark.parametrize("allowed", [0.0, 1e-6, 1e-2])
def test_the_chunked_report_of_a_finite_tensor_is_the_float64_report(dtype: torch.dtype, numel: int, allowed: float) -> None:
    from dpverify.core import comparison

    actual, rounded = _hard_pair(dtype, numel, numel)
    assert bool(torch.isfinite(actual).all())  # the finite path's precondition
    for shape in [(numel,), (1, numel, 1)] + ([(41, numel // 41)] if numel % 41 == 0 else []):
        a, r = actual.reshape(shape), rounded.reshape(shape)
        fast = comparison._detailed_finite("g", a, r, allowed, 1e-7)
        allowed_each = torch.full((), allowed, dtype=torch.float64)
        slow = comparison._detailed("g", a, r.to(torch.float64), allowed_each, 1e-7)
        assert fast == slow


def test_derived_references_give_the_comparisons_of_fresh_ones() -> None:
    g = torch.Generator().manual_seed(3)
    anchor = torch.randn(40, 30, generator=g, dtype=torch.float64)
    expected = (anchor * (1 + 1e-7 * torch.randn(40, 30, generator=g, dtype=torch.float64))).float()
    jitter = (anchor * (1 + 1e-7 * torch.randn(40, 30, generator=g, dtype=torch.float64))).float()
    memo: dict[Any, Any] = {}
    for actual in (expected.clone(), expected * (1 + 1e-3), expected + 1e-9):
        for sample in (None, jitter):
            fresh = compare_tensors(TensorId("g"), actual, expected, anchor, Tolerance(), terms=2.0, jitter=sample)
            shared = compare_tensors(TensorId("g"), actual, expected, anchor, Tolerance(), terms=2.0, jitter=sample, derived=memo)
            assert shared == fresh
    assert len(memo) == 2  # one per set of reference tensors: with and without the sample
    # other tensors, even of equal values, are other references
    compare_tensors(TensorId("g"), expected, expected.clone(), anchor, Tolerance(), derived=memo)
    assert len(memo) == 3


def test_largest_abs_and_magnitudes_of_dense_sparse_and_empty_tensors() -> None:
    dense = torch.tensor([[3.0, -4.0], [0.0, 0.0]])
    assert largest_abs(dense) == 4.0
    assert magnitudes(dense) == (4.0, 5.0)
    assert magnitudes(dense.to_sparse()) == (4.0, 5.0)
    assert largest_abs(torch.empty(0)) == 0.0
    assert magnitudes(torch.empty(0, 3)) == (0.0, 0.0)
    assert math.isnan(largest_abs(torch.tensor([1.0, math.nan])))
