"""What runs on each DDP rank: the shard it sees, the training steps, and the checks' tasks.

A check sends one frozen task (module, full batch, shard sizes, loss, step functions) to
every rank through a ``RankRunner``; each rank cuts its contiguous shard out of the batch,
runs the steps on fresh copies of the module wrapped in torch's own
``DistributedDataParallel``, and returns what they produced (gradients, outputs, buffers,
parameters) as CPU tensors. Everything here must be importable by the rank processes, and
every function a task names must be picklable.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpverify.core.errors import InvalidArgument
from dpverify.core.step import convert_tensors, flatten_tensors, no_tf32, parameter_sites
from dpverify.core.tree import map_tensors

__all__ = [
    "BufferTask",
    "MicroBatch",
    "RankBuffers",
    "RankInfo",
    "RankStep",
    "RankTraining",
    "ShardContext",
    "StepTask",
    "TrainingTask",
    "ddp_step",
    "even_shards",
    "micro_mean_accumulation_step",
    "no_sync_accumulation_step",
    "run_buffer_task",
    "run_step_task",
    "run_training_task",
    "shard_bounds",
    "take_rows",
    "weighted_ddp_step",
]

LossFn = Callable[[Any, Any], torch.Tensor]
Step = Callable[["ShardContext"], Any]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclass(frozen=True)
class RankInfo:
    """Who a task runs as: passed to every task function as its first argument.

    Defined here, with the per-rank code that reads it, rather than in the pool that makes
    it, so that what runs on a rank does not depend on how the ranks are managed.

    Attributes:
        rank: this process's rank in the default process group.
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``.
        device: where this rank computes, ``"cpu"`` or ``"cuda:<local rank>"``.
    """

    rank: int
    world_size: int
    backend: str
    device: str


def even_shards(batch_size: int, world_size: int) -> tuple[int, ...]:
    """Contiguous shard sizes as even as possible; the first ``batch_size % world_size``
    ranks get one row more (``even_shards(5, 2) == (3, 2)``).

    Raises:
        InvalidArgument: fewer rows than ranks (a rank with no rows has no mean loss).
    """
    if batch_size < world_size:
        raise InvalidArgument(
            f"a batch of {batch_size} rows cannot give each of {world_size} ranks a row; "
            f"pass at least world_size={world_size} rows"
        )
    base, extra = divmod(batch_size, world_size)
    return tuple(base + 1 if rank < extra else base for rank in range(world_size))


def shard_bounds(shard_sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` rows of every shard, in rank order."""
    bounds, start = [], 0
    for size in shard_sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def take_rows(obj: Any, start: int, stop: int, batch_size: int) -> Any:
    """Rows ``start:stop`` of every tensor with ``batch_size`` rows in a nested structure;
    other tensors (parameters-like, scalars) and objects are passed whole."""

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > 0 and tensor.size(0) == batch_size:
            return tensor[start:stop]
        return tensor

    return map_tensors(obj, rows)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a rank's shard.

    Attributes:
        inputs: its positional forward arguments.
        target: its rows of the target.
        rows: its row count.
        kwargs: its keyword forward arguments (batched tensors cut like ``inputs``).
        items: the items its mean loss averages over: its rows, or for a token-level loss
            its tokens that are not ignored (as the check counted them).
    """

    inputs: tuple[Any, ...]
    target: Any
    rows: int
    kwargs: dict[str, Any]
    items: int


def _count_syncs_then_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    # torch's default all-reduce (divide by world size, then sum), counting one gradient
    # synchronisation per backward pass at its last bucket.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if bucket.is_last():
        state.syncs += 1
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
class ShardContext:
    """What a rank's training step sees; the argument of every ``step`` function.

    A step wraps ``module`` with ``ctx.ddp()`` (torch's DistributedDataParallel with the
    check's keyword arguments), runs forward and backward on its shard, and may return the
    forward's output to have it compared row by row with the single-device output. It must
    leave the gradients in ``module``'s parameters. A step that does its own all-reduce
    can use ``module`` directly, unwrapped.

    Attributes:
        rank: this rank.
        world_size: number of ranks.
        module: this rank's copy of the module, on ``device``, weights as on every rank.
        inputs: this rank's shard of the positional forward arguments (``()`` for a
            keyword-only forward).
        target: this rank's shard of the target.
        loss_fn: ``loss_fn(output, target)``, a mean loss (over rows, or over tokens).
        shard_sizes: rows of every rank's shard, in rank order.
        device: where this rank computes.
        ddp_kwargs: keyword arguments for DistributedDataParallel.
        micro_batches: micro-batches per shard, for gradient accumulation.
        count_syncs: whether ``ddp()`` counts gradient synchronisations (through a
            communication hook running torch's default all-reduce).
        syncs: gradient synchronisations seen so far (when counted).
        kwargs: this rank's shard of the keyword forward arguments: call
            ``model(*ctx.inputs, **ctx.kwargs)``.
        item_kind: what each rank's mean loss averages over, as the check found it:
            ``"rows"``, ``"tokens (target != -100)"``, or ``"items"`` (counted by ``items=``).
        item_counts: every rank's count of those items, in rank order (``()``: rows).
        micro_batch_items: this rank's count per micro-batch of ``micro_batch_split()``
            (``()``: rows).

    A token-level loss (a mean over the labels that are not -100) is exact under DDP when
    each rank's mean loss is weighted by its share of the tokens, ``ctx.loss_weight`` =
    ``ctx.items * world_size / ctx.total_items``; or, equivalently, when each rank divides
    its summed token loss by the all-reduced token count (``ctx.total_items``) and
    multiplies by ``world_size`` (DDP divides the summed gradients by it).
    """

    rank: int
    world_size: int
    module: nn.Module
    inputs: tuple[Any, ...]
    target: Any
    loss_fn: LossFn
    shard_sizes: tuple[int, ...]
    device: torch.device
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    micro_batches: int = 1
    count_syncs: bool = False
    syncs: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)
    item_kind: str = "rows"
    item_counts: tuple[int, ...] = ()
    micro_batch_items: tuple[int, ...] = ()
    _wrapper: DistributedDataParallel | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return sum(self.shard_sizes)

    @property
    def shard_size(self) -> int:
        return self.shard_sizes[self.rank]

    @property
    def items(self) -> int:
        """The items this rank's mean loss averages over: ``t_r``, its tokens for a
        token-level loss, else its rows."""
        return self.item_counts[self.rank] if self.item_counts else self.shard_size

    @property
    def total_items(self) -> int:
        """``T``: the items over every rank (what an all-reduce of ``items`` gives), the
        count the full-batch mean loss divides by; else the batch's rows."""
        return sum(self.item_counts) if self.item_counts else self.batch_size

    @property
    def loss_weight(self) -> float:
        """``t_r * world_size / T``: the factor that makes DDP's average of per-rank mean
        losses the full-batch mean loss, for any shards (1.0 for equal ones): the rank's
        share of the items, its rows (``n_r * world_size / B``) or its tokens."""
        return self.items * self.world_size / self.total_items

    @property
    def wrapped(self) -> bool:
        return self._wrapper is not None

    def ddp(self) -> DistributedDataParallel:
        """The module wrapped in DistributedDataParallel (made once, then reused)."""
        if self._wrapper is None:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            wrapper = DistributedDataParallel(self.module, device_ids=device_ids, **self.ddp_kwargs)
            if self.count_syncs:
                wrapper.register_comm_hook(self, _counting_hook())
            self._wrapper = wrapper
        return self._wrapper

    def micro_batch_split(self) -> list[MicroBatch]:
        """This shard cut into ``micro_batches`` contiguous micro-batches, as even as
        possible, each with its count of items (``micro_batch_items``, rows when the check
        counted none for this cut)."""
        sizes = even_shards(self.shard_size, self.micro_batches)
        counts = self.micro_batch_items if len(self.micro_batch_items) == len(sizes) else sizes
        return [
            MicroBatch(
                take_rows(self.inputs, start, stop, self.shard_size),
                take_rows(self.target, start, stop, self.shard_size),
                stop - start,
                take_rows(self.kwargs, start, stop, self.shard_size),
                count,
            )
            for (start, stop), count in zip(shard_bounds(sizes), counts, strict=True)
        ]


def ddp_step(ctx: ShardContext) -> Any:
    """The textbook DDP step: forward the shard, mean loss, backward. Biased when the ranks
    hold different numbers of items (rows, or tokens of a token-level loss): DDP averages
    per-rank means (the loss-averaging trap)."""
    model = ctx.ddp()
    output = model(*ctx.inputs, **ctx.kwargs)
    ctx.loss_fn(output, ctx.target).backward()
    return output


def weighted_ddp_step(ctx: ShardContext) -> Any:
    """The exact DDP step for any shards: the rank's mean loss times its share of the
    items, ``ctx.loss_weight`` (``n_r * W / B`` for rows, ``t_r * W / T`` for tokens)."""
    model = ctx.ddp()
    output = model(*ctx.inputs, **ctx.kwargs)
    (ctx.loss_fn(output, ctx.target) * ctx.loss_weight).backward()
    return output


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


# --------------------------------------------------------------------------- tasks


def _on(obj: Any, device: torch.device) -> Any:
    return convert_tensors(obj, None, device)


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    grads: dict[str, torch.Tensor | None] = {}
    for name, module_path, attr in parameter_sites(module):
        param = module.get_submodule(module_path)._parameters[attr]
        grads[name] = None if param is None or param.grad is None else _cpu(param.grad)
    return grads


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _cpu(p) for name, p in module.named_parameters()}


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _cpu(b) for name, b in module.named_buffers()}


