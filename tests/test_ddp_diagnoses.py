"""DDP failures named by their real cause, from what the ranks were seen doing: a loss
all-reduced outside autograd, the one synchronisation of no_sync accumulation on the wrong
micro-batch, and the token trap only where the mismatch is the trap's. User-style steps,
each in a buggy and a fixed variant."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpverify.core.comparison import StepComparison
from dpverify.core.errors import ParallelMismatch
from dpverify.ddp.checks import assert_ddp_accumulation_matches, assert_ddp_grads_match
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.ddp.rank import ShardContext

VOCAB, WIDTH, LENGTH = 11, 6, 6


def mlp() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 5, generator=generator), torch.randn(rows, 2, generator=generator)


def _report(failure: ParallelMismatch) -> StepComparison:
    report = failure.report
    assert isinstance(report, StepComparison)
    return report


# --------------------------------------------------------------------------- all_reduce in the loss
# Top-level functions: the ranks unpickle them by name.


def step_all_reducing_the_loss(ctx: ShardContext) -> Any:
    """The averaged loss for the log, reduced in place, then backpropagated."""
    model = ctx.ddp()
    output = model(ctx.inputs[0])
    loss = F.mse_loss(output, ctx.target)
    dist.all_reduce(loss)
    loss = loss / dist.get_world_size()
    loss.backward()
    return output


def step_logging_a_detached_copy(ctx: ShardContext) -> Any:
    """The fix: the average for the log from a detached copy; the rank's own loss backward."""
    model = ctx.ddp()
    output = model(ctx.inputs[0])
    loss = F.mse_loss(output, ctx.target)
    reported = loss.detach().clone()
    dist.all_reduce(reported)
    (reported / dist.get_world_size()).item()
    loss.backward()
    return output


def step_halving_the_loss(ctx: ShardContext) -> Any:
    """A plain 1/world_size with no all-reduce: the factor alone does not name all_reduce."""
    model = ctx.ddp()
    output = model(ctx.inputs[0])
    (F.mse_loss(output, ctx.target) / ctx.world_size).backward()
    return output


def test_a_loss_all_reduced_outside_autograd_is_named(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=step_all_reducing_the_loss, pool=ddp_pool)
    text = str(caught.value)
    assert "(1/2, one over the world size): the loss went through torch.distributed.all_reduce, which autograd does not differentiate" in text
    assert "Seen on the ranks: the step passed tensors that require grad to torch.distributed.all_reduce (shapes rank 0: []; rank 1: [];" in text
    assert "sum-reduction" not in text
    assert "divided by the world size twice" not in text
    assert _report(caught.value).scale == pytest.approx(0.5, rel=1e-4)


def test_all_reducing_a_detached_copy_for_the_log_passes(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    assert assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=step_logging_a_detached_copy, pool=ddp_pool).ok


def test_a_factor_of_one_over_the_world_size_without_all_reduce_is_not_blamed_on_it(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=step_halving_the_loss, pool=ddp_pool)
    text = str(caught.value)
    assert "divided by the world size twice" in text
    assert "all_reduce, which autograd" not in text


# --------------------------------------------------------------------------- the micro-batch that syncs


def accumulate_syncing_first(ctx: ShardContext) -> None:
    """The sync on the first micro-batch: `no_sync() if i != 0`."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for i, part in enumerate(parts):
        with model.no_sync() if i != 0 else contextlib.nullcontext():
            (F.mse_loss(model(*part.inputs), part.target) / len(parts)).backward()


def accumulate_syncing_last(ctx: ShardContext) -> None:
    """The fix: every micro-batch but the last inside no_sync()."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for i, part in enumerate(parts):
        with model.no_sync() if i != len(parts) - 1 else contextlib.nullcontext():
            (F.mse_loss(model(*part.inputs), part.target) / len(parts)).backward()


def test_the_sync_on_the_first_micro_batch_is_named(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(12)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=3, step=accumulate_syncing_first, pool=ddp_pool)
    text = str(caught.value)
    assert "rank 0 synchronised on micro-batch 1 of 3; rank 1 synchronised on micro-batch 1 of 3. DDP must synchronise on the last" in text
    assert "the gradients of later micro-batches never reach the other ranks" in text


def test_the_sync_on_the_last_micro_batch_passes(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(12)
    result = assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=3, step=accumulate_syncing_last, pool=ddp_pool)
    assert result.ok
    assert "Gradient synchronisations per rank: [1, 1] (one expected)." in result.notes


# --------------------------------------------------------------------------- the token trap, where it fits


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.tanh(self.embed(input_ids)))
        return logits


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def padded(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (len(lengths), LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (len(lengths), LENGTH), generator=generator)
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
        labels[row, length:] = -100
    return ids, labels


def token_mean_step(ctx: ShardContext) -> Any:
    """The trap: each rank's token-mean loss, averaged by DDP."""
    model = ctx.ddp()
    logits = model(ctx.inputs[0])
    token_loss(logits, ctx.target).backward()
    return logits


def summed_all_reduce_step(ctx: ShardContext) -> Any:
    """Weights the token means right, but all-reduces the gradients by hand and forgets to
    divide by the world size: another bug, on token data."""
    logits = ctx.module(ctx.inputs[0])
    (token_loss(logits, ctx.target) * ctx.loss_weight).backward()
    for param in ctx.module.parameters():
        dist.all_reduce(param.grad)
    return logits


def weighted_token_step(ctx: ShardContext) -> Any:
    """The fix: each rank's token mean weighted by its share of the tokens."""
    model = ctx.ddp()
    logits = model(ctx.inputs[0])
    (token_loss(logits, ctx.target) * ctx.loss_weight).backward()
    return logits


TRAP = "(the loss-averaging trap)"


def test_the_token_trap_note_comes_with_the_token_trap(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded([6, 6, 2, 3])
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(TinyLM(), ids, labels, loss_fn=token_loss, world_size=2, step=token_mean_step, pool=ddp_pool)
    text = str(caught.value)
    assert "Each rank's loss is a mean over its tokens" in text
    assert TRAP in text
    assert "The step's gradients equal the plain per-rank mean-loss step's" in text


def test_another_bug_on_token_data_gets_its_own_cause_and_no_token_note(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded([6, 6, 2, 3])
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(TinyLM(), ids, labels, loss_fn=token_loss, world_size=2, step=summed_all_reduce_step, pool=ddp_pool)
    text = str(caught.value)
    assert "(2, the world size): the ranks' gradients were summed but not divided by the world size" in text
    assert TRAP not in text


def test_the_weighted_token_step_passes_without_a_trap_note(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded([6, 6, 2, 3])
    result = assert_ddp_grads_match(TinyLM(), ids, labels, loss_fn=token_loss, world_size=2, step=weighted_token_step, pool=ddp_pool)
    assert result.ok
    assert not any(TRAP in note for note in result.notes)
