"""Randomness across DDP ranks: every rank starts from its own random stream (seed + rank,
as launchers seed them), a step that seeds every rank alike is caught drawing the same
dropout masks, and a train-mode Dropout model is compared exactly, its ranks' masks
replayed on one device. User-style steps, each in a buggy and a fixed variant."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_ddp_diagnoses import _report, batch
from torch import nn

from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.checks import assert_ddp_accumulation_matches, assert_ddp_grads_match
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.ddp.rank import ShardContext
from dpverify.mutants import summed_allreduce_step
from dpverify.ranked.randomness import DropoutCall, recording_dropout, replaying_dropout
from dpverify.registry import CHECKS, Case, Target, Verdict
from dpverify.strategies import DeviceList, ModelSpec, Scenario

SAME = "Every rank draws the same random numbers"


class Regularised(nn.Module):
    """A classifier head with dropout, in train mode."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp = nn.Linear(5, 16)
            self.drop = nn.Dropout(0.3)
            self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.drop(F.relu(self.inp(x))))
        return out


# --------------------------------------------------------------------------- rank steps
# Top-level functions: the ranks unpickle them by name.


def step_seeding_every_rank_alike(ctx: ShardContext) -> Any:
    """`set_seed(0)` at the top of the training script, on every rank."""
    torch.manual_seed(0)
    model = ctx.ddp()
    output = model(ctx.inputs[0])
    F.mse_loss(output, ctx.target).backward()
    return output


def weighted_step_seeding_every_rank_alike(ctx: ShardContext) -> Any:
    """The same on uneven shards, each rank's loss weighted by its share of the rows."""
    torch.manual_seed(0)
    model = ctx.ddp()
    output = model(ctx.inputs[0])
    (F.mse_loss(output, ctx.target) * ctx.loss_weight).backward()
    return output


def step_seeding_each_rank(ctx: ShardContext) -> Any:
    """The fix: one stream per rank, `set_seed(0 + rank)`."""
    torch.manual_seed(0 + dist.get_rank())
    model = ctx.ddp()
    output = model(ctx.inputs[0])
    F.mse_loss(output, ctx.target).backward()
    return output


def accumulate_seeding_every_rank_alike(ctx: ShardContext) -> None:
    torch.manual_seed(0)
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for i, part in enumerate(parts):
        with model.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
            (F.mse_loss(model(*part.inputs), part.target) / len(parts)).backward()


# --------------------------------------------------------------------------- one stream per rank


def test_a_dropout_model_passes_with_its_masks_replayed(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    result = assert_ddp_grads_match(Regularised().train(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool)
    assert result.ok
    assert result.replayed == ("drop",)
    assert any("Dropout layers ['drop'] ran in train mode" in note for note in result.notes)


def test_a_step_that_seeds_every_rank_alike_is_caught(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(Regularised().train(), x, y, loss_fn=F.mse_loss, world_size=2, step=step_seeding_every_rank_alike, pool=ddp_pool)
    text = str(caught.value)
    assert f"{SAME}: ranks 0 and 1 drew the dropout mask of 'drop' from the same random generator state" in text
    assert "their masks agree on all 48 entries they share" in text
    assert "torch.manual_seed(seed + rank)" in text
    # the masks replay, so the gradients themselves match: the finding is the failure
    assert all(row.ok for row in _report(caught.value).tensors)


def test_uneven_shards_seeded_alike_share_the_first_rows_masks(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(5)  # shards [3, 2]: the shorter mask is the start of the longer
    with pytest.raises(ParallelMismatch, match=r"agree on all 32 entries they share") as caught:
        assert_ddp_grads_match(
            Regularised().train(), x, y, loss_fn=F.mse_loss, world_size=2, step=weighted_step_seeding_every_rank_alike, shards=[3, 2], pool=ddp_pool,
        )
    assert all(row.ok for row in _report(caught.value).tensors)


def test_a_step_that_seeds_each_rank_passes(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    assert assert_ddp_grads_match(Regularised().train(), x, y, loss_fn=F.mse_loss, world_size=2, step=step_seeding_each_rank, pool=ddp_pool).ok


def test_same_seed_asks_for_one_stream_on_every_rank(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    result = assert_ddp_grads_match(
        Regularised().train(), x, y, loss_fn=F.mse_loss, world_size=2, step=step_seeding_every_rank_alike, same_seed=True, pool=ddp_pool,
    )
    assert result.ok
    with pytest.raises(InvalidArgument, match="same_seed"):
        assert_ddp_grads_match(Regularised().train(), x, y, loss_fn=F.mse_loss, world_size=2, same_seed="yes", pool=ddp_pool)  # type: ignore[arg-type]


def test_accumulation_replays_every_micro_batch_and_catches_one_seed(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(12)
    result = assert_ddp_accumulation_matches(Regularised().train(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=3, pool=ddp_pool)
    assert result.ok
    assert result.replayed == ("drop",)
    with pytest.raises(ParallelMismatch, match=SAME):
        assert_ddp_accumulation_matches(
            Regularised().train(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=3, step=accumulate_seeding_every_rank_alike, pool=ddp_pool,
        )


def mlp() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def test_a_step_that_seeds_every_rank_alike_is_noted_without_dropout(ddp_pool: DDPWorkerPool) -> None:
    # no mask to compare: the ranks leaving the step in one random state is the evidence
    x, y = batch(6)
    alike = assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=step_seeding_every_rank_alike, pool=ddp_pool)
    own = assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=step_seeding_each_rank, pool=ddp_pool)
    note = "All 2 ranks left the step in the same random state"
    assert any(note in text for text in alike.notes)
    assert not any(note in text for text in own.notes)


# --------------------------------------------------------------------------- verdicts


def _dropout_case() -> Case:
    return Case.from_scenario(Scenario(ModelSpec(kind="dropout", hidden=8, train=True, p=0.5), batch_size=6, devices=DeviceList((0, 1))))


def test_a_dropout_model_gets_a_real_verdict_not_an_explanation() -> None:
    spec = CHECKS["ddp-grads"]
    assert spec.run(_dropout_case()).verdict == Verdict.PASS
    caught = spec.run(_dropout_case(), Target(step=summed_allreduce_step))
    assert caught.verdict == Verdict.FAIL, caught.summary
    assert "the world size" in caught.detail


def test_other_random_layers_are_still_explained() -> None:
    # Dropout2d drops channels, not entries: its masks are not recorded, so it still explains
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 8), nn.Unflatten(1, (2, 2, 2)), nn.Dropout2d(0.5), nn.Flatten(), nn.Linear(8, 1))
    case = Case(module, (torch.randn(6, 4),), torch.randn(6, 1), F.mse_loss, (0, 1), 0, None, per_row_mean_loss=True)
    assert CHECKS["ddp-grads"].run(case).verdict == Verdict.EXPLAINED


# --------------------------------------------------------------------------- recording and replay


def test_replay_refuses_masks_that_do_not_follow_the_rows() -> None:
    module = Regularised().train()
    calls: list[DropoutCall] = []
    with recording_dropout(module, calls):
        module(torch.randn(3, 5))
    assert [call.keep.shape for call in calls] == [torch.Size([3, 16])]
    assert replaying_dropout(module, [calls, calls], [[3], [3]]) is not None
    assert replaying_dropout(module, [calls, calls], [[3], [2]]) is None  # rank 1 ran 2 rows
    assert replaying_dropout(module, [calls, []], [[3], [3]]) is None  # rank 1 drew nothing
    assert not module._forward_hooks
    assert not module.drop._forward_hooks
