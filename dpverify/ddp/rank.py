"""What runs on each DDP rank: the context a step sees, the training steps, and the checks'
tasks, on the shared rank side of ``dpverify.ranked.rank``: each step wraps a fresh copy of
the module in torch's own ``DistributedDataParallel``. Everything here must be importable
by the rank processes, and every function a task names must be picklable.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpverify.ranked.randomness import DropoutCall, generator_state, recording_dropout
from dpverify.ranked.rank import (
    MicroBatch,
    RankContext,
    RankInfo,
    RankStep,
    RankStepTask,
    RankTraining,
    RankTrainingTask,
    buffers_of,
    grads_of,
    optimizer_state_of,
    outputs_of,
    run_step,
    seeded,
    train,
)

__all__ = [
    "RankBuffers",
    "ShardContext",
    "StepTask",
    "TrainingTask",
    "ddp_step",
    "micro_mean_accumulation_step",
    "no_sync_accumulation_step",
    "run_buffer_task",
    "run_step_task",
    "run_training_task",
    "watching_all_reduce",
    "weighted_ddp_step",
]

Step = Callable[["ShardContext"], Any]


def _count_syncs_then_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    # torch's default all-reduce (divide by world size, then sum), counting one gradient
    # synchronisation per backward pass at its last bucket, with the forwards run so far
    # (the micro-batch whose backward it is).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if bucket.is_last():
        state.syncs += 1
        state.sync_forwards.append(state.forwards)
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def _counting_hook() -> Callable[..., Any]:
    # DistributedDataParallel._check_comm_hook compares annotations with the real classes,
    # so the hook carries them as objects rather than as (postponed) strings.
    _count_syncs_then_allreduce.__annotations__ = {
        "bucket": dist.GradBucket,  # type: ignore[attr-defined,unused-ignore]
        "return": torch.futures.Future[torch.Tensor],
    }
    return _count_syncs_then_allreduce


@dataclass
class ShardContext(RankContext):
    """What a rank's DDP step sees; the argument of every ``step`` function.

    A step wraps ``module`` with ``ctx.ddp()`` (torch's DistributedDataParallel with the
    check's keyword arguments), runs forward and backward on its shard, and may return the
    forward's output to have it compared row by row with the single-device output. It must
    leave the gradients in ``module``'s parameters. A step that does its own all-reduce
    can use ``module`` directly, unwrapped.

    The attributes of ``RankContext`` (``inputs``, ``target``, ``loss_weight``,
    ``micro_batch_split()``, ...), and:

    Attributes:
        ddp_kwargs: keyword arguments for DistributedDataParallel.
        count_syncs: whether ``ddp()`` counts gradient synchronisations (through a
            communication hook running torch's default all-reduce).
        syncs: gradient synchronisations seen so far (when counted).
        forwards: forwards of ``module`` seen so far (when synchronisations are counted).
        sync_forwards: for each synchronisation, the forwards seen before it: the
            micro-batch whose backward synchronised, from 1.
        init_sync: whether ``ddp()`` leaves DistributedDataParallel's start-up
            collectives on (torch's ``init_sync``: a check of the parameters' shapes across
            ranks and a broadcast of rank 0's parameters and buffers). False only where
            they cannot change anything (``WRAPPING_FIRST_STEPS``); ``ddp_kwargs`` may still
            name ``init_sync``, which wins.
    """

    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    count_syncs: bool = False
    init_sync: bool = True
    syncs: int = 0
    forwards: int = 0
    sync_forwards: list[int] = field(default_factory=list)
    _wrapper: DistributedDataParallel | None = field(default=None, repr=False)

    @property
    def wrapped(self) -> bool:
        """Whether the step used ``ddp()``."""
        return self._wrapper is not None

    def ddp(self) -> DistributedDataParallel:
        """The module wrapped in DistributedDataParallel (made once, then reused)."""
        if self._wrapper is None:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            kwargs = dict(self.ddp_kwargs)
            if not self.init_sync and _HAS_INIT_SYNC:
                kwargs.setdefault("init_sync", False)
            wrapper = DistributedDataParallel(self.module, device_ids=device_ids, **kwargs)
            if self.count_syncs:
                wrapper.register_comm_hook(self, _counting_hook())
                self.module.register_forward_pre_hook(self._forwarded)
            self._wrapper = wrapper
        return self._wrapper

    def _forwarded(self, _module: nn.Module, _args: Any) -> None:
        self.forwards += 1


@contextlib.contextmanager
def watching_all_reduce(seen: list[tuple[int, ...]]) -> Iterator[None]:
    """Runs the body with ``torch.distributed.all_reduce`` appending to ``seen`` the shape of
    every tensor requiring grad it is given: autograd has no formula for it (torch 2.13
    passes the gradient through unchanged, with a warning that no autograd kernel is
    registered for c10d::allreduce_), so a loss all-reduced this way and then divided by the
    world size sends ``1/world_size`` of its gradient back. Calls through a name bound
    before the step (``from torch.distributed import all_reduce``) are not seen."""
    original = dist.all_reduce

    @functools.wraps(original)
    def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            seen.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def ddp_step(ctx: ShardContext) -> Any:
    """The textbook DDP step: forward the shard, mean loss, backward. Biased when the ranks
    hold different numbers of items (rows, or tokens of a token-level loss): DDP averages
    per-rank means (the loss-averaging trap)."""
    return ctx.backward(ctx.ddp())


def weighted_ddp_step(ctx: ShardContext) -> Any:
    """The exact DDP step for any shards: the rank's mean loss times its share of the
    items, ``ctx.loss_weight`` (``n_r * W / B`` for rows, ``t_r * W / T`` for tokens)."""
    return ctx.backward(ctx.ddp(), ctx.loss_weight)


def no_sync_accumulation_step(ctx: ShardContext) -> None:
    """Gradient accumulation over ``ctx.micro_batches`` micro-batches with ``no_sync()``.

    Forward *and* backward of every micro-batch but the last run inside ``no_sync()`` (DDP
    prepares the all-reduce in forward: torch/nn/parallel/distributed.py, ``_pre_forward``),
    and each micro-batch's mean loss is weighted by its share of the items over every rank
    and micro-batch, ``items * W / T`` (``rows * W / B``, ``1/k`` when all micro-batches
    are equal; for a token-level loss its tokens over the total count), so the one
    synchronisation at the end gives the full-batch gradient.
    """
    _accumulate(ctx, lambda loss, part, _k: loss * (part.items * ctx.world_size / ctx.total_items))


def _accumulate(ctx: ShardContext, scaled: Callable[[torch.Tensor, MicroBatch, int], torch.Tensor]) -> None:
    """Forward and backward of each micro-batch, every one but the last inside
    ``no_sync()``, backpropagating ``scaled(loss, micro_batch, number_of_micro_batches)``."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            output = model(*part.inputs, **part.kwargs)
            scaled(ctx.loss_fn(output, part.target), part, len(parts)).backward()


def micro_mean_accumulation_step(ctx: ShardContext) -> None:
    """Gradient accumulation that divides each micro-batch's mean loss by the number of
    micro-batches (the trainers' ``loss / gradient_accumulation_steps``). Exact only when
    every micro-batch of every rank holds as many items: with different numbers of tokens
    (or rows) it is the loss-averaging trap. The accumulation check runs it for contrast."""
    _accumulate(ctx, lambda loss, _part, k: loss / k)


#: Whether this torch's DistributedDataParallel takes ``init_sync`` (from torch 2.3 on).
_HAS_INIT_SYNC = "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters

#: dpverify's own steps: each wraps the module with ``ctx.ddp()`` before anything else
#: touches it, and every rank's module is then a copy of the same pickled module, equal bit
#: for bit. DistributedDataParallel's start-up collectives (``init_sync``: the parameters'
#: shapes compared across ranks, rank 0's parameters and buffers broadcast) would find equal
#: shapes and copy equal values, so these steps' wrappers skip them: two collectives fewer per
#: step, the larger part of a small model's step on the ranks. A custom step keeps torch's
#: default, since it may change the module before it wraps it.
WRAPPING_FIRST_STEPS = frozenset({ddp_step, weighted_ddp_step, no_sync_accumulation_step, micro_mean_accumulation_step})


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class StepTask(RankStepTask):
    """One DDP step per function in ``steps``, each on a fresh copy of ``module``: a
    ``RankStepTask`` with DistributedDataParallel's keyword arguments, ``micro_batches``
    per shard, whether to count gradient synchronisations, and whether to convert the
    module's batch norms to SyncBatchNorm."""

    ddp_kwargs: tuple[tuple[str, Any], ...] = ()
    micro_batches: int = 1
    count_syncs: bool = False
    sync_batchnorm: bool = False


def _context(
    info: RankInfo, task: StepTask | TrainingTask, shard_sizes: tuple[int, ...], sync_batchnorm: bool = False, *, first: Step | None, **more: Any,
) -> ShardContext:
    """The context of rank ``info`` over its own copy of ``task.module``, on its device,
    the batch norms converted to SyncBatchNorm when asked; ``first``: the step that runs
    first on it, whose wrapper skips DDP's start-up collectives when it is one of
    ``WRAPPING_FIRST_STEPS`` (None: dpverify's own code, which wraps the copy first)."""
    device = torch.device(info.device)
    model = copy.deepcopy(task.module).to(device)
    if sync_batchnorm and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif sync_batchnorm:
        from dpverify.ddp.syncbn import convert_to_host_sync_batchnorm

        model = convert_to_host_sync_batchnorm(model)
    return ShardContext.for_rank(
        info, model, task.loss_fn, shard_sizes, ddp_kwargs=dict(task.ddp_kwargs), init_sync=first is not None and first not in WRAPPING_FIRST_STEPS, **more,
    )


def _run_one(info: RankInfo, task: StepTask, step: Step) -> RankStep:
    ctx = _context(
        info, task, task.shard_sizes, task.sync_batchnorm, first=step, micro_batches=task.micro_batches, count_syncs=task.count_syncs,
    )
    dropout: list[DropoutCall] = []
    all_reduced: list[tuple[int, ...]] = []
    end_state: list[str] = []

    def step_then_read_state(context: ShardContext) -> Any:
        # the random state the step leaves, read before run_step restores the process's
        output = step(context)
        end_state.append(generator_state(context.device))
        return output

    with recording_dropout(ctx.module, dropout), watching_all_reduce(all_reduced):
        output, loss = run_step(ctx, task, step_then_read_state)
    return RankStep(
        grads=grads_of(ctx.module),
        outputs=outputs_of(output),
        loss=loss,
        buffers=buffers_of(ctx.module),
        wrapped=ctx.wrapped,
        syncs=ctx.syncs if task.count_syncs and ctx.wrapped else None,
        sync_forwards=tuple(ctx.sync_forwards),
        forwards=ctx.forwards if task.count_syncs and ctx.wrapped else None,
        dropout=tuple(dropout),
        grad_all_reduces=tuple(all_reduced),
        end_state=end_state[0] if end_state else None,
    )


def run_step_task(info: RankInfo, task: StepTask) -> tuple[RankStep, ...]:
    """Runs every step of ``task`` on this rank's shard (a task for ``RankRunner.run``)."""
    return tuple(_run_one(info, task, step) for step in task.steps)


@dataclass(frozen=True)
class TrainingTask(RankTrainingTask):
    """``len(batches)`` optimizer steps of DDP training from the same weights on every
    rank: a ``RankTrainingTask`` with DistributedDataParallel's keyword arguments."""

    ddp_kwargs: tuple[tuple[str, Any], ...] = ()


def run_training_task(info: RankInfo, task: TrainingTask) -> RankTraining:
    """Trains this rank's copy for ``len(task.batches)`` steps (a task for ``RankRunner.run``)."""
    ctx = _context(info, task, task.shard_sizes[0], first=task.step)
    trained = train(ctx, task, read_buffers=buffers_of, read_state=optimizer_state_of, record_dropout=True)
    grads_none = tuple(name for name, grad in grads_of(ctx.module).items() if grad is None)
    return RankTraining(
        trained.params, buffers_of(ctx.module), grads_none, ctx.wrapped, step_buffers=trained.buffers, step_state=trained.state,
        dropout=trained.dropout, end_states=trained.end_states,
    )


@dataclass(frozen=True)
class RankBuffers:
    """Buffers after the train step, after the next (eval) forward, and that forward's output."""

    after_step: dict[str, torch.Tensor]
    after_next_forward: dict[str, torch.Tensor]
    next_outputs: tuple[tuple[str, torch.Tensor], ...]


def run_buffer_task(info: RankInfo, task: StepTask) -> RankBuffers:
    """One train step with grad (so DDP syncs buffers before the next forward), then an
    eval forward under no_grad (a task for ``RankRunner.run``; ``task.steps`` unused)."""
    ctx = _context(info, task, task.shard_sizes, first=None)
    model = ctx.module
    ctx.load(task.inputs, task.target, task.kwargs, task.shard_sizes)
    wrapper = ctx.ddp()
    with seeded(ctx.device, task.seed):
        wrapper.train()
        task.loss_fn(wrapper(*ctx.inputs, **ctx.kwargs), ctx.target).backward()
        after_step = buffers_of(model)
        wrapper.eval()
        with torch.no_grad():
            output = wrapper(*ctx.inputs, **ctx.kwargs)
    return RankBuffers(after_step, buffers_of(model), outputs_of(output))
