"""The pipeline training check: several optimizer steps of every stage against one device,
the user's hook between the schedule's backward and the optimizer step (a tied
embedding's all-reduce), an objective apart from the per-microbatch loss, and the
token-mean trap over microbatches, in user code written buggy and fixed."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.pool import DDPWorkerPool

VOCAB, DIM, SEQ = 16, 8, 4
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.05)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyGPT(nn.Module):
    """A GPT-like language model whose output projection is its input embedding (weight
    tying, as GPT-2 does): a pipeline puts the two on the first and the last stage."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block(DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(ids))))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def sync_tied_embedding(ctx: Any) -> None:
    """The fix: sum the tied weight's gradient over the first and the last stage."""
    if ctx.num_stages == 1:  # one device: one weight with the whole gradient
        return
    if ctx.is_first:
        weight = ctx.module.embed.weight
    elif ctx.is_last:
        weight = ctx.module.head.weight
    else:
        return
    dist.all_reduce(weight.grad, group=ctx.tied_group)


def average_tied_embedding(ctx: Any) -> None:
    """The bug: the data-parallel habit, averaging the copies' gradients (each holds only
    a part of the gradient, not a whole one)."""
    if ctx.reference:
        return
    weight = ctx.module.embed.weight if ctx.is_first else ctx.module.head.weight
    dist.all_reduce(weight.grad, group=ctx.tied_group)
    weight.grad /= dist.get_world_size(ctx.tied_group)


def token_batches(steps: int = 2, rows: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        found.append((ids, torch.roll(ids, -1, dims=1)))
    return found


def train(pool: DDPWorkerPool, **options: Any) -> dpverify.StepComparison:
    kwargs: dict[str, Any] = {
        "loss_fn": lm_loss, "optimizer": SGD, "world_size": 2, "n_microbatches": 2, "split_points": ["block"], "pool": pool,
    }
    kwargs.update(options)
    batches = kwargs.pop("batches", None) or token_batches()
    return dpverify.assert_pipeline_training_matches(TinyGPT(), batches, **kwargs)


def test_a_tied_embedding_without_a_hook_is_named(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool)
    text = str(caught.value)
    print(text)
    assert "step 1 stage 1 param 'embed.weight' (as 'head.weight')" in text
    assert "'embed.weight' is one weight tied across stages" in text
    assert "no after_backward hook" in text


def test_the_tied_embedding_summed_over_its_stages_passes(ddp_pool: DDPWorkerPool) -> None:
    result = train(ddp_pool, after_backward=sync_tied_embedding, optimizer=ADAM)
    print(result)
    assert result.ok


def test_averaging_the_tied_gradients_is_named(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool, after_backward=average_tied_embedding)
    text = str(caught.value)
    print(text)
    assert "averaged over the 2 stages instead of summed" in text
