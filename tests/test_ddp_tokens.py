"""Token-level losses and keyword-only batches under real DDP on gloo ranks: a language-model
loss is a mean over the labels that are not -100, so ranks and micro-batches of equal rows
but different numbers of real tokens make the plain recipes (DDP's average of rank means,
a micro-batch's mean over the number of micro-batches) biased."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.checks import assert_ddp_accumulation_matches, assert_ddp_grads_match
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.ddp.rank import ShardContext, ddp_step
from dpverify.registry import CHECKS, Case, Target, Verdict

VOCAB, WIDTH, LENGTH = 11, 6, 6


class TinyLM(nn.Module):
    """Embedding and a linear head, called as trainers call a model: ``model(input_ids=...)``."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, *, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.tanh(self.embed(input_ids)))
        return logits


def token_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The mean over the tokens whose label is not ``ignore_index``."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=ignore_index)


def padded(lengths: list[int], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids of ``len(lengths)`` rows, and labels that are -100 past each row's length."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (len(lengths), LENGTH), generator=generator)
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
        labels[row, length:] = -100
    return ids, labels


#: Two rows per rank on two ranks: rank 0 holds 12 real tokens, rank 1 holds 5.
LENGTHS = [6, 6, 2, 3]


def f64_loss(ids: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float(token_loss(TinyLM().double()(input_ids=ids), labels))


# --------------------------------------------------------------------------- rank steps
# Top-level functions: the ranks unpickle them by name.


def summed_over_all_reduced_count(ctx: ShardContext) -> Any:
    """The recipe of the trainers: the rank's summed token loss over the all-reduced count of
    real tokens, times world_size (DDP divides the summed gradients by it)."""
    model = ctx.ddp()
    logits = model(*ctx.inputs, **ctx.kwargs)
    summed = F.cross_entropy(logits.reshape(-1, VOCAB), ctx.target.reshape(-1), ignore_index=-100, reduction="sum")
    count = (ctx.target != -100).sum().to(logits.dtype)
    dist.all_reduce(count)
    assert int(count) == ctx.total_items  # what the check counted is what the ranks count
    (summed / count * ctx.world_size).backward()
    return logits


def micro_mean_over_k(ctx: ShardContext) -> None:
    """Accumulation that divides each micro-batch's token-mean loss by the number of
    micro-batches (``loss / gradient_accumulation_steps``)."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        with contextlib.nullcontext() if index == len(parts) - 1 else model.no_sync():
            (ctx.loss_fn(model(**part.kwargs), part.target) / len(parts)).backward()


def micro_sum_over_total_count(ctx: ShardContext) -> None:
    """Accumulation that divides each micro-batch's summed token loss by the count of real
    tokens over every micro-batch and rank (all-reduced once), times world_size."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    count = sum((part.target != -100).sum() for part in parts).to(torch.float32)
    dist.all_reduce(count)
    for index, part in enumerate(parts):
        with contextlib.nullcontext() if index == len(parts) - 1 else model.no_sync():
            logits = model(**part.kwargs)
            summed = F.cross_entropy(logits.reshape(-1, VOCAB), part.target.reshape(-1), ignore_index=-100, reduction="sum")
            (summed / count * ctx.world_size).backward()


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found is not None, f"{pattern!r} not in:\n{text}"
    return float(found.group(1))


# --------------------------------------------------------------------------- one step


def test_plain_ddp_step_on_padded_labels_is_the_token_trap_with_its_predicted_size(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded(LENGTHS)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(TinyLM(), (), labels, loss_fn=token_loss, world_size=2, step=ddp_step, pool=ddp_pool, forward_kwargs={"input_ids": ids})
    text = str(caught.value)
    assert "falls into the loss-averaging trap" in text
    assert "tokens: [12, 5] (target != -100), 17 in all, on shards [2, 2], although the shards have equal rows" in text
    assert "[1/24, 1/10] instead of 1/T = 1/17" in text
    # the bias the counts predict, sum((1/W - t_r/T) * L_r), from the ranks' own mean losses
    shard_losses = [f64_loss(ids[a:b], labels[a:b]) for a, b in ((0, 2), (2, 4))]
    predicted = sum((0.5 - t / 17) * loss for t, loss in zip([12, 5], shard_losses, strict=True))
    assert abs(predicted) > 1e-3  # a trap worth the name: the test can tell it from zero
    assert _number(r"the token counts predict ([-+][0-9.e+-]+)\)", text) == pytest.approx(predicted, rel=1e-2)
    # and the plain step really was that far off: mean of the rank means minus the full loss
    measured = sum(shard_losses) / 2 - f64_loss(ids, labels)
    assert _number(r"\(bias ([-+][0-9.e+-]+);", text) == pytest.approx(measured, rel=1e-2)


def test_token_weighted_steps_pass(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded(LENGTHS)
    result = assert_ddp_grads_match(TinyLM(), (), labels, loss_fn=token_loss, world_size=2, pool=ddp_pool, forward_kwargs={"input_ids": ids})
    assert result.ok
    assert "step weighted_ddp_step" in result.scenario  # the default weights each rank by t_r * W / T
    assert any("t_r * world_size / T = [1.412, 0.5882]" in note for note in result.notes)
    assert any(c.mismatched for c in result.contrasts)  # plain ddp_step, shown for contrast, is off
    # a step that never reads the check's counts: the sum over the all-reduced token count
    assert assert_ddp_grads_match(
        TinyLM(), (), labels, loss_fn=token_loss, world_size=2, step=summed_over_all_reduced_count, pool=ddp_pool, forward_kwargs={"input_ids": ids},
    ).ok


def test_a_keyword_only_batch_is_sharded_in_the_helper_and_the_registry(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded([6, 5, 6, 5])  # equal tokens per rank: the plain step is exact
    kwargs = {"input_ids": ids}
    result = assert_ddp_grads_match(TinyLM(), (), labels, loss_fn=token_loss, world_size=2, pool=ddp_pool, forward_kwargs=kwargs)
    assert "rank 1 output[2:4]" in [t.name for t in result.tensors]  # rank 1 got rows 2:4 of input_ids
    assert "step ddp_step" in result.scenario
    assert not any("loss-averaging trap" in note for note in result.notes)  # tokens proportional to rows
    case = Case(TinyLM(), (), labels, token_loss, device_ids=(0, 1), forward_kwargs=kwargs)
    assert CHECKS["ddp-grads"].run(case, Target(pool=ddp_pool)).verdict is Verdict.PASS
    uneven = Case(TinyLM(), (), padded(LENGTHS)[1], token_loss, device_ids=(0, 1), forward_kwargs={"input_ids": padded(LENGTHS)[0]})
    assert CHECKS["ddp-grads"].run(uneven, Target(pool=ddp_pool)).verdict is Verdict.PASS
    caught = CHECKS["ddp-grads"].run(uneven, Target(pool=ddp_pool, step=ddp_step))
    assert caught.verdict is Verdict.FAIL
    assert "loss-averaging trap" in caught.detail


# --------------------------------------------------------------------------- accumulation


def test_accumulation_must_divide_by_the_total_token_count(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded([6, 2, 5, 3])  # one row per micro-batch: [[6, 2], [5, 3]] tokens
    common: dict[str, Any] = {"loss_fn": token_loss, "world_size": 2, "micro_batches": 2, "pool": ddp_pool, "forward_kwargs": {"input_ids": ids}}
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_accumulation_matches(TinyLM(), (), labels, step=micro_mean_over_k, **common)
    text = str(caught.value)
    assert "The step's gradients equal those of dividing each micro-batch's mean loss by the number of micro-batches, 2" in text
    assert "[[6, 2], [5, 3]] (target != -100) per rank, 16 in all" in text
    losses = [f64_loss(ids[i : i + 1], labels[i : i + 1]) for i in range(4)]
    predicted = sum((1 / 4 - t / 16) * loss for t, loss in zip([6, 2, 5, 3], losses, strict=True))
    assert abs(predicted) > 1e-3
    assert _number(r"predict a bias of ([-+][0-9.e+-]+) in the loss it optimises", text) == pytest.approx(predicted, rel=1e-2)
    assert assert_ddp_accumulation_matches(TinyLM(), (), labels, step=micro_sum_over_total_count, **common).ok
    assert assert_ddp_accumulation_matches(TinyLM(), (), labels, **common).ok  # no_sync_accumulation_step weights by tokens


# --------------------------------------------------------------------------- items= and bad input


def test_items_given_wrong_is_a_clear_failure_and_right_passes(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded(LENGTHS)
    common: dict[str, Any] = {"loss_fn": token_loss, "world_size": 2, "pool": ddp_pool, "forward_kwargs": {"input_ids": ids}}

    def rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        return int(args[-1].size(0))  # the shard's target comes last: its rows, not its tokens

    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(TinyLM(), (), labels, items=rows, **common)
    text = str(caught.value)
    assert "items= counts [2, 2] do not match the loss" in text
    assert "The counts tokens (target != -100), [12, 5], reproduce it" in text
    tokens = assert_ddp_grads_match(TinyLM(), (), labels, items=lambda args, kwargs: int((args[-1] != -100).sum()), **common)
    assert tokens.ok
    assert "step weighted_ddp_step" in tokens.scenario  # the counts given drive the default step


def test_bad_keyword_batches_and_items_are_argument_errors(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded(LENGTHS)
    common: dict[str, Any] = {"loss_fn": token_loss, "world_size": 2, "pool": ddp_pool}
    with pytest.raises(InvalidArgument, match=r"items=3 is not callable"):
        assert_ddp_grads_match(TinyLM(), (), labels, forward_kwargs={"input_ids": ids}, items=3, **common)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"forward_kwargs='input_ids' is str; pass a mapping"):
        assert_ddp_grads_match(TinyLM(), (), labels, forward_kwargs="input_ids", **common)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"inputs=\(\) is empty"):
        assert_ddp_grads_match(TinyLM(), (), labels, **common)
    with pytest.raises(InvalidArgument, match=r"forward_kwargs holds no tensor with a batch dimension"):
        assert_ddp_accumulation_matches(TinyLM(), (), labels, forward_kwargs={"input_ids": 3}, micro_batches=2, **common)
    with pytest.raises(InvalidArgument, match=r"(?s)forward_kwargs=.* cannot be pickled"):
        assert_ddp_grads_match(TinyLM(), (), labels, forward_kwargs={"input_ids": ids, "hook": lambda x: x}, **common)
