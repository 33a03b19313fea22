"""Public FSDP2 checks: torch's ``fully_shard`` on real ranks against one device.

Each check sends one task to the pooled ranks (``fsdp_rank``) and compares the full
gradients, outputs or parameters with the single-device step as every ranked check does
(``RankedCheck``); what is compared, the evidence asked for and the loss-averaging trap
are in docs/distributed.md and the helpers' docstrings.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Unpack

import torch
from torch import nn

from dpverify.checks.dp import raise_unless_ok
from dpverify.core.comparison import (
    StepComparison,
    TensorComparison,
    TensorId,
    Tolerance,
    compare_tensors,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.step import (
    StepResult,
    batch_size_of,
    convert_tensors,
    default_dtype,
)
from dpverify.core.tree import map_tensors
from dpverify.core.validation import require_bool
from dpverify.ddp.pool import ParallelError
from dpverify.models.layouts import read_without_forward
from dpverify.ranked.check import (
    CPU,
    FSDP_RANKS,
    Batch,
    RankedCheck,
    ShardUnit,
    TrainingTrace,
    callable_name,
    describe_batches,
    exact_training_notes,
    grads_only,
    jittered_training,
    local_buffer_notes,
    require_step,
    train_single_device,
    training_batches,
    training_code,
    training_rows,
    training_scale_note,
)
from dpverify.ranked.notes import (
    items_notes,
    ranks_disagree,
    scale_note,
    sum_loss_note,
    training_stream_findings,
    trap_fits,
)
from dpverify.ranked.options import (
    ShardedKeywords,
    TrainingKeywords,
    accepted,
    check_keywords,
    documented,
)
from dpverify.ranked.randomness import dropout_layers, training_masks
from dpverify.ranked.rank import (
    AfterBackward,
    LossFn,
    OptimizerFactory,
    ReferenceContext,
    after_backward_note,
    one_rank_group,
)
from dpverify.ranked.sharded import module_paths, send_steps, trap_text
from dpverify.sharded.fsdp_rank import (
    MESH_DIM,
    FSDPContext,
    FSDPRankStep,
    FSDPRankTraining,
    FSDPStepTask,
    FSDPTrainingTask,
    Held,
    Precision,
    fsdp_step,
    run_fsdp_step_task,
    run_fsdp_training_task,
    shard_order,
    weighted_fsdp_step,
)

__all__ = [
    "FSDPCheck",
    "FSDPContext",
    "assert_fsdp_grads_match",
    "assert_fsdp_training_matches",
    "fsdp_step",
    "weighted_fsdp_step",
]

class FSDPKeywords(ShardedKeywords, total=False):
    """The optional keywords of the FSDP2 helpers (each takes those its docstring lists)."""

    shard_modules: Sequence[str] | None
    reshard_after_forward: bool


class FSDPTrainingKeywords(FSDPKeywords, TrainingKeywords, total=False):
    """The optional keywords of ``assert_fsdp_training_matches``."""


#: What FSDP2 does with buffers, for the note on buffers updated from the local batch.
FSDP_BUFFER_SYNC = "FSDP2 leaves buffers alone: each rank goes on from its own local-batch update."


# --------------------------------------------------------------------------- validation


def _shard_modules(module: nn.Module, shard_modules: Sequence[str] | None) -> tuple[str, ...]:
    """The qualified names ``fully_shard`` is applied to, in the order it must be (children
    before parents, the root last). Default: every direct child that holds a parameter,
    then the root; the root is always sharded (torch's FSDP2 expects ``fully_shard`` on the
    root, which owns what no child does and runs the root pre-forward)."""
    if shard_modules is None:
        return shard_order([*_default_units(module), ""])
    if isinstance(shard_modules, (str, bytes)) or not isinstance(shard_modules, Sequence):
        raise InvalidArgument(
            f"shard_modules={shard_modules!r}: pass a list of qualified module names, e.g. ['0', '2'] or ['encoder.layers.0']"
        )
    valid = dict(module.named_modules())
    bypassed = read_without_forward(module)
    for name in shard_modules:
        if not isinstance(name, str):
            raise InvalidArgument(f"shard_modules contains {name!r}; name the modules by their qualified names (strings)")
        if name not in valid:
            raise InvalidArgument(
                f"shard_modules names {name!r}, which is not a submodule of {type(module).__name__}; "
                f"valid names: {module_paths(module)} ('' is the root)"
            )
        if isinstance(valid[name], _CONTAINERS):
            elements = ", ".join(repr(f"{name}.{child}") for child, _ in valid[name].named_children())
            raise InvalidArgument(
                f"shard_modules names {name!r}, a {type(valid[name]).__name__}: fully_shard needs a module "
                f"with a forward of its own; name its elements instead ({elements})"
            )
        if name in bypassed:
            parent = bypassed[name]
            raise InvalidArgument(
                f"shard_modules names {name!r}, whose parent {type(valid[parent]).__name__} "
                f"{parent or '(the root)'!r} reads its parameters without calling its forward: FSDP2 "
                "gathers a group's parameters in its forward hook, so they would reach the parent as "
                f"shards (torch raises 'mixed torch.Tensor and DTensor'); name {parent or 'the root'!r} instead"
            )
    return shard_order([*shard_modules, ""])


#: Containers without a forward of their own, which ``fully_shard`` refuses
#: (torch/distributed/fsdp/_fully_shard/_fsdp_init.py, ``_validate_module``).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _default_units(module: nn.Module, prefix: str = "", outside: frozenset[int] = frozenset()) -> list[str]:
    """Each direct child that holds a parameter, as FSDP users wrap their blocks; a
    ModuleList or ModuleDict is replaced by its elements (each block of a layer list).

    A child that shares a parameter with another (a language model's output layer tied to
    its embedding) cannot be a group of its own: FSDP2 refuses a parameter two groups
    manage (torch/distributed/fsdp/_fully_shard/_fsdp_init.py). Such a child is replaced by
    its own children, and a leaf that still shares is left to the root's group, which then
    holds the tied parameter once.
    """
    children = [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]
    if isinstance(module, nn.MultiheadAttention):
        return []  # it reads out_proj's weight without calling it: one group, its own or its parent's
    owned = [frozenset(id(p) for p in child.parameters()) for _name, child in children]
    names: list[str] = []
    for index, (name, child) in enumerate(children):
        path = f"{prefix}{name}"
        others = outside.union(*(ids for j, ids in enumerate(owned) if j != index))
        shared = not owned[index].isdisjoint(others)
        if isinstance(child, _CONTAINERS) or (shared and any(True for _ in child.children())):
            names += _default_units(child, f"{path}.", others)
        elif not shared:
            names.append(path)
    return names


@dataclass(frozen=True)
class FSDPCheck(RankedCheck):
    """A validated FSDP2 scenario: ``RankedCheck``'s, and where ``fully_shard`` applies.
    Unlike DDP, a rank may get 0 rows: FSDP2 accepts it (the rank still joins every
    all-gather and reduce-scatter, and contributes a zero gradient), and with the weighted
    step (weight 0) the result is still the full-batch gradient."""

    shard_modules: tuple[str, ...] = ("",)
    reshard_after_forward: bool = True
    #: the dtype the ranks' mixed-precision policy computed in, when coarser than the
    #: module's: the single-device reference runs in it too (``in_compute_dtype``)
    compute_dtype: torch.dtype | None = None

    def reference(self, dtype: torch.dtype | None, *, jitter: float = 0.0) -> StepResult:
        """The single-device full-batch step in ``dtype``; None is the dtype the ranks
        computed in (``compute_dtype``, else the module's own)."""
        return super().reference(self.compute_dtype if dtype is None else dtype, jitter=jitter)

    def in_compute_dtype(self, ranks: Sequence[FSDPRankStep]) -> FSDPCheck:
        """This check judged at the precision the ranks computed in: the single-device step
        in the coarsest ``param_dtype`` of their ``MixedPrecisionPolicy`` (anchored in float64:
        the tolerance is that dtype's). Unchanged without one coarser than the module's."""
        dtypes = {compute for rank in ranks for _name, compute, _reduce in rank.precision.params if compute is not None}
        coarsest = max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)
        if coarsest is None or torch.finfo(coarsest).eps <= torch.finfo(self.dtype).eps:
            return self
        return replace(self, dtype=coarsest, compute_dtype=coarsest)

    NO_GRAD: ClassVar[str] = "fully_shard would have no gradient to reduce-scatter, and there is nothing to compare"
    UNIT: ClassVar[ShardUnit] = FSDP_RANKS
    AVERAGER: ClassVar[str] = "FSDP2's reduce-scatter"

    @classmethod
    def of(cls, module: nn.Module, inputs: Any, target: Any, loss_fn: LossFn, world_size: int, options: FSDPKeywords) -> FSDPCheck:
        """The scenario of one call of an FSDP2 helper: its arguments and ``options``."""
        return cls.create(
            module, inputs, target, loss_fn=loss_fn, world_size=world_size, **check_keywords(options),
            shard_modules=_shard_modules(module, options.get("shard_modules")),
            reshard_after_forward=require_bool(options.get("reshard_after_forward", True), "reshard_after_forward"),
        )

    def layout(self) -> str:
        shown = [name if name else "(root)" for name in self.shard_modules]
        return (
            f"{self.shards_text()}, mesh ({MESH_DIM!r},); FSDP2 fully_shard on {shown} modules, "
            f"reshard_after_forward={self.reshard_after_forward}"
        )


