"""Dropout in the DDP training check: every rank trains in its own random stream, its
``nn.Dropout`` masks are recorded in every step and replayed, step by step, by the
single-device training, so a train-mode Dropout model gets a real verdict over several
optimizer steps; a step that reseeds every rank alike is caught drawing the same random
numbers; randomness that cannot be replayed (attention dropout) still explains a mismatch.
User-style steps, buggy and fixed."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_randomness import SAME, Regularised
from torch import nn

from dpverify.core.comparison import StepComparison
from dpverify.core.errors import ParallelMismatch
from dpverify.ddp.checks import assert_ddp_training_matches
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.ddp.rank import ShardContext
from dpverify.models.hooks import accumulation_step
from dpverify.mutants import summed_allreduce_step
from dpverify.registry import CHECKS, Case, Target, Verdict
from dpverify.sharded.fsdp import assert_fsdp_training_matches
from dpverify.sharded.fsdp_rank import FSDPContext
from dpverify.strategies import DeviceList, ModelSpec, Scenario

SGD = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)


def batches(steps: int = 3, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 5, generator=g), torch.randn(rows, 2, generator=g)) for _ in range(steps)]


def _report(failure: ParallelMismatch) -> StepComparison:
    report = failure.report
    assert isinstance(report, StepComparison)
    return report


# Top-level steps: the ranks unpickle them by name.


def step_reseeding_every_rank_alike(ctx: ShardContext) -> Any:
    """The bug: the training loop seeds each step with the step's number, the same on every rank."""
    torch.manual_seed(1000 + ctx.step_index)
    output = ctx.ddp()(ctx.inputs[0])
    F.mse_loss(output, ctx.target).backward()
    return output


def step_reseeding_each_rank(ctx: ShardContext) -> Any:
    """The fix: each rank's own stream, the rank added to the seed."""
    torch.manual_seed(1000 + ctx.step_index + 100 * dist.get_rank())
    output = ctx.ddp()(ctx.inputs[0])
    F.mse_loss(output, ctx.target).backward()
    return output


def fsdp_step_reseeding_every_rank_alike(ctx: FSDPContext) -> Any:
    """The same bug in an FSDP2 step."""
    torch.manual_seed(1000 + ctx.step_index)
    output = ctx.fsdp()(ctx.inputs[0])
    F.mse_loss(output, ctx.target).backward()
    return output


def train(pool: DDPWorkerPool, **options: Any) -> StepComparison:
    return assert_ddp_training_matches(Regularised().train(), batches(), loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=pool, **options)


def test_a_dropout_model_trains_three_steps_with_its_masks_replayed(ddp_pool: DDPWorkerPool) -> None:
    result = train(ddp_pool)
    print(result)
    assert result.ok
    assert result.replayed == ("drop",)
    assert any("in every step each rank drew its masks from its own random stream (seed + rank)" in note for note in result.notes)


def test_a_step_that_accumulates_micro_batches_replays_each_forwards_masks(ddp_pool: DDPWorkerPool) -> None:
    result = assert_ddp_training_matches(
        Regularised().train(), batches(rows=8), loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=ddp_pool,
        step=functools.partial(accumulation_step, micro_batches=2),
    )
    assert result.ok
    assert result.replayed == ("drop",)


def test_a_step_that_reseeds_every_rank_alike_is_caught_in_training(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool, step=step_reseeding_every_rank_alike)
    text = str(caught.value)
    print(text)
    assert f"In optimizer step 1: {SAME}: ranks 0 and 1 drew the dropout mask of 'drop' from the same random generator state" in text
    assert "torch.manual_seed(seed + rank)" in text
    # the masks replay, so the parameters themselves match: the finding is the failure
    assert all(row.ok for row in _report(caught.value).tensors)
    assert train(ddp_pool, step=step_reseeding_each_rank).ok
    assert train(ddp_pool, step=step_reseeding_every_rank_alike, same_seed=True).ok


def test_fsdp2_training_replays_the_masks_and_catches_one_seed(ddp_pool: DDPWorkerPool) -> None:
    def fsdp(**options: Any) -> StepComparison:
        return assert_fsdp_training_matches(
            Regularised().train(), batches(), loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=ddp_pool, **options,
        )

    result = fsdp()
    print(result)
    assert result.ok
    assert result.replayed == ("drop",)
    with pytest.raises(ParallelMismatch) as caught:
        fsdp(step=fsdp_step_reseeding_every_rank_alike)
    assert f"In optimizer step 1: {SAME}" in str(caught.value)


def _dropout_case() -> Case:
    return Case.from_scenario(Scenario(ModelSpec(kind="dropout", hidden=8, train=True, p=0.5), batch_size=6, devices=DeviceList((0, 1))))


def test_the_registry_gives_a_dropout_model_a_real_training_verdict() -> None:
    spec = CHECKS["ddp-training"]
    passed = spec.run(_dropout_case())
    assert passed.verdict == Verdict.PASS, passed.summary
    caught = spec.run(_dropout_case(), Target(step=summed_allreduce_step))
    assert caught.verdict == Verdict.FAIL, caught.summary
    fsdp = CHECKS["fsdp-training"].run(_dropout_case())
    assert fsdp.verdict == Verdict.PASS, fsdp.summary


class Attending(nn.Module):
    """Self-attention with attention dropout (torch draws it with F.dropout inside
    MultiheadAttention's forward: not an nn.Dropout layer, so not replayed)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.attn = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)
            self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.attn(x, x, x, need_weights=False)[0].mean(1))
        return out


def test_attention_dropout_that_cannot_replay_stays_explained() -> None:
    g = torch.Generator().manual_seed(2)
    case = Case(Attending().train(), (torch.randn(6, 3, 4, generator=g),), torch.randn(6, 1, generator=g), F.mse_loss, (0, 1), 0, None, per_row_mean_loss=True)
    result = CHECKS["ddp-training"].run(case)
    assert result.verdict == Verdict.EXPLAINED, result.summary
    assert "attn" in result.detail
