"""Tensor-parallel (parallelize_module) checks on gloo CPU ranks: plans that must pass, the
evidence that sharding ran, layouts that do not compose, the loss-averaging trap over
data-parallel groups, bad arguments, and the deliberately broken styles they must catch."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.mutants.sharded import LocalOutputColwiseParallel, NoAllReduceRowwiseParallel
from dpverify.sharded.tensor_parallel import (
    TPContext,
    assert_tensor_parallel_grads_match,
    tp_step,
)

SUM_MSE = functools.partial(F.mse_loss, reduction="sum")
MLP_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def mlp(out: int = 4, hidden: int = 8, dtype: torch.dtype = torch.float32, blocks: int = 1) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 6 if blocks > 1 else out)]
        if blocks > 1:
            layers += [nn.Linear(6, hidden), nn.GELU(), nn.Linear(hidden, out)]
        return nn.Sequential(*layers).to(dtype)


def batch(rows: int = 8, out: int = 4, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 5, generator=generator, dtype=dtype), torch.randn(rows, out, generator=generator, dtype=dtype)


def check(model: nn.Module, plan: dict[str, Any], pool: DDPWorkerPool, **kwargs: Any) -> Any:
    x, y = kwargs.pop("data", None) or batch(out=kwargs.pop("out", 4), dtype=kwargs.pop("dtype", torch.float32))
    kwargs.setdefault("loss_fn", F.mse_loss)
    return assert_tensor_parallel_grads_match(model, x, y, world_size=pool.world_size, plan=plan, pool=pool, **kwargs)


def mismatch(run: Callable[[], Any]) -> str:
    with pytest.raises(ParallelMismatch) as caught:
        run()
    return str(caught.value)


# --------------------------------------------------------------------------- plans that pass


@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_colwise_rowwise_mlp_matches_one_device(ddp_pool: DDPWorkerPool, dtype: torch.dtype) -> None:
    result = check(mlp(dtype=dtype), MLP_PLAN, ddp_pool, dtype=dtype)
    text = str(result)
    assert result.ok
    assert "passed" in text
    # evidence in the scenario line: the parameters each rank held sharded, with placements
    local_rows = 8 // ddp_pool.world_size
    assert f"0.weight: Shard(0) local [{local_rows}, 5]" in text
    assert f"2.weight: Shard(1) local [4, {local_rows}]" in text
    assert "3 of 4 parameters sharded over 'tp'" in text
    assert "mesh (" in text
    assert "named ('tp',)" in text
    if dtype == torch.float64:
        assert result.worst_ratio < 1.0
        grads = [t for t in result.tensors if "grad" in t.name]
        assert len(grads) == 4 * ddp_pool.world_size  # every rank's every gradient was compared


class KeywordOnly(nn.Module):
    """An MLP whose forward takes its batch by keyword only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, *, features: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(features)
        return out


def test_two_hidden_blocks_and_keyword_only_forward(ddp_pool: DDPWorkerPool) -> None:
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(), "5": RowwiseParallel()}
    result = check(mlp(blocks=2), plan, ddp_pool)
    assert "6 of 8 parameters sharded" in str(result)

    x, y = batch()
    result = assert_tensor_parallel_grads_match(
        KeywordOnly(), (), y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool,
        plan={"body.0": ColwiseParallel(), "body.2": RowwiseParallel()}, forward_kwargs={"features": x},
    )
    assert "keyword arguments ['features']" in str(result)


class Stack(nn.Module):
    """Two residual-free MLP blocks in a ModuleList, to shard with pattern keys."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 5)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_fnmatch_keys_and_dtensor_outputs_made_whole(ddp_pool: DDPWorkerPool) -> None:
    # pattern keys, as parallelize_module accepts them
    result = check(Stack(), {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}, ddp_pool, out=5)
    assert "6 of 8 parameters sharded" in str(result)
    # outputs kept as DTensors (use_local_output=False) are made whole by the step: correct plans
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Shard(0), use_local_output=False)}
    assert check(mlp(), plan, ddp_pool).ok
    assert check(mlp(), {"2": ColwiseParallel(use_local_output=False)}, ddp_pool).ok


class SequenceBlock(nn.Module):
    """LayerNorm under SequenceParallel between a colwise and a rowwise Linear, on [B, S, F]."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.seq = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.seq(x)
        return out


