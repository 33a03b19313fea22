"""Classes of correct scenarios an independent generator found false alarms and a crash in:
subnormal float64 gradients, steps whose chunks round differently from the full batch, and
near-converged targets. Every model here is built from fixed values, not a seed, and
every test asserts the verdict, not the bits of one machine's kernels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify import ParallelMismatch, Tolerance
from dpverify.core.comparison import StepComparison, TensorId, compare_tensors
from dpverify.core.step import copy_module
from dpverify.models.specs import DeviceList, LossSpec, ModelSpec, Scenario
from dpverify.models.training import OptimizerSpec, TrainingScenario
from dpverify.mutants import TinyErrorDataParallel
from dpverify.registry import CHECKS, Case, Target


def _fixed_linear(inputs: int, outputs: int, dtype: torch.dtype = torch.float64) -> nn.Linear:
    layer = nn.Linear(inputs, outputs).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-0.9, 0.8, inputs * outputs, dtype=dtype).reshape(outputs, inputs))
        layer.bias.copy_(torch.linspace(0.3, -0.2, outputs, dtype=dtype))
    return layer


def _rows(rows: int, features: int, scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    values = torch.linspace(-1.0, 1.0, rows * features, dtype=torch.float64).reshape(rows, features)
    return (values.sin() * scale).to(dtype)


def test_subnormal_float64_gradients_pass_instead_of_raising_zero_division() -> None:
    # roundoff * scale underflows to 0 for a scale of 1e-309: the reproduction
    x, y = _rows(4, 3, 1e-309), _rows(4, 2, 1e-309)
    result = dpverify.assert_dp_grads_match(_fixed_linear(3, 2), x, y, loss_fn=F.mse_loss, device_ids=[0, 1])
    assert result.ok


def test_a_zero_difference_passes_whatever_the_references_round_to() -> None:
    # subnormal references, the float32 probe flushed to 0: the parallel result equal to
    # the single-device one is never a mismatch
    expected = torch.tensor([3e-320, -7e-321, 0.0, 5e-324], dtype=torch.float64)
    anchor = torch.tensor([2.5e-320, -7e-321, 1e-323, 0.0], dtype=torch.float64)
    for probe in (None, torch.zeros(4), anchor.float()):
        row = compare_tensors(TensorId("grad", "w"), expected.clone(), expected, anchor, Tolerance(), probe, 0.0, anchor)
        assert row.ok, row.details()


class _ChunkRounding(nn.Module):
    """``(x + K) - K`` with ``K = 1e8 / rows**2``: x in exact arithmetic, rounded at the
    spacing of K, which a chunk of few rows makes far coarser than the full batch (the
    way batch-size-dependent kernels round), then a Linear layer. Elementwise IEEE
    arithmetic, the same on every machine."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = _fixed_linear(3, 2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = 1e8 / x.shape[0] ** 2
        out: torch.Tensor = self.head((x + shift) - shift)
        return out


def test_a_step_whose_chunks_round_coarser_than_the_full_batch_passes() -> None:
    for dtype in (torch.float32, torch.float64):
        x, y = _rows(16, 3, 1.0, dtype), _rows(16, 2, 1.0, dtype)
        result = dpverify.assert_dp_grads_match(
            _ChunkRounding(dtype), x, y, loss_fn=F.mse_loss, device_ids=list(range(16))
        )
        assert result.ok
        summed = dpverify.assert_grad_sum_equals_mean_loss_grad(
            _ChunkRounding(dtype), x, y, loss_fn=F.mse_loss, device_ids=list(range(16))
        )
        assert summed.ok


