"""What every ranked backend runs on a rank: who the rank is, its shard of the batch, the
context a step sees, the step runner, the training loop, and CPU snapshots of what a step
left (gradients, parameters, buffers, outputs).

A check sends one frozen task to every rank of a ``RankRunner``; the DDP, FSDP2,
tensor-parallel and pipeline tasks (``dpverify.ddp.rank``, ``dpverify.sharded.*_rank``)
differ in how a step wraps the module and in the evidence they return, and share the rest
from here. Everything here must be importable by the rank processes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.core.step import LossFn, convert_tensors, flatten_tensors, no_tf32, parameter_sites
from dpverify.core.tree import map_tensors
from dpverify.ranked.randomness import DropoutCall, generator_state, rank_seed, recording_dropout

__all__ = [
    "AfterBackward",
    "Batch",
    "LossFn",
    "MicroBatch",
    "OptimizerFactory",
    "RankContext",
    "RankInfo",
    "RankStep",
    "RankStepTask",
    "RankTraining",
    "RankTrainingTask",
    "ReferenceContext",
    "StepRead",
    "Trained",
    "after_backward_note",
    "buffers_of",
    "cpu_copy",
    "even_shards",
    "grads_of",
    "items_of",
    "one_rank_group",
    "one_rank_group_held",
    "optimizer_state_of",
    "outputs_of",
    "params_of",
    "run_step",
    "seeded",
    "shard_bounds",
    "shard_of",
    "take_rows",
    "to_device",
    "train",
]

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
#: The user's code between backward and the optimizer step, ``hook(ctx)``: clipping,
#: unscaling, a custom all-reduce. Run on every rank with its context, and on the
#: single-device reference with a context of one rank (``RankContext.reference``).
AfterBackward = Callable[[Any], None]
#: One batch of a training run: ``(inputs, kwargs, target)``.
Batch = tuple[tuple[Any, ...], Mapping[str, Any], Any]
C = TypeVar("C", bound="RankContext")


@dataclass(frozen=True)
class RankInfo:
    """Who a task runs as: passed to every task function as its first argument.

    Defined with the per-rank code that reads it, rather than in the pool that makes it, so
    that what runs on a rank does not depend on how the ranks are managed.

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


# --------------------------------------------------------------------------- shards


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
    return list(itertools.pairwise(itertools.accumulate(shard_sizes, initial=0)))


def take_rows(obj: Any, start: int, stop: int, batch_size: int) -> Any:
    """Rows ``start:stop`` of every tensor with ``batch_size`` rows in a nested structure;
    other tensors (parameters-like, scalars) and objects are passed whole."""

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() > 0 and tensor.size(0) == batch_size:
            return tensor[start:stop]
        return tensor

    return map_tensors(obj, rows)


