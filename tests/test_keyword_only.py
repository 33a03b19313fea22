"""Keyword-only forwards (``model(**batch)``, as trainers call models): ``inputs=()`` with
the batch in ``forward_kwargs`` on every DataParallel check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify.registry import CHECKS, Case


class _KeywordOnly(nn.Module):
    """forward(*, input_ids, labels=None): the output, or its mean loss given labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = self.linear(input_ids)
        return out if labels is None else F.mse_loss(out, labels)


def _batch(rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 3, generator=generator)


@pytest.mark.parametrize("helper", [dpverify.assert_dp_grads_match, dpverify.assert_grad_sum_equals_mean_loss_grad])
def test_the_gradient_checks_take_a_keyword_only_batch(helper: object) -> None:
    x, y = _batch()
    result = helper(_KeywordOnly(), (), y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], forward_kwargs={"input_ids": x})  # type: ignore[operator]
    assert "chunk sizes [2, 2, 1]" in result.scenario


def test_the_replicas_rows_are_read_from_the_keyword_tensors() -> None:
    x, y = _batch()
    result = dpverify.assert_grad_sum_equals_mean_loss_grad(_KeywordOnly(), (), y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], forward_kwargs={"input_ids": x})
    assert result.notes[0] == "3 replicas contributed (chunks [2, 2, 1])."


def test_the_loss_checks_take_a_keyword_only_batch() -> None:
    x, y = _batch()
    kwargs = {"input_ids": x, "labels": y}
    report = dpverify.check_forward_loss_average(_KeywordOnly(), (), device_ids=[0, 1, 2], forward_kwargs=kwargs)
    assert report.chunk_sizes == (2, 2, 1)
    assert report.is_biased
    dpverify.assert_loss_reduction_matches_full_batch(_KeywordOnly(), (), device_ids=[0, 1, 2], reduce=dpverify.chunk_weighted_loss, forward_kwargs=kwargs)
    with pytest.raises(dpverify.ParallelMismatch):
        dpverify.assert_loss_reduction_matches_full_batch(_KeywordOnly(), (), device_ids=[0, 1, 2], reduce=lambda losses, sizes: losses.mean(), forward_kwargs=kwargs)


def test_registry_cases_with_a_keyword_only_batch() -> None:
    x, y = _batch()
    grads = Case(_KeywordOnly(), (), y, F.mse_loss, (0, 1, 2), forward_kwargs={"input_ids": x})
    assert grads.batch_size == 5
    assert CHECKS["dp-grads"].run(grads).verdict is dpverify.Verdict.PASS
    loss = Case(_KeywordOnly(), (), device_ids=(0, 1, 2), forward_kwargs={"input_ids": x, "labels": y})
    assert CHECKS["dp-loss-average"].run(loss).verdict is dpverify.Verdict.WARN


def test_an_empty_call_is_named() -> None:
    _x, y = _batch()
    with pytest.raises(dpverify.InvalidArgument, match=r"inputs=\(\) is empty; .* forward_kwargs"):
        dpverify.assert_dp_grads_match(_KeywordOnly(), (), y, loss_fn=F.mse_loss, device_ids=[0, 1])
    with pytest.raises(dpverify.InvalidArgument, match="forward_kwargs holds no tensor with a batch dimension"):
        dpverify.assert_dp_grads_match(_KeywordOnly(), (), y, loss_fn=F.mse_loss, device_ids=[0, 1], forward_kwargs={"input_ids": 3})