# --------------------------------------------------------------------------- evidence


def _sharding_findings(check: FSDPCheck, held: Sequence[tuple[Held, ...]], wrapped: Sequence[bool], plain: Sequence[tuple[str, ...]]) -> tuple[list[str], list[str]]:
    """(failures, notes) on whether the ranks really ran FSDP2, judged by the parameters
    whoever sharded them (``ctx.fsdp()``, or a step calling ``fully_shard`` itself): every
    parameter a DTensor, some held in part (with more than one rank), every gradient a
    DTensor. ``wrapped`` (``ctx.fsdp()`` ran) only words the failure of a rank that held
    no DTensor at all."""
    failures: list[str] = []
    unsharded = [r for r, params in enumerate(held) if params and not any(h.dtensor for h in params)]
    if unsharded:
        never = [r for r in unsharded if r < len(wrapped) and not wrapped[r]]
        how = (
            f"The step never called ctx.fsdp() on ranks {unsharded}, nor fully_shard itself" if never == unsharded
            else f"fully_shard left every parameter a plain tensor on ranks {unsharded}"
        )
        failures.append(
            f"{how}: the module was not sharded (no parameter is a DTensor), so "
            "no gradient went through FSDP2's reduce-scatter and nothing of FSDP2 was checked. "
            "Call model = ctx.fsdp() (it takes fully_shard's keywords, mp_policy= among them) and run "
            "forward and backward through it."
        )
    for r, params in enumerate(held):
        plain_params = [h.name for h in params if not h.dtensor]
        if plain_params and r not in unsharded:
            failures.append(
                f"Rank {r} held parameters {plain_params} as plain tensors, not DTensors: fully_shard did not manage them."
            )
    # across ranks: a parameter of one element is stored whole by one rank and not at all
    # by the others, so a rank may hold nothing in part while the module is sharded
    if check.world_size > 1 and any(held) and not any(h.sharded for params in held for h in params):
        failures.append(
            "Every rank stored every parameter whole (no DTensor shard smaller than the parameter): "
            "the parameters were never sharded over the ranks."
        )
    for r, names in enumerate(plain):
        if names:
            failures.append(
                f"Rank {r}'s gradients for {list(names)} are plain tensors, not DTensors: they did not "
                "come out of FSDP2's reduce-scatter (a backward through an unsharded module)."
            )
    notes: list[str] = []
    if not failures and held and held[0]:
        first = held[0]
        placements = sorted({h.placements for h in first})
        local, full = sum(h.local for h in first), sum(h.numel for h in first)
        notes.append(
            f"Sharding ran: every rank held its {len(first)} parameters as DTensors over the mesh "
            f"({MESH_DIM!r},) with placements {placements}; rank 0 stored {local} of their {full} "
            "elements, and every gradient was a DTensor (compared after full_tensor())."
        )
    return failures, notes


