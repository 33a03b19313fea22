"""What runs on each rank of an FSDP2 check: the context a step sees, the default steps,
and the tasks that return the full gradients and parameters (``DTensor.full_tensor()``)
with the evidence that sharding ran (how each parameter was held, the mixed precision
applied); docs/distributed.md says what the check makes of them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from dpverify.ranked.rank import (
    RankContext,
    RankInfo,
    RankStep,
    RankStepTask,
    RankTraining,
    RankTrainingTask,
    StepRead,
    buffers_of,
    cpu_copy,
    outputs_of,
    run_step,
    train,
)
from dpverify.sharded.mesh import _dim0_shard, device_mesh, full_grads, quiet

__all__ = [
    "FSDPContext",
    "FSDPRankStep",
    "FSDPRankTraining",
    "FSDPStepTask",
    "FSDPTrainingTask",
    "Held",
    "Precision",
    "fsdp_step",
    "precision_of",
    "read_fsdp_step",
    "run_fsdp_step_task",
    "run_fsdp_training_task",
    "shard_order",
    "weighted_fsdp_step",
]

#: The name of the mesh dimension the checks shard over.
MESH_DIM = "dp"


def shard_order(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` in the order ``fully_shard`` must see them: a module before any module
    that contains it (deepest first, the root ``""`` last), otherwise as given. FSDP2
    gives a module the parameters that no ``fully_shard``-ed descendant already manages
    (torch/distributed/fsdp/_fully_shard/_fsdp_init.py, ``_get_managed_states``), so a
    parent sharded first would take its children's parameters into its own group."""
    unique = list(dict.fromkeys(names))
    return tuple(sorted(unique, key=lambda name: -(name.count(".") + 1) if name else 1))


@dataclass(frozen=True)
class Held:
    """How one rank held one parameter when its step ended.

    Attributes:
        name: the parameter's qualified name.
        dtensor: whether it was a DTensor.
        local: elements this rank stored (its shard; all of them for a plain tensor).
        numel: elements of the full parameter.
        placements: the DTensor's placements, e.g. ``"(Shard(dim=0),)"`` (``""``: plain).
    """

    name: str
    dtensor: bool
    local: int
    numel: int
    placements: str

    @property
    def sharded(self) -> bool:
        """Held as a DTensor of which this rank stores only a part."""
        return self.dtensor and self.local < self.numel


def _held(name: str, tensor: torch.Tensor) -> Held:
    if isinstance(tensor, DTensor):
        return Held(name, True, tensor.to_local().numel(), tensor.numel(), str(tuple(tensor.placements)))
    return Held(name, False, tensor.numel(), tensor.numel(), "")


@dataclass
class FSDPContext(RankContext):
    """What a rank's FSDP2 step sees; the argument of every ``step`` function.

    ``RankContext``'s attributes, and:

    Attributes:
        shard_modules: qualified names of the modules ``fsdp()`` applies ``fully_shard``
            to, in the order it does (deepest first; ``""`` is the root).
        reshard_after_forward: passed to every ``fully_shard``.

    A step calls ``ctx.fsdp()`` to shard ``module`` in place, runs forward and backward on
    its shard, and may return the output to have it compared row by row (a step may also
    call ``fully_shard`` itself: the check judges sharding by the parameters).
    """

    shard_modules: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    info: RankInfo | None = field(default=None, repr=False)
    _sharded: bool = field(default=False, repr=False)
    _mesh: Any = field(default=None, repr=False)

    @property
    def wrapped(self) -> bool:
        """Whether ``fsdp()`` sharded the module."""
        return self._sharded

    @property
    def group(self) -> Any:
        """The process group FSDP2 reduce-scatters the gradients over, for collectives in a
        hook (``dist.all_reduce(t, group=ctx.group)``): the group of the mesh ``fsdp()``
        sharded over, or of the one-dimensional mesh of the first DTensor parameter (a
        step that called ``fully_shard`` itself); None (every rank) before sharding."""
        mesh = self._mesh
        if mesh is None:
            mesh = next((p.device_mesh for p in self.module.parameters() if isinstance(p, DTensor)), None)
        if mesh is None or mesh.ndim != 1:
            return None
        return mesh.get_group()

    def fsdp(self, **options: Any) -> nn.Module:
        """``module`` after ``fully_shard`` on each of ``shard_modules`` (applied on the first
        call; the same module after).

        Args:
            **options: ``fully_shard``'s keyword arguments, passed to every call:
                ``mp_policy``, ``offload_policy``, ``reshard_after_forward`` (default the
                context's), ``mesh`` (default the mesh ``("dp",)`` of every rank; another
                must span every rank, which the check's batch is sharded over), ...
        """
        if not self._sharded:
            if self.info is None:
                raise RuntimeError("FSDPContext.fsdp() needs the rank's RankInfo (info=)")
            if options.get("mesh") is None:
                options["mesh"] = device_mesh(self.info, (self.world_size,), (MESH_DIM,))
            options.setdefault("reshard_after_forward", self.reshard_after_forward)
            self._mesh = options["mesh"]
            for name in self.shard_modules:
                fully_shard(self.module.get_submodule(name), **options)
            self._sharded = True
        return self.module

    def fsdp_modules(self) -> list[FSDPModule]:
        """Every module ``fsdp()`` sharded (empty before it ran)."""
        return [sub for sub in self.module.modules() if isinstance(sub, FSDPModule)]

    def ddp(self) -> Any:
        raise TypeError("an FSDP2 step shards the module with ctx.fsdp(); ctx.ddp() is for the DDP checks")


