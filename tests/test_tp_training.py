"""Tensor-parallel training (``assert_tensor_parallel_training_matches``) on 2 gloo CPU ranks,
with the user's code after backward written as users write it: gradient clipping in
Megatron's style (sums of squares of the local shards) and torch's, a clip guarded by the
rank, and a sequence-parallel LayerNorm whose gradients nothing all-reduces. Each bug in a
buggy and a fixed variant: the buggy one is caught with its cause, the fixed one passes."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from dpverify import assert_tensor_parallel_grads_match, assert_tensor_parallel_training_matches
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.pool import DDPWorkerPool, ParallelError
from dpverify.mutants.sharded import tp_global_clip

MAX_NORM = 0.05
SGD = functools.partial(torch.optim.SGD, lr=0.5)
ADAM = functools.partial(torch.optim.Adam, lr=0.05)
MLP_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))


def mlp_batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 5, generator=generator), torch.randn(6, 4, generator=generator)) for _ in range(steps)]


def train(pool: DDPWorkerPool, module: nn.Module, plan: dict[str, Any], batches: Any, **options: Any) -> Any:
    options.setdefault("optimizer", SGD)
    return assert_tensor_parallel_training_matches(
        module, batches, loss_fn=F.mse_loss, world_size=pool.world_size, plan=plan, pool=pool, **options,
    )


def mismatch(pool: DDPWorkerPool, *args: Any, **options: Any) -> str:
    with pytest.raises(ParallelMismatch) as caught:
        train(pool, *args, **options)
    return str(caught.value)


# --------------------------------------------------------------------------- the user's clipping


def torch_clip(ctx: Any) -> None:
    # every gradient of the MLP's plan is a DTensor: clip_grad_norm_ computes the norm of the
    # full gradients (a Replicate() DTensor) and scales every shard by the same coefficient
    torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), MAX_NORM)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _sharded(grad: torch.Tensor) -> bool:
    return isinstance(grad, DTensor) and any(isinstance(p, Shard) for p in grad.placements)


@torch.no_grad()
def _scale(ctx: Any, norm: torch.Tensor) -> None:
    coef = (MAX_NORM / (norm + 1e-6)).clamp(max=1.0)
    for p in ctx.module.parameters():
        if p.grad is not None:
            _local(p.grad).mul_(coef)


@torch.no_grad()
def megatron_clip_local_norm(ctx: Any) -> None:
    # BUG: the norm of what this rank holds; the other ranks' shards are never counted
    squares = torch.stack([_local(p.grad).pow(2).sum() for p in ctx.module.parameters() if p.grad is not None]).sum()
    _scale(ctx, squares.sqrt())


@torch.no_grad()
def _global_norm(ctx: Any) -> torch.Tensor:
    # Megatron's recipe: sum the squares of the sharded gradients' shards over the
    # tensor-parallel group, and count the replicated ones once
    grads = [p.grad for p in ctx.module.parameters() if p.grad is not None]
    sharded = sum((_local(g).pow(2).sum() for g in grads if _sharded(g)), torch.zeros(()))
    dist.all_reduce(sharded, group=ctx.tp_group)
    replicated = sum((_local(g).pow(2).sum() for g in grads if not _sharded(g)), torch.zeros(()))
    return (sharded + replicated).sqrt()


def megatron_clip(ctx: Any) -> None:
    _scale(ctx, _global_norm(ctx))


def clip_on_rank_zero(ctx: Any) -> None:
    norm = _global_norm(ctx)  # every rank joins the all-reduce
    if ctx.rank == 0:  # BUG: the clip itself only on the "main" rank
        _scale(ctx, norm)


@pytest.mark.parametrize("hook", [torch_clip, megatron_clip])
def test_a_global_clip_passes(ddp_pool: DDPWorkerPool, hook: Any) -> None:
    result = train(ddp_pool, mlp(), MLP_PLAN, mlp_batches(), after_backward=hook)
    assert result.ok
    assert f"{hook.__name__}(ctx) ran after every backward, on every rank and in the single-device run." in result.notes
    assert "3 of 4 parameters sharded over 'tp'" in result.scenario


def test_clip_grad_norm_over_dtensor_and_plain_gradients_is_told_how_to_combine_them(ddp_pool: DDPWorkerPool) -> None:
    # torch 2.13's clip_grad_norm_ refuses a mix; the plan leaves the head plain
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 2))
    batches = [(x, y[:, :2]) for x, y in mlp_batches()]
    with pytest.raises(ParallelError) as caught:
        train(ddp_pool, model, MLP_PLAN, batches, after_backward=torch_clip)
    notes = "\n".join(caught.value.__notes__)
    assert "the plan leaves the parameters ['3.weight', '3.bias'] plain tensors" in notes
    assert "get_total_norm(dtensor_grads).full_tensor()" in notes
    assert train(ddp_pool, model, MLP_PLAN, batches, after_backward=tp_global_clip).ok  # the combined norm


def test_a_clip_norm_from_the_local_shard_is_caught(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(ddp_pool, mlp(), MLP_PLAN, mlp_batches(), after_backward=megatron_clip_local_norm)
    assert "step 1" in text
    assert "megatron_clip_local_norm(ctx) ran after every backward" in text
    assert "a factor of each rank's own" in text
    assert "a clip norm from its local shards" in text
    assert "ctx.tp_group" in text


def test_a_clip_on_one_rank_only_is_caught(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(ddp_pool, mlp(), MLP_PLAN, mlp_batches(), after_backward=clip_on_rank_zero)
    assert "step 1" in text
    assert "Ranks [0] scaled them as the single device did, ranks [1] did not" in text
    assert "did not run alike on every rank" in text


def test_adam_state_is_compared_every_step(ddp_pool: DDPWorkerPool) -> None:
    result = train(ddp_pool, mlp(), MLP_PLAN, mlp_batches(3), optimizer=ADAM, after_backward=torch_clip)
    assert result.ok
    names = {(row.id.kind, row.id.name) for row in result.tensors}
    assert ("optimizer state", "0.weight.exp_avg_sq") in names
    assert ("param", "2.weight") in names
    assert any("after each of the 3 optimizer steps" in note for note in result.notes)


def average_over_data_parallel(ctx: Any) -> None:
    # a hand-written data-parallel average, written for any mesh: without data-parallel
    # groups ctx.dp_group holds this rank alone, and the average changes nothing
    for p in ctx.module.parameters():
        if p.grad is not None:
            local = _local(p.grad)
            dist.all_reduce(local, group=ctx.dp_group)
            local /= dist.get_world_size(ctx.dp_group)


def test_the_hook_sees_the_tensor_parallel_and_data_parallel_groups(ddp_pool: DDPWorkerPool) -> None:
    assert train(ddp_pool, mlp(), MLP_PLAN, mlp_batches(), after_backward=average_over_data_parallel).ok


def test_a_hook_that_needs_dtensor_gradients_is_told_the_reference_has_plain_ones(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(AttributeError) as caught:
        train(ddp_pool, mlp(), MLP_PLAN, mlp_batches(), after_backward=placements_of_grads)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "raised in after_backward=placements_of_grads(ctx)" in notes
    assert "the gradients are plain tensors, not DTensors" in notes


def placements_of_grads(ctx: Any) -> None:
    for p in ctx.module.parameters():
        assert p.grad.placements  # DTensor only


class TrackedTanh(nn.Tanh):
    """A Tanh that keeps a running mean square of what it sees (an activation statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean_square", torch.zeros(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean_square.mul_(0.9).add_(0.1 * h.pow(2).mean())
        return super().forward(h)


def test_a_running_statistic_of_a_local_shard_is_caught_in_the_buffers(ddp_pool: DDPWorkerPool) -> None:
    # between the colwise and the rowwise Linear each rank holds its own columns only
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), TrackedTanh(), nn.Linear(8, 4))
    text = mismatch(ddp_pool, model, MLP_PLAN, mlp_batches())
    assert "step 1 buffer '1.mean_square': tensors are not close" in text
    # the same statistic where the activations are whole: on the replicated output
    torch.manual_seed(0)
    fixed = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4), TrackedTanh())
    result = train(ddp_pool, fixed, MLP_PLAN, mlp_batches())
    assert result.ok
    assert ("buffer", "3.mean_square") in {(row.id.kind, row.id.name) for row in result.tensors}