def _undivided_note(c: float | None, world: int) -> list[str]:
    if c is None or world < 2 or abs(c - world) > 1e-3 * world:
        return []
    return [
        f"FSDP2 divides the reduce-scattered gradients by the world size, {world}, unless told not "
        "to: a module with set_gradient_divide_factor(1.0) (or set_reduce_scatter_divide_factor) "
        f"leaves the sum over ranks, {world} times the full-batch gradient."
    ]


# --------------------------------------------------------------------------- gradients


@documented
def assert_fsdp_grads_match(
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, **options: Unpack[FSDPKeywords],
) -> StepComparison:
    """Asserts one FSDP2 (``fully_shard``) step gives every rank the full-batch gradient.

    Each rank takes a copy of ``module`` (same weights everywhere), applies torch's
    ``fully_shard`` over the mesh ``("dp",)`` of every rank to each module of
    ``shard_modules`` and to the root, runs ``step`` on its contiguous shard of the batch,
    and returns its gradients made whole (``DTensor.full_tensor()``) and its outputs. Every
    rank's gradients and its rows of the output must equal the single-device full-batch step
    (float64-anchored tolerance, as ``assert_ddp_grads_match``). ``module`` is left untouched.

    A step that never called ``ctx.fsdp()``, parameters that were never sharded, or
    plain-tensor gradients fail the check even when the numbers match. With uneven shards
    the plain ``fsdp_step`` (the loss-averaging trap) is run for contrast and
    ``weighted_fsdp_step`` verified; docs/distributed.md tells the evidence and the trap.

    Args:
        module: the model to check.
        inputs: the batch tensor, or a tuple of positional forward arguments; ``()`` for a
            keyword-only forward (the batch in ``forward_kwargs``).
        target: the second argument of ``loss_fn`` (sharded like the batch).
        loss_fn: ``loss_fn(output, target)``, a scalar mean loss; picklable.
        world_size: number of ranks.
        shards: rows per rank (default: as even as possible). A rank may get 0 rows, as
            FSDP2 allows (it joins the collectives with a zero gradient).
        step: the per-rank step to verify, ``step(ctx: FSDPContext)``, picklable; it must shard
            with ``ctx.fsdp()``. Default ``fsdp_step``, or ``weighted_fsdp_step`` when the ranks
            hold different numbers of items.
        shard_modules: qualified names of the submodules to ``fully_shard`` (the root always
            follows). Default: every direct child that holds a parameter.
        reshard_after_forward: passed to ``fully_shard``: free the unsharded parameters after
            forward (all-gather them again in backward), or keep them.
        <shared: pool, rtol, atol, msg, forward_kwargs, exact>

    Returns:
        The comparison (``str()`` summarises it).

    Raises:
        ParallelMismatch: a rank's gradient or output differs, or the ranks did not shard.
        ParallelError: a rank raised, died or hung; the pool restarts for the next check.
        InvalidArgument: an argument cannot be used (a ``shard_modules`` name that is not a
            submodule, an unpicklable loss or step), or the module has no trainable parameter.
    """
    __tracebackhide__ = True
    accepted(assert_fsdp_grads_match, options, FSDPKeywords)
    check = FSDPCheck.of(module, inputs, target, loss_fn, world_size, options)
    step = options.get("step")
    require_step(step, "FSDPContext")
    title = "FSDP2 (fully_shard) gradients must match the single-device full-batch gradient on every rank"
    counted, chosen, verified, naive = send_steps(
        check, step, fsdp_step, weighted_fsdp_step, run_fsdp_step_task, title, FSDPStepTask,
        shard_modules=check.shard_modules, reshard_after_forward=check.reshard_after_forward,
    )
    check = check.in_compute_dtype(verified)
    refs = check.references(items=counted if counted.by_tokens else None)
    expected, anchor = refs.expected, refs.anchor
    rows = check.rank_rows(verified, refs)
    ok = all(row.ok for row in rows)
    notes: list[str] = items_notes(counted, naive is not None)
    contrasts: list[TensorComparison] = []
    reduction = None if ok else check.loss_reduction(counted)
    if naive is not None:
        if trap_fits(step, ok, reduction, verified, naive):
            token_intro = (
                "FSDP2's reduce-scatter averages the ranks' gradients as DDP's all-reduce does, so DDP's "
                "token trap holds here, with fsdp_step for ddp_step and weighted_fsdp_step for weighted_ddp_step: "
            )
            averages = (
                "FSDP2's reduce-scatter averages the ranks' gradients (it divides their sum by the world size, "
                f"{check.world_size}, as DDP does)"
            )
            notes.append(
                trap_text(check, counted, naive, anchor or expected, token_intro, averages=averages, plain="fsdp_step", weighted="weighted_fsdp_step")
            )
        if step is None:
            contrasts = grads_only(check.rank_rows(naive, refs, variant="plain fsdp_step", contrast=True))
        elif trap_fits(step, ok, reduction, verified, naive):
            notes.append(
                "The step's gradients equal the plain per-rank mean-loss step's (fsdp_step): it falls into "
                "the loss-averaging trap. Multiply the rank's loss by ctx.loss_weight (weighted_fsdp_step)."
            )
    failures, evidence = _sharding_findings(check, [s.held for s in verified], [s.wrapped for s in verified], [s.plain_grads for s in verified])
    notes += evidence
    if check.compute_dtype is not None:
        dtype = str(check.compute_dtype).removeprefix("torch.")
        notes.append(
            f"Mixed precision: the ranks' fully_shard computed in {dtype} (MixedPrecisionPolicy param_dtype), so "
            f"the single-device reference ran in {dtype} too, anchored in float64: the tolerance is {dtype}'s."
        )
    scale = None
    if not ok:
        more, scale = scale_note(
            verified, expected, check.world_size, shard_sizes=check.shard_sizes, reduction=reduction,
            averager="FSDP2's reduce-scatter",
        )
        notes += more + _undivided_note(scale, check.world_size) + ranks_disagree(verified)
    outcome = check.outcome(title, chosen, rows, contrasts=contrasts, notes=notes, failures=failures, scale=scale)
    return raise_unless_ok(outcome, options.get("msg"))


