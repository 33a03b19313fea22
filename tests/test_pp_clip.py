"""Gradient clipping on pipeline stages: the habit of data parallelism,
``clip_grad_norm_(ctx.module.parameters(), max_norm)`` on every rank, clips each stage by
the norm of its own parameters' gradients (a stage holds only its own), where one device
clips by the whole model's norm. The pipeline training check catches it at step 1 and names
that cause from the gradients each stage's optimizer used; the clip by the norm summed over
the stages passes; a bug that is not a clip gets no clip note."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_pp_training import ADAM, TinyGPT, lm_loss, token_batches
from torch import nn

import dpverify
from dpverify.core.errors import ParallelMismatch
from dpverify.ddp.pool import DDPWorkerPool

MAX_NORM = 0.05
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]


def stage_clip(ctx: Any) -> None:
    """The bug: DDP's clip, where every rank holds every parameter, run on a pipeline stage."""
    torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), MAX_NORM)


def clip_on_the_last_stage(ctx: Any) -> None:
    """Another bug: the global norm, but only the stage that holds the loss clips."""
    params = [p for p in ctx.module.parameters() if p.grad is not None]
    square = sum((p.grad.detach().double().pow(2).sum() for p in params), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(square, group=ctx.group)
    if ctx.is_last:
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, square.sqrt())


def global_clip(ctx: Any, max_norm: float = MAX_NORM) -> None:
    """The fix: the squared norms summed over the stages, then torch's clip with that norm."""
    params = [p for p in ctx.module.parameters() if p.grad is not None]
    square = sum((p.grad.detach().double().pow(2).sum() for p in params), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(square, group=ctx.group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, square.sqrt())


def sync_then_stage_clip(ctx: Any) -> None:
    """The bug on a tied model: the tied embedding's copies summed, then each stage clipped alone."""
    dpverify.sync_tied_grads(ctx)
    torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), 0.5)


def sync_then_global_clip(ctx: Any) -> None:
    """The fix: the copies summed, then the norm summed over the stages, the tied weight
    counted once (on the first stage)."""
    dpverify.sync_tied_grads(ctx)
    params = [(name, p) for name, p in ctx.module.named_parameters() if p.grad is not None]
    counted = [p for name, p in params if ctx.is_first or name not in ctx.tied]
    square = sum((p.grad.detach().double().pow(2).sum() for p in counted), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(square, group=ctx.group)
    torch.nn.utils.clip_grads_with_norm_([p for _n, p in params], 0.5, square.sqrt())


def summed_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target, reduction="sum")


def train(pool: DDPWorkerPool, hook: Any, loss_fn: Any = F.mse_loss) -> dpverify.StepComparison:
    return dpverify.assert_pipeline_training_matches(
        mlp(), batches(), loss_fn=loss_fn, optimizer=SGD, world_size=2, n_microbatches=2, after_backward=hook, pool=pool,
    )


def test_a_clip_by_each_stages_own_norm_is_named(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool, stage_clip)
    text = str(caught.value)
    print(text)
    assert "the table shows step 1" in text
    assert "times a factor of the stage's own (stage 0 x" in text
    assert "Each stage clipped by the norm of its own parameters' gradients" in text
    assert "a pipeline's global norm sums the squared norms over the stages; all-reduce it over ctx.group" in text
    assert "clip_grads_with_norm_(params, max_norm, square.sqrt())" in text


def test_a_clip_on_some_stages_only_is_named(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool, clip_on_the_last_stage)
    text = str(caught.value)
    print(text)
    assert "Stages [1] scaled them as one device did" in text
    assert "stages [0] left them as the backward made them" in text


def test_the_clip_by_the_norm_summed_over_the_stages_passes(ddp_pool: DDPWorkerPool) -> None:
    result = train(ddp_pool, global_clip)
    print(result)
    assert result.ok


def test_a_tied_model_summed_then_clipped_per_stage_is_named_for_the_clip(ddp_pool: DDPWorkerPool) -> None:
    def tied(hook: Any) -> dpverify.StepComparison:
        return dpverify.assert_pipeline_training_matches(
            TinyGPT(), token_batches(), loss_fn=lm_loss, optimizer=ADAM, world_size=2, n_microbatches=2, split_points=["block"],
            after_backward=hook, pool=ddp_pool,
        )

    with pytest.raises(ParallelMismatch) as caught:
        tied(sync_then_stage_clip)
    text = str(caught.value)
    assert "Each stage clipped by the norm of its own parameters' gradients" in text
    assert "they were not summed" not in text  # they were: the clip scaled each copy by its stage's factor
    assert tied(sync_then_global_clip).ok


def test_a_bug_that_is_not_a_clip_gets_no_clip_note(ddp_pool: DDPWorkerPool) -> None:
    # a sum loss with scale_grads=True: every stage's gradient 1/2 of one device's, the
    # clip's threshold too high to clip anything
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool, functools.partial(global_clip, max_norm=1e6), loss_fn=summed_mse)
    text = str(caught.value)
    print(text)
    assert "sum-reduction loss" in text
    assert "own parameters" not in text
    assert "factor of the stage's own" not in text
