"""Public DistributedDataParallel checks: real DDP on real ranks against one device.

Every check sends one task to the ranks of a ``RankRunner`` (a ``DDPWorkerPool``, shared per
world size by default, or the current process group under torchrun), runs the same
scenario on one device in the parent (float32, plus the float64 anchor of the tolerance),
and compares each rank's tensors with the single-device ones through the Core comparison,
so that messages read like the DataParallel ones; a tensor that fails is compared again with
the rounding a correct DDP step makes (``DDPReferences``). See docs/semantics.md, DistributedDataParallel.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpverify.checks.dp import Check, raise_unless_ok, require_loss_fn
from dpverify.core.comparison import (
    Msg,
    StepComparison,
    TensorComparison,
    Terms,
    Tolerance,
    compare_tensors,
    step_comparison,
    uniform_scale,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.items import Items
from dpverify.core.numerics import max_abs
from dpverify.core.step import (
    Key,
    StepResult,
    as_inputs,
    batch_size_of,
    convert_tensors,
    copy_module,
    default_dtype,
    first_parameter_dtype,
    flatten_tensors,
    parameter_sites,
    run_step,
)
from dpverify.core.validation import (
    require_arguments_fit,
    require_callable,
    require_int_at_least,
    require_mapping,
    require_module_with_grads,
    require_target_rows,
)
from dpverify.ddp.items import PieceItems, count_piece_items, require_items
from dpverify.ddp.pool import ParallelError, RankRunner, require_picklable, shared_pool
from dpverify.ddp.rank import (
    BufferTask,
    RankBuffers,
    Step,
    StepTask,
    TrainingTask,
    ddp_step,
    micro_mean_accumulation_step,
    no_sync_accumulation_step,
    run_buffer_task,
    run_step_task,
    run_training_task,
    weighted_ddp_step,
)
from dpverify.ranked.rank import (
    LossFn,
    OptimizerFactory,
    RankStep,
    RankTraining,
    even_shards,
    shard_bounds,
    take_rows,
)

__all__ = [
    "assert_ddp_accumulation_matches",
    "assert_ddp_buffers_match",
    "assert_ddp_grads_match",
    "assert_ddp_sync_batchnorm_matches",
    "assert_ddp_training_matches",
    "assert_dp_ddp_agree",
]

CPU = torch.device("cpu")
_T = TypeVar("_T")
_RESERVED_DDP_KWARGS = ("module", "device_ids", "output_device", "process_group")


# --------------------------------------------------------------------------- validation


def _trainable_module(module: Any) -> nn.Module:
    """The module, once it is known to have a parameter that requires grad."""
    return require_module_with_grads(
        module,
        why="DistributedDataParallel refuses such a module, and there is no gradient to compare",
    )


def _trainable_names(module: nn.Module) -> frozenset[str]:
    """Qualified names (as in the gradient dictionaries) of the parameters that require grad."""
    return frozenset(
        name for name, path, attr in parameter_sites(module)
        if getattr(module.get_submodule(path)._parameters[attr], "requires_grad", False)
    )


def _unused_names(module: nn.Module, grads: Mapping[str, torch.Tensor | None]) -> list[str]:
    """Parameters that require grad but got none on one device: they take no part in the
    loss. A frozen parameter has no gradient either, but DDP ignores it."""
    trainable = _trainable_names(module)
    return [name for name, grad in grads.items() if grad is None and name in trainable]


def _runner(pool: RankRunner | None, world_size: int) -> RankRunner:
    if pool is None:
        return shared_pool(world_size)
    if not callable(getattr(pool, "run", None)):
        raise InvalidArgument(f"pool={pool!r} has no run(); pass a DDPWorkerPool or None")
    if pool.world_size != world_size:
        raise InvalidArgument(
            f"pool has world_size {pool.world_size} but world_size={world_size}; pass a pool "
            f"of {world_size} ranks, or pool=None to use the shared one"
        )
    return pool


def _shards(shards: Sequence[int] | None, batch_size: int, world_size: int) -> tuple[int, ...]:
    if shards is None:
        return even_shards(batch_size, world_size)
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
        raise InvalidArgument(f"shards={shards!r}: pass one row count per rank, e.g. [3, 2]")
    sizes = tuple(shards)
    if len(sizes) != world_size:
        raise InvalidArgument(
            f"shards={list(sizes)} has {len(sizes)} entries for world_size={world_size}; "
            "pass one row count per rank"
        )
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgument(
                f"shards={list(sizes)} contains {size!r}; every rank needs an int >= 1 rows "
                "(a rank without rows has no mean loss)"
            )
    if sum(sizes) != batch_size:
        raise InvalidArgument(
            f"shards={list(sizes)} sums to {sum(sizes)} but the batch has {batch_size} rows; "
            "the shards must cover the batch exactly"
        )
    return sizes


def _sendable(value: Any, name: str, expected: str) -> None:
    """A callable the ranks can unpickle (by name: a top-level function or a partial of one)."""
    require_callable(value, name, expected)
    require_picklable(value, name)


def _step(step: Step | None) -> None:
    """A custom step, when given, is a callable the ranks can unpickle."""
    if step is not None:
        _sendable(step, "step", "a top-level function step(ctx: ShardContext)")


def _ddp_kwargs(ddp_kwargs: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """The keyword arguments each rank gives DistributedDataParallel, as sorted pairs; the
    ones each rank sets for itself are refused, and the rest must pickle to reach the ranks."""
    if ddp_kwargs is None:
        return ()
    kwargs = require_mapping(ddp_kwargs, "ddp_kwargs", "{'find_unused_parameters': True}")
    for key in kwargs:
        if key in _RESERVED_DDP_KWARGS:
            raise InvalidArgument(
                f"ddp_kwargs[{key!r}] is set by each rank (its own device and the default "
                "process group); leave it out"
            )
    require_picklable(dict(kwargs), "ddp_kwargs")
    return tuple(sorted(kwargs.items()))


def _forward_kwargs(forward_kwargs: Mapping[str, Any] | None, argument: str = "forward_kwargs") -> dict[str, Any]:
    """The keyword forward arguments, checked: a mapping with string keys that pickles."""
    if forward_kwargs is None:
        return {}
    kwargs = dict(require_mapping(forward_kwargs, argument, "{'input_ids': ids}"))
    for key in kwargs:
        if not isinstance(key, str):
            raise InvalidArgument(f"{argument} has the key {key!r}; keyword arguments are named by strings")
    require_picklable(kwargs, argument)
    return kwargs


def _name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        kwargs = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
        return f"{_name(fn.func)}({kwargs})"
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def validated_call(
    module: nn.Module, inputs: Any, target: Any, loss_fn: LossFn, forward_kwargs: Mapping[str, Any] | None,
) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """The positional and keyword forward arguments of a ranked check and the batch's rows,
    every argument checked the same way for DDP, FSDP2 and tensor parallelism: a list of
    arguments meant as a tuple, a target of other rows, a loss that is not callable, and
    anything that cannot be pickled to the ranks."""
    kwargs = _forward_kwargs(forward_kwargs)
    require_arguments_fit(module, inputs)
    args = as_inputs(inputs, keywords=bool(kwargs))
    batch = batch_size_of(args, kwargs=kwargs)
    require_target_rows(target, batch)
    require_loss_fn(loss_fn)
    require_picklable(loss_fn, "loss_fn")
    require_picklable(module, "module")
    require_picklable(args, "inputs")
    require_picklable(target, "target")
    return args, kwargs, batch


@dataclass(frozen=True)
class DDPCheck:
    """A validated DDP scenario: module, batch, shards, where it runs and how it compares."""

    module: nn.Module
    args: tuple[Any, ...]
    target: Any
    loss_fn: LossFn
    world_size: int
    shard_sizes: tuple[int, ...]
    runner: RankRunner
    tolerance: Tolerance
    dtype: torch.dtype
    ddp_kwargs: tuple[tuple[str, Any], ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        module: nn.Module,
        inputs: Any,
        target: Any,
        *,
        loss_fn: LossFn,
        world_size: int,
        shards: Sequence[int] | None = None,
        pool: RankRunner | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        ddp_kwargs: Mapping[str, Any] | None = None,
        forward_kwargs: Mapping[str, Any] | None = None,
    ) -> DDPCheck:
        _trainable_module(module)
        world = require_int_at_least(world_size, "world_size", 1)
        args, kwargs, batch = validated_call(module, inputs, target, loss_fn, forward_kwargs)
        return cls(
            module=module,
            args=args,
            target=target,
            loss_fn=loss_fn,
            world_size=world,
            shard_sizes=_shards(shards, batch, world),
            runner=_runner(pool, world),
            tolerance=Tolerance(rtol=rtol, atol=atol),
            dtype=first_parameter_dtype(module),
            ddp_kwargs=_ddp_kwargs(ddp_kwargs),
            kwargs=kwargs,
        )

    @property
    def batch_size(self) -> int:
        return sum(self.shard_sizes)

    @property
    def uneven(self) -> bool:
        return len(set(self.shard_sizes)) > 1

    @property
    def find_unused(self) -> bool:
        return bool(dict(self.ddp_kwargs).get("find_unused_parameters", False))

    @property
    def static_graph(self) -> bool:
        return bool(dict(self.ddp_kwargs).get("static_graph", False))

    def unused_findings(self, unused: Sequence[str], *, wrapped: bool = True) -> tuple[list[str], list[str]]:
        """(failures, notes) for parameters that get no gradient on one device.

        Without ``find_unused_parameters`` (or ``static_graph``) torch's DDP fails on such a
        model whatever the gradients of this step look like: it refuses the next forward. A
        step that never wraps the module in DDP is not concerned.
        """
        if not unused or not wrapped or self.find_unused:
            return [], []
        if self.static_graph:
            return [], [_static_graph_note(unused)]
        return [_unused_failure(unused)], []

    def loss_reduction(self, items: PieceItems | None = None) -> str | None:
        """How ``loss_fn`` reduces on this batch and these shards (``_loss_reduction``):
        over the ranks' items when counted (a token-mean loss is a mean), else their rows."""
        weights = items.per_rank if items is not None else None
        return _loss_reduction(self.module, self.args, self.target, self.loss_fn, self.shard_sizes, self.kwargs, weights)

    def count_items(self, micro_batches: int = 1, items: Items | None = None) -> PieceItems:
        """What each rank's micro-batches' mean losses average over (``count_piece_items``)."""
        return count_piece_items(self.module, self.args, self.kwargs, self.target, self.loss_fn, self.shard_sizes, micro_batches, items)

    def describe(self, step: Step | None = None) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.ddp_kwargs)
        keywords = f" (keyword arguments {sorted(self.kwargs)})" if self.kwargs else ""
        text = (
            f"batch of {self.batch_size} rows{keywords} in contiguous shards {list(self.shard_sizes)} on "
            f"{self.world_size} ranks ({self.runner.backend}); DistributedDataParallel({kwargs})"
        )
        return text if step is None else f"{text}; step {_name(step)}"

    def target_as(self, dtype: torch.dtype | None) -> Any:
        return convert_tensors(self.target, dtype, CPU)

    def reference(self, dtype: torch.dtype | None, *, jitter: float = 0.0) -> StepResult:
        """The single-device full-batch step in ``dtype`` (None: the module's own), from
        parameters perturbed by ``jitter`` (``run_step``) when given."""
        target = self.target_as(dtype)
        loss_fn = self.loss_fn
        return run_step(self.module, self.args, lambda output: loss_fn(output, target), dtype=dtype, jitter=jitter, kwargs=self.kwargs)

    def anchor(self) -> StepResult | None:
        return None if self.tolerance.explicit else self.reference(torch.float64)

    def references(self, micro_batches: int = 1, *, expected: StepResult | None = None, items: PieceItems | None = None) -> DDPReferences:
        """What the ranks' tensors are compared with: the single-device full-batch step
        (or ``expected``, e.g. DataParallel's step) and the float64 anchor, with the
        rounding samples a failing tensor gets (``DDPReferences``). ``micro_batches``: the
        pieces each rank's shard is cut into, as the ranks cut it; ``items``: what each
        piece's loss averages over (default: rows)."""
        return DDPReferences(self, self.reference(None) if expected is None else expected, self.anchor(), micro_batches, items)

    def send(self, fn: Callable[..., Any], task: Any, what: str) -> tuple[Any, ...]:
        try:
            return self.runner.run(fn, task)
        except ParallelError as error:
            error.add_note(f"dpverify: raised by the ranks of: {what}. Scenario: {self.describe()}.")
            if _UNFINISHED_REDUCTION in str(error):
                error.add_note(_UNUSED_HINT)
            raise

    def step_task(self, steps: Sequence[Step], items: PieceItems | None = None, **options: Any) -> StepTask:
        """The ranks' task: ``steps`` on this batch, with the items ``items`` counted
        (``ShardContext.item_counts``; rows when None)."""
        return StepTask(
            module=self.module,
            inputs=self.args,
            target=self.target,
            loss_fn=self.loss_fn,
            shard_sizes=self.shard_sizes,
            steps=tuple(steps),
            ddp_kwargs=self.ddp_kwargs,
            kwargs=self.kwargs,
            item_kind=items.kind if items is not None else "rows",
            item_counts=items.counts if items is not None else (),
            **options,
        )

    def rows(self, label: str, actual: RankStep, refs: DDPReferences, rank: int, *, contrast: bool = False) -> list[TensorComparison]:
        """This rank's outputs (its rows of the full-batch output) and gradients. A
        ``contrast`` is expected to differ: it gets no second look (``DDPReferences.compare``)."""
        found: list[TensorComparison] = []
        start, stop = shard_bounds(self.shard_sizes)[rank]
        mine = dict(actual.outputs)
        for path, tensor in refs.expected.outputs:
            if path not in mine or tensor.dim() == 0 or tensor.size(0) != self.batch_size:
                continue
            found.append(refs.compare(f"{label}{path}[{start}:{stop}]", mine[path], Key.output(path, (start, stop)), contrast=contrast))
        for name in refs.expected.grads:
            found.append(refs.compare(f"{label}grad {name!r}", actual.grads.get(name), Key.grad(name), name, contrast=contrast))
        return found

    def outcome(
        self,
        title: str,
        step: Step | None,
        rows: Sequence[TensorComparison],
        *,
        contrasts: Sequence[TensorComparison] = (),
        notes: Sequence[str] = (),
        failures: Sequence[str] = (),
        divergence: bool = True,
        scale: float | None = None,
    ) -> StepComparison:
        return step_comparison(
            title, self.describe(step), self.tolerance, self.dtype, self.module, rows,
            contrasts=contrasts, notes=notes, failures=failures, scale=scale, divergence=divergence,
        )