# --------------------------------------------------------------------------- training


def _state_findings(world: int, ranks: Sequence[FSDPRankTraining]) -> tuple[list[str], list[str]]:
    """(failures, notes) on the optimizer state: a plain state tensor on some rank, or, with
    more than one rank, state that every rank stored whole, means the optimizer was not
    built over the sharded parameters. Judged across ranks, as the parameters are
    (``_sharding_findings``): the state of a parameter of one row is stored whole by one
    rank and not at all by the others, so a rank may hold nothing in part."""
    states = ranks[0].state
    if not states:
        return [], ["The optimizer keeps no per-parameter state tensor (nothing to shard)."]
    failures = []
    for r, rank in enumerate(ranks):
        whole = [h.name for h in rank.state if not h.dtensor]
        if whole:
            failures.append(
                f"Rank {r}'s optimizer state {whole} is not sharded (plain tensors): the optimizer was not "
                "built over FSDP2's sharded parameters."
            )
    if not failures and world > 1 and not any(h.sharded for rank in ranks for h in rank.state):
        failures.append(
            "Every rank stored its optimizer state whole (no DTensor shard smaller than the tensor): the optimizer "
            "was not built over FSDP2's sharded parameters."
        )
    if failures:
        return failures, []
    local, full = sum(h.local for h in states), sum(h.numel for h in states)
    example = next((h for h in states if h.sharded), states[0])
    return [], [
        f"Optimizer state sharded: {len(states)} state tensors per rank are DTensors; rank 0 stores "
        f"{local} of their {full} elements (e.g. {example.name!r}: {example.local} of {example.numel})."
    ]