def shard_of(
    inputs: Any, target: Any, shard_sizes: Sequence[int], shard: int, kwargs: Mapping[str, Any] | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """Shard ``shard``'s rows of the positional arguments, the target and the keyword
    arguments of a batch cut in contiguous ``shard_sizes``."""
    batch = sum(shard_sizes)
    start, stop = shard_bounds(shard_sizes)[shard]
    return (
        take_rows(inputs, start, stop, batch),
        take_rows(target, start, stop, batch),
        take_rows(dict(kwargs or {}), start, stop, batch),
    )


def items_of(counts: Sequence[Sequence[int]], shard: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(every shard's count, shard's counts per micro-batch)`` from per-shard,
    per-micro-batch counts of items; both empty when none were counted (rows)."""
    if not counts:
        return (), ()
    return tuple(sum(pieces) for pieces in counts), tuple(counts[shard])


# --------------------------------------------------------------------------- tensors


def to_device(obj: Any, device: torch.device) -> Any:
    """Fresh copies on ``device`` of every tensor in a nested structure."""
    return convert_tensors(obj, None, device)


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of ``tensor`` (sendable to the parent)."""
    return tensor.detach().to("cpu", copy=True)


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """CPU copy of the gradient of every distinct parameter, by qualified name (None: no
    gradient). A tied parameter appears once, under its first name."""
    grads: dict[str, torch.Tensor | None] = {}
    for name, module_path, attr in parameter_sites(module):
        param = module.get_submodule(module_path)._parameters[attr]
        grads[name] = None if param is None or param.grad is None else cpu_copy(param.grad)
    return grads


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copy of every parameter, by qualified name."""
    return {name: cpu_copy(p) for name, p in module.named_parameters()}


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copy of every buffer, by qualified name."""
    return {name: cpu_copy(b) for name, b in module.named_buffers()}


def outputs_of(output: Any) -> tuple[tuple[str, torch.Tensor], ...]:
    """CPU copy of every tensor of a step's output, by path (``output['logits']``); empty
    for None."""
    return tuple((path, cpu_copy(t)) for path, t in flatten_tensors(output, "output"))


@contextlib.contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Runs the body with the random state seeded with ``seed`` and restored afterwards
    (the CPU's, and ``device``'s when it is a GPU), and TF32 off: a step starts from the
    random state its seed gives, whatever ran before in the process (each shard's own,
    ``rank_seed``, in a one-step check)."""
    fork = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork), no_tf32():
        # the generators fork_rng restores, seeded alone: torch.manual_seed also queues a
        # seed, with a formatted stack trace, for every accelerator not started in this
        # process, which cost more than a small model's forward on a rank
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


# --------------------------------------------------------------------------- context


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


@dataclass
class RankContext:
    """What a rank's step sees, whatever the backend: the backends' contexts
    (``ShardContext``, ``FSDPContext``, ``TPContext``) add how a step wraps the module.

    Attributes:
        rank: this rank.
        world_size: number of ranks.
        module: this rank's copy of the module, on ``device``, weights as on every rank.
        inputs: this rank's shard of the positional forward arguments (``()`` for a
            keyword-only forward).
        target: this rank's shard of the target.
        loss_fn: ``loss_fn(output, target)``, a mean loss (over rows, or over tokens).
        shard_sizes: rows of every shard, in order: one per rank, or per data-parallel
            group when ranks share a shard.
        device: where this rank computes.
        micro_batches: micro-batches per shard, for gradient accumulation.
        kwargs: this rank's shard of the keyword forward arguments: call
            ``model(*ctx.inputs, **ctx.kwargs)``.
        item_kind: what each shard's mean loss averages over, as the check found it:
            ``"rows"``, ``"tokens (target != -100)"``, or ``"items"`` (counted by ``items=``).
        item_counts: every shard's count of those items, in order (``()``: rows).
        micro_batch_items: this shard's count per micro-batch of ``micro_batch_split()``
            (``()``: rows).
        step_index: in a training run, which optimizer step is running (0 for the first;
            always 0 in a one-step check).
        reference: True in the single-device reference run that an ``after_backward``
            hook also sees: one rank over the full batch, ``group`` a group of one rank.

    A token-level loss (a mean over the labels that are not -100) is exact when each
    shard's mean loss is weighted by its share of the tokens, ``ctx.loss_weight``; or,
    equivalently, when each rank divides its summed token loss by the all-reduced token
    count (``ctx.total_items``) and multiplies by the number of shards (the backend divides
    the summed gradients by it).
    """

    rank: int
    world_size: int
    module: nn.Module
    inputs: tuple[Any, ...]
    target: Any
    loss_fn: LossFn
    shard_sizes: tuple[int, ...]
    device: torch.device
    micro_batches: int = 1
    kwargs: dict[str, Any] = field(default_factory=dict)
    item_kind: str = "rows"
    item_counts: tuple[int, ...] = ()
    micro_batch_items: tuple[int, ...] = ()
    step_index: int = 0
    reference: bool = False

    @classmethod
    def for_rank(cls: type[C], info: RankInfo, module: nn.Module, loss_fn: LossFn, shard_sizes: tuple[int, ...], /, **more: Any) -> C:
        """The context of rank ``info`` over its copy ``module``, before any batch is
        loaded; ``more``: the backend's own fields."""
        return cls(
            rank=info.rank, world_size=info.world_size, module=module, inputs=(), target=None, loss_fn=loss_fn,
            shard_sizes=shard_sizes, device=torch.device(info.device), **more,
        )

    @property
    def shard_index(self) -> int:
        """Which of ``shard_sizes`` this rank runs: its rank."""
        return self.rank

    @property
    def batch_size(self) -> int:
        return sum(self.shard_sizes)

    @property
    def shard_size(self) -> int:
        return self.shard_sizes[self.shard_index]

    @property
    def items(self) -> int:
        """The items this rank's mean loss averages over: ``t_r``, its tokens for a
        token-level loss, else its rows."""
        return self.item_counts[self.shard_index] if self.item_counts else self.shard_size

    @property
    def total_items(self) -> int:
        """``T``: the items over every shard (what an all-reduce of ``items`` gives), the
        count the full-batch mean loss divides by; else the batch's rows."""
        return sum(self.item_counts) if self.item_counts else self.batch_size

    @property
    def loss_weight(self) -> float:
        """``t_r * shards / T``: the factor that makes the backend's average of per-shard
        mean losses the full-batch mean loss, for any shards (1.0 for equal ones): the
        shard's share of the items, its rows (``n_r * world_size / B`` under DDP) or its
        tokens."""
        return self.items * len(self.shard_sizes) / self.total_items

    @property
    def group(self) -> Any:
        """The process group this rank's gradients are averaged over, for collectives in a
        hook: ``dist.all_reduce(t, group=ctx.group)``. None, torch.distributed's default
        group (every rank), here and under DDP; a sharded backend's context names its own.
        In the single-device reference it is a group of one rank, where a collective
        returns its input."""
        return None

    @property
    def wrapped(self) -> bool:
        """Whether the step wrapped the module the backend's way (DDP, FSDP2, a plan)."""
        return False

    def load(
        self, inputs: Any, target: Any, kwargs: Mapping[str, Any] | None, shard_sizes: Sequence[int], *,
        item_kind: str = "rows", item_counts: Sequence[Sequence[int]] = (),
    ) -> None:
        """Gives the context this rank's shard (``shard_index``) of a batch cut in
        ``shard_sizes``, on ``device``; ``item_counts``: per shard, its count of
        ``item_kind`` per micro-batch (``()``: rows)."""
        self.shard_sizes = tuple(shard_sizes)
        part_inputs, part_target, part_kwargs = shard_of(inputs, target, shard_sizes, self.shard_index, kwargs)
        self.inputs, self.target = to_device(part_inputs, self.device), to_device(part_target, self.device)
        self.kwargs = to_device(part_kwargs, self.device)
        self.item_kind = item_kind
        self.item_counts, self.micro_batch_items = items_of(item_counts, self.shard_index)

    def backward(self, model: Callable[..., Any], weight: float | None = None) -> Any:
        """Forwards this shard through ``model`` and backwards its mean loss, times
        ``weight`` when given (the textbook steps' body); returns the output."""
        output = model(*self.inputs, **self.kwargs)
        loss = self.loss_fn(output, self.target)
        (loss if weight is None else loss * weight).backward()
        return output

    def micro_batch_split(self) -> list[MicroBatch]:
        """This shard cut into ``micro_batches`` contiguous micro-batches, as even as
        possible, each with its count of items (``micro_batch_items``, rows when the check
        counted none for this cut)."""
        sizes = even_shards(self.shard_size, self.micro_batches)
        counts = self.micro_batch_items if len(self.micro_batch_items) == len(sizes) else sizes
        parts = []
        for piece, (rows, count) in enumerate(zip(sizes, counts, strict=True)):
            inputs, target, kwargs = shard_of(self.inputs, self.target, sizes, piece, self.kwargs)
            parts.append(MicroBatch(inputs, target, rows, kwargs, count))
        return parts


@dataclass
class ReferenceContext(RankContext):
    """The context an ``after_backward`` hook sees in the single-device reference run: one
    rank (``rank`` 0, ``world_size`` 1) over the full batch, ``reference`` True, ``group``
    a process group of this process alone (``one_rank_group``)."""

    one_rank: Any = None
    reference: bool = True

    @property
    def group(self) -> Any:
        return self.one_rank


# --------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class RankStepTask:
    """One step per function in ``steps`` on every rank, each on a fresh copy of
    ``module``: what every backend's step task holds (``StepTask``, ``FSDPStepTask`` and
    ``TPStepTask`` add how the module is wrapped).

    ``inputs``, ``target`` and ``kwargs`` are the whole batch's (each rank cuts its shard,
    ``RankContext.load``); ``seed`` gives the random state every step starts from: each
    shard's own stream, ``rank_seed(seed, shard)``, as launchers seed ranks, or ``seed``
    itself on every rank when ``same_seed``; ``item_counts`` the items of every shard's
    micro-batches as the parent counted them (``()``: rows).
    """

    module: nn.Module
    inputs: tuple[Any, ...]
    target: Any
    loss_fn: LossFn
    shard_sizes: tuple[int, ...]
    steps: tuple[Callable[[Any], Any], ...]
    seed: int = field(default=0, kw_only=True)
    same_seed: bool = field(default=False, kw_only=True)
    kwargs: Mapping[str, Any] = field(default_factory=dict, kw_only=True)
    item_kind: str = field(default="rows", kw_only=True)
    item_counts: tuple[tuple[int, ...], ...] = field(default=(), kw_only=True)


@dataclass(frozen=True)
class RankStep:
    """What one step left on one rank (CPU tensors).

    Attributes:
        grads: gradient of every parameter of the unwrapped module, by qualified name.
        outputs: the step's returned output, flattened by path (empty if it returned None).
        loss: the rank's mean loss on its shard (None when the step returned no output).
        buffers: every buffer after the step.
        wrapped: whether the step wrapped the module (``ctx.wrapped``).
        syncs: gradient synchronisations counted (None when not counted).
        sync_forwards: for each synchronisation counted, how many forwards of the module
            had run (the micro-batch it synchronised on, from 1).
        forwards: the forwards of the module the step ran (when synchronisations are counted).
        dropout: the masks the module's Dropout layers drew, in order (``recording_dropout``).
        grad_all_reduces: the shapes of the tensors requiring grad that the step passed to
            ``torch.distributed.all_reduce``, which autograd does not differentiate.
        end_state: a digest of the random generator's state the step left (None: not read).
    """

    grads: dict[str, torch.Tensor | None]
    outputs: tuple[tuple[str, torch.Tensor], ...]
    loss: float | None
    buffers: dict[str, torch.Tensor]
    wrapped: bool
    syncs: int | None
    sync_forwards: tuple[int, ...] = ()
    forwards: int | None = None
    dropout: tuple[DropoutCall, ...] = ()
    grad_all_reduces: tuple[tuple[int, ...], ...] = ()
    end_state: str | None = None


def run_step(ctx: RankContext, task: RankStepTask, step: Callable[[Any], Any]) -> tuple[Any, float | None]:
    """Loads this rank's shard of ``task``'s batch into ``ctx`` and runs ``step(ctx)`` from
    the random state of its shard's stream, ``rank_seed(task.seed, ctx.shard_index)``
    (``task.seed`` itself when ``task.same_seed``; ``seeded``).

    Returns:
        What the step returned, and the rank's mean loss on that output (None when the
        step returned nothing, or the shard has no row: a mean over no row is NaN).
    """
    ctx.load(task.inputs, task.target, task.kwargs, task.shard_sizes, item_kind=task.item_kind, item_counts=task.item_counts)
    seed = task.seed if task.same_seed else rank_seed(task.seed, ctx.shard_index)
    with seeded(ctx.device, seed):
        output = step(ctx)
        loss = None
        if output is not None and ctx.shard_size > 0:
            with torch.no_grad():
                loss = float(ctx.loss_fn(output, ctx.target))
    return output, loss


# --------------------------------------------------------------------------- training


@contextlib.contextmanager
def after_backward_note(hook: AfterBackward) -> Iterator[None]:
    """Runs the body, adding to what it raises that it came from the ``after_backward``
    hook (``hook``), with the fix when it used a process group that the single-device
    reference does not have."""
    try:
        yield
    except Exception as error:
        name = getattr(hook, "__qualname__", None) or type(hook).__name__
        error.add_note(f"dpverify: raised in after_backward={name}(ctx)")
        if "default process group has not been initialized" in str(error).lower():
            error.add_note("dpverify: pass group=ctx.group to collectives in the hook (a group of one rank in the single-device reference)")
        raise


@dataclass
class _Held:
    """``one_rank_group_held``'s state: whether a block holds a group, and the group once made."""

    active: bool = False
    group: Any = None


_held = _Held()


@contextlib.contextmanager
def one_rank_group_held() -> Iterator[None]:
    """Within the block, every ``one_rank_group()`` is one group, made on first use and
    destroyed when the block ends, instead of a group each: tearing a gloo group down costs
    about 10 ms (its destructor joins its threads), more than a small model's training
    check. That default group stays initialised between uses (``dist.is_initialized()``),
    so hold one only around code that does not look: the DataParallel training check holds
    one over its runs (between them only its comparisons run), ``dpverify fuzz`` one over a
    DataParallel session of dpverify's models and torch's DataParallel. Nothing is held
    where a default group exists already (torchrun) or a block already holds one."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized() or _held.active:
        yield
        return
    _held.active = True
    try:
        yield
    finally:
        made, _held.active, _held.group = _held.group, False, None
        if made is not None and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_group() -> Iterator[Any]:
    """A process group of this process alone, for the single-device reference's
    ``after_backward`` hook: a new default gloo group of one rank when none is initialised
    (destroyed afterwards), else, under torchrun, this rank's own subgroup (every rank
    creates its own, collectively, as ``new_subgroups`` requires); within
    ``one_rank_group_held``, the block's one group. None when torch.distributed is not
    available."""
    import torch.distributed as dist

    if not dist.is_available():
        yield None
        return
    if _held.active:
        if _held.group is None:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
            _held.group = dist.group.WORLD
        yield _held.group
        return
    if dist.is_initialized():
        # gloo whatever the default group's backend: the reference runs on the CPU
        group, _all = dist.new_subgroups(group_size=1, backend="gloo")
        try:
            yield group
        finally:
            dist.destroy_process_group(group)
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class RankTrainingTask:
    """``len(batches)`` optimizer steps of training from the same weights on every rank:
    what every backend's training task holds (``TrainingTask``, ``FSDPTrainingTask`` add how
    the module is wrapped).

    ``batches`` holds one ``(inputs, kwargs, target)`` per optimizer step; ``shard_sizes``,
    ``item_kinds`` and ``item_counts`` are per batch (the last two ``()`` for rows);
    ``seed``: every rank trains in its shard's own stream, ``rank_seed(seed, shard)``, or
    in ``seed`` itself when ``same_seed``.
    """

    module: nn.Module
    batches: tuple[Batch, ...]
    loss_fn: LossFn
    optimizer: OptimizerFactory
    shard_sizes: tuple[tuple[int, ...], ...]
    step: Callable[[Any], Any]
    seed: int = field(default=0, kw_only=True)
    after_backward: AfterBackward | None = field(default=None, kw_only=True)
    item_kinds: tuple[str, ...] = field(default=(), kw_only=True)
    item_counts: tuple[tuple[int, ...], ...] = field(default=(), kw_only=True)
    same_seed: bool = field(default=False, kw_only=True)


def optimizer_state_of(
    optimizer: torch.optim.Optimizer, module: nn.Module, whole: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> dict[str, torch.Tensor]:
    """CPU copy of the optimizer's per-parameter state tensors of at least one dimension
    (SGD's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq``), named
    ``"<parameter>.<key>"`` (``"0.weight.exp_avg"``); ``whole`` makes a sharded one whole
    (FSDP2's ``DTensor.full_tensor()``, a collective: every rank reads in the same order).
    A step counter (a scalar) is left out: it counts steps, which the parameters show."""
    names = {id(p): name for name, p in module.named_parameters()}
    found: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                found[f"{names.get(id(param), '?')}.{key}"] = cpu_copy(whole(value))
    return found


@dataclass(frozen=True)
class Trained:
    """What ``train`` saw: the parameters after every optimizer step, the gradients each
    step stepped with (when read), the optimizer (None: no step ran), and after every step
    the buffers and the optimizer's state (``optimizer_state_of``; when read); when
    recorded, each step's Dropout masks (``recording_dropout``) and a digest of the random
    state each step left (``generator_state``)."""

    params: tuple[dict[str, torch.Tensor], ...]
    step_grads: tuple[dict[str, torch.Tensor | None], ...]
    optimizer: torch.optim.Optimizer | None
    buffers: tuple[dict[str, torch.Tensor], ...] = ()
    state: tuple[dict[str, torch.Tensor], ...] = ()
    dropout: tuple[tuple[DropoutCall, ...], ...] = ()
    end_states: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepRead:
    """What one read after an optimizer step gives ``train`` (``read_step``): the
    parameters, the gradients the step used, the buffers and the optimizer's state, as CPU
    tensors (whole ones, for a sharded module)."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]


def train(
    ctx: RankContext,
    plan: RankTrainingTask,
    *,
    optimizer_after_first_step: bool = False,
    read_params: Callable[[nn.Module], dict[str, torch.Tensor]] = params_of,
    read_grads: Callable[[nn.Module], dict[str, torch.Tensor | None]] | None = None,
    read_buffers: Callable[[nn.Module], dict[str, torch.Tensor]] | None = None,
    read_state: Callable[[torch.optim.Optimizer, nn.Module], dict[str, torch.Tensor]] | None = None,
    read_step: Callable[[nn.Module, torch.optim.Optimizer], StepRead] | None = None,
    record_dropout: bool = False,
) -> Trained:
    """Trains ``ctx.module`` on this rank for ``len(plan.batches)`` optimizer steps: load
    the rank's shard of each batch into ``ctx``, zero the gradients, ``plan.step(ctx)``,
    ``plan.after_backward(ctx)`` when given, step the optimizer, read the parameters.

    Args:
        ctx: the rank's context, over its copy of the module (reused by every step, so a
            wrapper the first step makes is kept).
        plan: the batches, the step and the optimizer.
        optimizer_after_first_step: build the optimizer after the first step, over the
            parameters it left (FSDP2's DTensors, so that the optimizer's state is sharded
            like them), instead of before the first step.
        read_params: the parameters after a step, as CPU tensors (whole ones, for a
            sharded module).
        read_grads: the gradients an optimizer step is about to use, when wanted.
        read_buffers: the buffers after a step, when wanted (``buffers_of``).
        read_state: the optimizer's state after a step, when wanted
            (``optimizer_state_of``; whole tensors, for a sharded optimizer).
        read_step: reads all four after the step at once, in place of the four readers
            (a sharded module's in one collective); the gradients are read after the
            optimizer step, which leaves them as it found them.
        record_dropout: record the masks the module's ``nn.Dropout`` layers draw in each
            step (``recording_dropout``), and the random state each step leaves, for the
            single-device reference to replay them and to tell ranks that drew alike.

    Raises:
        Exception: what a step raised, with a note saying in which optimizer step.
    """
    module = ctx.module
    optimizer = None if optimizer_after_first_step else plan.optimizer(module.parameters())
    params: list[dict[str, torch.Tensor]] = []
    step_grads: list[dict[str, torch.Tensor | None]] = []
    buffers: list[dict[str, torch.Tensor]] = []
    states: list[dict[str, torch.Tensor]] = []
    dropout: list[tuple[DropoutCall, ...]] = []
    end_states: list[str] = []
    # each shard's own random stream, as launchers seed ranks (ranks sharing a shard share it)
    seed = plan.seed if plan.same_seed else rank_seed(plan.seed, ctx.shard_index)
    with seeded(ctx.device, seed):
        for index, ((inputs, kwargs, target), sizes) in enumerate(zip(plan.batches, plan.shard_sizes, strict=True)):
            counts = plan.item_counts[index] if plan.item_counts else ()
            ctx.load(
                inputs, target, kwargs, sizes,
                item_kind=plan.item_kinds[index] if plan.item_kinds else "rows",
                item_counts=tuple((count,) for count in counts),
            )
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            ctx.step_index = index
            try:
                calls: list[DropoutCall] = []
                with recording_dropout(module, calls) if record_dropout else contextlib.nullcontext():
                    plan.step(ctx)
                if record_dropout:
                    dropout.append(tuple(calls))
                    end_states.append(generator_state(ctx.device))
                if plan.after_backward is not None:
                    with after_backward_note(plan.after_backward):
                        plan.after_backward(ctx)
            except Exception as error:
                # The parent retells some of torch's errors (an unfinished reduction) and
                # needs to know in which step they came.
                error.add_note(f"dpverify: raised in optimizer step {index + 1} of {len(plan.batches)}")
                raise
            if optimizer is None:
                optimizer = plan.optimizer(module.parameters())
            if read_grads is not None and read_step is None:
                step_grads.append(read_grads(module))
            optimizer.step()
            if read_step is not None:
                read = read_step(module, optimizer)
                params.append(read.params)
                step_grads.append(read.grads)
                buffers.append(read.buffers)
                states.append(read.state)
                continue
            params.append(read_params(module))
            if read_buffers is not None:
                buffers.append(read_buffers(module))
            if read_state is not None:
                states.append(read_state(optimizer, module))
    return Trained(tuple(params), tuple(step_grads), optimizer, tuple(buffers), tuple(states), tuple(dropout), tuple(end_states))


@dataclass(frozen=True)
class RankTraining:
    """Parameters after every optimizer step, and the buffers at the end, on one rank;
    ``step_buffers`` and ``step_state``: the buffers and the optimizer's state after every
    step (``Trained.buffers``, ``Trained.state``; empty when not read); ``dropout`` and
    ``end_states``: each step's Dropout masks and the random state it left
    (``Trained.dropout``, ``Trained.end_states``; empty when not recorded)."""

    params: tuple[dict[str, torch.Tensor], ...]
    buffers: dict[str, torch.Tensor]
    grads_none: tuple[str, ...]
    wrapped: bool = True
    step_buffers: tuple[dict[str, torch.Tensor], ...] = field(default=(), kw_only=True)
    step_state: tuple[dict[str, torch.Tensor], ...] = field(default=(), kw_only=True)
    dropout: tuple[tuple[DropoutCall, ...], ...] = field(default=(), kw_only=True)
    end_states: tuple[str, ...] = field(default=(), kw_only=True)