# Relative size of the parameter perturbation of a float64 model's jittered run, as in the
# DataParallel checks (dpverify/checks/dp.py): a few units of float64 roundoff, the size of
# the rounding a step makes in each parameter use.
_JITTER = 8 * torch.finfo(torch.float64).eps


@dataclass(frozen=True)
class _Rounding:
    """What measures the rounding of a correct DDP step beyond the single-device step's own
    (see ``DDPReferences``): the terms of every gradient, and two more single-device runs."""

    terms: dict[str, Terms]
    probe: StepResult | None
    jitter: StepResult | None


@dataclass
class DDPReferences:
    """The single-device tensors a DDP check compares the ranks' with, and a second look
    for the tensors that fail against them.

    ``expected`` is the full-batch step in the working dtype (DataParallel's step for
    ``assert_dp_ddp_agree``) and ``anchor`` its float64 twin (None with explicit
    tolerances). That alone misjudges two things a correct DDP step does. Its all-reduce
    sums the ranks' gradients, ``n_r / B`` times each rank's mean-loss gradient (and each
    rank sums its micro-batches' first): where those terms cancel (an l1 loss's sign
    gradients summing to an exact 0), the result carries rounding of the size of the
    terms, not of the near-zero total. And in float64 the anchor is the single-device step
    itself, so the rounding of the model cannot be measured against it. So a tensor that
    fails is compared again as the DataParallel checks compare theirs: with ``terms``
    (``sum over pieces of n / B * max |g_piece|``, and the same in the 2-norm, each piece's
    gradient from a single-device step on its rows), and with a float32 ``probe`` and a
    jittered float64 run for float64 models, or a working-dtype run from parameters one
    unit in the last place off for other dtypes. These steps run once per check, and only
    when a tensor fails: a passing check never pays for them.
    """

    check: DDPCheck
    expected: StepResult
    anchor: StepResult | None
    micro_batches: int = 1
    items: PieceItems | None = None
    _rounding: list[_Rounding] = field(default_factory=list, repr=False)

    def compare(
        self, name: str, actual: torch.Tensor | None, key: Callable[[StepResult], torch.Tensor | None], grad: str | None = None, *, contrast: bool = False,
    ) -> TensorComparison:
        """``actual`` against the tensor ``key`` picks; ``grad``: the parameter whose
        gradient it is (the terms apply to gradients only). A ``contrast`` is expected to
        differ and gets no second look."""
        expected = key(self.expected)
        anchor = key(self.anchor) if self.anchor is not None else None
        first = compare_tensors(name, actual, expected, anchor, self.check.tolerance)
        if first.ok or first.problem is not None or contrast or self.anchor is None:
            return first
        second = self.rounding()
        return compare_tensors(
            name, actual, expected, anchor, self.check.tolerance,
            probe=key(second.probe) if second.probe is not None else None,
            terms=second.terms.get(grad) if grad is not None else None,
            jitter=key(second.jitter) if second.jitter is not None else None,
        )

    def rounding(self) -> _Rounding:
        """The second look's steps (``DDPReferences``), run once, on first need."""
        if not self._rounding:
            check = self.check
            wide = check.dtype == torch.float64
            probe = _optional(lambda: check.reference(torch.float32)) if wide else None
            if wide:
                jitter = _optional(lambda: check.reference(torch.float64, jitter=_JITTER))
            else:
                jitter = _optional(lambda: check.reference(None, jitter=torch.finfo(check.dtype).eps))
            terms = _optional(lambda: _all_reduce_terms(check, self.micro_batches, self.items)) or {}
            self._rounding.append(_Rounding(terms, probe, jitter))
        return self._rounding[0]


def _optional(run: Callable[[], _T]) -> _T | None:
    """``run()``, or None when it raises: a second look that cannot be had (a BatchNorm
    given a one-row shard, a loss that refuses float32) leaves the first verdict standing."""
    try:
        return run()
    except Exception:
        return None


def _loss_against(loss_fn: LossFn, target: Any, output: Any) -> torch.Tensor:
    return loss_fn(output, target)


