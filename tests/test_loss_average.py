"""check_forward_loss_average and assert_loss_reduction_matches_full_batch."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function_variadic

import dpverify
from dpverify import InvalidArgument, ParallelMismatch
from dpverify.models.builtin import LossHead, builtin_case

Out = namedtuple("Out", ["prediction", "loss"])


def weighted(losses: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return (losses * torch.tensor(sizes, dtype=losses.dtype)).sum() / sum(sizes)


def mean(losses: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return losses.mean()


@pytest.mark.parametrize(
    ("batch", "ids", "biased"),
    [(8, [0, 1], False), (6, [0, 1, 2, 3], False), (5, [0, 1, 2, 3], True), (7, [0, 1], True), (2, [0, 1, 2, 3], False)],
)
def test_report_is_biased_exactly_when_chunks_are_uneven(batch: int, ids: list[int], biased: bool) -> None:
    case = builtin_case("loss-in-forward", batch=batch)
    report = dpverify.check_forward_loss_average(case.module, case.inputs, device_ids=ids)
    assert report.chunk_sizes == tuple(dpverify.chunk_sizes(batch, len(ids)))
    assert report.is_biased is biased
    assert report.weighted_mean == pytest.approx(report.full_batch_loss, rel=1e-12)
    assert report.weighted_grad_error < 1e-12
    # the bias is exactly what the chunk weights predict
    assert report.loss_bias == pytest.approx(report.predicted_bias, rel=1e-9, abs=1e-14)
    assert (report.grad_bias > 1e-6) is biased
    assert len(report.replica_losses) == len(report.chunk_sizes)


def test_report_for_five_rows_on_four_devices() -> None:
    case = builtin_case("loss-in-forward", batch=5)
    report = dpverify.check_forward_loss_average(case.module, case.inputs, device_ids=[0, 1, 2, 3])
    assert report.sample_weights == pytest.approx((1 / 6, 1 / 6, 1 / 3))
    text = str(report)
    assert "chunk sizes [2, 2, 1], 3 replicas used" in text
    assert "[1/6, 1/6, 1/3] instead of 1/B = 1/5" in text
    assert "Fix: weight each replica's loss by n_i/B" in text
    unbiased = str(dpverify.check_forward_loss_average(case.module, case.inputs, device_ids=[0]))
    assert "equals the full-batch loss here because the chunks are equal" in unbiased


class DictLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.linear(x).squeeze(-1)
        return {"prediction": prediction, "loss": F.l1_loss(prediction, y)}


class NamedLoss(DictLoss):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Out:  # type: ignore[override]
        out = super().forward(x, y)
        return Out(out["prediction"], out["loss"])


class ScalarLoss(DictLoss):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, y)["loss"]


class LossFirst(DictLoss):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x, y)
        return out["loss"], out["prediction"]


@pytest.mark.parametrize(("cls", "loss_at"), [(DictLoss, -1), (NamedLoss, -1), (ScalarLoss, -1), (LossFirst, 0)])
def test_loss_found_in_every_output_shape(cls: type[nn.Module], loss_at: int) -> None:
    torch.manual_seed(0)
    inputs = (torch.randn(5, 3), torch.randn(5))
    report = dpverify.check_forward_loss_average(cls(), inputs, device_ids=[0, 1, 2, 3], loss_at=loss_at)
    assert report.is_biased
    dpverify.assert_loss_reduction_matches_full_batch(cls(), inputs, device_ids=[0, 1, 2, 3], reduce=weighted, loss_at=loss_at)


@pytest.mark.parametrize(("batch", "ids"), [(5, [0, 1, 2, 3]), (7, [0, 1])])
def test_mean_reduction_fails_on_uneven_chunks_with_the_bias(batch: int, ids: list[int]) -> None:
    case = builtin_case("loss-in-forward", batch=batch)
    with pytest.raises(ParallelMismatch, match=r"(?s)The reduced per-replica loss must equal the full-batch loss.*\(bias [+-]\d") as caught:
        dpverify.assert_loss_reduction_matches_full_batch(case.module, case.inputs, device_ids=ids, reduce=mean)
    assert "The chunks are uneven" in str(caught.value)
    dpverify.assert_loss_reduction_matches_full_batch(case.module, case.inputs, device_ids=ids, reduce=weighted)


@pytest.mark.parametrize(("batch", "ids"), [(8, [0, 1]), (2, [0, 1, 2, 3]), (4, [0])])
def test_mean_reduction_passes_on_equal_chunks(batch: int, ids: list[int]) -> None:
    case = builtin_case("loss-in-forward", batch=batch)
    result = dpverify.assert_loss_reduction_matches_full_batch(case.module, case.inputs, device_ids=ids, reduce=mean)
    assert next(t.name for t in result.tensors) == "loss"


@pytest.mark.parametrize(
    ("loss_at", "match"),
    [(5, "loss_at=5 is out of range for the forward's 2 outputs"), ("loss", "loss_at='loss' must be an int index")],
)
def test_bad_loss_location(loss_at: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        dpverify.check_forward_loss_average(LossHead(), (torch.randn(4, 3), torch.randn(4)), device_ids=[0, 1], loss_at=loss_at)


def test_mapping_without_loss_key() -> None:
    class NoLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"out": self.linear(x)}

    with pytest.raises(InvalidArgument, match=r"mapping with keys \['out'\]; the loss must be under the key 'loss'"):
        dpverify.check_forward_loss_average(NoLoss(), torch.randn(4, 3), device_ids=[0, 1])


def test_per_sample_losses_are_rejected_with_the_reason() -> None:
    class PerSample(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).squeeze(-1)

    with pytest.raises(InvalidArgument, match="gathered into 4 values for 2 replicas"):
        dpverify.check_forward_loss_average(PerSample(), torch.randn(4, 3), device_ids=[0, 1])


def test_reduce_must_be_callable() -> None:
    with pytest.raises(InvalidArgument, match="reduce='mean' is not callable"):
        dpverify.assert_loss_reduction_matches_full_batch(LossHead(), (torch.randn(4, 3), torch.randn(4)), device_ids=[0, 1], reduce="mean")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- rounding noise


class Float32Loss(nn.Module):
    """Computes its loss in float32 even when cast to float64, as Hugging Face's causal LM
    loss does (``logits.float()``): its noise is float32's, not float64's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.linear(x).float(), y)