def _outputs(output: Any) -> tuple[tuple[str, torch.Tensor], ...]:
    return tuple((path, _cpu(t)) for path, t in flatten_tensors(output, "output"))


def _module_copy(module: nn.Module, device: torch.device, *, sync_batchnorm: bool) -> nn.Module:
    model = copy.deepcopy(module).to(device)
    if sync_batchnorm:
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            from dpverify.ddp.syncbn import convert_to_host_sync_batchnorm

            model = convert_to_host_sync_batchnorm(model)
    return model


@dataclass(frozen=True)
class StepTask:
    """One DDP step per function in ``steps``, each on a fresh copy of ``module``.

    ``item_counts``: the items (rows, tokens) of every rank's micro-batches, per rank, as
    the parent counted them (``()``: rows); ``item_kind`` says what they count."""

    module: nn.Module
    inputs: tuple[Any, ...]
    target: Any
    loss_fn: LossFn
    shard_sizes: tuple[int, ...]
    steps: tuple[Step, ...]
    ddp_kwargs: tuple[tuple[str, Any], ...] = ()
    micro_batches: int = 1
    count_syncs: bool = False
    sync_batchnorm: bool = False
    seed: int = 0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    item_kind: str = "rows"
    item_counts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class RankStep:
    """What one step left on one rank (CPU tensors).

    Attributes:
        grads: gradient of every parameter of the unwrapped module, by qualified name.
        outputs: the step's returned output, flattened by path (empty if it returned None).
        loss: the rank's mean loss on its shard (None when the step returned no output).
        buffers: every buffer after the step.
        wrapped: whether the step used ``ctx.ddp()``.
        syncs: gradient synchronisations counted (None when not counted).
    """

    grads: dict[str, torch.Tensor | None]
    outputs: tuple[tuple[str, torch.Tensor], ...]
    loss: float | None
    buffers: dict[str, torch.Tensor]
    wrapped: bool
    syncs: int | None