def _all_reduce_terms(check: DDPCheck, micro_batches: int, items: PieceItems | None = None) -> dict[str, Terms]:
    """The magnitude of what a correct DDP step sums into every gradient: each rank's
    shard, cut into ``micro_batches`` pieces as the ranks cut it (``micro_batch_split``),
    contributes ``t / T`` times its piece's mean-loss gradient (each piece's loss weighted
    by its share of the items, ``t * world_size / T``, rows or tokens, the all-reduce's
    average dividing by ``world_size``). Measured with a single-device step on each
    piece's rows, in the working dtype."""
    largest: dict[str, float] = {}
    norms: dict[str, float] = {}
    batch = check.batch_size
    target = check.target_as(None)
    loss_fn = check.loss_fn
    total = items.total if items is not None else batch
    for rank, (start, stop) in enumerate(shard_bounds(check.shard_sizes)):
        rows = stop - start
        shard, shard_target = take_rows(check.args, start, stop, batch), take_rows(target, start, stop, batch)
        shard_kwargs = take_rows(check.kwargs, start, stop, batch)
        for piece, (low, high) in enumerate(shard_bounds(even_shards(rows, micro_batches))):
            loss = functools.partial(_loss_against, loss_fn, take_rows(shard_target, low, high, rows))
            step = run_step(check.module, take_rows(shard, low, high, rows), loss, kwargs=take_rows(shard_kwargs, low, high, rows))
            weight = (items.counts[rank][piece] if items is not None else high - low) / total
            for name, grad in step.grads.items():
                if grad is None or not grad.numel():
                    continue
                dense = grad.to_dense() if grad.is_sparse else grad
                size, norm = max_abs(dense), float(torch.linalg.vector_norm(dense))
                if math.isfinite(size) and math.isfinite(norm):
                    largest[name] = largest.get(name, 0.0) + weight * size
                    norms[name] = norms.get(name, 0.0) + weight * norm
    return {name: Terms(largest[name], norms[name]) for name in largest}


_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"

_UNUSED_HINT = (
    "dpverify: 'Expected to have finished reduction in the prior iteration' means some "
    "parameters got no gradient in the previous step: without find_unused_parameters=True, "
    "DDP waits for them and never reduces their bucket. Pass "
    "ddp_kwargs={'find_unused_parameters': True} (dpverify check: --ddp-kwargs find_unused_parameters=true), or make every parameter take part in the loss."
)


# --------------------------------------------------------------------------- diagnosis


def _explain_scale(
    c: float, world_size: int, micro_batches: int = 1, shard_size: int | None = None, reduction: str | None = None,
    averager: str = "DDP",
) -> str:
    """A sentence on a uniform gradient factor between a rank and one device, naming every
    classic mistake that produces that factor (2 can be the world size and the rows per rank).

    Each factor is what torch's DDP gives (it averages the ranks' gradients) for the mistake
    named, with ``reduction`` (``_loss_reduction``) telling a sum loss from a mean one:

    - ``k`` micro-batches: mean losses of the micro-batches added up, not divided by ``k``;
    - ``W``: the ranks' gradients summed and not averaged, or a mean loss times ``W``;
    - ``n`` rows per rank: a step that sums its rows' losses while ``loss_fn`` averages;
    - ``1/W``: a sum loss (each rank sums its ``n`` rows, DDP divides by ``W``: the average is
      ``1/W`` of the full-batch sum), or a mean loss divided by ``W`` on top of DDP;
    - ``1/(k W)``: a sum loss whose micro-batch losses were weighted by ``1/k``, as the
      mean-loss recipe does.

    ``averager`` names what averages the ranks' gradients in the text (FSDP2's
    reduce-scatter averages as DDP's all-reduce does).
    """
    text = f"Every rank's gradient is {c:.6g} times the single-device full-batch gradient"

    def near(value: float) -> bool:
        return abs(c - value) < 1e-3 * value

    summed = reduction == "sum"
    causes = []
    if micro_batches > 1 and near(micro_batches) and not summed:
        causes.append(
            f"({micro_batches}, the number of micro-batches): each micro-batch's loss must be "
            f"divided by {micro_batches} (weighted by its rows * world_size / B), or the "
            "accumulated gradient is the sum of the micro-batch means"
        )
    if world_size > 1 and near(world_size) and not summed:
        causes.append(
            f"({world_size}, the world size): the ranks' gradients were summed but not divided "
            f"by the world size. {averager} averages for you; a hand-written all_reduce with "
            "ReduceOp.SUM must be followed by grad /= world_size, and a loss must not be "
            f"multiplied by the world size on top of the average {averager} takes"
        )
    if shard_size and shard_size > 1 and near(shard_size) and not summed:
        causes.append(
            f"({shard_size}, the rows per rank): the step's loss is the sum over the rank's "
            "rows (or its mean times the rows) while loss_fn, which the single-device step "
            "uses, averages: divide the step's loss by its rows (ctx.shard_size), or use "
            f"loss_fn as it is; {averager} then averages the ranks"
        )
    if world_size > 1 and near(1.0 / world_size):
        if reduction != "mean":
            unweighted = " and the micro-batch losses were added up unweighted" if micro_batches > 1 else ""
            causes.append(
                f"(1/{world_size}, one over the world size): "
                + ("loss_fn is a sum-reduction loss (the full batch's loss is the sum of the shards' losses)" if summed else "a sum-reduction loss (e.g. reduction='sum')")
                + f"{unweighted}. Each rank's loss sums its own rows, and "
                f"{averager} divides the sum of the ranks' gradients by the world size, {world_size}, "
                "so every rank gets 1/world_size of the full-batch sum that one device computes. "
                "Use a mean loss (reduction='mean'); or keep the sum and multiply each rank's "
                "loss by world_size (loss * ctx.world_size in a step); DataParallel, which sums "
                "its replicas' gradients, gives the single-device gradient for the same sum loss"
            )
        if not summed:
            causes.append(
                f"(1/{world_size}, one over the world size): the gradients were divided by the "
                "world size twice, e.g. a mean loss divided by world_size (or a hand-written "
                f"average) on top of {averager}, which already averages over ranks"
            )
    if world_size > 1 and micro_batches > 1 and near(1.0 / (world_size * micro_batches)) and reduction != "mean":
        causes.append(
            f"(1/{world_size * micro_batches} = 1/(micro-batches * world size)): "
            f"a sum-reduction loss with each micro-batch's loss weighted by its share "
            f"(1/{micro_batches}, the recipe for a mean loss): each rank's gradient is "
            f"1/{micro_batches} of the sum over its rows, and {averager} divides by the world size, "
            f"{world_size}. Use a mean loss; or keep the sum, add the micro-batch losses up "
            "unweighted and multiply them by world_size"
        )
    if not causes:
        return text + "."
    return text + " " + "; or ".join(causes) + "."


def _unused_failure(unused: Sequence[str]) -> str:
    return (
        f"Parameters {list(unused)} get no gradient (they take no part in the loss; on one "
        "device their .grad stays None), and DistributedDataParallel runs without "
        "find_unused_parameters=True: it waits for their gradients, so the step's all-reduce "
        "never completes (the ranks' gradients are not averaged), and the next forward raises "
        "'Expected to have finished reduction in the prior iteration before starting a new "
        "one'. Pass ddp_kwargs={'find_unused_parameters': True} (dpverify check: --ddp-kwargs "
        "find_unused_parameters=true; their .grad then stays None "
        "on every rank, as on one device), or make them take part in the loss, or freeze them "
        "with requires_grad_(False)."
    )


def _static_graph_note(unused: Sequence[str]) -> str:
    return (
        f"Parameters {list(unused)} get no gradient on one device. DistributedDataParallel("
        "static_graph=True) copes with parameters the forward never uses, but (torch 2.13) "
        "not with a module output that the loss leaves out: from the second step on, the "
        "gradients are no longer averaged. If a later step fails, pass "
        "ddp_kwargs={'find_unused_parameters': True} instead."
    )


def _unused_training_error(error: ParallelError, unused_by_step: Sequence[Sequence[str]], check: DDPCheck) -> ParallelError | None:
    """torch's 'Expected to have finished reduction' on the ranks, retold: which parameters,
    from which step, and the fix. None when one device shows no parameter without gradient
    (the cause is then on the ranks only, e.g. a branch that only some ranks take)."""
    text = str(error)
    if _UNFINISHED_REDUCTION not in text or check.find_unused:
        return None
    first = next((index for index, names in enumerate(unused_by_step) if names), None)
    if first is None:
        return None
    names = list(unused_by_step[first])
    found = re.search(r"dpverify: raised in optimizer step (\d+)", text)
    where = f"at the forward of step {found.group(1)}" if found else "at a later forward"
    ranks = [f.rank for f in error.failures if f.kind == "raised"]
    head = (
        f"DDP training failed {where}: ranks {ranks} raised torch's 'Expected to have finished "
        f"reduction in the prior iteration before starting a new one', because parameters "
        f"{names} get no gradient in step {first + 1} (they take no part in the loss; on one "
        "device their .grad stays None). Without find_unused_parameters=True, "
        "DistributedDataParallel waits for their gradients, never completes that step's "
        "all-reduce, and refuses the next forward. Pass "
        "ddp_kwargs={'find_unused_parameters': True} (dpverify check: --ddp-kwargs "
        "find_unused_parameters=true), or make every parameter take part in the loss, or freeze the unused ones with requires_grad_(False)."
    )
    ranks_text = "\n".join(f"  rank {f.rank} {f.summary}" for f in error.failures)
    body = (
        f"{head}\n\nWhat the ranks reported (tracebacks in .failures):\n{ranks_text}\n\n"
        f"Scenario: {check.describe()}."
    )
    return ParallelError(body, error.failures)


# --------------------------------------------------------------------------- loss reduction


