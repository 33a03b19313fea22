"""Pipeline parallelism (torch.distributed.pipelining) on gloo CPU ranks: the check, its
evidence, its traps, its refusals, and the mutant schedules it must catch."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.mutants.sharded import SkipLastMicrobatchGPipe, UnscaledGPipe
from dpverify.sharded.pipeline import (
    assert_pipeline_grads_match,
    pipeline_check,
    stage_children,
)
from dpverify.sharded.pipeline_rank import PipelineRankStep, run_pipeline_task

SUM_MSE = functools.partial(F.mse_loss, reduction="sum")


def mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def deep(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    """Six children, a LayerNorm among them: enough for four stages."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2),
        ).to(dtype)


def batch(rows: int = 8, dtype: torch.dtype = torch.float64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=generator).to(dtype), torch.randn(rows, 2, generator=generator).to(dtype)


class Chain(nn.Module):
    """Not a Sequential, but its forward is the chain of its children."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.encoder = nn.Linear(5, 8).double()
            self.act = nn.Tanh()
            self.head = nn.Linear(8, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.encoder(x)))


class Residual(Chain):
    """Children that are not a chain: the head adds the encoder's output back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(x)
        return self.head(self.act(hidden) + hidden)


def square_tied() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    model[2].weight = model[0].weight
    return model


def check(model: nn.Module, pool: DDPWorkerPool, **kwargs: Any) -> Any:
    x, y = kwargs.pop("data", batch(8, next(model.parameters()).dtype))
    options: dict[str, Any] = {"loss_fn": F.mse_loss, "world_size": pool.world_size, "n_microbatches": 4, "pool": pool}
    options.update(kwargs)
    return assert_pipeline_grads_match(model, x, y, **options)


# --------------------------------------------------------------------------- correct pipelines


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_match_one_device_in_float64(ddp_pool: DDPWorkerPool, schedule: str) -> None:
    model = mlp()
    result = check(model, ddp_pool, schedule=schedule)
    assert result.ok
    assert all(t.max_abs <= 2e-8 for t in result.tensors)
    names = {t.name for t in result.tensors}
    assert {"stage 0 grad '0.weight'", "stage 1 grad '4.bias'", "stage 1 output"} <= names
    assert "schedule loss (mean of 4 microbatch losses)" in names
    assert all(p.grad is None for p in model.parameters())  # the user's module is untouched


def test_the_ranks_report_what_each_stage_ran(ddp_pool: DDPWorkerPool) -> None:
    model = mlp()
    x, y = batch(8)
    scenario = pipeline_check(model, x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=4, pool=ddp_pool)
    ranks: tuple[PipelineRankStep, ...] = ddp_pool.run(run_pipeline_task, scenario.task())
    assert [r.stage_index for r in ranks] == [0, 1]
    assert [r.children for r in ranks] == [("0", "1", "2"), ("3", "4")]
    assert [set(r.held) for r in ranks] == [{"0.weight", "0.bias", "2.weight", "2.bias"}, {"4.weight", "4.bias"}]
    for rank in ranks:
        assert sorted(rank.forwards) == sorted(rank.backwards) == [0, 1, 2, 3]
        assert rank.forward_rows == (2, 2, 2, 2)
        assert rank.output_grads == 4
    assert len(ranks[0].losses) == 0
    assert len(ranks[1].losses) == 4
    assert ranks[1].outputs[0][1].shape == (8, 2)


def test_four_stages_with_layernorm_named_split_points_in_float32(ddp_pools: Any) -> None:
    pool = ddp_pools(4)
    model = deep(torch.float32)
    result = check(model, pool, split_points=["1", "3", "5"], schedule="1f1b")
    assert result.ok, str(result)
    assert "stage 0 children ['0']; stage 1 children ['1', '2']; stage 2 children ['3', '4']; stage 3 children ['5']" in result.scenario
    assert {t.name for t in result.tensors} >= {"stage 1 grad '1.weight'", "stage 3 grad '5.weight'"}


def test_float32_two_stages_gpipe(ddp_pool: DDPWorkerPool) -> None:
    assert check(mlp(torch.float32), ddp_pool, split_points=[2]).ok