def fsdp_step(ctx: FSDPContext) -> Any:
    """The textbook FSDP2 step: shard, forward the rank's rows, mean loss, backward. Biased
    when the ranks hold different numbers of items: FSDP2's reduce-scatter averages the
    per-rank gradients (the loss-averaging trap, as under DDP)."""
    return ctx.backward(ctx.fsdp())


def weighted_fsdp_step(ctx: FSDPContext) -> Any:
    """The exact FSDP2 step for any shards: the rank's mean loss times its share of the
    items, ``ctx.loss_weight`` (``n_r * W / B`` for rows, ``t_r * W / T`` for tokens)."""
    return ctx.backward(ctx.fsdp(), ctx.loss_weight)


# --------------------------------------------------------------------------- tasks


def _holding(module: nn.Module) -> tuple[Held, ...]:
    return tuple(_held(name, p) for name, p in module.named_parameters())


@dataclass(frozen=True)
class FSDPStepTask(RankStepTask):
    """One FSDP2 step per function in ``steps``, each on a fresh copy of ``module``: a
    ``RankStepTask`` with the modules to shard and ``reshard_after_forward``."""

    shard_modules: tuple[str, ...]
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Precision:
    """Mixed precision as FSDP2 applied it on one rank, read from torch's own records
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``FSDPParam.init_dtype_attrs``;
    ``_fsdp_state.py``, ``_cast_forward_inputs`` and ``_cast_output_dtype``).

    Attributes:
        params: ``(name, param_dtype, reduce_dtype)`` per sharded parameter: the dtype its
            forward and backward computed in and the dtype its gradient was reduced in,
            each None where torch casts nothing (a ``param_dtype`` equal to the parameter's
            own; a ``reduce_dtype`` equal to ``param_dtype``). FSDP2 keeps the sharded
            parameter, its gradient and the optimizer's step in the parameter's own dtype.
        modules: ``(qualified name, input dtype, output dtype)`` per sharded module: the
            dtype its floating-point forward inputs were cast to (``cast_forward_inputs``)
            and its outputs (``output_dtype``), None where not cast.
    """

    params: tuple[tuple[str, torch.dtype | None, torch.dtype | None], ...] = ()
    modules: tuple[tuple[str, torch.dtype | None, torch.dtype | None], ...] = ()

    @property
    def mixed(self) -> bool:
        """Whether FSDP2 cast anything: a parameter, a gradient's reduction, an output."""
        return any(p is not None or r is not None for _n, p, r in self.params) or any(o is not None for _n, _i, o in self.modules)