# --------------------------------------------------------------------------- sequence parallel


class Block(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


class SequenceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        with torch.no_grad():  # a trained norm: not the ones and zeros every rank would share
            self.block.norm.weight.uniform_(0.5, 1.5)
            self.block.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def sequence_plan(norm: Any = None) -> dict[str, Any]:
    # the block takes its rows of the sequence (Shard(1)), the LayerNorm runs on them, the
    # colwise Linear gathers the sequence back, the rowwise one all-reduces
    plan: dict[str, Any] = {
        "block": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
        "block.up": ColwiseParallel(input_layouts=Shard(1)),
        "block.down": RowwiseParallel(output_layouts=Replicate()),
    }
    if norm is not None:
        plan["block.norm"] = norm
    return plan


def sequence_batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(3, 4, 8, generator=generator), torch.randn(3, 4, 8, generator=generator)) for _ in range(steps)]


def all_reduce_norm_grads(ctx: Any) -> None:
    # Megatron's allreduce of the sequence-parallel LayerNorm's gradients
    for p in ctx.module.block.norm.parameters():
        if p.grad is not None and not isinstance(p.grad, DTensor):
            dist.all_reduce(p.grad, group=ctx.tp_group)


PARTIAL = "the LayerNorm's gradients are per-rank partial sums over the sequence shards"