def test_a_module_whose_forward_chains_its_children(ddp_pool: DDPWorkerPool) -> None:
    result = check(Chain(), ddp_pool, split_points=["head"])
    assert result.ok
    assert "stage 0 children ['encoder', 'act']; stage 1 children ['head']" in result.scenario


def test_a_sum_loss_with_scale_grads_false_matches(ddp_pool: DDPWorkerPool) -> None:
    assert check(mlp(), ddp_pool, loss_fn=SUM_MSE, scale_grads=False).ok


# --------------------------------------------------------------------------- traps


def test_sum_loss_with_scale_grads_is_one_over_the_microbatches(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as raised:
        check(mlp(), ddp_pool, loss_fn=SUM_MSE)
    text = str(raised.value)
    assert raised.value.report.scale == pytest.approx(0.25, rel=1e-6)
    assert "(1/4, one over n_microbatches=4)" in text
    assert "Use a mean loss (reduction='mean') with scale_grads=True" in text
    assert "pass scale_grads=False" in text


def test_mean_loss_without_scale_grads_is_n_microbatches_times(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as raised:
        check(mlp(), ddp_pool, scale_grads=False)
    text = str(raised.value)
    assert raised.value.report.scale == pytest.approx(4.0, rel=1e-6)
    assert "(4, n_microbatches): loss_fn averages over its rows (a mean loss) and scale_grads=False" in text


def test_uneven_microbatches_are_refused_before_anything_runs() -> None:
    x, y = batch(10)
    # No pool is passed and none of world size 2 needs to start: validation comes first.
    with pytest.raises(InvalidArgument, match=r"n_microbatches=4 does not divide the batch of 10 rows") as raised:
        assert_pipeline_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=4)
    text = str(raised.value)
    assert "[3, 3, 2, 2]" in text
    assert "Pass a batch divisible by n_microbatches (e.g. 12 rows)" in text
    assert "pick n_microbatches among [1, 2, 5, 10]" in text


# --------------------------------------------------------------------------- mutants and evidence


def test_unscaled_gpipe_is_caught_naming_the_microbatches(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as raised:
        check(mlp(), ddp_pool, schedule=UnscaledGPipe)
    text = str(raised.value)
    assert "did not divide the accumulated gradients by n_microbatches=4" in text
    assert raised.value.report.scale == pytest.approx(4.0, rel=1e-6)


def test_a_schedule_that_skips_a_microbatch_is_caught_by_the_evidence(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as raised:
        check(mlp(), ddp_pool, schedule=SkipLastMicrobatchGPipe)
    failures = raised.value.report.failures
    assert "Stage 0 (rank 0) ran forward for microbatches [0, 1, 2], not each of the n_microbatches=4 once" in failures[0]
    assert any("The last stage reported 3 microbatch losses" in f for f in failures)


def test_a_weight_tied_across_stages_is_held_by_two(ddp_pool: DDPWorkerPool) -> None:
    model = square_tied()
    with pytest.raises(ParallelMismatch) as raised:
        check(model, ddp_pool, split_points=[2])
    assert any("'0.weight' by stages [0, 1]" in f for f in raised.value.report.failures)
    # Both children in one stage: the tie is one parameter again, and the step is exact.
    assert check(model, ddp_pool, split_points=[4]).ok


def test_msg_rewrites_the_failure(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch, match=r"^pipeline: Pipeline-parallel gradients"):
        check(mlp(), ddp_pool, schedule=UnscaledGPipe, msg=lambda text: f"pipeline: {text}")


# --------------------------------------------------------------------------- bad input


def lambda_loss() -> Any:
    return lambda output, target: F.mse_loss(output, target)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_microbatches": 0}, r"n_microbatches=0 must be an int >= 1"),
        ({"world_size": 1}, r"world_size=1: one stage is not a pipeline"),
        ({"split_points": [5]}, r"split_points=\[5\] leaves stage 1 without a child"),
        ({"split_points": [0]}, r"split_points=\[0\] leaves stage 0 without a child"),
        ({"world_size": 3, "split_points": [3, 2]}, r"split_points=\[3, 2\] leaves stage 1 without a child"),
        ({"split_points": [1, 2]}, r"split_points=\[1, 2\] has 2 entries for world_size=2"),
        ({"split_points": ["decoder"]}, r"split_points names the child 'decoder'.*\['0', '1', '2', '3', '4'\]"),
        ({"split_points": "2"}, r"split_points='2': pass a list"),
        ({"world_size": 6}, r"has 5 top-level children .* too few for world_size=6"),
        ({"schedule": "zigzag"}, r"schedule='zigzag' is not a schedule .*\['1f1b', 'gpipe'\]"),
        ({"schedule": nn.Linear}, r"schedule=.* neither a schedule name"),
        ({"loss_fn": lambda_loss()}, r"loss_fn=.* cannot be pickled"),
        ({"n_microbatches": 16}, r"n_microbatches=16 is more than the batch's 8 rows"),
        ({"world_size": 4, "n_microbatches": 2, "schedule": "1f1b"}, r"n_microbatches=2 is fewer than the 4 stages"),
        ({"scale_grads": 1}, r"scale_grads=1 must be True or False"),
    ],
)
def test_bad_arguments_are_refused_naming_them(changes: dict[str, Any], message: str) -> None:
    x, y = batch(8)
    options: dict[str, Any] = {"loss_fn": F.mse_loss, "world_size": 2, "n_microbatches": 4}
    options.update(changes)
    with pytest.raises(InvalidArgument, match=message):
        pipeline_check(mlp(), x, y, **options)


def test_a_module_that_is_not_the_chain_of_its_children_is_refused() -> None:
    x, y = batch(8)
    with pytest.raises(InvalidArgument, match=r"module=Residual is not the chain of its top-level children"):
        pipeline_check(Residual(), x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=4)
    # The same children in a chain are accepted (the refusal is about the forward).
    pipeline_check(Chain(), x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=4)


class Pair(nn.Module):
    """``(x, None)``: a tuple, but not of tensors."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None


class Both(nn.Module):
    """``(x, x)``: a tuple of tensors, which a stage sends (the next stage's first child takes
    them as arguments, a child within a stage as one)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class Add(nn.Module):
    def forward(self, *args: Any) -> torch.Tensor:
        first, second = args[0] if len(args) == 1 else args
        return first + second  # type: ignore[no-any-return]


def test_a_stage_may_end_with_a_tuple_of_tensors_and_nothing_else() -> None:
    x, y = batch(8)
    with pytest.raises(InvalidArgument, match=r"stage 0 ends with child '1', which returns tuple, not a tensor or a tuple of tensors"):
        pipeline_check(nn.Sequential(nn.Linear(5, 2).double(), Pair(), nn.Identity()), x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=4)
    check = pipeline_check(nn.Sequential(nn.Linear(5, 2).double(), Both(), Add()), x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=4)
    assert check.stages == (("0", "1"), ("2",))


def test_a_tuple_of_tensors_crosses_a_stage_boundary(ddp_pool: DDPWorkerPool) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), Both(), Add(), nn.Linear(4, 2)).double()
    result = check(model, ddp_pool, split_points=[2])
    assert {"stage 0 grad '0.weight'", "stage 1 grad '3.weight'", "stage 1 output"} <= {t.name for t in result.tensors}


def test_validation_leaves_the_module_untouched() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()
    x, y = batch(8)
    pipeline_check(model, x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=4)
    assert int(model[1].num_batches_tracked) == 0
    assert torch.equal(model[1].running_mean, torch.zeros(6, dtype=torch.float64))


def test_the_target_must_have_the_batch_rows() -> None:
    x, y = batch(8)
    with pytest.raises(InvalidArgument, match=r"target is a tensor of shape \(4, 2\)"):
        pipeline_check(mlp(), x, y[:4], loss_fn=F.mse_loss, world_size=2, n_microbatches=4)


def test_even_split_gives_the_first_stages_one_child_more() -> None:
    assert stage_children(mlp(), 2) == (("0", "1", "2"), ("3", "4"))
    assert stage_children(deep(), 4) == (("0", "1"), ("2", "3"), ("4",), ("5",))