def precision_of(module: nn.Module) -> Precision:
    """What mixed precision the FSDP2 modules in ``module`` applied, whoever called
    ``fully_shard`` (read after a forward: torch settles the dtypes at its lazy init).
    Read defensively: a torch without these records gives an empty ``Precision``."""
    names = {id(p): name for name, p in module.named_parameters()}
    params: list[tuple[str, torch.dtype | None, torch.dtype | None]] = []
    modules: list[tuple[str, torch.dtype | None, torch.dtype | None]] = []
    for qualified, sub in module.named_modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        group = getattr(state, "_fsdp_param_group", None)
        policy = getattr(state, "_mp_policy", None) or getattr(group, "mp_policy", None)
        param_dtype = getattr(policy, "param_dtype", None)
        cast_inputs = param_dtype if getattr(policy, "cast_forward_inputs", False) and isinstance(param_dtype, torch.dtype) else None
        output = getattr(policy, "output_dtype", None)
        modules.append((qualified, cast_inputs, output if isinstance(output, torch.dtype) else None))
        for fsdp_param in getattr(group, "fsdp_params", ()):
            name = names.get(id(getattr(fsdp_param, "sharded_param", None)))
            if name is not None:
                compute, reduce = getattr(fsdp_param, "param_dtype", None), getattr(fsdp_param, "reduce_dtype", None)
                params.append((name, compute if isinstance(compute, torch.dtype) else None, reduce if isinstance(reduce, torch.dtype) else None))
    return Precision(tuple(params), tuple(modules))


@dataclass(frozen=True)
class FSDPRankStep(RankStep):
    """What one FSDP2 step left on one rank: ``RankStep``'s gradients (full, from
    ``full_tensor()``), outputs, loss and buffers, ``wrapped`` (``ctx.fsdp()`` ran), and:

    Attributes:
        held: how the rank held each parameter at the end of the step.
        plain_grads: parameters whose gradient was a plain tensor, not a DTensor.
        precision: the mixed precision FSDP2 applied (``precision_of``).
    """

    held: tuple[Held, ...] = ()
    plain_grads: tuple[str, ...] = ()
    precision: Precision = field(default_factory=Precision)


def _context(info: RankInfo, model: nn.Module, task: FSDPStepTask | FSDPTrainingTask, shard_sizes: tuple[int, ...]) -> FSDPContext:
    return FSDPContext.for_rank(
        info, model, task.loss_fn, shard_sizes, shard_modules=task.shard_modules,
        reshard_after_forward=task.reshard_after_forward, info=info,
    )


def _run_one(info: RankInfo, task: FSDPStepTask, step: Any) -> FSDPRankStep:
    model = copy.deepcopy(task.module).to(torch.device(info.device))
    ctx = _context(info, model, task, task.shard_sizes)
    output, loss = run_step(ctx, task, step)
    return FSDPRankStep(
        grads=full_grads(model),
        outputs=outputs_of(output),
        loss=loss,
        buffers=buffers_of(model),
        wrapped=ctx.wrapped,
        syncs=None,
        held=_holding(model),
        plain_grads=tuple(name for name, p in model.named_parameters() if p.grad is not None and not isinstance(p.grad, DTensor)),
        precision=precision_of(model),
    )


def run_fsdp_step_task(info: RankInfo, task: FSDPStepTask) -> tuple[FSDPRankStep, ...]:
    """Runs every step of ``task`` on this rank's shard (a task for ``RankRunner.run``)."""
    with quiet():
        return tuple(_run_one(info, task, step) for step in task.steps)


@dataclass(frozen=True)
class FSDPTrainingTask(RankTrainingTask):
    """``len(batches)`` optimizer steps of FSDP2 training; the first step shards the module
    and the optimizer is built after it, so the optimizer holds the DTensor parameters (and
    its state is sharded like them)."""

    shard_modules: tuple[str, ...]
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class FSDPRankTraining(RankTraining):
    """``RankTraining`` (full parameters after every step), and how the rank held its
    parameters and its optimizer state at the end (``state``: one ``Held`` per tensor
    of the optimizer's per-parameter state with at least one dimension, named
    ``"<parameter>.<key>"``, e.g. ``"0.weight.exp_avg"``)."""

    held: tuple[Held, ...] = ()
    state: tuple[Held, ...] = ()
    precision: Precision = field(default_factory=Precision)
    #: each step's full gradients, as the optimizer stepped with them
    step_grads: tuple[dict[str, torch.Tensor | None], ...] = ()
    #: the dtypes of the sharded parameters and of their gradients after the last step
    param_dtypes: tuple[str, ...] = ()
    grad_dtypes: tuple[str, ...] = ()


def _pieces(named: Sequence[tuple[str, torch.Tensor | None]]) -> list[Any]:
    """What this rank sends of each tensor (``gather_full``'s pieces): its local dim-0 shard
    of a DTensor sharded so, else whether it holds a DTensor (None: no tensor)."""
    return [
        cpu_copy(t.to_local()) if isinstance(t, DTensor) and _dim0_shard(t) else (isinstance(t, DTensor) if t is not None else None)
        for _name, t in named
    ]