def test_sequence_parallel_layernorm_block(ddp_pool: DDPWorkerPool) -> None:
    plan = {
        "seq": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
        "seq.0": SequenceParallel(),
        "seq.1": ColwiseParallel(input_layouts=Shard(1)),
        "seq.3": RowwiseParallel(),
    }
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(3, 4, 6, generator=generator), torch.randn(3, 4, 6, generator=generator)
    result = assert_tensor_parallel_grads_match(SequenceBlock(), x, y, loss_fn=F.mse_loss, world_size=2, plan=plan, pool=ddp_pool)
    text = str(result)
    assert "seq.1.weight: Shard(0) local [4, 6]" in text
    # SequenceParallel keeps the norm's parameters whole, as replicated DTensors
    assert "['seq.0.weight', 'seq.0.bias', 'seq.3.bias'] as DTensors not sharded over 'tp'" in text


# --------------------------------------------------------------------------- the 2-D mesh


@pytest.mark.parametrize("ddp_pool", [4], indirect=True)
def test_tp_with_fsdp_on_a_2x2_mesh_even_and_uneven(ddp_pool: DDPWorkerPool) -> None:
    even = check(mlp(), MLP_PLAN, ddp_pool, data_parallel=2)
    text = str(even)
    assert "mesh (2, 2) named ('dp', 'tp')" in text
    assert "FSDP2 fully_shard over 'dp' on ['0', '2', '(root)']" in text
    assert "StridedShard(0, split_factor=2), Shard(0)" in text  # FSDP2's dim-0 shard of a TP shard
    assert {t.name for t in even.tensors if "loss" in t.name} == {
        "rank 0 loss (rows [0:4])", "rank 1 loss (rows [0:4])", "rank 2 loss (rows [4:8])", "rank 3 loss (rows [4:8])",
    }

    uneven = check(mlp(), MLP_PLAN, ddp_pool, data_parallel=2, shards=[5, 3])
    assert "step weighted_tp_step" in str(uneven)
    assert any("1/(data_parallel * n_g) = [1/10, 1/6]" in note for note in uneven.notes)
    assert any("n_g * data_parallel / B = [1.25, 0.75]" in note for note in uneven.notes)
    assert uneven.contrasts
    assert not all(c.ok for c in uneven.contrasts)

    # the plain step on uneven shards must fail: the trap, named
    text = mismatch(lambda: check(mlp(), MLP_PLAN, ddp_pool, data_parallel=2, shards=[5, 3], step=tp_step))
    assert "the loss-averaging trap" in text
    assert "ctx.loss_weight" in text