def _loss_reduction(
    module: nn.Module, args: tuple[Any, ...], target: Any, loss_fn: LossFn, shard_sizes: Sequence[int],
    kwargs: Mapping[str, Any] | None = None, weights: Sequence[int] | None = None,
) -> str | None:
    """``"sum"`` when ``loss_fn`` adds up its rows' losses, ``"mean"`` when it averages them,
    None when this batch does not tell (one shard, a zero loss, a loss that is neither).

    Measured on one device, in float64, on slices of one full-batch output: the loss of the
    whole batch is compared with the sum and with the mean of the shards' losses weighted
    by ``weights`` (their items, e.g. tokens; default their rows). Slicing one output keeps
    layers that mix rows (BatchNorm) out of the question.
    """
    batch = sum(shard_sizes)
    if len(shard_sizes) < 2:
        return None
    counts = list(weights) if weights is not None else list(shard_sizes)
    if len(counts) != len(shard_sizes) or sum(counts) <= 0:
        return None
    try:
        model = copy_module(module, torch.float64)
        inputs = convert_tensors(args, torch.float64, CPU)
        keywords = convert_tensors(dict(kwargs or {}), torch.float64, CPU)
        wanted = convert_tensors(target, torch.float64, CPU)
        with torch.no_grad(), torch.random.fork_rng(devices=[]), default_dtype(torch.float64):
            torch.manual_seed(0)
            output = model(*inputs, **keywords)
            full = float(loss_fn(output, wanted))
            parts = [
                float(loss_fn(take_rows(output, start, stop, batch), take_rows(wanted, start, stop, batch)))
                for start, stop in shard_bounds(shard_sizes)
            ]
    except Exception:  # a loss that cannot take a slice tells nothing; the check goes on
        return None
    summed = math.fsum(parts)
    mean = math.fsum(n * part for n, part in zip(counts, parts, strict=True)) / sum(counts)
    scale = max(abs(full), abs(summed), abs(mean))
    if not math.isfinite(scale) or scale == 0.0:
        return None
    is_sum, is_mean = abs(full - summed) <= 1e-9 * scale, abs(full - mean) <= 1e-9 * scale
    if is_sum and not is_mean:
        return "sum"
    if is_mean and not is_sum:
        return "mean"
    return None


def _sum_loss_note(world_size: int, averager: str = "DDP") -> str:
    return (
        "loss_fn sums over the rows (the full batch's loss is the sum of the shards' losses, "
        f"not their mean, e.g. reduction='sum'). {averager} averages the ranks' gradients, which is "
        "right for a mean loss; with a sum loss each rank sums only its own rows and the "
        f"average divides by the world size, {world_size}, so the gradients are not the "
        "single-device ones. Use a mean loss; or keep the sum and multiply each rank's loss by "
        "world_size (loss * ctx.world_size in a step, instead of ctx.loss_weight); "
        "DataParallel, which sums its replicas' gradients, gives the single-device gradient "
        "for the same sum loss."
    )


def _ranks_disagree(steps: Sequence[RankStep]) -> list[str]:
    first = steps[0].grads
    for rank, step in enumerate(steps[1:], start=1):
        for name, grad in first.items():
            other = step.grads.get(name)
            if (grad is None) != (other is None) or (grad is not None and other is not None and not torch.equal(grad, other)):
                return [
                    f"Rank 0 and rank {rank} hold different gradients for {name!r} after the "
                    "step: the gradients were not all-reduced (a step that neither uses "
                    "ctx.ddp() nor all-reduces by hand, or a bucket DDP never reduced)."
                ]
    return []


def _scale_note(
    steps: Sequence[RankStep], expected: StepResult, world_size: int, micro_batches: int = 1,
    shard_sizes: Sequence[int] = (), reduction: str | None = None, averager: str = "DDP",
) -> tuple[list[str], float | None]:
    """The uniform factor's sentence, and the sum-loss note when the factor did not name it;
    and the factor. ``averager``: what averages the ranks' gradients, in the text."""
    c = uniform_scale(steps[0].grads, expected.grads)
    equal = shard_sizes[0] if shard_sizes and len(set(shard_sizes)) == 1 else None
    notes = [] if c is None else [_explain_scale(c, world_size, micro_batches, equal, reduction, averager)]
    if reduction == "sum" and not any("sum-reduction loss" in note for note in notes):
        notes.append(_sum_loss_note(world_size, averager))
    return notes, c


def _relative_gap(actual: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None]) -> float:
    worst = 0.0
    for name, ref in reference.items():
        got = actual.get(name)
        if ref is None or got is None:
            continue
        scale = float(ref.double().abs().max()) if ref.numel() else 0.0
        if scale > 0:
            worst = max(worst, float((got.double() - ref.double()).abs().max()) / scale)
    return worst


def _trap_note(check: DDPCheck, naive: Sequence[RankStep], reference: StepResult) -> str:
    """The loss-averaging trap under DDP, with the bias the plain step really had."""
    sizes, batch, world = check.shard_sizes, check.batch_size, check.world_size
    weights = ", ".join(f"1/{world * n}" for n in sizes)
    factors = ", ".join(f"{n * world / batch:.4g}" for n in sizes)
    text = (
        f"Uneven shards {list(sizes)}: DDP averages the ranks' gradients, so a per-rank mean "
        f"loss gives each sample of rank r the weight 1/(world_size * n_r) = [{weights}] "
        f"instead of 1/B = 1/{batch} (the loss-averaging trap)."
    )
    losses = [step.loss for step in naive]
    if all(loss is not None for loss in losses):
        mean_of_means = sum(loss for loss in losses if loss is not None) / world
        full = float(reference.loss)
        text += (
            f" With the plain step (ddp_step) the ranks' mean losses average to "
            f"{mean_of_means:.8g} against the full batch's {full:.8g} (bias "
            f"{mean_of_means - full:+.3g}),"
        )
    gap = _relative_gap(naive[0].grads, reference.grads)
    text += (
        f" and its gradients differ from the full-batch gradients by up to {gap:.3g} "
        f"(relative). Exact for any shards: multiply each rank's loss by "
        f"n_r * world_size / B = [{factors}] (ctx.loss_weight; weighted_ddp_step)."
    )
    return text


def _fraction(value: float) -> str:
    """``8`` for 8.0, ``8.5`` for 8.5: the denominator of a weight ``1/value``."""
    return str(round(value)) if abs(value - round(value)) < 1e-9 else f"{value:.4g}"


def _token_trap_note(check: DDPCheck, items: PieceItems, naive: Sequence[RankStep], reference: StepResult) -> str:
    """The loss-averaging trap under DDP when each rank's loss is a mean over its tokens:
    the counts, the weights plain ``ddp_step`` gives, the bias it had and the bias the
    counts predict, and the exact recipe."""
    world, counts, total = check.world_size, items.per_rank, items.total
    noun = items.noun
    equal_rows = ", although the shards have equal rows" if not check.uneven else ""
    weights = ", ".join(f"1/{_fraction(world * t)}" for t in counts)
    factors = ", ".join(f"{t * world / total:.4g}" for t in counts)
    text = (
        f"Each rank's loss is a mean over its {noun}: {list(counts)}{items.detail}, {total} in "
        f"all, on shards {list(check.shard_sizes)}{equal_rows}. DDP averages the ranks' "
        f"gradients, so a per-rank mean loss gives each of rank r's {noun} the weight "
        f"1/(world_size * t_r) = [{weights}] instead of 1/T = 1/{total} (the loss-averaging trap)."
    )
    predicted = items.predicted_rank_bias()
    said = f"; the {items.singular} counts predict {predicted:+.3g}" if predicted is not None else ""
    losses = [step.loss for step in naive]
    facts = []
    if losses and all(loss is not None for loss in losses):
        mean_of_means = sum(loss for loss in losses if loss is not None) / world
        full = float(reference.loss)
        facts.append(
            f"the ranks' mean losses average to {mean_of_means:.8g} against the full batch's "
            f"{full:.8g} (bias {mean_of_means - full:+.3g}{said})"
        )
    elif predicted is not None:
        facts.append(f"the {items.singular} counts predict a bias of {predicted:+.3g} in the average of the ranks' mean losses")
    facts.append(f"its gradients differ from the full-batch gradients by up to {_relative_gap(naive[0].grads, reference.grads):.3g} (relative)")
    text += (
        " With the plain step (ddp_step) " + ", and ".join(facts) + ". "
        f"Exact: multiply each rank's mean loss by its share of the {noun}, t_r * world_size / T "
        f"= [{factors}] (ctx.loss_weight; weighted_ddp_step), or all-reduce the {items.singular} count and "
        f"divide each rank's summed loss by it (ctx.total_items), times world_size. Weighting by "
        "rows (n_r * world_size / B) is not exact here."
    )
    return text


def _accumulation_trap_note(check: DDPCheck, items: PieceItems, micro_batches: int, plain: Sequence[RankStep], reference: StepResult) -> str:
    """Dividing each micro-batch's mean loss by the number of micro-batches, when the
    micro-batches hold different numbers of items: the weights, the bias the counts
    predict, how far its gradients are, and the exact recipe."""
    world, total, noun = check.world_size, items.total, items.noun
    pieces = [list(rank) for rank in items.counts]
    weights = ", ".join(f"1/{_fraction(world * micro_batches * t)}" for t in items.flat)
    text = (
        f"The micro-batches hold different numbers of {noun}: {pieces}{items.detail} per rank, "
        f"{total} in all. Dividing each micro-batch's mean loss by the number of micro-batches, "
        f"{micro_batches} (micro_mean_accumulation_step), gives each of micro-batch p's {noun} "
        f"the weight 1/(world_size * {micro_batches} * t_p) = [{weights}] instead of 1/T = "
        f"1/{total} (the loss-averaging trap)."
    )
    predicted = items.predicted_piece_bias()
    facts = [f"the {items.singular} counts predict a bias of {predicted:+.3g} in the loss it optimises"] if predicted is not None else []
    if plain:
        facts.append(f"its gradients differ from the full-batch gradients by up to {_relative_gap(plain[0].grads, reference.grads):.3g} (relative)")
    if facts:
        text += " Here " + ", and ".join(facts) + "."
    text += (
        f" Exact: weight each micro-batch's mean loss by t_p * world_size / T (part.items * "
        f"ctx.world_size / ctx.total_items; no_sync_accumulation_step), that is divide its summed "
        f"loss by the total count over every micro-batch and rank, not by {micro_batches}."
    )
    return text