def _whole(named: Sequence[tuple[str, torch.Tensor | None]], pieces: Sequence[Sequence[Any]]) -> list[torch.Tensor | None]:
    """Each tensor of ``named`` made whole from every rank's ``pieces`` (``gather_full``),
    in order; a tensor another placement shards is gathered with ``full_tensor()`` when
    every rank holds a DTensor, else kept as this rank holds it."""
    full: list[torch.Tensor | None] = []
    for index, (_name, tensor) in enumerate(named):
        mine = [held[index] for held in pieces]
        if tensor is None:
            full.append(None)
        elif all(isinstance(piece, torch.Tensor) for piece in mine):
            full.append(torch.cat(mine, dim=0))
        elif isinstance(tensor, DTensor) and all(piece is True or isinstance(piece, torch.Tensor) for piece in mine):
            full.append(cpu_copy(tensor.full_tensor()))
        else:
            full.append(cpu_copy(tensor.to_local() if isinstance(tensor, DTensor) else tensor))
    return full


def read_fsdp_step(module: nn.Module, optimizer: torch.optim.Optimizer) -> StepRead:
    """The whole parameters, gradients and optimizer state after an FSDP2 optimizer step,
    and the buffers, with one ``all_gather_object`` for all of them (as ``gather_full``
    does for one kind: FSDP2's own collectives already cost milliseconds a step on gloo).

    The optimizer's state (``optimizer_state_of``'s tensors) is made whole only when every
    rank holds the same entries: a rank whose optimizer skipped a parameter (no gradient)
    has no state for it, and then no rank reads any (an empty dict; the parameters show
    the step that rank skipped)."""
    params = [(name, p.detach()) for name, p in module.named_parameters()]
    grads = [(name, p.grad) for name, p in module.named_parameters()]
    names = {id(p): name for name, p in module.named_parameters()}
    state = sorted(
        (f"{names.get(id(p), '?')}.{key}", value)
        for p, entries in optimizer.state.items()
        for key, value in entries.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    keys = tuple(name for name, _t in state)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (keys, _pieces([*params, *grads]), _pieces(state)))
    whole = _whole([*params, *grads], [held for _keys, held, _state in every])
    full_params, full_grads = whole[: len(params)], whole[len(params) :]
    full_state: list[torch.Tensor | None] = []
    if all(other == keys for other, _held, _state in every):
        full_state = _whole(state, [held for _keys, _held, held in every])
    return StepRead(
        params={name: t for (name, _p), t in zip(params, full_params, strict=True) if t is not None},
        grads={name: t for (name, _g), t in zip(grads, full_grads, strict=True)},
        buffers=buffers_of(module),
        state={name: t for (name, _s), t in zip(state, full_state, strict=False) if t is not None},
    )


def _optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> tuple[Held, ...]:
    held = []
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                held.append(_held(f"{names.get(id(param), '?')}.{key}", value))
    return tuple(held)


def run_fsdp_training_task(info: RankInfo, task: FSDPTrainingTask) -> FSDPRankTraining:
    """Trains this rank's copy as ``FSDPTrainingTask`` says (a task for ``RankRunner.run``)."""
    model = copy.deepcopy(task.module).to(torch.device(info.device))
    ctx = _context(info, model, task, task.shard_sizes[0])
    with quiet():
        trained = train(ctx, task, optimizer_after_first_step=True, read_step=read_fsdp_step, record_dropout=True)
        grads_none = tuple(name for name, p in model.named_parameters() if p.grad is None)
        names = {id(p): name for name, p in model.named_parameters()}
        state = _optimizer_state(trained.optimizer, names) if trained.optimizer is not None else ()
        param_dtypes = tuple(dict.fromkeys(str(p.dtype) for p in model.parameters()))
        grad_dtypes = tuple(dict.fromkeys(str(p.grad.dtype) for p in model.parameters() if p.grad is not None))
    return FSDPRankTraining(
        trained.params, buffers_of(model), grads_none, ctx.wrapped, held=_holding(model), state=state,
        step_buffers=trained.buffers, step_state=trained.state, dropout=trained.dropout, end_states=trained.end_states,
        precision=precision_of(model), step_grads=trained.step_grads, param_dtypes=param_dtypes, grad_dtypes=grad_dtypes,
    )
