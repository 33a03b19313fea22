"""What runs on each rank of a tensor-parallel check: the context a step sees, the default
steps, the hooks that record the layouts module inputs and outputs really had, and the task
that returns the full gradients and output with that evidence. A rank that raises inside
the step reports the error with the layouts seen until then, so that a plan whose layouts
do not compose is explained from evidence instead of torch's traceback.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._pytree import tree_leaves, tree_map

from dpverify.ranked.rank import (
    RankContext,
    RankInfo,
    RankStep,
    RankStepTask,
    RankTraining,
    RankTrainingTask,
    ReferenceContext,
    buffers_of,
    outputs_of,
    run_step,
    train,
)
from dpverify.sharded.mesh import device_mesh, full_grads, full_params, gather_full, quiet

__all__ = [
    "DP_DIM",
    "TP_DIM",
    "Layout",
    "Placed",
    "Seen",
    "TPContext",
    "TPRankStep",
    "TPRankTraining",
    "TPReferenceContext",
    "TPStepTask",
    "TPTrainingTask",
    "full_output",
    "run_tp_step_task",
    "run_tp_training_task",
    "style_name",
    "tp_step",
    "weighted_tp_step",
]

#: The mesh dimension tensor parallelism shards over, and the data-parallel one (FSDP2).
TP_DIM = "tp"
DP_DIM = "dp"


# --------------------------------------------------------------------------- layouts


def placement_text(placement: Any) -> str:
    """``Shard(1)``, ``Replicate()``, ``Partial(sum)`` (torch's ``str`` abbreviates them to
    ``S(1)``, ``R``, ``P(sum)``; its ``repr`` says ``Shard(dim=1)``)."""
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if type(placement).__name__ == "_StridedShard":  # FSDP2's dim-0 shard of a TP shard (2-D meshes)
        return f"StridedShard({placement.dim}, split_factor={placement.split_factor})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    return str(placement)


def _short(placements: Sequence[Any]) -> str:
    return ", ".join(placement_text(p) for p in placements)


@dataclass(frozen=True)
class Layout:
    """How one tensor looked at one point of a forward, on one rank.

    Attributes:
        dtensor: whether it was a DTensor.
        placements: its placements (``"Shard(1)"``, ``"Replicate()"``, ``"Partial(sum)"``;
            ``""`` for a plain tensor).
        local: the shape this rank stored.
        shape: the global shape (a plain tensor's own).
        sharded: some placement is a ``Shard``.
        partial: some placement is a ``Partial`` (a sum not yet reduced over the ranks).
    """

    dtensor: bool
    placements: str
    local: tuple[int, ...]
    shape: tuple[int, ...]
    sharded: bool = False
    partial: bool = False

    def describe(self) -> str:
        """``DTensor Shard(1) local [8, 2] of global [8, 4]``, or ``plain tensor [8, 4]``."""
        if self.dtensor:
            return f"DTensor {self.placements} local {list(self.local)} of global {list(self.shape)}"
        return f"plain tensor {list(self.shape)}"


def _first_tensor(obj: Any) -> torch.Tensor | None:
    return next((leaf for leaf in tree_leaves(obj) if isinstance(leaf, torch.Tensor)), None)


def layout_of(obj: Any) -> Layout | None:
    """The layout of the first tensor in ``obj`` (any nesting), None when it holds none."""
    tensor = _first_tensor(obj)
    if tensor is None:
        return None
    if isinstance(tensor, DTensor):
        kinds = tensor.placements
        return Layout(
            True, _short(kinds), tuple(tensor.to_local().shape), tuple(tensor.shape),
            any(isinstance(p, Shard) or type(p).__name__ == "_StridedShard" for p in kinds),
            any(isinstance(p, Partial) for p in kinds),
        )
    return Layout(False, "", tuple(tensor.shape), tuple(tensor.shape))


@dataclass(frozen=True)
class Seen:
    """One module call of a forward on one rank, as the hooks saw it.

    Attributes:
        path: the module's qualified name (``""``: the root).
        style: the plan's style on it (its class name; ``""``: none).
        received: its first input as it arrived (before the style's input hook).
        entered: its first input as its forward saw it (after the style's input hook).
        produced: its forward's output (before the style's output hook; None: the forward
            raised).
        handed: its output as handed on (after the style's output hook).
        source: the module whose handed-on output ``received`` is (through modules without
            a style that kept its shape), or None.
        kept_local: the forward produced a DTensor and what was handed on is its local
            tensor itself (same storage: ``to_local()`` without any collective).
    """

    path: str
    style: str
    received: Layout | None
    entered: Layout | None = None
    produced: Layout | None = None
    handed: Layout | None = None
    source: str | None = None
    kept_local: bool = False


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s data lives; None for the pending result of a collective
    (``AsyncCollectiveTensor``: a collective did run) or a tensor without storage."""
    if isinstance(tensor, AsyncCollectiveTensor):
        return None
    try:
        return int(tensor.untyped_storage().data_ptr())
    except RuntimeError:
        return None


class _Recorder:
    """Forward hooks on every module, placed around the hooks ``parallelize_module``
    installed (torch/distributed/tensor/_api.py, ``distribute_module``: the style's input
    function is a forward pre-hook, its output function a forward hook): prepended ones see
    what arrives and what the forward produced, appended ones what the forward saw and what
    was handed on."""

    def __init__(self, model: nn.Module, styles: Mapping[str, str]) -> None:
        self.calls: list[dict[str, Any]] = []
        self._open: list[int] = []
        self._origin: dict[int, str] = {}
        self._alive: list[torch.Tensor] = []  # keeps tagged tensors alive, so ids stay unique
        for path, module in model.named_modules():
            style = styles.get(path, "")
            module.register_forward_pre_hook(self._arrived(path, style), prepend=True, with_kwargs=True)
            module.register_forward_pre_hook(self._entered, with_kwargs=True)
            module.register_forward_hook(self._produced, prepend=True)
            module.register_forward_hook(self._handed(path, style))

    def _arrived(self, path: str, style: str) -> Any:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            first = _first_tensor((args, kwargs))
            source = self._origin.get(id(first)) if first is not None else None
            self.calls.append({"path": path, "style": style, "received": layout_of((args, kwargs)), "source": source, "first": first})
            self._open.append(len(self.calls) - 1)

        return hook

    def _entered(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._open:
            self.calls[self._open[-1]]["entered"] = layout_of((args, kwargs))

    def _produced(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self._open:
            call = self.calls[self._open[-1]]
            call["produced"] = layout_of(output)
            first = _first_tensor(output)
            if isinstance(first, DTensor):
                call["local_storage"] = _storage(first.to_local())

    def _handed(self, path: str, style: str) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if not self._open:
                return
            call = self.calls[self._open.pop()]
            call["handed"] = layout_of(output)
            out = _first_tensor(output)
            if out is not None and not isinstance(out, DTensor) and call.get("local_storage") is not None:
                call["kept_local"] = _storage(out) == call["local_storage"]
            if out is None or id(out) in self._origin:
                return
            first = call.pop("first", None)
            if style:
                origin: str | None = path
            elif first is not None and tuple(first.shape) == tuple(out.shape):
                origin = self._origin.get(id(first))  # an elementwise module passes its input's origin on
            else:
                origin = None
            if origin is not None:
                self._origin[id(out)] = origin
                self._alive.append(out)

        return hook

    def seen(self) -> tuple[Seen, ...]:
        return tuple(
            Seen(
                c["path"], c["style"], c["received"], c.get("entered"), c.get("produced"), c.get("handed"), c["source"],
                c.get("kept_local", False),
            )
            for c in self.calls
        )


# --------------------------------------------------------------------------- context


@dataclass
class TPContext(RankContext):
    """What a rank's tensor-parallel step sees; the argument of every ``step`` function.

    ``RankContext``'s attributes (``world_size`` counts every rank), and:

    Attributes:
        plan: the plan ``parallelize()`` gives ``parallelize_module``.
        data_parallel: data-parallel groups (1: every rank sees the whole batch).
        dp_rank: this rank's data-parallel group; ``inputs``, ``target`` and ``kwargs`` are
            its shard of the batch, ``shard_sizes`` the rows of every group.
        tp_rank: this rank's place in its tensor-parallel group.
        fsdp_modules: with ``data_parallel`` > 1, the modules ``parallelize()`` then shards
            with FSDP2 over the ``"dp"`` dimension (deepest first, ``""`` the root).
        mesh: the whole device mesh (``("tp",)``, or ``("dp", "tp")``).

    A step calls ``ctx.parallelize()`` to apply the plan, runs forward and backward, and
    may return the output to have it compared; the default steps make a DTensor output
    whole first (``full_output``).
    """

    plan: Mapping[str, Any] = field(default_factory=dict)
    data_parallel: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    fsdp_modules: tuple[str, ...] = ()
    mesh: DeviceMesh | None = field(default=None, repr=False)
    _recorder: _Recorder | None = field(default=None, repr=False)

    @property
    def tp_size(self) -> int:
        return self.world_size // self.data_parallel

    @property
    def shard_index(self) -> int:
        """This rank's data-parallel group, whose shard it runs: ``items``,
        ``shard_size`` and ``loss_weight`` (``t_g * data_parallel / T``) are the group's."""
        return self.dp_rank

    @property
    def wrapped(self) -> bool:
        """Whether ``parallelize()`` applied the plan."""
        return self._recorder is not None

    def tp_mesh(self) -> DeviceMesh:
        """The mesh dimension the plan shards over."""
        if self.mesh is None:
            raise RuntimeError("TPContext has no device mesh (mesh=)")
        return self.mesh[TP_DIM] if self.data_parallel > 1 else self.mesh

    @property
    def tp_group(self) -> Any:
        """The process group of this rank's tensor-parallel group (the ``"tp"`` mesh
        dimension): where a sum over the shards of a gradient goes, e.g. the local sums of
        squares of a clip norm, ``dist.all_reduce(t, group=ctx.tp_group)``."""
        return self.tp_mesh().get_group()

    @property
    def dp_group(self) -> Any:
        """The process group of the ranks that hold this rank's place in the other
        data-parallel groups (the ``"dp"`` mesh dimension, over which FSDP2 averages); a
        group of this rank alone without data parallelism."""
        if self.data_parallel > 1:
            assert self.mesh is not None
            return self.mesh[DP_DIM].get_group()
        return _own_group(self.rank)

    @property
    def group(self) -> Any:
        """The tensor-parallel group (``tp_group``): where the shards of a gradient are
        summed."""
        return self.tp_group

    def parallelize(self) -> nn.Module:
        """``module`` after ``parallelize_module(module, tp_mesh, plan)`` and, with
        data-parallel groups, ``fully_shard`` over ``"dp"`` on each of ``fsdp_modules``
        (applied on the first call; the same module after)."""
        if self._recorder is None:
            parallelize_module(self.module, self.tp_mesh(), dict(self.plan))
            if self.data_parallel > 1:
                assert self.mesh is not None
                for name in self.fsdp_modules:
                    fully_shard(self.module.get_submodule(name), mesh=self.mesh[DP_DIM])
            self._recorder = _Recorder(self.module, {path: style_name(style) for path, style in _matched(self.module, self.plan)})
        return self.module

    def seen(self) -> tuple[Seen, ...]:
        """The module calls recorded since ``parallelize()``."""
        return self._recorder.seen() if self._recorder is not None else ()

    def ddp(self) -> Any:
        raise TypeError("a tensor-parallel step applies its plan with ctx.parallelize(); ctx.ddp() is for the DDP checks")


#: one group of a single rank per rank process (and default group), made on first use
_OWN_GROUPS: dict[tuple[int, int], Any] = {}


def _own_group(rank: int) -> Any:
    """A process group of rank ``rank`` alone (only its members take part in making it),
    kept for the life of the rank process."""
    key = (id(dist.group.WORLD), rank)
    if key not in _OWN_GROUPS:
        _OWN_GROUPS[key] = dist.new_group([rank], use_local_synchronization=True)
    return _OWN_GROUPS[key]


@dataclass
class TPReferenceContext(ReferenceContext):
    """What an ``after_backward`` hook of the tensor-parallel training check sees in the
    single-device reference: ``ReferenceContext``'s one rank over the full batch, with
    ``TPContext``'s names for its groups (``tp_group``, ``dp_group``, ``group``: a process
    group of this process alone, where a collective returns its input) and places
    (``tp_rank`` 0 of ``tp_size`` 1, ``dp_rank`` 0 of ``data_parallel`` 1). Its gradients
    are plain tensors, not DTensors."""

    data_parallel: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    mesh: DeviceMesh | None = field(default=None, repr=False)

    @property
    def tp_size(self) -> int:
        return 1

    @property
    def tp_group(self) -> Any:
        return self.one_rank

    @property
    def dp_group(self) -> Any:
        return self.one_rank


def style_name(style: Any) -> str:
    """How messages name a plan's style: its ``label`` where it has one (a style that
    applies an entry of another library's plan says which, e.g. transformers' 'colwise'),
    else its class."""
    label = getattr(style, "label", None)
    return label if isinstance(label, str) else type(style).__name__


def _matched(module: nn.Module, plan: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(path, style)`` for every module a plan key matches, as ``parallelize_module``
    matches them (``fnmatch`` per dotted atom)."""
    from fnmatch import fnmatch

    found = []
    for path, _sub in module.named_modules():
        atoms = path.split(".") if path else []
        for key, style in plan.items():
            parts = key.split(".")
            if len(parts) == len(atoms) and all(fnmatch(a, p) for a, p in zip(atoms, parts, strict=True)):
                found.append((path, style))
                break
    return found


def full_output(output: Any) -> Any:
    """``output`` with every DTensor made whole (``full_tensor()``, differentiable): what one
    device would have returned. A pending collective's result (``AsyncCollectiveTensor``,
    what a style's ``to_local()`` hands on) is left as it is: it waits when used, and
    ``wait()`` would cut it from the autograd graph."""
    return tree_map(lambda leaf: leaf.full_tensor() if isinstance(leaf, DTensor) else leaf, output)


def tp_step(ctx: TPContext) -> Any:
    """The textbook tensor-parallel step: apply the plan, forward (the group's rows), mean
    loss on the whole output, backward. Biased when data-parallel groups hold different
    numbers of items (FSDP2 averages per-group means: the loss-averaging trap)."""
    model = ctx.parallelize()
    output = full_output(model(*ctx.inputs, **ctx.kwargs))
    ctx.loss_fn(output, ctx.target).backward()
    return output


def weighted_tp_step(ctx: TPContext) -> Any:
    """The exact step for any data-parallel shards: the group's mean loss times its share of
    the items, ``ctx.loss_weight`` (1.0 without data-parallel groups)."""
    model = ctx.parallelize()
    output = full_output(model(*ctx.inputs, **ctx.kwargs))
    (ctx.loss_fn(output, ctx.target) * ctx.loss_weight).backward()
    return output


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Placed:
    """How one rank held one parameter after the step.

    Attributes:
        name: the parameter's qualified name.
        placements: the DTensor's placements, e.g. ``"Shard(0)"`` (``""``: a plain tensor).
        tp_sharded: whether it was sharded over the ``"tp"`` dimension.
        local: the shape this rank stored.
        shape: the full shape.
    """

    name: str
    placements: str
    tp_sharded: bool
    local: tuple[int, ...]
    shape: tuple[int, ...]


def _placed(name: str, param: torch.Tensor) -> Placed:
    if not isinstance(param, DTensor):
        return Placed(name, "", False, tuple(param.shape), tuple(param.shape))
    names = param.device_mesh.mesh_dim_names or ()
    tp = names.index(TP_DIM) if TP_DIM in names else -1
    sharded = tp >= 0 and isinstance(param.placements[tp], Shard)
    return Placed(name, _short(param.placements), sharded, tuple(param.to_local().shape), tuple(param.shape))


@dataclass(frozen=True)
class TPStepTask(RankStepTask):
    """One tensor-parallel step per function in ``steps``, each on a fresh copy of
    ``module``: a ``RankStepTask`` whose ``shard_sizes`` are the rows of each data-parallel
    group, with the plan, the data-parallel groups and the modules FSDP2 shards over them."""

    plan: Mapping[str, Any]
    data_parallel: int = 1
    fsdp_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class TPRankStep(RankStep):
    """What one tensor-parallel step left on one rank: ``RankStep``'s full gradients, whole
    outputs and loss, ``wrapped`` (``ctx.parallelize()`` ran), and:

    Attributes:
        dp_rank: the rank's data-parallel group (whose rows it ran).
        tp_rank: its place in its tensor-parallel group.
        held: how it held each parameter.
        seen: every module call of the forward, with its layouts (``Seen``).
        error: ``"Type: message"`` of what the step raised on this rank (None: it ran).
        failed_ranks: the ranks on which the step raised (every rank reports them).
    """

    dp_rank: int = 0
    tp_rank: int = 0
    held: tuple[Placed, ...] = ()
    seen: tuple[Seen, ...] = ()
    error: str | None = None
    failed_ranks: tuple[int, ...] = ()


def _whole(output: Any) -> Any:
    """A step's output as one device would have returned it: every pending collective
    waited for, every DTensor made whole (None stays None)."""
    return full_output(tree_map(lambda leaf: leaf.wait() if isinstance(leaf, AsyncCollectiveTensor) else leaf, output))


def _context(info: RankInfo, task: TPStepTask | TPTrainingTask, shard_sizes: tuple[int, ...]) -> TPContext:
    """This rank's context over a fresh copy of ``task.module`` on its device, on the
    ``(data_parallel, world_size // data_parallel)`` mesh (a 1-D tensor-parallel one
    without data parallelism)."""
    model = copy.deepcopy(task.module).to(torch.device(info.device))
    d = task.data_parallel
    tp_size = info.world_size // d
    dp_rank, tp_rank = divmod(info.rank, tp_size)
    mesh = device_mesh(info, (d, tp_size), (DP_DIM, TP_DIM)) if d > 1 else device_mesh(info, (info.world_size,), (TP_DIM,))
    return TPContext.for_rank(
        info, model, task.loss_fn, shard_sizes, plan=task.plan, data_parallel=d, dp_rank=dp_rank, tp_rank=tp_rank,
        fsdp_modules=task.fsdp_modules, mesh=mesh,
    )


def _run_one(info: RankInfo, task: TPStepTask, step: Any) -> TPRankStep:
    ctx = _context(info, task, task.shard_sizes)
    model, dp_rank, tp_rank = ctx.module, ctx.dp_rank, ctx.tp_rank
    error: str | None = None
    output: Any = None
    loss: float | None = None
    try:
        output, loss = run_step(ctx, task, lambda c: _whole(step(c)))
    except Exception as raised:  # reported with the layouts seen; the parent explains it
        error = f"{type(raised).__name__}: {raised}"
    # every rank learns whether any raised, so none waits alone in the gradient gathering
    failures: list[Any] = [None] * info.world_size
    dist.all_gather_object(failures, error is not None)
    failed = tuple(r for r, f in enumerate(failures) if f)
    return TPRankStep(
        grads={} if failed else full_grads(model),
        outputs=() if failed else outputs_of(output),
        loss=None if failed else loss,
        buffers={} if failed else buffers_of(model),
        wrapped=ctx.wrapped,
        syncs=None,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        held=tuple(_placed(name, p) for name, p in model.named_parameters()),
        seen=ctx.seen(),
        error=error,
        failed_ranks=failed,
    )


def run_tp_step_task(info: RankInfo, task: TPStepTask) -> tuple[TPRankStep, ...]:
    """Runs every step of ``task`` on this rank (a task for ``RankRunner.run``)."""
    with quiet():
        return tuple(_run_one(info, task, step) for step in task.steps)


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TPTrainingTask(RankTrainingTask):
    """``len(batches)`` optimizer steps of tensor-parallel training: a ``RankTrainingTask``
    with the plan, the data-parallel groups and the modules FSDP2 shards over them
    (``shard_sizes``: the rows of each data-parallel group, per batch). The first step
    applies the plan; the optimizer is built after it, over the DTensor parameters."""

    plan: Mapping[str, Any] = field(default_factory=dict)
    data_parallel: int = 1
    fsdp_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class TPRankTraining(RankTraining):
    """What tensor-parallel training left on one rank: ``RankTraining``'s whole parameters
    after every step, and per step (whole tensors, ``full_tensor()``):

    Attributes:
        step_grads: the gradients each optimizer step used (after ``after_backward``).
        step_buffers: the buffers after each step.
        step_states: the optimizer state after each step, ``"<parameter>.<key>"`` (e.g.
            ``"0.weight.exp_avg"``) to tensor.
        dp_rank: the rank's data-parallel group; tp_rank: its place in its
            tensor-parallel group.
        held: how it held each parameter at the end.
    """

    step_grads: tuple[dict[str, torch.Tensor | None], ...] = ()
    step_buffers: tuple[dict[str, torch.Tensor], ...] = ()
    step_states: tuple[dict[str, torch.Tensor], ...] = ()
    dp_rank: int = 0
    tp_rank: int = 0
    held: tuple[Placed, ...] = ()


def optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str], read: Any) -> dict[str, torch.Tensor]:
    """Every tensor of ``optimizer``'s per-parameter state, ``"<parameter>.<key>"`` to
    ``read([(name, tensor), ...])``'s copy (whole tensors on a rank, clones on one device)."""
    named = [
        (f"{names.get(id(param), '?')}.{key}", value)
        for param, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    ]
    found = read(named)
    return {name: tensor for name, tensor in found.items() if tensor is not None}


def _full_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    full = gather_full(list(module.named_buffers()))
    return {name: tensor for name, tensor in full.items() if tensor is not None}


def run_tp_training_task(info: RankInfo, task: TPTrainingTask) -> TPRankTraining:
    """Trains this rank's copy as ``TPTrainingTask`` says (a task for ``RankRunner.run``),
    reading the whole parameters, buffers and optimizer state after every step."""
    ctx = _context(info, task, task.shard_sizes[0])
    model, dp_rank, tp_rank = ctx.module, ctx.dp_rank, ctx.tp_rank
    made: list[torch.optim.Optimizer] = []
    buffers: list[dict[str, torch.Tensor]] = []
    states: list[dict[str, torch.Tensor]] = []

    def build(params: Any) -> torch.optim.Optimizer:
        made.append(task.optimizer(params))
        return made[-1]

    def read(module: nn.Module) -> dict[str, torch.Tensor]:
        # after each optimizer step: the parameters, and with them the buffers and the state
        params = full_params(module)
        buffers.append(_full_buffers(module))
        names = {id(p): name for name, p in module.named_parameters()}
        states.append(optimizer_state(made[-1], names, gather_full) if made else {})
        return params

    with quiet():
        trained = train(
            ctx, dataclasses.replace(task, optimizer=build), optimizer_after_first_step=True, read_params=read,
            read_grads=full_grads,
        )
    grads_none = tuple(name for name, p in model.named_parameters() if p.grad is None)
    return TPRankTraining(
        trained.params, buffers[-1] if buffers else {}, grads_none, ctx.wrapped, step_grads=trained.step_grads,
        step_buffers=tuple(buffers), step_states=tuple(states), dp_rank=dp_rank, tp_rank=tp_rank,
        held=tuple(_placed(name, p) for name, p in model.named_parameters()),
    )