class _ChunkCentred(nn.Module):
    """Subtracts the mean of the rows it receives: a result that depends on the split in
    exact arithmetic, as much in float64 as in float32."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = _fixed_linear(3, 2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x - 1e-3 * x.mean(0, keepdim=True))
        return out


def test_a_result_that_depends_on_the_split_still_fails() -> None:
    # the chunk-by-chunk sample reproduces it, but it does not shrink with the precision
    for dtype in (torch.float32, torch.float64):
        x, y = _rows(8, 3, 1.0, dtype) + 1.0, _rows(8, 2, 1.0, dtype)
        try:
            dpverify.assert_dp_grads_match(_ChunkCentred(dtype), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3])
        except ParallelMismatch:
            continue
        raise AssertionError(f"{dtype}: a split-dependent result passed")


def test_a_wrapper_error_is_still_caught_where_chunks_round_coarser() -> None:
    # the chunk-by-chunk sample never contains what the wrapper does (float64: its chunks
    # round at 1e-8, far below the error)
    x, y = _rows(16, 3, 1.0), _rows(16, 2, 1.0)
    try:
        dpverify.assert_dp_grads_match(
            _ChunkRounding(torch.float64), x, y, loss_fn=F.mse_loss, device_ids=list(range(16)),
            parallel=TinyErrorDataParallel,
        )
    except ParallelMismatch:
        return
    raise AssertionError("a 1e-4 error in one gradient passed")


class _NearConverged(nn.Module):
    """Two RMSNorm blocks and a Linear head whose bias is frozen (the output bias of an
    RMSNorm stack is the other case)."""

    def __init__(self, frozen_bias: bool) -> None:
        super().__init__()
        self.inp = _fixed_linear(3, 4, torch.float32)
        self.norm = nn.RMSNorm(4)
        self.mid = _fixed_linear(4, 4, torch.float32)
        self.out = _fixed_linear(4, 2, torch.float32)
        self.out.bias.requires_grad_(not frozen_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.tanh(self.mid(self.norm(self.inp(x)))) * 1e4)
        return out


def test_near_converged_targets_pass() -> None:
    for frozen_bias, loss in ((True, F.smooth_l1_loss), (False, F.mse_loss)):
        model = _NearConverged(frozen_bias)
        x = _rows(11, 3, 1.0, torch.float32)
        with torch.no_grad():
            out64 = copy.deepcopy(model).double()(x.double())
        residual = 1e-7 * out64.abs() * _rows(11, 2, 1.0)
        y = (out64 + residual).float()
        for devices in ([0, 1, 2], list(range(11))):
            assert dpverify.assert_dp_grads_match(model, x, y, loss_fn=loss, device_ids=devices).ok
            assert dpverify.assert_grad_sum_equals_mean_loss_grad(model, x, y, loss_fn=loss, device_ids=devices).ok


def test_copies_in_the_modules_own_dtype_share_no_storage_with_it() -> None:
    # A float64 model's float64 steps (the anchor, the jittered sample) copy it in its own
    # dtype, where ``Tensor.to`` returns the same storage unless told to copy.
    model = nn.Sequential(_fixed_linear(3, 4), nn.BatchNorm1d(4)).double()
    copied = copy_module(model, torch.float64)
    originals = [t.data_ptr() for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    copies = [t.data_ptr() for t in [*copied.parameters(), *copied.buffers()] if t.is_floating_point()]
    assert not set(originals) & set(copies)


def test_checks_leave_a_float64_module_bit_for_bit_untouched() -> None:
    # The jittered float64 reference once scaled the module's own parameters by 1 +- 8 eps
    # on every check, so that a later check of the same module ran its parallel step on
    # other parameters than the references it shared: ill-conditioned float64 models (a
    # masked sequence-first attention with gain 61, a LayerNorm over one feature on
    # inputs of 1e6) failed their second check.
    model = nn.Sequential(_fixed_linear(3, 4), nn.Tanh(), _fixed_linear(4, 2))
    before = copy.deepcopy(model.state_dict())
    x, y = _rows(6, 3, 1e3), _rows(6, 2, 1.0)
    dpverify.assert_dp_grads_match(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
    dpverify.assert_grad_sum_equals_mean_loss_grad(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


class _NearConvergedHead(nn.Module):
    """``(out, chunk mean L1 loss)``: ``out`` goes through the rows' mean and back, exact in
    exact arithmetic, and rounding with the rows of the chunk it sees; targets sit 1e-13
    from ``out``, so the loss is far smaller than the terms it is a difference of."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([0.75, 1.25], dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        centre = x.mean(0)
        out = ((x - centre) + centre) * self.scale
        return out, (out - y).abs().mean()


def _near_converged(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _rows(rows, 2, 3.0)
    residuals = torch.tensor([1.0, -2.0, 3.0, 1.0, -1.0, 2.0, 2.0, -3.0, 4.0, 1.0], dtype=torch.float64)
    return x, x * torch.tensor([0.75, 1.25], dtype=torch.float64) + 1e-13 * residuals[: 2 * rows].reshape(rows, 2)


def test_loss_average_of_a_near_converged_loss_on_equal_chunks_is_not_biased() -> None:
    # calibrate 17010 (a float32 GRU, L1 loss 3.7e-10 on chunks [1, 1]): the chunks' rounding
    # of outputs near 1 is far above a roundoff of the loss itself, which the noise was
    # sized from; the jittered step measures it
    report = dpverify.check_forward_loss_average(_NearConvergedHead(), _near_converged(4), device_ids=[0, 1])
    assert report.chunk_sizes == (2, 2)
    assert report.weighted_is_exact
    assert not report.is_biased


def test_loss_average_of_a_near_converged_loss_on_uneven_chunks_is_still_biased() -> None:
    report = dpverify.check_forward_loss_average(_NearConvergedHead(), _near_converged(5), device_ids=[0, 1])
    assert report.chunk_sizes == (3, 2)
    assert report.is_biased
    assert report.grad_bias > 0.01


def _attention_adam_scenario() -> TrainingScenario:
    # the fuzz session's false alarm, shrunk: one attention layer of width 1, Adam, float64
    model = ModelSpec(kind="attention", features=1, hidden=1, outputs=2, depth=1, activation="relu", pooling="mean", train=True, p=0.5)
    scenario = Scenario(
        model=model, batch_size=2, devices=DeviceList(device_ids=(0, 1), output_device=None),
        loss=LossSpec(name="mse", reduction="mean"), dtype=torch.float64, seed=0,
    )
    adam = OptimizerSpec(name="adam", lr=0.001, momentum=0.0, weight_decay=0.0)
    return TrainingScenario(scenario=scenario, optimizer=adam, steps=1, clip=None, micro_batches=1, dp=True)


def test_adam_on_a_gradient_that_cancels_to_rounding_passes() -> None:
    # The key bias of attention has a zero gradient in exact arithmetic (softmax ignores a
    # shift of every score); computed, it is rounding noise, which Adam's m / (sqrt(v) + eps)
    # turns into an update lr/eps = 1e5 times that noise, different on every split. The
    # float64 anchor of a float64 run cannot show that rounding; the jittered second run does.
    scenario = _attention_adam_scenario()
    report = CHECKS["dp-training"].check(Case.from_scenario(scenario), Target().with_defaults(**scenario.code()))
    assert isinstance(report, StepComparison)
    assert report.ok  # a failure raises


def test_adam_still_sees_a_relative_gradient_error_of_1e_4() -> None:
    # Adam's update is scale-invariant, but its first moment is not: the error shows there,
    # beyond the jittered run's rounding
    scenario = _attention_adam_scenario()
    case = Case.from_scenario(scenario)
    with pytest.raises(ParallelMismatch, match="exp_avg"):
        CHECKS["dp-training"].check(case, Target(parallel=TinyErrorDataParallel).with_defaults(**scenario.code()))
