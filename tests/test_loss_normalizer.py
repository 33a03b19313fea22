"""Losses divided by a count given to forward (the trainers' ``num_items_in_batch``): the
single-device and the parallel call each get their own count (``per_call_kwargs``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_loss_tokens import tiny_gpt2
from torch import nn

import dpverify

VOCAB = 11


class _SummedTokens(nn.Module):
    """The summed token cross-entropy over ``num_items_in_batch`` (the mean when not given)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, VOCAB)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(input_ids))).reshape(-1, VOCAB)
        if num_items_in_batch is None:
            return F.cross_entropy(logits, labels.reshape(-1))
        summed = F.cross_entropy(logits, labels.reshape(-1), reduction="sum")
        result: torch.Tensor = summed / num_items_in_batch
        return result


def _batch(padding: list[int]) -> dict[str, torch.Tensor]:
    """8 rows of 5 tokens; row r loses its last ``padding[r]`` labels to -100."""
    ids = torch.randint(1, VOCAB, (8, 5), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    for row, pad in enumerate(padding):
        if pad:
            labels[row, -pad:] = -100
    return {"input_ids": ids, "labels": labels}


def _trainer(count: int) -> Any:
    """What a trainer passes without averaging tokens across devices: the count, and on n
    devices count // n for each (a tensor expanded to (n, 1), which DataParallel scatters)."""

    def per_call(devices: int) -> dict[str, torch.Tensor]:
        n = torch.tensor(count)
        if devices > 1:
            n = (n // devices).unsqueeze(0).expand(devices, -1)
        return {"num_items_in_batch": n}

    return per_call


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"] != -100).sum())


def test_the_trainer_recipe_is_exact_when_the_count_divides_evenly() -> None:
    batch = _batch([1, 1, 1, 1, 0, 0, 0, 0])  # 36 tokens on 4 devices: 9 each
    assert _tokens(batch) == 36
    report = dpverify.check_forward_loss_average(_SummedTokens(), (), device_ids=[0, 1, 2, 3], forward_kwargs=batch, per_call_kwargs=_trainer(36))
    assert report.normalizer == "num_items_in_batch"
    assert report.normalizer_full == 36
    assert report.normalizer_given == (9, 9, 9, 9)
    assert not report.is_biased
    dpverify.assert_loss_reduction_matches_full_batch(
        _SummedTokens(), (), device_ids=[0, 1, 2, 3], reduce=lambda losses, sizes: losses.mean(),
        forward_kwargs=batch, per_call_kwargs=_trainer(36),
    )


def test_the_trainer_recipe_is_biased_by_what_the_counts_predict_when_it_does_not() -> None:
    batch = _batch([1, 2, 0, 0, 0, 4, 0, 0])  # 33 tokens on 4 devices: 8 each, 32 in all
    count = _tokens(batch)
    assert count == 33
    report = dpverify.check_forward_loss_average(_SummedTokens(), (), device_ids=[0, 1, 2, 3], forward_kwargs=batch, per_call_kwargs=_trainer(count))
    assert report.normalizer_given == (8, 8, 8, 8)
    assert report.is_biased
    assert report.predicted_bias == pytest.approx(report.loss_bias, rel=1e-9)
    # 32 where 33 is right: loss.mean() is the full-batch loss times 33/32
    assert report.mean_of_means == pytest.approx(report.full_batch_loss * 33 / 32, rel=1e-12)
    text = str(report)
    assert "the replicas got [8, 8, 8, 8], which add up to 32" in text
    assert "Fix: give every replica the whole count 33 and add the replica losses" in text
    with pytest.raises(dpverify.ParallelMismatch, match=r"Each replica divided by the num_items_in_batch it was given, \[8.0, 8.0, 8.0, 8.0\]"):
        dpverify.assert_loss_reduction_matches_full_batch(
            _SummedTokens(), (), device_ids=[0, 1, 2, 3], reduce=lambda losses, sizes: losses.mean(),
            forward_kwargs=batch, per_call_kwargs=_trainer(count),
        )


def test_the_whole_count_and_a_sum_of_replica_losses_is_exact() -> None:
    batch = _batch([1, 2, 0, 0, 0, 4, 0, 0])
    count = _tokens(batch)

    def whole(devices: int) -> dict[str, torch.Tensor]:
        n = torch.tensor(count)
        return {"num_items_in_batch": n.unsqueeze(0).expand(devices, -1) if devices > 1 else n}

    dpverify.assert_loss_reduction_matches_full_batch(
        _SummedTokens(), (), device_ids=[0, 1, 2, 3], reduce=lambda losses, sizes: losses.sum(),
        forward_kwargs=batch, per_call_kwargs=whole,
    )


def test_bad_per_call_kwargs_are_named() -> None:
    batch = _batch([0] * 8)
    with pytest.raises(dpverify.InvalidArgument, match="per_call_kwargs"):
        dpverify.check_forward_loss_average(_SummedTokens(), (), device_ids=[0, 1], forward_kwargs=batch, per_call_kwargs=3)  # type: ignore[arg-type]
    with pytest.raises(dpverify.InvalidArgument, match=r"per_call_kwargs\(1\) returned int"):
        dpverify.check_forward_loss_average(_SummedTokens(), (), device_ids=[0, 1], forward_kwargs=batch, per_call_kwargs=lambda devices: 40)  # type: ignore[arg-type,return-value]
    with pytest.raises(dpverify.InvalidArgument, match=r"both give \['labels'\]"):
        dpverify.check_forward_loss_average(_SummedTokens(), (), device_ids=[0, 1], forward_kwargs=batch, per_call_kwargs=lambda devices: {"labels": batch["labels"]})


def test_a_hugging_face_model_with_num_items_in_batch() -> None:
    model = tiny_gpt2()
    assert model.config.vocab_size == VOCAB
    batch = _batch([1, 2, 0, 0, 0, 4, 0, 0])
    count = int((batch["labels"][:, 1:] != -100).sum())  # the causal head skips each row's first label
    report = dpverify.check_forward_loss_average(model, (), device_ids=[0, 1, 2, 3], forward_kwargs=batch, per_call_kwargs=_trainer(count))
    assert report.is_biased == (count % 4 != 0)
    assert abs(report.predicted_bias - report.loss_bias) <= 8 * report.loss_noise  # GPT-2's loss is float32
