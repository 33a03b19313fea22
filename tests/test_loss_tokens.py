"""Token-level losses: each replica's loss is a mean over its non-ignored tokens, so
averaging replica losses is biased even on chunks of equal rows, by what the token counts
predict; weighting by the token counts is exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dpverify
from dpverify.registry import CHECKS, Case

VOCAB = 11


class _TokenHead(nn.Module):
    """forward(*, input_ids, labels): the mean cross-entropy over labels that are not ignored."""

    def __init__(self, loss: nn.Module | None = None, shift: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, VOCAB)
        self.loss = loss if loss is not None else nn.CrossEntropyLoss()
        self.shift = shift

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        if self.shift:  # a causal head: token t predicts label t + 1
            logits, labels = logits[:, :-1], labels[:, 1:]
        result: torch.Tensor = self.loss(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return result


def _padded(rows: int = 8, length: int = 6, ignore: int = -100) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (rows, length), generator=generator)
    labels = ids.clone()
    keep = torch.randint(1, length + 1, (rows,), generator=generator)  # real tokens per row
    for row, n in enumerate(keep.tolist()):
        labels[row, n:] = ignore
    return {"input_ids": ids, "labels": labels}


def _report(model: nn.Module, batch: dict[str, torch.Tensor], devices: int = 4, **options: Any) -> dpverify.LossAverageReport:
    return dpverify.check_forward_loss_average(model, (), device_ids=list(range(devices)), forward_kwargs=batch, **options)


def _chunks(tensor: torch.Tensor, devices: int) -> list[torch.Tensor]:
    return list(tensor.chunk(devices))


def test_padded_labels_on_equal_chunks_are_biased_by_what_the_token_counts_predict() -> None:
    batch = _padded()
    report = _report(_TokenHead(), batch)
    assert report.chunk_sizes == (2, 2, 2, 2)
    assert report.items == "tokens (labels != -100)"
    assert report.item_counts == tuple(int((c != -100).sum()) for c in _chunks(batch["labels"], 4))
    assert report.unequal_items
    assert report.is_biased
    assert report.weighted_is_exact  # weighting by the token counts is the exact recipe
    assert report.predicted_bias == pytest.approx(report.loss_bias, rel=1e-9, abs=1e-12)
    assert report.weighted_mean == pytest.approx(report.full_batch_loss, rel=1e-12)
    text = str(report)
    assert "the replicas hold different numbers of tokens" in text
    assert "although the chunks have equal rows" in text
    assert "t_i/T" in text
    assert "the chunks are uneven" not in text


def test_a_causal_shift_is_found() -> None:
    batch = _padded()
    report = _report(_TokenHead(shift=True), batch)
    assert report.items == "tokens (labels != -100, shifted)"
    assert report.item_counts == tuple(int((c[:, 1:] != -100).sum()) for c in _chunks(batch["labels"], 4))
    assert report.weighted_is_exact


def test_the_losss_own_ignore_index_is_found() -> None:
    batch = _padded(ignore=0)
    report = _report(_TokenHead(nn.CrossEntropyLoss(ignore_index=0)), batch)
    assert report.items == "tokens (labels != 0)"
    assert report.weighted_is_exact


def test_without_padding_the_items_are_rows_and_equal_chunks_are_exact() -> None:
    batch = _padded()
    batch["labels"] = batch["input_ids"].clone()
    report = _report(_TokenHead(), batch)
    assert report.items == "rows"
    assert not report.is_biased
    # and uneven chunks of unpadded rows are the row-level trap
    uneven = _report(_TokenHead(), {k: v[:5] for k, v in batch.items()}, devices=4)
    assert uneven.items == "rows"
    assert uneven.is_biased
    assert uneven.weighted_is_exact


def test_items_overrides_the_count() -> None:
    batch = _padded()

    def tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return int((kwargs["labels"] != -100).sum())

    report = _report(_TokenHead(), batch, items=tokens)
    assert report.items == "items"
    assert report.weighted_is_exact
    # a wrong count: the weighting by it is not exact, and the report says so
    rows = _report(_TokenHead(), batch, items=lambda args, kwargs: len(kwargs["labels"]))
    assert not rows.weighted_is_exact
    with pytest.raises(dpverify.InvalidArgument, match="items= returned"):
        _report(_TokenHead(), batch, items=lambda args, kwargs: "many")
    with pytest.raises(dpverify.InvalidArgument, match="items"):
        _report(_TokenHead(), batch, items=3)


def test_a_reduce_that_takes_the_item_counts() -> None:
    batch = _padded()
    received: list[list[int]] = []

    def by_tokens(losses: torch.Tensor, sizes: list[int], counts: list[int]) -> torch.Tensor:
        received.append(counts)
        return dpverify.chunk_weighted_loss(losses, counts)

    result = dpverify.assert_loss_reduction_matches_full_batch(_TokenHead(), (), device_ids=[0, 1, 2, 3], reduce=by_tokens, forward_kwargs=batch)
    assert received == [[int((c != -100).sum()) for c in _chunks(batch["labels"], 4)]]
    assert "Each replica's loss is a mean over its tokens (labels != -100)" in "\n".join(result.notes)
    # weighting by rows, the two-argument recipe, is not exact for a token mean
    with pytest.raises(dpverify.ParallelMismatch, match="t_i/T"):
        dpverify.assert_loss_reduction_matches_full_batch(_TokenHead(), (), device_ids=[0, 1, 2, 3], reduce=dpverify.chunk_weighted_loss, forward_kwargs=batch)


def test_the_registry_warns_with_the_token_counts() -> None:
    batch = _padded()
    case = Case(_TokenHead(), (), device_ids=(0, 1, 2, 3), forward_kwargs=batch)
    result = CHECKS["dp-loss-average"].run(case)
    assert result.verdict is dpverify.Verdict.WARN
    assert "weight by t_i/T, tokens" in result.summary
    # the exact recipe is the weighting by tokens, and it passes; weighting by rows does not
    assert CHECKS["dp-weighted-loss"].run(case).verdict is dpverify.Verdict.PASS
    by_rows = dpverify.Target(reduce=dpverify.chunk_weighted_loss)
    assert CHECKS["dp-weighted-loss"].run(case, by_rows).verdict is dpverify.Verdict.FAIL


def tiny_gpt2() -> nn.Module:
    """A one-layer GPT-2 over ``VOCAB`` tokens, built from its config (nothing downloaded),
    in eval mode (no dropout); skips the test where transformers is missing."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
    model: nn.Module = transformers.GPT2LMHeadModel(config).eval()
    return model


def test_the_hf_gpt2_keyword_only_call_with_padded_labels() -> None:
    model = tiny_gpt2()
    batch = _padded()
    report = _report(model, batch)
    assert report.items == "tokens (labels != -100, shifted)"
    assert report.is_biased
    assert report.weighted_is_exact
    assert abs(report.predicted_bias - report.loss_bias) <= 8 * report.loss_noise  # GPT-2's loss is float32


def test_a_replica_without_tokens_is_named() -> None:
    batch = _padded()
    batch["labels"][2:4] = -100  # replica 1's chunk: every label ignored
    report = _report(_TokenHead(), batch)
    assert report.replica_losses[1] != report.replica_losses[1]  # NaN
    assert report.is_biased  # never a pass
    result = CHECKS["dp-loss-average"].run(Case(_TokenHead(), (), device_ids=(0, 1, 2, 3), forward_kwargs=batch))
    assert result.verdict is dpverify.Verdict.WARN
    assert result.summary == "loss.mean() is NaN (chunks [2, 2, 2, 2]): replica 1 averaged over no items"
    text = str(report)
    assert "loss.mean() is NaN: replica 1 returned NaN while the full-batch loss is finite." in text
    assert "holds no counted item" in text