def _items_notes(items: PieceItems, trap: bool) -> list[str]:
    """What the ranks' losses average over, when it is not rows and no trap note says it;
    and, for counts given by ``items=``, whether the evidence bears them out."""
    notes = []
    given = items.given_note()
    if items.by_tokens and not trap and given is None:
        micro = len(items.counts[0]) > 1
        counts = [list(c) for c in items.counts] if micro else list(items.per_rank)
        notes.append(
            f"Each {'micro-batch' if micro else 'rank'}'s loss is a mean over its {items.noun}: "
            f"{counts}{items.detail}{' per rank' if micro else ''}; they hold equal numbers, so "
            "averaging their mean losses is exact here."
        )
    if given is not None:
        notes.append(given)
    return notes


def _same_up_to_rounding(actual: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None]) -> bool:
    """Whether two sets of float32 gradients agree to about 1e-4 of their scale: enough to
    tell a step that reproduces another (a known mistake) from one that does not."""
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or want is None:
            present = got if got is not None else want
            if present is not None and bool(present.any()):
                return False
            continue
        scale = float(want.double().abs().max()) if want.numel() else 0.0
        if want.numel() and float((got.double() - want.double()).abs().max()) > 1e-4 * scale + 1e-30:
            return False
    return True


# --------------------------------------------------------------------------- gradients


def assert_ddp_grads_match(
    module: nn.Module,
    inputs: Any,
    target: Any,
    *,
    loss_fn: LossFn,
    world_size: int,
    shards: Sequence[int] | None = None,
    step: Step | None = None,
    pool: RankRunner | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    items: Items | None = None,
) -> StepComparison:
    """Asserts one DistributedDataParallel step gives every rank the full-batch gradient.

    The batch is cut into contiguous shards, one per rank; each rank runs ``step`` on its
    shard with a copy of ``module`` (same weights everywhere), and every rank's gradients,
    and its rows of the output, must equal the single-device full-batch step (float64-
    anchored tolerance, as ``assert_dp_grads_match``). ``module`` is left untouched.

    When the ranks hold different numbers of items (uneven shards; or, for a token-level
    loss, different numbers of tokens that are not ignored, even on shards of equal rows),
    DDP's average of per-rank mean losses is biased (the loss-averaging trap): the plain
    step is run and shown for contrast with its bias and the bias the counts predict, and
    the exact recipe, each rank's loss times its share of the items (``ctx.loss_weight``:
    ``n_r * world_size / B``, or ``t_r * world_size / T`` for tokens), is the one verified.

    What each rank's loss averages over is read from the evidence: the rows, unless another
    count, not proportional to the rows, reproduces the full-batch loss from the shards'
    losses (measured on one device) clearly better: the entries of the target, or of an
    integer forward argument, that are not an ignore index (-100, or the ``ignore_index``
    of ``loss_fn`` or of a loss module in ``module``), whole or shifted by one for a causal
    language model. ``items`` counts them instead.

    Args:
        module: the model to check.
        inputs: the batch tensor, or a tuple of positional forward arguments; ``()`` for a
            keyword-only forward (the batch in ``forward_kwargs``).
        target: the second argument of ``loss_fn`` (sharded like the batch).
        loss_fn: ``loss_fn(output, target)`` returns a scalar mean loss (over rows, or over
            tokens); picklable.
        world_size: number of ranks.
        shards: rows per rank (default: as even as possible, the first ranks one more).
        step: the per-rank training step to verify, ``step(ctx: ShardContext)``, picklable
            (a top-level function). It must leave gradients in ``ctx.module``'s parameters,
            through ``ctx.ddp()`` or a hand-written all-reduce. Default: ``ddp_step``, or
            ``weighted_ddp_step`` when the ranks hold different numbers of items.
        pool: the ranks to use (default: the shared pool of ``world_size`` ranks).
        ddp_kwargs: keyword arguments for DistributedDataParallel.
        rtol: explicit relative tolerance (with ``atol``) instead of the anchored rule.
        atol: explicit absolute tolerance (with ``rtol``).
        msg: replaces the failure message, or a callable that rewrites it.
        forward_kwargs: keyword arguments of the forward, ``model(*inputs, **forward_kwargs)``;
            tensors with the batch's rows are sharded along dim 0 like ``inputs``, others
            reach every rank whole. Picklable.
        items: ``items(args, kwargs) -> int``, the items one shard's mean loss averages
            over (its tokens), called in this process on each shard's forward arguments
            with the shard's target appended as the last positional argument (``args[-1]``).
            Default: found from the evidence (see above).

    Returns:
        The comparison (``str()`` summarises it).

    Parameters that require grad but take no part in the loss (an unused layer, a pooler
    whose output the loss ignores) must have ``.grad`` None on every rank, as on one device:
    that needs ``ddp_kwargs={'find_unused_parameters': True}``, and without it the check
    fails naming them (torch's DDP never completes the step's all-reduce and refuses the next
    forward). Frozen parameters (``requires_grad=False``) are ignored by DDP and compared as
    None. A gradient that is uniformly off by a factor gets its likely causes named, among
    them a sum-reduction loss (``1/world_size``: DDP averages the ranks' gradients).

    Raises:
        ParallelMismatch: a rank's gradient or output differs beyond tolerance, or parameters
            get no gradient under DDP without ``find_unused_parameters``.
        ParallelError: a rank raised, died or hung; the pool restarts for the next check.
        InvalidArgument: an argument cannot be used (unpicklable loss or step included), or
            the module has no parameter that requires grad.
    """
    __tracebackhide__ = True
    check = DDPCheck.create(
        module, inputs, target, loss_fn=loss_fn, world_size=world_size, shards=shards,
        pool=pool, rtol=rtol, atol=atol, ddp_kwargs=ddp_kwargs, forward_kwargs=forward_kwargs,
    )
    _step(step)
    counted = check.count_items(1, require_items(items))
    trap = counted.unequal_ranks
    chosen = step or (weighted_ddp_step if trap else ddp_step)
    steps: list[Step] = [chosen, ddp_step] if trap else [chosen]
    title = "DistributedDataParallel gradients must match the single-device full-batch gradient on every rank"
    results = check.send(run_step_task, check.step_task(steps, counted), title)
    verified = [rank_steps[0] for rank_steps in results]
    refs = check.references(items=counted)
    expected, anchor = refs.expected, refs.anchor
    rows = [row for r, s in enumerate(verified) for row in check.rows(f"rank {r} ", s, refs, r)]
    ok = all(row.ok for row in rows)
    notes: list[str] = _items_notes(counted, trap)
    contrasts: list[TensorComparison] = []
    reduction = None if ok else check.loss_reduction(counted)
    if trap:
        naive = [rank_steps[1] for rank_steps in results]
        if reduction != "sum":  # the trap is about per-rank mean losses
            reference = anchor or expected
            notes.append(_token_trap_note(check, counted, naive, reference) if counted.by_tokens else _trap_note(check, naive, reference))
        if step is None:
            contrasts = [c for r, s in enumerate(naive) for c in check.rows(f"rank {r} plain ddp_step ", s, refs, r, contrast=True) if c.name.startswith(f"rank {r} plain ddp_step grad")]
        elif not ok and reduction != "sum" and _same_up_to_rounding(verified[0].grads, naive[0].grads):
            share = f" (t_r * world_size / T, its share of the {counted.noun})" if counted.by_tokens else ""
            notes.append(
                "The step's gradients equal the plain per-rank mean-loss step's: it falls into "
                f"the loss-averaging trap. Multiply the rank's loss by ctx.loss_weight{share}."
            )
    failures, unused_notes = check.unused_findings(_unused_names(module, expected.grads), wrapped=all(s.wrapped for s in verified))
    notes += unused_notes
    scale = None
    if not ok:
        more, scale = _scale_note(verified, expected, check.world_size, shard_sizes=check.shard_sizes, reduction=reduction)
        notes += more + _ranks_disagree(verified)
    return raise_unless_ok(check.outcome(title, chosen, rows, contrasts=contrasts, notes=notes, failures=failures, scale=scale), msg)


# --------------------------------------------------------------------------- accumulation