def _float32_case(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return Float32Loss(), (torch.randn(batch, 6), torch.randint(0, 5, (batch,)))


def test_float32_loss_in_a_float64_module_is_judged_by_float32_noise() -> None:
    module, inputs = _float32_case(8)
    report = dpverify.check_forward_loss_average(module, inputs, device_ids=[0, 1])
    assert report.chunk_sizes == (4, 4)
    assert not report.is_biased, str(report)
    assert report.loss_bias != 0  # float32 rounding is there, and is not called a bias
    assert abs(report.loss_bias) < 1e-5 * abs(report.full_batch_loss)
    assert report.grad_bias < 1e-5
    assert "uneven" not in str(report)
    assert "float32 rounding" in str(report)
    assert report.compute_dtype == "float32"
    assert report.loss_noise >= torch.finfo(torch.float32).eps * abs(report.full_batch_loss)
    assert report.weighted_is_exact

    # uneven chunks: biased, as the chunk weights predict up to float32 noise
    module, inputs = _float32_case(7)
    uneven = dpverify.check_forward_loss_average(module, inputs, device_ids=[0, 1])
    assert uneven.chunk_sizes == (4, 3)
    assert uneven.is_biased, str(uneven)
    assert uneven.weighted_is_exact
    assert abs(uneven.loss_bias - uneven.predicted_bias) < 10 * uneven.loss_noise
    assert abs(uneven.predicted_bias) > 100 * uneven.loss_noise
    assert uneven.grad_bias > 1e-3
    assert "Why: the chunks are uneven" in str(uneven)


def _float32_head(logits: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """A loss head that takes part in ``__torch_function__`` dispatch, as the functions of
    ``torch.nn.functional`` do, and returns a dict: a torch function mode sees the dict it
    returns, not the float32 ops inside it."""
    if has_torch_function_variadic(logits, y):
        result: dict[str, torch.Tensor] = handle_torch_function(_float32_head, (logits, y), logits, y)
        return result
    return {"loss": F.cross_entropy(logits.float(), y)}


class DictFloat32Loss(Float32Loss):
    """Returns a dict whose loss the head computed in float32, cast back to the module's
    dtype: only the head's dict shows that the loss was computed in float32."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = self.linear(x)
        return {"logits": logits, "loss": _float32_head(logits, y)["loss"].to(logits.dtype)}


def test_a_float32_loss_returned_in_a_dict_is_judged_by_float32_noise() -> None:
    torch.manual_seed(0)
    inputs = (torch.randn(8, 6), torch.randint(0, 5, (8,)))
    report = dpverify.check_forward_loss_average(DictFloat32Loss(), inputs, device_ids=[0, 1])
    assert report.compute_dtype == "float32"
    assert report.chunk_sizes == (4, 4)
    assert report.loss_bias != 0  # float32 rounding is there, and is not called a bias
    assert not report.is_biased, str(report)


class KeyBiasAttention(nn.Module):
    """One attention layer: the key projection's bias adds ``q_i . b`` to every score of
    query ``i``, which softmax ignores, so its gradient is zero in exact arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(4, 4)
        self.key = nn.Linear(4, 4)
        self.value = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ self.key(x).transpose(-1, -2)
        hidden = scores.softmax(-1) @ self.value(x)
        return F.mse_loss(self.out(hidden).mean(dim=(1, 2)), y)


class TwoFeatureNorm(nn.Module):
    """A LayerNorm over 2 features without epsilon outputs +-1 whatever its input, so the
    gradients of every layer before it are zero in exact arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 2)
        self.norm = nn.LayerNorm(2, eps=0.0)
        self.last = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.last(self.norm(self.first(x))).squeeze(-1), y)


@pytest.mark.parametrize(
    ("cls", "shape", "zero"),
    [(KeyBiasAttention, (6, 5, 4), ("key.bias",)), (TwoFeatureNorm, (6, 3), ("first.weight", "first.bias"))],
)
def test_gradients_zero_in_exact_arithmetic_are_not_called_biased(
    cls: type[nn.Module], shape: tuple[int, ...], zero: tuple[str, ...]
) -> None:
    torch.manual_seed(0)
    inputs = (torch.randn(*shape), torch.randn(shape[0]))
    report = dpverify.check_forward_loss_average(cls(), inputs, device_ids=[0, 1])
    assert report.chunk_sizes == (3, 3)
    assert not report.is_biased, str(report)
    by_name = dict(report.grad_bias_by_parameter)
    assert all(by_name[name] < 1e-12 for name in zero), by_name
    assert report.grad_bias < 1e-12
    assert report.weighted_grad_error < 1e-12
    assert "uneven" not in str(report)
    three = dpverify.check_forward_loss_average(cls(), inputs, device_ids=[0, 1, 2, 3])
    assert three.chunk_sizes == (2, 2, 2)
    assert not three.is_biased, str(three)
    # uneven chunks: biased, and the zero gradient still reads as (near) zero difference
    five = (inputs[0][:5], inputs[1][:5])
    biased = dpverify.check_forward_loss_average(cls(), five, device_ids=[0, 1])
    assert biased.is_biased, str(biased)
    assert all(dict(biased.grad_bias_by_parameter)[name] < 1e-12 for name in zero)


class SummedLoss(DictLoss):
    """Returns its chunk's summed loss, not the per-row mean: wrong for any split."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.l1_loss(self.linear(x).squeeze(-1), y, reduction="sum")


def test_even_chunks_biased_for_another_reason_never_blame_unevenness() -> None:
    torch.manual_seed(0)
    inputs = (torch.randn(6, 3), torch.randn(6))
    report = dpverify.check_forward_loss_average(SummedLoss(), inputs, device_ids=[0, 1])
    assert report.chunk_sizes == (3, 3)
    assert report.is_biased
    text = str(report)
    assert "uneven" not in text
    assert "the replica losses are not the per-row means of their chunks" in text
    assert "the chunks [3, 3] are equal" in text
    assert not report.weighted_is_exact
    # with uneven chunks both reasons are given
    uneven = str(dpverify.check_forward_loss_average(SummedLoss(), (inputs[0][:5], inputs[1][:5]), device_ids=[0, 1]))
    assert "the chunks are uneven" in uneven
    assert "the replica losses are not the per-row means" in uneven


def _builtin_even() -> tuple[nn.Module, Any]:
    case = builtin_case("loss-in-forward", batch=8)
    return case.module, case.inputs


def _attention_even() -> tuple[nn.Module, Any]:
    torch.manual_seed(1)
    return KeyBiasAttention(), (torch.randn(4, 5, 4), torch.randn(4))


def _summed_even() -> tuple[nn.Module, Any]:
    torch.manual_seed(2)
    return SummedLoss(), (torch.randn(8, 3), torch.randn(8))


@pytest.mark.parametrize("make", [_builtin_even, lambda: _float32_case(8), _attention_even, _summed_even])
def test_even_chunks_never_read_uneven(make: Any) -> None:
    module, inputs = make()
    for ids in ([0, 1], [0, 1, 2, 3], [0]):
        report = dpverify.check_forward_loss_average(module, inputs, device_ids=ids)
        assert len(set(report.chunk_sizes)) == 1
        assert "uneven" not in str(report), str(report)


def test_frozen_parameters_are_left_out_of_the_gradient_comparison() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(3, 4).requires_grad_(False)
            self.out = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.out(torch.tanh(self.frozen(x))), y)

    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    report = dpverify.check_forward_loss_average(Head(), (x, y), device_ids=[0, 1])
    assert report.is_biased
    assert [name for name, _ in report.grad_bias_by_parameter] == ["out.weight", "out.bias"]
