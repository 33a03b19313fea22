"""check_forward_loss_average and assert_loss_reduction_matches_full_batch."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify import InvalidArgument, ParallelMismatch
from dpverify._builtin import LossHead, builtin_case

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