def assert_ddp_accumulation_matches(
    module: nn.Module,
    inputs: Any,
    target: Any,
    *,
    loss_fn: LossFn,
    world_size: int,
    micro_batches: int,
    shards: Sequence[int] | None = None,
    step: Step | None = None,
    pool: RankRunner | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    items: Items | None = None,
) -> StepComparison:
    """Asserts gradient accumulation with ``no_sync()`` equals one full-batch step.

    Each rank cuts its shard into ``micro_batches`` contiguous micro-batches (see
    ``ShardContext.micro_batch_split``) and runs ``step`` (default
    ``no_sync_accumulation_step``). The accumulated gradients must equal the full-batch
    gradient on every rank, and the ranks must synchronise exactly once: the all-reduces
    are counted through a DDP communication hook (torch's default all-reduce) when the
    step wraps the module with ``ctx.ddp()``.

    Catches the classic mistakes: micro-batch losses not divided by the number of
    micro-batches (gradients ``micro_batches`` times too large), a forward outside
    ``no_sync()`` (DDP prepares the all-reduce in forward, so that backward synchronises
    anyway: the gradients still match, the communication ``no_sync`` should save does not
    happen), and a last micro-batch inside ``no_sync()`` (never synchronised).

    For a token-level loss (each micro-batch's loss a mean over its tokens that are not
    ignored, found or counted as in ``assert_ddp_grads_match``), dividing each micro-batch's
    mean loss by the number of micro-batches is biased when the micro-batches hold
    different numbers of tokens: the exact recipe weights each by ``t * world_size / T``,
    its tokens over the total count over every micro-batch and rank (``MicroBatch.items``,
    ``ShardContext.total_items``), which the default step does. When the micro-batches hold
    different numbers of items, the division by ``micro_batches``
    (``micro_mean_accumulation_step``) is run for contrast and its bias reported, and a
    step whose gradients equal it is named as that trap.

    Args:
        micro_batches: micro-batches per rank (every shard needs at least that many rows).
        items: ``items(args, kwargs) -> int`` for one micro-batch (its target is
            ``args[-1]``), as in ``assert_ddp_grads_match``.
        Others: as ``assert_dp_grads_match`` and ``assert_ddp_grads_match``.

    Raises:
        ParallelMismatch: gradients differ, or the synchronisation count is not one, or
            parameters get no gradient under DDP without ``find_unused_parameters`` (no
            synchronisation is then counted: DDP never completes the all-reduce).
    """
    __tracebackhide__ = True
    check = DDPCheck.create(
        module, inputs, target, loss_fn=loss_fn, world_size=world_size, shards=shards,
        pool=pool, rtol=rtol, atol=atol, ddp_kwargs=ddp_kwargs, forward_kwargs=forward_kwargs,
    )
    k = require_int_at_least(micro_batches, "micro_batches", 1)
    if min(check.shard_sizes) < k:
        raise InvalidArgument(
            f"micro_batches={k} but the shards are {list(check.shard_sizes)}; every shard "
            f"needs at least {k} rows (pass a larger batch or fewer micro-batches)"
        )
    _step(step)
    counted = check.count_items(k, require_items(items))
    trap = counted.unequal_pieces
    chosen = step or no_sync_accumulation_step
    steps: list[Step] = [chosen, micro_mean_accumulation_step] if trap else [chosen]
    title = f"DDP gradient accumulation over {k} micro-batches must match one full-batch step"
    task = check.step_task(steps, counted, micro_batches=k, count_syncs=True)
    sent = check.send(run_step_task, task, title)
    results = [rank_steps[0] for rank_steps in sent]
    refs = check.references(k, items=counted)
    expected = refs.expected
    rows = [row for r, s in enumerate(results) for row in check.rows(f"rank {r} ", s, refs, r)]
    ok = all(row.ok for row in rows)
    failures, notes = check.unused_findings(_unused_names(module, expected.grads), wrapped=all(s.wrapped for s in results))
    notes += _items_notes(counted, trap)
    reduction = None if ok else check.loss_reduction(counted)
    contrasts: list[TensorComparison] = []
    if trap and reduction != "sum":
        plain = [rank_steps[1] for rank_steps in sent]
        notes.append(_accumulation_trap_note(check, counted, k, plain, refs.anchor or expected))
        if step is None:
            label = "micro_mean_accumulation_step"
            contrasts = [c for r, s in enumerate(plain) for c in check.rows(f"rank {r} {label} ", s, refs, r, contrast=True) if c.name.startswith(f"rank {r} {label} grad")]
        elif not ok and _same_up_to_rounding(results[0].grads, plain[0].grads):
            notes.append(
                "The step's gradients equal those of dividing each micro-batch's mean loss by "
                f"the number of micro-batches, {k}: it falls into the loss-averaging trap. Weight "
                "each micro-batch's mean loss by part.items * ctx.world_size / ctx.total_items."
            )
    counts = [s.syncs for s in results]
    if any(c is None for c in counts):
        notes.append(
            "Synchronisations were not counted: the step did not wrap the module with ctx.ddp()."
        )
    elif any(c != 1 for c in counts) and not failures:
        # With unused parameters DDP never completes the all-reduce, so no synchronisation is
        # counted: that is the unused parameters' failure, not a last micro-batch in no_sync().
        failures.append(_sync_failure(counts, k))
    scale = None
    if not ok:
        more, scale = _scale_note(results, expected, check.world_size, k, shard_sizes=check.shard_sizes, reduction=reduction)
        notes += more + _ranks_disagree(results)
    notes.append(f"Gradient synchronisations per rank: {counts} (one expected).")
    outcome = check.outcome(title, chosen, rows, contrasts=contrasts, notes=notes, failures=failures, scale=scale)
    return raise_unless_ok(outcome, msg)


def _sync_failure(counts: Sequence[int | None], micro_batches: int) -> str:
    worst = max(c for c in counts if c is not None)
    if worst == 0:
        return (
            f"No rank synchronised its gradients over the {micro_batches} micro-batches: the "
            "last micro-batch also ran inside no_sync(), so the gradients were never averaged "
            "across ranks. Run the last forward and backward outside no_sync()."
        )
    return (
        f"The gradients were synchronised {worst} times over {micro_batches} micro-batches "
        "(once expected, after the last backward). A micro-batch's forward ran outside "
        "no_sync(): DDP prepares the all-reduce in forward (torch/nn/parallel/distributed.py, "
        "_pre_forward), so its backward synchronised even inside no_sync(). Run forward and "
        "backward of every micro-batch but the last inside `with model.no_sync():`. The "
        "gradients are right, but every micro-batch paid for an all-reduce."
    )


# --------------------------------------------------------------------------- training


Batch = tuple[tuple[Any, ...], dict[str, Any], Any]


def _describe_batches(batches: Any, forward_kwargs: Mapping[str, Any]) -> list[Batch]:
    """``(inputs, kwargs, target)`` per step, from ``(inputs, target)`` pairs and
    ``(inputs, kwargs, target)`` triples; ``forward_kwargs`` go to every batch (a triple's
    own keyword arguments win)."""
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or not batches:
        raise InvalidArgument(
            "batches must be a non-empty list of (inputs, target) pairs or (inputs, kwargs, "
            "target) triples, one per optimizer step"
        )
    found = []
    for index, entry in enumerate(batches):
        if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
            raise InvalidArgument(f"batches[{index}] is not an (inputs, target) pair or an (inputs, kwargs, target) triple")
        own = _forward_kwargs(entry[1], f"batches[{index}][1]") if len(entry) == 3 else {}
        kwargs = {**forward_kwargs, **own}
        found.append((as_inputs(entry[0], keywords=bool(kwargs)), kwargs, entry[-1]))
    return found


def _train_single_device(
    module: nn.Module,
    batches: Sequence[Batch],
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    dtype: torch.dtype | None,
) -> tuple[list[dict[str, torch.Tensor]], list[list[str]]]:
    """Parameters after every step on one device, and the parameters that required grad
    but got none in each step (``_unused_names``)."""
    model = copy.deepcopy(module)
    if dtype is not None:
        model.to(dtype=dtype)
    opt = optimizer(model.parameters())
    history = []
    unused: list[list[str]] = []
    with torch.random.fork_rng(devices=[]), default_dtype(dtype):
        torch.manual_seed(0)
        for inputs, kwargs, target in batches:
            opt.zero_grad(set_to_none=True)
            output = model(*convert_tensors(inputs, dtype, CPU), **convert_tensors(kwargs, dtype, CPU))
            loss_fn(output, convert_tensors(target, dtype, CPU)).backward()
            unused.append(_unused_names(model, {name: p.grad for name, p in model.named_parameters()}))
            opt.step()
            history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return history, unused