def _cast_to(dtype: torch.dtype) -> Callable[[Any], Any]:
    """Casts the floating-point tensors in a nested value to ``dtype``, inside autograd,
    as FSDP2 casts a module's inputs and outputs (torch's ``_cast_fp_tensor``)."""
    return lambda value: map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


class _MixedReference:
    """The single-device forward and backward that FSDP2 runs under ``precision``
    (torch/distributed/fsdp/_fully_shard: ``FSDPParam`` casts each parameter to its
    ``param_dtype`` for the all-gather; every sharded module casts its floating-point
    inputs (``cast_forward_inputs``) and outputs (``output_dtype``); the gradient comes out
    in ``param_dtype``, is reduce-scattered in ``reduce_dtype`` and cast back to the
    parameter's own dtype, in which the optimizer steps it)."""

    def __init__(self, module: nn.Module, loss_fn: LossFn, precision: Precision) -> None:
        self.model = copy.deepcopy(module)
        self.loss_fn = loss_fn
        self.dtypes = {name: compute for name, compute, _reduce in precision.params}
        self.reduce = {name: reduce for name, _compute, reduce in precision.params}
        for qualified, inputs_dtype, output_dtype in precision.modules:
            sub = self.model.get_submodule(qualified)
            if inputs_dtype is not None:
                cast_inputs = _cast_to(inputs_dtype)
                sub.register_forward_pre_hook(lambda _m, args, kwargs, cast=cast_inputs: cast((args, kwargs)), with_kwargs=True)
            if output_dtype is not None:
                cast_output = _cast_to(output_dtype)
                sub.register_forward_hook(lambda _m, _args, output, cast=cast_output: cast(output))

    def grads(self, params: Mapping[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor | None]:
        """The gradients of the full batch at ``params``, each in the coarser of its compute
        dtype and its reduction's (its rounding is what a correct step may carry)."""
        compute = {
            name: p.detach().to(self.dtypes.get(name) or p.dtype).requires_grad_(p.requires_grad) for name, p in params.items()
        }
        grads = _grads_at(self.model, self.loss_fn, compute, batch, None)
        return {name: _coarser(grad, self.reduce.get(name)) for name, grad in grads.items()}


def _coarser(grad: torch.Tensor | None, reduce: torch.dtype | None) -> torch.Tensor | None:
    """``grad`` rounded to ``reduce`` when that dtype is the coarser (a float32 gradient
    reduce-scattered in bfloat16), else as it is."""
    if grad is None or reduce is None or torch.finfo(reduce).eps <= torch.finfo(grad.dtype).eps:
        return grad
    return grad.to(reduce)


def _grads_at(
    model: nn.Module, loss_fn: LossFn, leaves: Mapping[str, torch.Tensor], batch: Batch, dtype: torch.dtype | None,
) -> dict[str, torch.Tensor | None]:
    """The gradients of the full batch (its tensors cast to ``dtype``; None: as they are)
    with ``leaves`` for ``model``'s parameters."""
    inputs, kwargs, target = batch
    with torch.random.fork_rng(devices=[]), default_dtype(dtype):
        torch.manual_seed(0)
        output = torch.func.functional_call(model, dict(leaves), convert_tensors(inputs, dtype, CPU), convert_tensors(dict(kwargs), dtype, CPU))
        loss_fn(output, convert_tensors(target, dtype, CPU)).backward()
    return {name: tensor.grad for name, tensor in leaves.items()}


def _hooked(
    module: nn.Module, loss_fn: LossFn, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor | None],
    hook: AfterBackward, batch: Batch, index: int, group: Any,
) -> dict[str, torch.Tensor | None]:
    """``grads`` after the user's ``after_backward`` hook ran on them in the single-device
    reference: on a copy of ``module`` holding ``params`` (in each gradient's dtype) with
    ``grads`` as its ``.grad``, over the full batch ``batch`` of step ``index``."""
    model = copy.deepcopy(module)
    inputs, kwargs, target = batch
    with torch.no_grad():
        for name, p in model.named_parameters():
            grad = grads.get(name)
            p.data = params[name].detach().to(grad.dtype if grad is not None else p.dtype, copy=True)
            p.grad = None if grad is None else grad.detach().clone()
    ctx = ReferenceContext(
        rank=0, world_size=1, module=model, inputs=tuple(inputs), target=target, loss_fn=loss_fn,
        shard_sizes=(batch_size_of(tuple(inputs), kwargs=kwargs),),
        device=CPU, kwargs=dict(kwargs), step_index=index, one_rank=group,
    )
    with after_backward_note(hook):
        hook(ctx)
    return {name: p.grad for name, p in model.named_parameters()}


