"""check_forward_loss_average on tiny Hugging Face models that compute their own loss.

The configs are built here (nothing is downloaded). BERT computes its loss in float64 once
cast; GPT-2's LM head computes it in float32 (``logits.float()``) even then, so its noise
is float32's. Both return the mean loss of their chunk when given ``labels``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dpverify

transformers = pytest.importorskip("transformers")

VOCAB = 64
LENGTH = 8


def _bert() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
    )
    return transformers.BertForSequenceClassification(config).eval()  # eval: no dropout


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _tokens(batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(1))


def _bert_report(batch: int) -> dpverify.LossAverageReport:
    labels = torch.randint(0, 3, (batch,), generator=torch.Generator().manual_seed(2))
    return dpverify.check_forward_loss_average(
        _bert(), _tokens(batch), device_ids=[0, 1], forward_kwargs={"labels": labels}
    )


def _gpt2_report(batch: int, labels: torch.Tensor | None = None) -> dpverify.LossAverageReport:
    tokens = _tokens(batch)
    return dpverify.check_forward_loss_average(
        _gpt2(), tokens, device_ids=[0, 1],
        forward_kwargs={"labels": tokens if labels is None else labels},
    )


def test_bert_even_chunks_are_not_biased() -> None:
    report = _bert_report(4)
    assert report.chunk_sizes == (2, 2)
    assert not report.is_biased, str(report)
    assert report.compute_dtype == "float64"
    # attention key biases have gradients zero in exact arithmetic: no relative blow-up
    assert report.grad_bias < 1e-12, report.grad_bias_by_parameter
    assert abs(report.loss_bias) < 1e-14
    assert "uneven" not in str(report)


def test_bert_uneven_chunks_are_biased_as_predicted() -> None:
    report = _bert_report(5)
    assert report.chunk_sizes == (3, 2)
    assert report.is_biased
    assert report.weighted_grad_error < 1e-12  # no relative blow-up on zero gradients
    assert report.loss_bias == pytest.approx(report.predicted_bias, rel=1e-9)
    assert report.grad_bias > 1e-2
    assert "Why: the chunks are uneven" in str(report)
    assert report.weighted_is_exact


def test_gpt2_even_rows_have_equal_token_counts_so_are_not_biased() -> None:
    # A mean over shifted tokens: with no padding every row predicts LENGTH - 1 tokens, so
    # equal chunks hold equal token counts and loss.mean() is exact, up to float32 noise.
    report = _gpt2_report(4)
    assert report.chunk_sizes == (2, 2)
    assert not report.is_biased, str(report)
    assert abs(report.loss_bias) < 1e-5 * report.full_batch_loss
    assert report.grad_bias < 1e-5
    assert "uneven" not in str(report)
    assert report.compute_dtype == "float32"


def test_gpt2_uneven_rows_are_biased_as_predicted() -> None:
    report = _gpt2_report(5)
    assert report.chunk_sizes == (3, 2)
    assert report.is_biased
    assert report.weighted_is_exact
    assert abs(report.loss_bias - report.predicted_bias) < 10 * report.loss_noise
    assert "Why: the chunks are uneven" in str(report)


def test_gpt2_ignored_labels_make_even_chunks_biased_for_the_token_counts() -> None:
    # Replica 0's rows predict one token each (-100 ignores the rest), replica 1's seven:
    # each replica's mean is over its own tokens, so no weighting by rows can be exact; the
    # token counts (labels != -100, shifted by one as the causal head does) are found from
    # the evidence, predict the bias, and weighting by them is exact.
    labels = _tokens(4).clone()
    labels[:2, 2:] = -100
    report = _gpt2_report(4, labels)
    assert report.chunk_sizes == (2, 2)
    assert report.items == "tokens (labels != -100, shifted)"
    shifted = (labels[:, 1:] != -100).sum(dim=1)
    assert report.item_counts == (int(shifted[:2].sum()), int(shifted[2:].sum()))
    assert report.is_biased
    assert report.weighted_is_exact
    assert abs(report.predicted_bias - report.loss_bias) <= 8 * report.loss_noise  # float32 loss
    text = str(report)
    assert "uneven" not in text
    assert "the replicas hold different numbers of tokens" in text
    assert "although the chunks have equal rows" in text
    assert "t_i/T" in text