def assert_ddp_training_matches(
    module: nn.Module,
    batches: Sequence[tuple[Any, Any]],
    *,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    world_size: int,
    shards: Sequence[int] | None = None,
    step: Step | None = None,
    pool: RankRunner | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    items: Items | None = None,
) -> StepComparison:
    """Asserts ``len(batches)`` optimizer steps of DDP training match one device.

    Every rank builds ``optimizer(params)`` over its copy of ``module`` and, for each
    ``(inputs, target)`` in ``batches``, zeroes the gradients, runs ``step`` on its shard and
    steps the optimizer. After every step, each rank's parameters must match single-device
    training on the full batches (float64-anchored tolerance: the float64 run uses the same
    optimizer over float64 parameters).

    Args:
        batches: one ``(inputs, target)`` pair, or ``(inputs, kwargs, target)`` triple
            (``kwargs``: that batch's keyword forward arguments; ``inputs`` may then be
            ``()``), per optimizer step.
        optimizer: picklable factory ``params -> Optimizer``, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``.
        shards: rows per rank, for every batch (default: even per batch).
        step: per-rank forward/backward (default ``ddp_step``, ``weighted_ddp_step`` when in
            some batch the ranks hold different numbers of items: rows, or tokens for a
            token-level loss); the optimizer step is the harness's.
        forward_kwargs: keyword forward arguments of every batch (sharded with its rows).
        items: ``items(args, kwargs) -> int`` for one shard of a batch (its target is
            ``args[-1]``); default: found per batch, as in ``assert_ddp_grads_match``.
        Others: as ``assert_ddp_grads_match``.

    Raises:
        ParallelMismatch: a rank's parameters differ after some step; the message shows the
            first such step.
        ParallelError: a rank raised. When torch's DDP refuses a forward because parameters
            got no gradient in the step before (no ``find_unused_parameters``), the message
            names them, the step, and the fix.
    """
    __tracebackhide__ = True
    pairs = _describe_batches(batches, _forward_kwargs(forward_kwargs))
    first_inputs, first_kwargs, first_target = pairs[0]
    check = DDPCheck.create(
        module, first_inputs, first_target, loss_fn=loss_fn, world_size=world_size,
        shards=shards, pool=pool, rtol=rtol, atol=atol, ddp_kwargs=ddp_kwargs, forward_kwargs=first_kwargs,
    )
    _sendable(optimizer, "optimizer", "a factory params -> Optimizer, e.g. functools.partial(torch.optim.SGD, lr=0.1)")
    sizes = tuple(
        _shards(shards, batch_size_of(inputs, argument=f"batches[{i}] inputs", kwargs=kwargs), check.world_size)
        for i, (inputs, kwargs, _t) in enumerate(pairs)
    )
    _step(step)
    require_items(items)
    counted = [
        count_piece_items(module, inputs, kwargs, target, loss_fn, shard_sizes, 1, items)
        for (inputs, kwargs, target), shard_sizes in zip(pairs, sizes, strict=True)
    ]
    uneven = any(c.unequal_ranks for c in counted)
    chosen = step or (weighted_ddp_step if uneven else ddp_step)
    require_picklable(pairs, "batches")
    task = TrainingTask(
        check.module, tuple(pairs), check.loss_fn, optimizer, sizes, chosen, check.ddp_kwargs,
        item_kinds=tuple(c.kind for c in counted), item_counts=tuple(c.per_rank for c in counted),
    )
    title = f"{len(pairs)} steps of DDP training with {_name(optimizer)} must match single-device training"
    # One device first: if the ranks fail, it tells which parameters got no gradient.
    expected, unused_by_step = _train_single_device(module, pairs, loss_fn, optimizer, None)
    try:
        ranks: tuple[RankTraining, ...] = check.send(run_training_task, task, title)
    except ParallelError as error:
        retold = _unused_training_error(error, unused_by_step, check)
        if retold is None:
            raise
        raise retold from None
    anchor = None if check.tolerance.explicit else _train_single_device(module, pairs, loss_fn, optimizer, torch.float64)[0]
    rows, failing_step = _training_rows(check, ranks, expected, anchor)
    notes = [f"Parameters compared after each of the {len(pairs)} optimizer steps; the table shows step {failing_step + 1}."]
    if uneven and step is None:
        tokens = next((c for c in counted if c.by_tokens and c.unequal_ranks), None)
        if tokens is not None:
            notes.append(
                f"In some batches the ranks hold different numbers of {tokens.noun}{tokens.detail} "
                f"(batch {counted.index(tokens) + 1}: {list(tokens.per_rank)}): each rank's mean loss "
                f"was weighted by its share of them, t_r * world_size / T (weighted_ddp_step)."
            )
        else:
            notes.append("Some batches split unevenly: each rank's loss was weighted by n_r * world_size / B (weighted_ddp_step).")
    notes += [f"Batch {i + 1}: {note}" for i, c in enumerate(counted) if (note := c.given_note()) is not None][:1]
    trainable = _trainable_names(module)
    none_ranks = sorted({name for r in ranks for name in r.grads_none if name in trainable})
    if none_ranks:
        notes.append(f"Parameters whose .grad stayed None on the ranks (the optimizer skipped them): {none_ranks}.")
    unused = list(dict.fromkeys(name for names in unused_by_step for name in names))
    failures, unused_notes = check.unused_findings(unused, wrapped=all(r.wrapped for r in ranks))
    notes += unused_notes
    if not all(row.ok for row in rows) and check.loss_reduction(counted[0]) == "sum":
        notes.append(_sum_loss_note(check.world_size))
    outcome = check.outcome(title, chosen, rows, notes=notes, failures=failures)
    return raise_unless_ok(outcome, msg)


def _training_rows(
    check: DDPCheck,
    ranks: Sequence[RankTraining],
    expected: Sequence[dict[str, torch.Tensor]],
    anchor: Sequence[dict[str, torch.Tensor]] | None,
) -> tuple[list[TensorComparison], int]:
    """Rows of the first step at which some rank diverges, else of the last step."""
    rows: list[TensorComparison] = []
    for index, reference in enumerate(expected):
        rows = [
            compare_tensors(
                f"rank {r} step {index + 1} param {name!r}",
                rank.params[index].get(name),
                value,
                anchor[index][name] if anchor else None,
                check.tolerance,
            )
            for r, rank in enumerate(ranks)
            for name, value in reference.items()
        ]
        if not all(row.ok for row in rows):
            return rows, index
    return rows, len(expected) - 1


# --------------------------------------------------------------------------- buffers