def _mixed_training_rows(
    check: FSDPCheck,
    pairs: Sequence[Batch],
    optimizer: OptimizerFactory,
    precision: Precision,
    ranks: Sequence[FSDPRankTraining],
    after_backward: AfterBackward | None = None,
    group: Any = None,
) -> tuple[list[TensorComparison], int]:
    """Rows of the first step at which some rank diverges (else of the last step), for
    training under a mixed-precision policy, each step judged where it rounds (as
    ``assert_fsdp_training_matches`` says): step k's gradients against ``_MixedReference``
    at the one-device parameters before it (after ``after_backward``, run on them with
    ``group`` as the reference's one-rank group), and the parameters after it against the
    one-device optimizer stepping them with rank 0's gradients, each anchored in float64.
    """
    mixed = _MixedReference(check.module, check.loss_fn, precision)
    model64 = copy.deepcopy(check.module).to(torch.float64)
    master = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in check.module.named_parameters()}
    # a copy even of a float64 module's: each optimizer steps its own parameters
    master64 = {name: p.detach().to(torch.float64, copy=True).requires_grad_(p.requires_grad) for name, p in master.items()}
    opt, opt64 = optimizer(list(master.values())), optimizer(list(master64.values()))
    rows: list[TensorComparison] = []
    for index, batch in enumerate(pairs):
        expected = mixed.grads(master, batch)
        leaves = {name: p.detach().to(torch.float64).requires_grad_(p.requires_grad) for name, p in master64.items()}
        anchor = _grads_at(model64, check.loss_fn, leaves, batch, torch.float64)
        if after_backward is not None:
            expected = _hooked(check.module, check.loss_fn, master, expected, after_backward, batch, index, group)
            anchor = _hooked(model64, check.loss_fn, master64, anchor, after_backward, batch, index, group)
        rows = [
            compare_tensors(
                TensorId("grad", name, rank=r, variant=f"step {index + 1}"), rank.step_grads[index].get(name), value, anchor[name], check.tolerance,
            )
            for r, rank in enumerate(ranks)
            for name, value in expected.items()
            if value is not None or rank.step_grads[index].get(name) is not None
        ]
        stepped = ranks[0].step_grads[index]
        for params, dtype in ((master, None), (master64, torch.float64)):
            for name, p in params.items():
                grad = stepped.get(name)  # one the rank could not make whole fails its row above
                p.grad = None if grad is None or grad.shape != p.shape else grad.to(dtype or p.dtype)
        opt.step()
        opt64.step()
        rows += [
            compare_tensors(
                TensorId("param", name, rank=r, variant=f"step {index + 1}"), rank.params[index].get(name), value.detach(),
                master64[name].detach(), check.tolerance,
            )
            for r, rank in enumerate(ranks)
            for name, value in master.items()
        ]
        rows += _state_rows(ranks, index, _state_of(opt, master), _state_of(opt64, master64), check.tolerance)
        buffers = {n: b for n, b in mixed.model.named_buffers() if b.is_floating_point()}
        buffers64 = dict(model64.named_buffers())
        rows += [
            compare_tensors(
                TensorId("buffer", name, rank=r, variant=f"step {index + 1}"), rank.step_buffers[index].get(name), value,
                buffers64.get(name), check.tolerance,
            )
            for r, rank in enumerate(ranks) if index < len(rank.step_buffers)
            for name, value in buffers.items()
        ]
        if not all(row.ok for row in rows):
            return rows, index
    return rows, len(pairs) - 1