def _shard_of(task_inputs: Any, target: Any, shard_sizes: Sequence[int], rank: int, kwargs: Mapping[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """This rank's rows of the positional arguments, the target and the keyword arguments."""
    batch = sum(shard_sizes)
    start, stop = shard_bounds(shard_sizes)[rank]
    return (
        take_rows(task_inputs, start, stop, batch),
        take_rows(target, start, stop, batch),
        take_rows(dict(kwargs or {}), start, stop, batch),
    )


def _items_of(counts: Sequence[Sequence[int]], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(every rank's count, this rank's counts per micro-batch) from per-rank, per-micro-batch
    counts; both empty when none were counted (rows)."""
    if not counts:
        return (), ()
    return tuple(sum(pieces) for pieces in counts), tuple(counts[rank])


def _run_one(info: RankInfo, task: StepTask, step: Step) -> RankStep:
    device = torch.device(info.device)
    model = _module_copy(task.module, device, sync_batchnorm=task.sync_batchnorm)
    inputs, target, kwargs = _shard_of(task.inputs, task.target, task.shard_sizes, info.rank, task.kwargs)
    per_rank, mine = _items_of(task.item_counts, info.rank)
    ctx = ShardContext(
        rank=info.rank,
        world_size=info.world_size,
        module=model,
        inputs=_on(inputs, device),
        target=_on(target, device),
        loss_fn=task.loss_fn,
        shard_sizes=task.shard_sizes,
        device=device,
        ddp_kwargs=dict(task.ddp_kwargs),
        micro_batches=task.micro_batches,
        count_syncs=task.count_syncs,
        kwargs=_on(kwargs, device),
        item_kind=task.item_kind,
        item_counts=per_rank,
        micro_batch_items=mine,
    )
    fork = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork), no_tf32():
        torch.manual_seed(task.seed)
        output = step(ctx)
        loss = None
        if output is not None:
            with torch.no_grad():
                loss = float(task.loss_fn(output, ctx.target))
    return RankStep(
        grads=_grads(model),
        outputs=_outputs(output) if output is not None else (),
        loss=loss,
        buffers=_buffers(model),
        wrapped=ctx.wrapped,
        syncs=ctx.syncs if task.count_syncs and ctx.wrapped else None,
    )


def run_step_task(info: RankInfo, task: StepTask) -> tuple[RankStep, ...]:
    """Runs every step of ``task`` on this rank's shard (a task for ``RankRunner.run``)."""
    return tuple(_run_one(info, task, step) for step in task.steps)


@dataclass(frozen=True)
class TrainingTask:
    """``len(batches)`` optimizer steps of DDP training from the same weights on every rank.

    ``batches``: ``(inputs, kwargs, target)`` per step; ``item_kinds`` and ``item_counts``:
    what each batch's rank losses average over and every rank's count of it, per batch
    (``()``: rows)."""

    module: nn.Module
    batches: tuple[tuple[tuple[Any, ...], Mapping[str, Any], Any], ...]
    loss_fn: LossFn
    optimizer: OptimizerFactory
    shard_sizes: tuple[tuple[int, ...], ...]
    step: Step
    ddp_kwargs: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    item_kinds: tuple[str, ...] = ()
    item_counts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class RankTraining:
    """Parameters after every optimizer step, and the buffers at the end, on one rank."""

    params: tuple[dict[str, torch.Tensor], ...]
    buffers: dict[str, torch.Tensor]
    grads_none: tuple[str, ...]
    wrapped: bool = True


def run_training_task(info: RankInfo, task: TrainingTask) -> RankTraining:
    """Trains this rank's copy for ``len(task.batches)`` steps (a task for ``RankRunner.run``)."""
    device = torch.device(info.device)
    model = _module_copy(task.module, device, sync_batchnorm=False)
    optimizer = task.optimizer(model.parameters())
    ctx = ShardContext(
        rank=info.rank,
        world_size=info.world_size,
        module=model,
        inputs=(),
        target=None,
        loss_fn=task.loss_fn,
        shard_sizes=task.shard_sizes[0],
        device=device,
        ddp_kwargs=dict(task.ddp_kwargs),
    )
    history: list[dict[str, torch.Tensor]] = []
    fork = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork), no_tf32():
        torch.manual_seed(task.seed)
        for index, ((inputs, kwargs, target), sizes) in enumerate(zip(task.batches, task.shard_sizes, strict=True)):
            shard_inputs, shard_target, shard_kwargs = _shard_of(inputs, target, sizes, info.rank, kwargs)
            ctx.inputs, ctx.target, ctx.shard_sizes = _on(shard_inputs, device), _on(shard_target, device), sizes
            ctx.kwargs = _on(shard_kwargs, device)
            ctx.item_kind = task.item_kinds[index] if task.item_kinds else "rows"
            ctx.item_counts = task.item_counts[index] if task.item_counts else ()
            ctx.micro_batch_items = (ctx.item_counts[info.rank],) if ctx.item_counts else ()
            optimizer.zero_grad(set_to_none=True)
            try:
                task.step(ctx)
            except Exception as error:
                # The parent retells some of torch's errors (an unfinished reduction) and
                # needs to know in which step they came.
                error.add_note(f"dpverify: raised in optimizer step {index + 1} of {len(task.batches)}")
                raise
            optimizer.step()
            history.append(_params(model))
    grads_none = tuple(name for name, grad in _grads(model).items() if grad is None)
    return RankTraining(tuple(history), _buffers(model), grads_none, ctx.wrapped)


@dataclass(frozen=True)
class BufferTask:
    """A train-mode DDP step, then an eval-mode forward: where do the buffers come from?"""

    module: nn.Module
    inputs: tuple[Any, ...]
    target: Any
    loss_fn: LossFn
    shard_sizes: tuple[int, ...]
    ddp_kwargs: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RankBuffers:
    """Buffers after the train step, after the next (eval) forward, and that forward's output."""

    after_step: dict[str, torch.Tensor]
    after_next_forward: dict[str, torch.Tensor]
    next_outputs: tuple[tuple[str, torch.Tensor], ...]


def run_buffer_task(info: RankInfo, task: BufferTask) -> RankBuffers:
    """One train step with grad (so DDP syncs buffers before the next forward), then an
    eval forward under no_grad (a task for ``RankRunner.run``)."""
    device = torch.device(info.device)
    model = _module_copy(task.module, device, sync_batchnorm=False)
    inputs, target, kwargs = _shard_of(task.inputs, task.target, task.shard_sizes, info.rank, task.kwargs)
    inputs, target, kwargs = _on(inputs, device), _on(target, device), _on(kwargs, device)
    device_ids = [device.index] if device.type == "cuda" else None
    wrapper = DistributedDataParallel(model, device_ids=device_ids, **dict(task.ddp_kwargs))
    fork = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork), no_tf32():
        torch.manual_seed(task.seed)
        wrapper.train()
        task.loss_fn(wrapper(*inputs, **kwargs), target).backward()
        after_step = _buffers(model)
        wrapper.eval()
        with torch.no_grad():
            output = wrapper(*inputs, **kwargs)
    return RankBuffers(after_step, _buffers(model), _outputs(output))