def test_sequence_parallel_layernorm_partial_grads_are_named(ddp_pool: DDPWorkerPool) -> None:
    text = mismatch(ddp_pool, SequenceModel(), sequence_plan(), sequence_batches())
    assert "step 1" in text
    assert PARTIAL in text
    assert "['block.norm.weight', 'block.norm.bias']" in text
    assert "dist.all_reduce(p.grad, group=ctx.tp_group)" in text
    assert "or use SequenceParallel, which does" in text


def test_the_one_step_check_names_the_partial_layernorm_grads(ddp_pool: DDPWorkerPool) -> None:
    x, y = sequence_batches(1)[0]
    with pytest.raises(ParallelMismatch, match=PARTIAL):
        assert_tensor_parallel_grads_match(SequenceModel(), x, y, loss_fn=F.mse_loss, world_size=2, plan=sequence_plan(), pool=ddp_pool)


@pytest.mark.parametrize("fix", ["SequenceParallel", "all-reduce hook"])
def test_sequence_parallel_layernorm_fixed_passes(ddp_pool: DDPWorkerPool, fix: str) -> None:
    if fix == "SequenceParallel":
        result = train(ddp_pool, SequenceModel(), sequence_plan(SequenceParallel()), sequence_batches())
    else:
        result = train(ddp_pool, SequenceModel(), sequence_plan(), sequence_batches(), after_backward=all_reduce_norm_grads)
    assert result.ok
    assert not any(PARTIAL in note for note in result.notes)


def test_a_global_clip_passes_with_sequence_parallel_partial_grads(ddp_pool: DDPWorkerPool) -> None:
    # SequenceParallel leaves the norm's gradients Partial(sum) DTensors: clip_grad_norm_
    # reduces them before taking their norm
    result = train(ddp_pool, SequenceModel(), sequence_plan(SequenceParallel()), sequence_batches(), after_backward=torch_clip)
    assert result.ok


# --------------------------------------------------------------------------- arguments


def test_bad_arguments_are_named(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(InvalidArgument, match="after_backward"):
        train(ddp_pool, mlp(), MLP_PLAN, mlp_batches(), after_backward="clip")
    with pytest.raises(InvalidArgument, match="optimizer"):
        train(ddp_pool, mlp(), MLP_PLAN, mlp_batches(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(InvalidArgument, match="plan"):
        train(ddp_pool, mlp(), {"9": ColwiseParallel()}, mlp_batches())


# --------------------------------------------------------------------------- a 2-D mesh


@pytest.mark.deep
@pytest.mark.parametrize("ddp_pool", [4], indirect=True)
def test_a_module_the_plan_leaves_plain_checks_on_a_2d_mesh(ddp_pool: DDPWorkerPool) -> None:
    # FSDP2 shards the plain head over "dp" alone: its whole tensors are rebuilt from one
    # piece per data-parallel group, not one per rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 2))
    batches = [(x, y[:, :2]) for x, y in mlp_batches()]
    result = train(ddp_pool, model, MLP_PLAN, batches, optimizer=ADAM, data_parallel=2)
    assert result.ok
    assert ("optimizer state", "3.weight.exp_avg") in {(row.id.kind, row.id.name) for row in result.tensors}
    x, y = batches[0]
    one_step = assert_tensor_parallel_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=4, plan=MLP_PLAN, data_parallel=2, pool=ddp_pool)
    assert one_step.ok