def _buffers_after_train_forward(module: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    model = copy.deepcopy(module)
    if dtype is not None:
        model.to(dtype=dtype)
    model.train()
    with torch.no_grad(), torch.random.fork_rng(devices=[]), default_dtype(dtype):
        torch.manual_seed(0)
        model(*convert_tensors(inputs, dtype, CPU), **convert_tensors(dict(kwargs or {}), dtype, CPU))
    return model


def _eval_outputs(model: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None, kwargs: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad(), default_dtype(dtype):
        output = model(*convert_tensors(inputs, dtype, CPU), **convert_tensors(dict(kwargs or {}), dtype, CPU))
    return {path: t.detach() for path, t in flatten_tensors(output, "output")}


def assert_ddp_buffers_match(
    module: nn.Module,
    inputs: Any,
    target: Any,
    *,
    loss_fn: LossFn,
    world_size: int,
    shards: Sequence[int] | None = None,
    pool: RankRunner | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
) -> StepComparison:
    """Asserts buffers (BatchNorm running statistics) come from rank 0, as DDP promises.

    Each rank runs one train-mode DDP step on its shard, then an eval-mode forward under
    ``torch.no_grad()``. Checked against one device:

    - after the step, rank ``r``'s buffers are the module's buffers updated by rank ``r``'s
      own shard (each rank's forward updates its own running statistics);
    - at the next forward, every rank uses rank 0's buffers (``broadcast_buffers=True``
      broadcasts them before a forward), so every rank's buffers and eval outputs are those
      of rank 0's model.

    DDP broadcasts buffers before a forward only when the previous forward ran with grad
    enabled outside ``no_sync()`` (``require_forward_param_sync``): after a forward under
    ``torch.no_grad()``, the next forward keeps every rank's own buffers.

    ``forward_kwargs`` are keyword forward arguments, sharded like ``inputs`` (which may then
    be ``()``); the other arguments are as in ``assert_ddp_grads_match``.

    Raises:
        ParallelMismatch: a rank's buffers or eval outputs differ; with
            ``broadcast_buffers=False`` the ranks keep their own statistics and fail here.
    """
    __tracebackhide__ = True
    check = DDPCheck.create(
        module, inputs, target, loss_fn=loss_fn, world_size=world_size, shards=shards,
        pool=pool, rtol=rtol, atol=atol, ddp_kwargs=ddp_kwargs, forward_kwargs=forward_kwargs,
    )
    if not any(True for _ in module.buffers()):
        raise InvalidArgument("module has no buffers; there is nothing for DDP to broadcast")
    title = "DDP buffers must come from rank 0 at the next forward"
    task = BufferTask(check.module, check.args, check.target, check.loss_fn, check.shard_sizes, check.ddp_kwargs, kwargs=check.kwargs)
    ranks: tuple[RankBuffers, ...] = check.send(run_buffer_task, task, title)
    shards_in = [
        (take_rows(check.args, start, stop, check.batch_size), take_rows(check.kwargs, start, stop, check.batch_size))
        for start, stop in shard_bounds(check.shard_sizes)
    ]
    rows = _buffer_rows(check, ranks, shards_in)
    notes = [
        "DDP broadcasts rank 0's buffers at the start of a forward that follows a grad-enabled "
        "forward outside no_sync(); each rank's own forward then updates them from its shard."
    ]
    failures = _broadcast_failures(ranks)
    outcome = check.outcome(title, None, rows, notes=notes, failures=failures, divergence=False)
    return raise_unless_ok(outcome, msg)


def _buffer_rows(check: DDPCheck, ranks: Sequence[RankBuffers], shards_in: Sequence[tuple[Any, dict[str, Any]]]) -> list[TensorComparison]:
    dtypes: list[torch.dtype | None] = [None] if check.tolerance.explicit else [None, torch.float64]
    after = {dtype: [_buffers_after_train_forward(check.module, args, dtype, kwargs) for args, kwargs in shards_in] for dtype in dtypes}

    def anchor_of(rank: int, name: str) -> torch.Tensor | None:
        if check.tolerance.explicit:
            return None
        return dict(after[torch.float64][rank].named_buffers())[name]

    rows: list[TensorComparison] = []
    rank0 = dict(after[None][0].named_buffers())
    for r, rank in enumerate(ranks):
        own = dict(after[None][r].named_buffers())
        for name, value in own.items():
            rows.append(compare_tensors(f"rank {r} buffer {name!r} after its step", rank.after_step.get(name), value, anchor_of(r, name), check.tolerance))
        for name, value in rank0.items():
            rows.append(compare_tensors(f"rank {r} buffer {name!r} at the next forward", rank.after_next_forward.get(name), value, anchor_of(0, name), check.tolerance))
    for r, rank in enumerate(ranks):
        args, kwargs = shards_in[r]
        expected = _eval_outputs(copy.deepcopy(after[None][0]), args, None, kwargs)
        anchors = {} if check.tolerance.explicit else _eval_outputs(copy.deepcopy(after[torch.float64][0]), args, torch.float64, kwargs)
        mine = dict(rank.next_outputs)
        for path, value in expected.items():
            rows.append(compare_tensors(f"rank {r} eval {path}", mine.get(path), value, anchors.get(path), check.tolerance))
    return rows


def _broadcast_failures(ranks: Sequence[RankBuffers]) -> list[str]:
    kept = [
        r for r, rank in enumerate(ranks[1:], start=1)
        if any(not torch.equal(v, ranks[0].after_next_forward[n]) for n, v in rank.after_next_forward.items())
        and all(torch.equal(v, rank.after_step[n]) for n, v in rank.after_next_forward.items())
    ]
    if not kept:
        return []
    return [
        f"Ranks {kept} kept their own running statistics at the next forward instead of rank "
        "0's: the buffers were not broadcast (DistributedDataParallel(broadcast_buffers=False), "
        "or the previous forward ran under torch.no_grad() or inside no_sync()). Every rank "
        "then evaluates a different model."
    ]


# --------------------------------------------------------------------------- SyncBatchNorm


def assert_ddp_sync_batchnorm_matches(
    module: nn.Module,
    inputs: Any,
    target: Any,
    *,
    loss_fn: LossFn,
    world_size: int,
    shards: Sequence[int] | None = None,
    pool: RankRunner | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    items: Items | None = None,
) -> StepComparison:
    """Asserts SyncBatchNorm under DDP equals BatchNorm on the full batch on one device.

    Every BatchNorm layer is converted to SyncBatchNorm on the ranks (torch's
    ``nn.SyncBatchNorm`` on GPU ranks; on CPU ranks, where torch refuses SyncBatchNorm,
    ``HostSyncBatchNorm``: torch's SyncBatchNorm autograd function with host stand-ins for
    its five CUDA-only kernels). Each rank's outputs, gradients and running statistics must
    equal train-mode BatchNorm on the whole batch. Plain BatchNorm under DDP, which
    normalises each shard with its own statistics, is shown for contrast. The step weights
    each rank's loss by its share of the items when the ranks hold different numbers
    (``weighted_ddp_step``; rows, or tokens found or counted by ``items`` as in
    ``assert_ddp_grads_match``); ``forward_kwargs`` are sharded like ``inputs``.

    Raises:
        ParallelMismatch: an output, gradient or running statistic differs.
        InvalidArgument: the module has no BatchNorm layer, or is in eval mode.
    """
    __tracebackhide__ = True
    check = DDPCheck.create(
        module, inputs, target, loss_fn=loss_fn, world_size=world_size, shards=shards,
        pool=pool, rtol=rtol, atol=atol, ddp_kwargs=ddp_kwargs, forward_kwargs=forward_kwargs,
    )
    layers = [name for name, sub in module.named_modules() if isinstance(sub, _BatchNorm)]
    if not layers:
        raise InvalidArgument("module has no BatchNorm layer; SyncBatchNorm would change nothing")
    if not module.training:
        raise InvalidArgument("module is in eval mode; BatchNorm only synchronises in train mode (call module.train())")
    counted = check.count_items(1, require_items(items))
    chosen = weighted_ddp_step if counted.unequal_ranks else ddp_step
    title = "SyncBatchNorm under DDP must match BatchNorm on the full batch on one device"
    synced = [s[0] for s in check.send(run_step_task, check.step_task([chosen], counted, sync_batchnorm=True), title)]
    plain = [s[0] for s in check.send(run_step_task, check.step_task([chosen], counted), title)]
    refs = check.references(items=counted)
    expected, anchor = refs.expected, refs.anchor
    rows = [row for r, s in enumerate(synced) for row in check.rows(f"rank {r} ", s, refs, r)]
    buffers = dict(_buffers_after_train_forward(module, check.args, None, check.kwargs).named_buffers())
    anchors = None if anchor is None else dict(_buffers_after_train_forward(module, check.args, torch.float64, check.kwargs).named_buffers())
    for r, s in enumerate(synced):
        for name, value in buffers.items():
            rows.append(compare_tensors(f"rank {r} buffer {name!r}", s.buffers.get(name), value, anchors.get(name) if anchors else None, check.tolerance))
    contrasts = [c for r, s in enumerate(plain) for c in check.rows(f"rank {r} plain BatchNorm ", s, refs, r, contrast=True) if "grad" in c.name]
    where = "torch's nn.SyncBatchNorm" if check.runner.backend == "nccl" else (
        "HostSyncBatchNorm (torch's SyncBatchNorm autograd function, host stand-ins for its "
        "CUDA-only kernels; torch refuses SyncBatchNorm on CPU)"
    )
    failures, unused_notes = check.unused_findings(_unused_names(module, expected.grads), wrapped=all(s.wrapped for s in synced))
    notes = [f"BatchNorm layers {layers} ran as {where}.", *unused_notes]
    if counted.unequal_ranks and counted.by_tokens:
        notes.append(
            f"The ranks hold different numbers of {counted.noun}, {list(counted.per_rank)}{counted.detail}: "
            "each rank's mean loss was weighted by its share of them, t_r * world_size / T (weighted_ddp_step)."
        )
    elif counted.unequal_ranks:
        notes.append("Uneven shards: each rank's loss was weighted by n_r * world_size / B (weighted_ddp_step).")
    notes += [note for note in (counted.given_note(),) if note is not None]
    if not all(row.ok for row in rows) and check.loss_reduction(counted) == "sum":
        notes.append(_sum_loss_note(check.world_size))
    outcome = check.outcome(title, chosen, rows, contrasts=contrasts, notes=notes, failures=failures, divergence=False)
    return raise_unless_ok(outcome, msg)


# --------------------------------------------------------------------------- DP and DDP


def assert_dp_ddp_agree(
    module: nn.Module,
    inputs: Any,
    target: Any,
    *,
    loss_fn: LossFn,
    world_size: int,
    pool: RankRunner | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    items: Items | None = None,
) -> StepComparison:
    """Asserts the same training code gives the same gradients under DP and DDP.

    The step (forward, ``loss_fn(output, target)``, backward) runs under DataParallel over
    ``world_size`` devices (virtual ones without CUDA) and under DistributedDataParallel on
    ``world_size`` ranks, each rank getting the rows DataParallel's scatter gives that
    device. DataParallel sums the replica gradients; DDP averages them over ranks. With a
    mean loss the two agree; with a sum loss (``reduction='sum'``) DDP's gradients are
    ``1/world_size`` of DataParallel's, and the failure says so.

    ``ddp_kwargs`` go to DistributedDataParallel, e.g. ``{'find_unused_parameters': True}``
    for a model with parameters that take no part in the loss (DataParallel needs no flag).
    ``forward_kwargs`` are scattered by DataParallel and sharded for DDP like ``inputs``.
    A token-level loss whose ranks hold different numbers of tokens makes DDP's plain step
    differ from DataParallel (which computes the loss once on the gathered output): the
    failure then names the token trap, with the counts found or given by ``items`` (as in
    ``assert_ddp_grads_match``).

    Raises:
        ParallelMismatch: the gradients differ (with the factor and its cause).
        InvalidArgument: the batch is too small for DataParallel to use every device, or the
            module has no parameter that requires grad.
    """
    __tracebackhide__ = True
    _trainable_module(module)
    require_items(items)
    dp = Check.create(
        module, inputs, device_ids=list(range(require_int_at_least(world_size, "world_size", 1))), rtol=rtol, atol=atol,
        forward_kwargs=forward_kwargs,
    )
    if dp.plan.n_replicas != world_size:
        raise InvalidArgument(
            f"DataParallel splits {sum(dp.plan.chunk_sizes)} rows into only {dp.plan.n_replicas} "
            f"chunks for {world_size} devices; pass a batch that gives every device rows "
            f"(at least {world_size} rows, e.g. a multiple of {world_size})"
        )
    check = DDPCheck.create(
        module, inputs, target, loss_fn=loss_fn, world_size=world_size,
        shards=list(dp.plan.chunk_sizes), pool=pool, rtol=rtol, atol=atol, ddp_kwargs=ddp_kwargs,
        forward_kwargs=forward_kwargs,
    )
    title = "DataParallel and DistributedDataParallel must give the same gradients for the same training code"
    ranks = [s[0] for s in check.send(run_step_task, check.step_task([ddp_step]), title)]
    target_now = check.target_as(None)
    dp_step = dp.run(lambda output: loss_fn(output, target_now), parallel=True)
    refs = check.references(expected=dp_step)
    rows = [
        refs.compare(f"rank {r} grad {name!r} vs DataParallel", s.grads.get(name), Key.grad(name), name)
        for r, s in enumerate(ranks)
        for name in dp_step.grads
    ]
    notes = [f"DataParallel over devices {dp.device_ids}: {dp.plan.describe()}."]
    single = refs.anchor or check.reference(None)
    # One device, not DataParallel: its reduce-add gives unused parameters zeros, not None.
    failures, unused_notes = check.unused_findings(_unused_names(module, single.grads))
    notes += unused_notes
    scale = None
    if not all(row.ok for row in rows):
        more, scale = _dp_ddp_diagnosis(check, ranks, dp_step, single, items)
        notes += more
    outcome = check.outcome(title, ddp_step, rows, notes=notes, failures=failures, scale=scale)
    return raise_unless_ok(outcome, msg)


def _dp_ddp_diagnosis(
    check: DDPCheck, ranks: Sequence[RankStep], dp_step: StepResult, reference: StepResult, items: Items | None = None,
) -> tuple[list[str], float | None]:
    """DataParallel computes the loss once, on the gathered full-batch output, so its gradient
    is the single-device one for any loss; DDP averages per-rank losses' gradients. For a sum
    loss DDP's average is 1/world_size of the full-batch sum: 1/world_size of DataParallel's."""
    world = check.world_size
    c = uniform_scale(ranks[0].grads, dp_step.grads)
    notes: list[str] = []
    reduction = check.loss_reduction() if c is not None else None
    if c is not None and abs(c * world - 1.0) < 1e-3 and reduction != "mean":
        notes.append(
            f"DDP's gradients are {c:.6g} = 1/{world} (one over the world size) times "
            "DataParallel's: the loss sums over the batch (e.g. reduction='sum'). DataParallel "
            "sums the replica gradients (ReduceAddCoalesced) while DistributedDataParallel "
            "averages them over ranks (all-reduce, then divide by world size), so the same "
            f"loss code gives gradients that differ by the world size, {world}. Use a mean "
            "loss, or multiply the DDP loss by world_size."
        )
    elif c is not None:
        notes.append(f"DDP's gradients are {c:.6g} times DataParallel's.")
    counted = check.count_items(1, items)
    if counted.unequal_ranks:
        notes.append(_token_trap_note(check, counted, ranks, reference) if counted.by_tokens else _trap_note(check, ranks, reference))
    return notes, c