@pytest.mark.parametrize("ddp_pool", [4], indirect=True)
def test_sum_loss_on_the_2d_mesh_is_scaled_and_named(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(lambda: check(mlp(), MLP_PLAN, ddp_pool, data_parallel=2, loss_fn=SUM_MSE))
    factor = re.search(r"is (\S+) times the single-device full-batch gradient", text)
    assert factor is not None, text
    assert float(factor.group(1)) == pytest.approx(0.5, rel=1e-4)  # measured: its 6th digit is rounding's
    assert "sum-reduction loss" in text
    assert "number of data-parallel groups" in text


def test_sum_loss_without_data_parallelism_passes(ddp_pool: DDPWorkerPool) -> None:
    # every rank sees the whole batch and nothing averages over ranks: a sum loss is exact
    assert check(mlp(), MLP_PLAN, ddp_pool, loss_fn=SUM_MSE).ok


# --------------------------------------------------------------------------- evidence


def no_parallelize_step(ctx: TPContext) -> Any:
    """Runs the module as it is: no plan applied."""
    output = ctx.module(*ctx.inputs)
    ctx.loss_fn(output, ctx.target).backward()
    return output


def test_a_step_that_never_parallelizes_fails(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(lambda: check(mlp(), MLP_PLAN, ddp_pool, step=no_parallelize_step))
    assert "never called ctx.parallelize() on ranks [0, 1]" in text
    assert "no parameter sharded (ctx.parallelize() never ran)" in text


def test_a_plan_that_shards_no_parameter_fails(ddp_pool: DDPWorkerPool) -> None:
    plan = {"0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=True)}
    text = mismatch(lambda: check(mlp(), plan, ddp_pool))
    assert "No parameter was sharded over the 'tp' mesh dimension on ranks [0, 1]" in text
    assert "pass vacuously" in text
    assert "0 of 12 compared tensors do not match" not in text  # the numbers agree; the evidence fails it


def test_a_dtensor_fed_to_an_unsharded_module_is_explained(ddp_pool: DDPWorkerPool) -> None:
    plan = {"0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))}
    text = mismatch(lambda: check(mlp(), plan, ddp_pool))
    assert "module '0' (PrepareModuleInput(" in text
    assert "Its parameters ['0.weight', '0.bias'] are plain tensors" in text
    assert "mixed a DTensor input with plain parameters" in text


# --------------------------------------------------------------------------- layouts


def test_a_last_colwise_left_local_names_the_module_and_the_fix(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(lambda: check(mlp(), {"2": ColwiseParallel()}, ddp_pool))
    assert "model output has shape [8, 2] where one device gives [8, 4]" in text
    assert "module '2' (ColwiseParallel(" in text
    assert "produced DTensor Shard(1) local [8, 2] of global [8, 4]" in text
    assert "use_local_output=False" in text
    assert "output_layouts=Replicate()" in text
    assert "RowwiseParallel" in text
    assert "Traceback" not in text


@pytest.mark.parametrize(
    ("plan", "module", "saw"),
    [
        ({"0": RowwiseParallel(), "2": RowwiseParallel()}, "'0' (RowwiseParallel(", "global [8, 10]"),
        ({"0": ColwiseParallel(), "2": ColwiseParallel()}, "'2' (ColwiseParallel(", "DTensor Replicate() local [8, 4] of global [8, 4]"),
        ({"2": RowwiseParallel()}, "'2' (RowwiseParallel(", "global [8, 16]"),
    ],
    ids=["rowwise-then-rowwise", "colwise-feeding-colwise", "rowwise-on-replicated-input"],
)
def test_layouts_that_do_not_compose_are_reported_from_the_hooks(ddp_pool: DDPWorkerPool, plan: dict[str, Any], module: str, saw: str) -> None:
    text = mismatch(lambda: check(mlp(), plan, ddp_pool))
    assert "The plan's layouts do not compose: module " + module in text
    assert saw in text
    assert "input_layouts=" in text
    assert "torch's message (rank 0)" in text
    assert "Traceback" not in text


def test_colwise_feeding_colwise_names_the_producer(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(lambda: check(mlp(), {"0": ColwiseParallel(), "2": ColwiseParallel()}, ddp_pool))
    assert "handed on by module '0' (ColwiseParallel(" in text
    assert "produced DTensor Shard(1) local [8, 4] of global [8, 8]" in text


@pytest.mark.parametrize("ddp_pool", [2], indirect=True)
def test_widths_not_divisible_by_the_tp_size(ddp_pool: DDPWorkerPool) -> None:
    # torch allows uneven DTensor shards: a last ColwiseParallel of 3 columns kept as a
    # DTensor is made whole correctly, so the verdict is a pass
    assert check(mlp(out=3), {"2": ColwiseParallel(use_local_output=False)}, ddp_pool, out=3).ok
    # but a hidden width of 7 handed on as local shards [8, 4] and [8, 3] cannot be read back
    # by RowwiseParallel (from_local assumes even shards): a clear failure, never a pass
    text = mismatch(lambda: check(mlp(hidden=7), MLP_PLAN, ddp_pool))
    assert "The ranks received different widths [3, 4]" in text
    assert "not divisible by the 2 tensor-parallel ranks" in text


# --------------------------------------------------------------------------- mutants


@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def test_no_allreduce_rowwise_is_caught(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(lambda: check(mlp(), {"0": ColwiseParallel(), "2": NoAllReduceRowwiseParallel()}, ddp_pool))
    assert "Module '2' (NoAllReduceRowwiseParallel(" in text
    assert "produced DTensor Partial(sum)" in text
    assert "never ran, so each rank went on with its own partial sum" in text
    assert "their sum over the" in text
    assert "off by the other ranks' partial sums" in text


@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def test_local_output_colwise_is_caught(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(lambda: check(mlp(), {"2": LocalOutputColwiseParallel()}, ddp_pool))
    assert "only in its own block of columns (rank 0 columns [0:" in text
    assert "the local shard of a ColwiseParallel output was used as the whole output" in text
    assert "output[0:8]: tensors are not close!" in text


# --------------------------------------------------------------------------- bad arguments


def test_bad_arguments_are_refused_before_the_ranks(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()

    def run(**kwargs: Any) -> None:
        arguments: dict[str, Any] = {"loss_fn": F.mse_loss, "world_size": 2, "plan": MLP_PLAN, "pool": ddp_pool}
        arguments.update(kwargs)
        assert_tensor_parallel_grads_match(mlp(), x, y, **arguments)

    with pytest.raises(InvalidArgument, match=r"plan key 'fc1' matches no submodule.*'0', '1', '2'"):
        run(plan={"fc1": ColwiseParallel()})
    with pytest.raises(InvalidArgument, match=r"plan\['0'\] is 'colwise' \(str\), not a ParallelStyle"):
        run(plan={"0": "colwise"})
    with pytest.raises(InvalidArgument, match=r"ColwiseParallel, which shards nn.Linear and nn.Embedding only, but '1' is Tanh"):
        run(plan={"1": ColwiseParallel()})
    with pytest.raises(InvalidArgument, match=r"plan=\[\]: pass a non-empty dict"):
        run(plan=[])
    with pytest.raises(InvalidArgument, match=r"world_size=2 is not divisible by data_parallel=3"):
        run(data_parallel=3)
    with pytest.raises(InvalidArgument, match=r"data_parallel=0 must be an int >= 1"):
        run(data_parallel=0)
    with pytest.raises(InvalidArgument, match=r"shards=\[4, 4\] has 2 entries for data_parallel=1"):
        run(shards=[4, 4])
    with pytest.raises(InvalidArgument, match=r"pool has world_size 2 but world_size=4"):
        run(world_size=4)
    with pytest.raises(InvalidArgument, match=r"step=<function .*<lambda>.* cannot be pickled"):
        run(step=lambda ctx: None)
    with pytest.raises(InvalidArgument, match=r"the batch has 1 rows for data_parallel=2 groups"):
        assert_tensor_parallel_grads_match(
            mlp(), x[:1], y[:1], loss_fn=F.mse_loss, world_size=2, data_parallel=2, plan=MLP_PLAN, pool=ddp_pool,
        )


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_float64_colwise_rowwise_gradients_are_within_1_5e_8_of_one_device(data_parallel: int, ddp_pools: Callable[[int], DDPWorkerPool]) -> None:
    world = 2 * data_parallel
    x, y = batch(8, dtype=torch.float64)
    result = assert_tensor_parallel_grads_match(
        mlp(dtype=torch.float64), x, y, loss_fn=F.mse_loss, world_size=world, data_parallel=data_parallel,
        plan={"0": ColwiseParallel(), "2": RowwiseParallel()}, pool=ddp_pools(world),
    )
    grads = [t for t in result.tensors if " grad " in t.name]
    assert grads
    assert all(t.max_abs <= 1.5e-8 for t in grads)
