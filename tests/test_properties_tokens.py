"""Token-level losses as properties: a language-model head on drawn padded token batches
(right or left padding, ignore index -100, 0 or -1, rows of padding only) split over 2 to 4
devices. Each replica's loss is a mean over its tokens (labels that are not the ignore index,
after the shift for a causal head), so ``loss.mean()`` of the replica losses is biased exactly
when the replicas hold different numbers of tokens, by what those counts predict, and
weighting each replica by its share of the tokens (t_i/T) is exact.

The token counts are computed here from the drawn labels, independently of dpverify's own
counting. Each property is a function that ``test_every_property_fails_on_a_head_that_breaks_it``
also runs on heads that break it: none passes by construction."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from torch import nn

import dpverify
from dpverify.models.specs import LanguageModelHead
from dpverify.strategies import (
    DeviceList,
    ModelSpec,
    TokenBatch,
    TokenScenario,
    device_lists,
    token_scenarios,
)

# one row (or fewer rows than devices) often makes one replica, where loss.mean() is
# trivially exact: the properties are about two or more
TOKENS = token_scenarios(devices=device_lists(min_devices=2, max_devices=4)).filter(lambda s: len(s.chunk_sizes) > 1)

#: How many times the report's measured rounding noise the predicted and measured bias may
#: differ by: both are the same sums of the same replica losses, in another order.
NOISE_MARGIN = 8


def _token_counts(scenario: TokenScenario) -> list[int]:
    """The tokens each replica's loss averages over, from the labels themselves: the
    chunks torch.chunk makes, their labels that are not the ignore index, without each row's
    first label for a causal head."""
    labels = scenario.build().kwargs["labels"]
    counted = labels[:, 1:] if scenario.model.kind == "causal-lm-head" else labels
    return [int((chunk != scenario.batch.ignore_index).sum()) for chunk in counted.chunk(len(scenario.devices.device_ids))]


def _report(scenario: TokenScenario, module: nn.Module | None = None) -> dpverify.LossAverageReport:
    s = scenario.build()
    return dpverify.check_forward_loss_average(
        s.module if module is None else module, s.inputs, device_ids=s.device_ids, forward_kwargs=s.kwargs,
    )


def _proportional(counts: list[int], others: list[int]) -> bool:
    """The same weights t_i/T: counts in proportion weight the replicas identically."""
    return all(c * sum(others) == o * sum(counts) for c, o in zip(counts, others, strict=True))


def _candidates(scenario: TokenScenario) -> dict[str, list[int]]:
    """Every count a loss over this batch may average over, by the report's name for it:
    labels (or input_ids, padded with id 0, which counts the same tokens when 0 is the
    ignore index) that are not the ignore index, whole or shifted."""
    s = scenario.build()
    n, ignore = len(scenario.devices.device_ids), scenario.batch.ignore_index
    found = {}
    for name in ("input_ids", "labels"):
        for shift in (False, True):
            tensor = s.kwargs[name][:, 1:] if shift else s.kwargs[name]
            found[f"tokens ({name} != {ignore}{', shifted' if shift else ''})"] = [int((c != ignore).sum()) for c in tensor.chunk(n)]
    return found


# -- the properties, as functions of a scenario and (to show they can fail) a module -----


def biased_exactly_when_the_token_counts_differ(scenario: TokenScenario, module: nn.Module | None = None) -> None:
    counts = _token_counts(scenario)
    assert min(counts) > 0  # what token_scenarios guarantees: no replica's loss is 0/0
    report = _report(scenario, module)
    unequal = len(set(counts)) > 1
    assert report.is_biased == unequal, f"token counts {counts}\n{report}"
    assert report.unequal_items == unequal


def the_token_counts_predict_the_bias(scenario: TokenScenario, module: nn.Module | None = None) -> None:
    report = _report(scenario, module)
    gap = abs(report.predicted_bias - report.loss_bias)
    assert gap <= NOISE_MARGIN * report.loss_noise, f"predicted {report.predicted_bias!r}, measured {report.loss_bias!r}\n{report}"
    # and so do the tokens counted here: sum((1/k - t_i/T) * loss_i)
    counts, losses = _token_counts(scenario), report.replica_losses
    ours = sum((1 / len(counts) - t / sum(counts)) * loss for t, loss in zip(counts, losses, strict=True))
    assert abs(ours - report.loss_bias) <= NOISE_MARGIN * report.loss_noise, f"tokens {counts} predict {ours!r}\n{report}"


def weighting_by_tokens_is_exact(scenario: TokenScenario, module: nn.Module | None = None) -> None:
    report = _report(scenario, module)
    assert report.weighted_is_exact, str(report)
    s = scenario.build()
    received: list[list[int]] = []

    def by_tokens(losses: torch.Tensor, sizes: list[int], counts: list[int]) -> torch.Tensor:
        received.append(counts)
        return dpverify.chunk_weighted_loss(losses, counts)

    dpverify.assert_loss_reduction_matches_full_batch(
        s.module if module is None else module, s.inputs, device_ids=s.device_ids, forward_kwargs=s.kwargs,
        reduce=by_tokens,
    )
    # the counts reduce received weight the replicas by their shares of the tokens
    assert len(received) == 1
    assert _proportional(received[0], _token_counts(scenario)), f"{received[0]} for tokens {_token_counts(scenario)}"


def the_item_counts_are_the_tokens(scenario: TokenScenario, module: nn.Module | None = None) -> None:
    counts, rows = _token_counts(scenario), scenario.chunk_sizes
    report = _report(scenario, module)
    assert list(report.chunk_sizes) == rows
    if _proportional(counts, rows):
        # tokens in proportion to rows weight the replicas as rows do: rows is the count
        assert report.items == "rows", str(report)
        assert list(report.item_counts) == rows
        return
    # The evidence (which counts reproduce the full-batch loss) tells counts apart only by the
    # weights they give: where another count of this batch is in proportion to the tokens (a
    # causal head's shifted count and the whole one agree on left-padded rows; equal counts
    # per replica are all in proportion), the report may name it, with its counts.
    alike = {name: c for name, c in _candidates(scenario).items() if _proportional(c, counts)}
    assert report.items in alike, f"token counts {counts}\n{report}"
    assert list(report.item_counts) == alike[report.items], str(report)
    if all(c == counts for c in alike.values()):
        assert list(report.item_counts) == counts, str(report)


PROPERTIES: dict[str, Callable[[TokenScenario, nn.Module | None], None]] = {
    "bias": biased_exactly_when_the_token_counts_differ,
    "prediction": the_token_counts_predict_the_bias,
    "weighting": weighting_by_tokens_is_exact,
    "counts": the_item_counts_are_the_tokens,
}


@given(TOKENS)
def test_loss_mean_is_biased_exactly_when_the_replicas_hold_different_numbers_of_tokens(scenario: TokenScenario) -> None:
    biased_exactly_when_the_token_counts_differ(scenario)


@given(TOKENS)
@pytest.mark.deep
def test_the_token_counts_predict_the_bias_of_loss_mean(scenario: TokenScenario) -> None:
    the_token_counts_predict_the_bias(scenario)


@given(TOKENS)
@pytest.mark.deep
def test_weighting_each_replica_by_its_share_of_the_tokens_is_the_full_batch(scenario: TokenScenario) -> None:
    weighting_by_tokens_is_exact(scenario)


@given(TOKENS)
def test_the_reported_item_counts_are_the_tokens_in_the_labels(scenario: TokenScenario) -> None:
    the_item_counts_are_the_tokens(scenario)


# -- every property can fail ----------------------------------------------------------------

#: Two chunks of two rows each, right-padded: 11 and 10 real tokens, 9 and 8 after the
#: causal shift; ignore index 0 (the padding id), so a loss that ignores -100 counts padding.
UNEQUAL = TokenBatch((6, 5, 4, 6), 6, "right", 0, seed=1)


class _OverEveryPosition(nn.Module):
    """The padding bug: the ignored labels are left out of the sum but not of the count."""

    def __init__(self, ignore_index: int) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits, labels, ignore_index=self.ignore_index, reduction="sum")
        return summed / labels.numel()


def _head(scenario: TokenScenario, loss: nn.Module, causal: bool | None = None) -> nn.Module:
    module = scenario.build().module
    assert isinstance(module, LanguageModelHead)
    module.loss = loss
    if causal is not None:
        module.causal = causal
    return module


def _scenario(kind: str) -> TokenScenario:
    return TokenScenario(ModelSpec(kind, hidden=4, activation="tanh"), UNEQUAL, DeviceList((0, 1)), torch.float64)


BROKEN: list[tuple[str, str, Callable[[TokenScenario], nn.Module]]] = [
    # a mean over every position, padding included, on equal rows: unbiased, though the
    # replicas hold different numbers of tokens
    ("bias", "lm-head", lambda s: _head(s, _OverEveryPosition(0))),
    # a summed loss: neither the prediction nor the token weighting reproduces it
    ("prediction", "lm-head", lambda s: _head(s, nn.CrossEntropyLoss(ignore_index=0, reduction="sum"))),
    ("weighting", "lm-head", lambda s: _head(s, nn.CrossEntropyLoss(ignore_index=0, reduction="sum"))),
    # a causal scenario whose head does not shift: it counts every row's first label
    ("counts", "causal-lm-head", lambda s: _head(s, nn.CrossEntropyLoss(ignore_index=0), causal=False)),
    # a head that ignores -100 while the padding is labelled 0: it counts the padding
    ("counts", "lm-head", lambda s: _head(s, nn.CrossEntropyLoss())),
]


@pytest.mark.parametrize(("name", "kind", "broken"), BROKEN)
def test_every_property_fails_on_a_head_that_breaks_it(name: str, kind: str, broken: Callable[[TokenScenario], nn.Module]) -> None:
    scenario = _scenario(kind)
    PROPERTIES[name](scenario, None)  # the correct head passes
    with pytest.raises((AssertionError, dpverify.ParallelMismatch)):
        PROPERTIES[name](scenario, broken(scenario))


def test_the_unequal_batch_holds_different_numbers_of_tokens_on_equal_rows() -> None:
    assert _scenario("lm-head").chunk_sizes == [2, 2]
    assert _token_counts(_scenario("lm-head")) == [11, 10]
    assert _token_counts(_scenario("causal-lm-head")) == [9, 8]