def _state_of(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state tensors over ``params``, named as the ranks name
    theirs (``optimizer_state_of``: ``"<parameter>.<key>"``)."""
    names = {id(p): name for name, p in params.items()}
    return {
        f"{names[id(p)]}.{key}": value.detach()
        for p, state in optimizer.state.items() if id(p) in names
        for key, value in state.items() if isinstance(value, torch.Tensor) and value.dim() > 0
    }


def _state_rows(
    ranks: Sequence[FSDPRankTraining], index: int, expected: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], tolerance: Tolerance,
) -> list[TensorComparison]:
    """Each rank's optimizer state after step ``index`` against the one-device optimizer's."""
    return [
        compare_tensors(
            TensorId("optimizer state", name, rank=r, variant=f"step {index + 1}"), rank.step_state[index].get(name), value,
            anchor.get(name), tolerance,
        )
        for r, rank in enumerate(ranks) if index < len(rank.step_state)
        for name, value in expected.items()
    ]


#: what torch's ``contract`` says when ``fully_shard`` is applied to a module twice
#: (torch/distributed/_composable/contract.py)
_SHARDED_TWICE = "can only be applied to a module once"


def _training_precision(ranks: Sequence[FSDPRankTraining]) -> tuple[Precision, list[str]]:
    """The mixed precision the ranks trained under (rank 0's), and a failure when the ranks
    applied different ones (each rank must shard the same way)."""
    found = ranks[0].precision
    differ = [r for r, rank in enumerate(ranks) if rank.precision != found]
    if not differ:
        return found, []
    return found, [
        f"Ranks {differ} applied another mixed precision than rank 0 (fully_shard's mp_policy): every rank must "
        "shard the module alike; the single-device reference follows rank 0's."
    ]


def _mixed_precision_note(precision: Precision, ranks: Sequence[FSDPRankTraining]) -> str:
    kept = "/".join(sorted({d.removeprefix("torch.") for rank in ranks for d in rank.param_dtypes}))
    grads = "/".join(sorted({d.removeprefix("torch.") for rank in ranks for d in rank.grad_dtypes})) or kept

    def shown(dtypes: Sequence[torch.dtype | None]) -> str:
        return "/".join(sorted({str(d).removeprefix("torch.") for d in dtypes if d is not None})) or kept

    computed = [p for _n, p, _r in precision.params]
    reduced = [r if r is not None else p for _n, p, r in precision.params]
    compute, reduce = shown(computed), shown(reduced)
    coarsest = max((d for d in computed + reduced if d is not None), key=lambda d: torch.finfo(d).eps, default=None)
    judged = shown([coarsest])
    cast = kept if reduce in (kept, compute) else f"{reduce} then to {kept}"
    return (
        f"Mixed precision (MixedPrecisionPolicy): FSDP2 ran forward and backward in {compute} and reduced the "
        f"gradients in {reduce}, while the sharded parameters stayed {kept} (their gradients {grads}) and the "
        f"optimizer stepped them in {kept}. The single-device reference trained the same way ({kept} master "
        f"parameters, each step's forward and backward on a {compute} copy, gradients cast to {cast}), and each "
        f"step was judged where its rounding happens: the gradients against that reference at the same parameters "
        f"(anchored in float64; {judged}'s tolerance), the parameters against the optimizer stepping them in "
        f"{kept} with those gradients (anchored in float64; {kept}'s tolerance)."
    )


@documented
def assert_fsdp_training_matches(
    module: nn.Module, batches: Sequence[tuple[Any, ...]], *, loss_fn: LossFn, optimizer: OptimizerFactory, world_size: int,
    **options: Unpack[FSDPTrainingKeywords],
) -> StepComparison:
    """Asserts ``len(batches)`` optimizer steps of FSDP2 training match one device.

    For each ``(inputs, target)`` in ``batches`` every rank runs ``step`` on its shard (the
    first call shards its copy of ``module``, as in ``assert_fsdp_grads_match``:
    ``ctx.fsdp(**fully_shard_keywords)``, or ``fully_shard`` called by the step itself,
    once), runs ``after_backward`` when given, and steps the optimizer, ``optimizer(params)``
    built after the first step over the sharded DTensor parameters so that its state is
    sharded too (gradients are zeroed before every later step). After every step each rank's
    full parameters and optimizer state (``full_tensor()``: SGD's ``momentum_buffer``,
    Adam's ``exp_avg`` and ``exp_avg_sq``) and its buffers must match single-device training
    on the full batches (float64-anchored: the float64 run uses the same optimizer); the
    message names the first step that differs. The check fails when the parameters or the
    optimizer state were not sharded.

    Under a ``MixedPrecisionPolicy`` (read off the ranks' FSDP2 modules) each step is judged
    where it rounds: the step's gradients against the single-device ones computed as FSDP2
    computes them at the same parameters (``param_dtype``'s tolerance), and the parameters
    after it against the optimizer stepping them in their own dtype with those gradients.
    Training with no rounding of the gradients is no fair reference: Adam, for one, moves a
    parameter by its learning rate whichever the sign of a gradient rounding may flip.

    Randomness: as in ``assert_ddp_training_matches``, each rank trains in its own stream
    (seed + rank), its ``nn.Dropout`` masks are recorded in every step and single-device
    training replays them step by step (not under a ``MixedPrecisionPolicy``), and two
    ranks that drew a mask from the same random state fail the check.

    Args:
        batches: one ``(inputs, target)`` pair, or ``(inputs, kwargs, target)`` triple, per
            optimizer step.
        optimizer: picklable factory ``params -> Optimizer``, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``.
        shards: rows per rank, for every batch (default: even per batch).
        step: per-rank forward/backward (default ``fsdp_step``, ``weighted_fsdp_step`` when in
            some batch the ranks hold different numbers of items); the optimizer step is the
            harness's. It shards the module in its first call and runs again on the sharded
            module (``ctx.fsdp()`` returns it).
        <shared: after_backward>
            On the ranks ``ctx.group`` is the group FSDP2 reduce-scatters over, and the
            gradients are DTensors: ``torch.nn.utils.clip_grad_norm_(ctx.module.parameters(),
            max_norm)`` computes the norm over every shard.
        Others: as ``assert_fsdp_grads_match``.

    Raises:
        ParallelMismatch: a rank's parameters differ after some step (the message shows the
            first such step), or the parameters or optimizer state were not sharded.
        ParallelError: a rank raised, died or hung (a step applying ``fully_shard`` again in a
            later step is told to shard once).
    """
    __tracebackhide__ = True
    accepted(assert_fsdp_training_matches, options, FSDPTrainingKeywords, without=("forward_kwargs",))
    after_backward = training_code(optimizer, options.get("after_backward"))
    pairs = describe_batches(batches, {})
    first_inputs, first_kwargs, first_target = pairs[0]
    first = options.copy()
    first["forward_kwargs"] = first_kwargs
    check = FSDPCheck.of(module, first_inputs, first_target, loss_fn, world_size, first)
    step = options.get("step")
    require_step(step, "FSDPContext")
    training = training_batches(check, pairs, options.get("shards"))
    counted, uneven = training.counted, training.uneven
    chosen = step or (weighted_fsdp_step if uneven else fsdp_step)
    task = FSDPTrainingTask(
        check.module, training.pairs, check.loss_fn, optimizer, training.sizes, chosen, check.shard_modules,
        check.reshard_after_forward, item_kinds=tuple(c.kind for c in counted),
        item_counts=tuple(c.per_rank if c.by_tokens else () for c in counted) if any(c.by_tokens for c in counted) else (),
        after_backward=after_backward,
    )
    title = f"{len(pairs)} steps of FSDP2 training with {callable_name(optimizer)} must match single-device training"
    try:
        ranks: tuple[FSDPRankTraining, ...] = check.send(run_fsdp_training_task, task, title)
    except ParallelError as error:
        if _SHARDED_TWICE in str(error):
            error.add_note(
                "dpverify: the step runs once per optimizer step, on the same module: shard it once. "
                "ctx.fsdp(...) does (later calls return the sharded module); a step calling fully_shard "
                "itself must skip it when the module is already an FSDPModule."
            )
        raise
    precision, mixed_failures = _training_precision(ranks)
    stepwise = precision.mixed and not check.tolerance.explicit
    trace: TrainingTrace | None = None
    expected: list[dict[str, torch.Tensor]] = []
    replayed: tuple[str, ...] = ()  # under mixed precision the Dropout masks are not replayed
    if stepwise:
        with _one_rank_group_if(after_backward) as group:
            rows, failing_step = _mixed_training_rows(check, training.pairs, optimizer, precision, ranks, after_backward, group)
    else:
        masks = training_masks(check.module, [rank.dropout for rank in ranks], training.sizes)
        replayed = tuple(dropout_layers(check.module)) if masks is not None else ()
        trace, trace64 = TrainingTrace(), None if check.tolerance.explicit else TrainingTrace()
        expected, _unused = train_single_device(
            check.module, training.pairs, loss_fn, optimizer, None, after_backward, trace=trace, dropout=masks, exact=check.exact,
        )
        anchor = None if trace64 is None else train_single_device(
            check.module, training.pairs, loss_fn, optimizer, torch.float64, after_backward, trace=trace64, dropout=masks,
        )[0]
        jittered = None if trace64 is None else jittered_training(check, training.pairs, optimizer, after_backward, masks)
        rows, failing_step = training_rows(check, ranks, expected, anchor, trace=trace, trace_anchor=trace64, jittered=jittered)
    compared = "Gradients, parameters, buffers and optimizer state" if stepwise else "Parameters, buffers and optimizer state"
    notes = [
        f"{compared} compared after each of the {len(pairs)} optimizer steps; the table shows step {failing_step + 1}.",
        *exact_training_notes(check, len(pairs), optimizer),
    ]
    if after_backward is not None:
        notes.append(f"{callable_name(after_backward)}(ctx) ran after every backward, on every rank and in the single-device run.")
    if replayed:
        notes.append(
            f"Dropout layers {list(replayed)} ran in train mode: in every step each rank drew its masks from its own "
            "random stream (seed + rank), and single-device training applied them, concatenated along the batch in "
            "rank order, in that step's forward."
        )
    ok = all(row.ok for row in rows)
    scale = None
    if not ok and expected:
        initial = {name: p.detach() for name, p in check.module.named_parameters()}
        hook = callable_name(after_backward) if after_backward is not None else None
        factor_note, scale = training_scale_note(
            ranks, expected, initial, failing_step, check.world_size, hook=hook, shards=check.world_size, trace=trace,
        )
        notes += [factor_note] if factor_note else []
        notes += local_buffer_notes(module, rows, FSDP_BUFFER_SYNC)
    if uneven and step is None:
        notes.append("Some batches split unevenly: each rank's loss was weighted by its share of the items, n_r * world_size / B (weighted_fsdp_step).")
    failures, evidence = _sharding_findings(check, [r.held for r in ranks], [r.wrapped for r in ranks], [() for _ in ranks])
    state_failures, state_notes = _state_findings(check.world_size, ranks)
    stream_failures, stream_notes = training_stream_findings(ranks, check.world_size)
    failures += state_failures + mixed_failures + stream_failures
    notes += evidence + state_notes + stream_notes
    if stepwise:
        notes.append(_mixed_precision_note(precision, ranks))
    elif precision.mixed:
        notes.append(
            "Mixed precision (MixedPrecisionPolicy): with explicit rtol and atol the parameters were compared with "
            "full-precision training, within those tolerances."
        )
    if not ok and check.loss_reduction(counted[0]) == "sum":
        notes.append(sum_loss_note(check.world_size))
    outcome = check.outcome(title, chosen, rows, notes=notes, failures=failures, scale=scale, replayed=replayed)
    return raise_unless_ok(outcome, options.get("msg"))


def _one_rank_group_if(after_backward: AfterBackward | None) -> contextlib.AbstractContextManager[Any]:
    """A group of one rank for the single-device reference's hook, only when there is one."""
    return one_rank_group() if after_backward is not None else contextlib.nullcontext()
