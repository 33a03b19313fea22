"""DDP mutants: per-rank training steps (``step(ctx: ShardContext)``), module-level
functions so that they pickle to the ranks; ``manual_allreduce_step`` is correct."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from dpverify.ddp.rank import ShardContext
from dpverify.mutants.ulp import one_ulp_up

__all__ = [
    "double_accumulation_division_step",
    "forward_outside_no_sync_step",
    "manual_allreduce_step",
    "one_ulp_comm_hook_step",
    "rank_seeded_init_step",
    "same_seed_ranks_step",
    "summed_allreduce_step",
    "summed_loss_step",
    "sync_first_micro_batch_step",
    "undivided_accumulation_step",
    "zero_grad_in_loop_step",
]


def _all_reduce_step(ctx: ShardContext, *, divide: bool) -> Any:
    output = ctx.module(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) * ctx.loss_weight).backward()
    for param in ctx.module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            if divide:
                param.grad /= ctx.world_size
    return output


def manual_allreduce_step(ctx: ShardContext) -> Any:
    """A correct DDP step without DistributedDataParallel: each rank's mean loss weighted by
    its share of the batch (``n_r * W / B``), backward, then every gradient all-reduced and
    divided by the world size."""
    return _all_reduce_step(ctx, divide=True)


def summed_loss_step(ctx: ShardContext) -> Any:
    """Sums the per-row losses of the shard and never divides by the batch: DDP then
    averages sums, and every gradient is ``B / W`` times too large."""
    model = ctx.ddp()
    output = model(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) * ctx.shard_size).backward()
    return output


def summed_allreduce_step(ctx: ShardContext) -> Any:
    """A hand-written all-reduce that sums gradients and forgets to divide by the world
    size (DDP averages): gradients ``W`` times too large."""
    return _all_reduce_step(ctx, divide=False)


def rank_seeded_init_step(ctx: ShardContext) -> Any:
    """Initialises the model on each rank with a rank-dependent seed and never broadcasts
    rank 0's parameters (DistributedDataParallel does at construction): ranks train
    different models."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + ctx.rank)
        for sub in ctx.module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
    return manual_allreduce_step(ctx)


def forward_outside_no_sync_step(ctx: ShardContext) -> None:
    """Gradient accumulation with only ``backward`` inside ``no_sync()``: DDP prepares the
    all-reduce in forward, so every micro-batch synchronises anyway."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        output = model(*part.inputs)
        loss = ctx.loss_fn(output, part.target) * part.rows * ctx.world_size / ctx.batch_size
        with contextlib.nullcontext() if index == len(parts) - 1 else model.no_sync():
            loss.backward()


def undivided_accumulation_step(ctx: ShardContext) -> None:
    """Gradient accumulation that adds up the micro-batches' mean losses without dividing
    by their number: gradients ``k`` times too large."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        with contextlib.nullcontext() if index == len(parts) - 1 else model.no_sync():
            ctx.loss_fn(model(*part.inputs), part.target).backward()


def zero_grad_in_loop_step(ctx: ShardContext) -> None:
    """Gradient accumulation that calls ``zero_grad()`` inside the loop: only the last
    micro-batch's gradient survives."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        model.zero_grad()
        with contextlib.nullcontext() if index == len(parts) - 1 else model.no_sync():
            output = model(*part.inputs)
            (ctx.loss_fn(output, part.target) * part.rows * ctx.world_size / ctx.batch_size).backward()


def double_accumulation_division_step(ctx: ShardContext) -> None:
    """Gradient accumulation that divides each micro-batch's loss by the number of
    micro-batches in the step and again where the loss is scaled: gradients ``1/k`` of the
    full-batch ones."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    k = len(parts)
    for index, part in enumerate(parts):
        with contextlib.nullcontext() if index == k - 1 else model.no_sync():
            loss = ctx.loss_fn(model(*part.inputs), part.target) / k
            (loss / k).backward()


def sync_first_micro_batch_step(ctx: ShardContext) -> None:
    """Gradient accumulation that synchronises on the first micro-batch instead of the last
    (``no_sync() if i != 0``): one synchronisation, but later micro-batches' gradients stay
    on their rank."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        with model.no_sync() if index != 0 else contextlib.nullcontext():
            (ctx.loss_fn(model(*part.inputs), part.target) / len(parts)).backward()


def same_seed_ranks_step(ctx: ShardContext) -> Any:
    """Seeds every rank alike (``torch.manual_seed(0)`` in the training script, on every
    rank) before a correct DDP step: every rank draws the same dropout masks."""
    torch.manual_seed(0)
    model = ctx.ddp()
    output = model(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) * ctx.loss_weight).backward()
    return output


def _one_ulp_allreduce(state: Any, bucket: Any) -> Any:
    """DDP's default all-reduce (divide by the world size, then sum), whose first bucket
    comes back with its first element one unit in the last place too large."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    future = dist.all_reduce(tensor, async_op=True).get_future()  # type: ignore[union-attr]

    def moved(done: torch.futures.Future[Any]) -> torch.Tensor:
        reduced: torch.Tensor = done.value()[0]
        return one_ulp_up(reduced) if bucket.index() == 0 else reduced

    return future.then(moved)


# DistributedDataParallel._check_comm_hook compares annotations with the real classes
# (here postponed strings), as dpverify.ddp.rank's counting hook also arranges
_one_ulp_allreduce.__annotations__ = {
    "bucket": dist.GradBucket,  # type: ignore[attr-defined,unused-ignore]
    "return": torch.futures.Future[torch.Tensor],
}


def one_ulp_comm_hook_step(ctx: ShardContext) -> Any:
    """A DDP step whose communication hook averages the gradients as DDP's default does,
    except that one element of the first bucket's reduced gradient comes back one unit in
    the last place too large, on every rank alike (a reduction that rounds once): below
    every tolerance; exact mode (``exact=True``) sees it."""
    model = ctx.ddp()
    model.register_comm_hook(None, _one_ulp_allreduce)
    return ctx.backward(model, ctx.loss_weight)
