"""The parent side of every ranked check (DDP, FSDP2, tensor and pipeline parallel).

A ranked check validates its scenario in this process (``RankedCheck.create``), sends one
task to the ranks of a ``RankRunner`` (``runner``), runs the same scenario on one device
(float32, plus the float64 anchor of the tolerance), and compares each rank's tensors with
the single-device ones (``References``), so that every backend's messages read alike. What
differs between the backends (how the ranks wrap the module, what evidence they report)
lives in ``dpverify.ddp`` and ``dpverify.sharded``, on this base.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpverify.core.comparison import (
    StepComparison,
    TensorComparison,
    TensorId,
    Terms,
    Tolerance,
    compare_tensors,
    step_comparison,
    steps_with_second_look,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.items import Items
from dpverify.core.numerics import FLOAT64_JITTER, jitter_for, largest_abs, magnitudes, scale_factor
from dpverify.core.step import (
    Key,
    StepResult,
    as_inputs,
    batch_size_of,
    convert_tensors,
    copy_module,
    default_dtype,
    first_parameter_dtype,
    jitter_parameters,
    parameter_sites,
    run_step,
)
from dpverify.core.validation import (
    require_arguments_fit,
    require_bool,
    require_callable,
    require_int_at_least,
    require_loss_fn,
    require_mapping,
    require_module_with_grads,
    require_target_rows,
)
from dpverify.ddp.pool import ParallelError, RankRunner, require_picklable, shared_pool
from dpverify.ddp.torchrun import group_runner
from dpverify.exact.case import (
    EXACT,
    Evidence,
    ExactCase,
    prove,
    require_no_tolerance,
    require_power_of_two,
)
from dpverify.exact.grid import dyadic_tree
from dpverify.exact.proof import Prover, proving
from dpverify.ranked.items import PieceItems, count_piece_items, cut_pieces, measure_losses
from dpverify.ranked.randomness import Masks, replaying
from dpverify.ranked.rank import (
    AfterBackward,
    Batch,
    LossFn,
    OptimizerFactory,
    RankStep,
    ReferenceContext,
    after_backward_note,
    even_shards,
    one_rank_group,
    optimizer_state_of,
    shard_bounds,
)

__all__ = [
    "CPU",
    "DDP_RANKS",
    "FSDP_RANKS",
    "TP_GROUPS",
    "Batch",
    "RankedCheck",
    "References",
    "ShardUnit",
    "TrainingBatches",
    "TrainingTrace",
    "callable_name",
    "describe_batches",
    "exact_batches",
    "exact_training_notes",
    "forward_keywords",
    "grads_only",
    "jittered_training",
    "local_buffer_notes",
    "loss_reduction",
    "optional",
    "per_shard_buffers",
    "relative_gap",
    "require_step",
    "runner",
    "same_up_to_rounding",
    "sendable",
    "shard_items",
    "shard_sizes",
    "train_single_device",
    "trainable_names",
    "training_batches",
    "training_code",
    "training_rows",
    "training_scale_note",
    "unused_names",
]

CPU = torch.device("cpu")
_T = TypeVar("_T")


# --------------------------------------------------------------------------- validation


def runner(pool: RankRunner | None, world_size: int) -> RankRunner:
    """The ranks a check runs on: ``pool``, checked against ``world_size``; when None, the
    ranks of the initialised default process group (a script torchrun started: every rank
    runs the check, ``group_runner``), else the shared pool of ``world_size`` ranks."""
    if pool is None:
        return group_runner(world_size) or shared_pool(world_size)
    if not callable(getattr(pool, "run", None)):
        raise InvalidArgument(f"pool={pool!r} has no run(); pass a DDPWorkerPool or None")
    if pool.world_size != world_size:
        raise InvalidArgument(
            f"pool has world_size {pool.world_size} but world_size={world_size}; pass a pool "
            f"of {world_size} ranks, or pool=None to use the shared one"
        )
    return pool


@dataclass(frozen=True)
class ShardUnit:
    """What one entry of ``shards=`` gives rows to, in the words of the errors: a rank of
    DDP (at least a row: a rank without rows has no mean loss), a rank of FSDP2 (which may
    get none), or a data-parallel group of tensor parallelism."""

    noun: str = "rank"
    count: str = "world_size"
    minimum: int = 1
    why: str = " (a rank without rows has no mean loss)"
    share: str = ""
    #: the error of a batch with fewer rows than units, for ``str.format(batch=, parts=)``
    #: (default: ``even_shards``'s, in ranks)
    too_few: str = ""


#: The units of the three backends that shard a batch.
DDP_RANKS = ShardUnit()
FSDP_RANKS = ShardUnit(minimum=0, why="")
TP_GROUPS = ShardUnit(
    "data-parallel group", "data_parallel", share=" (each group's tensor-parallel ranks share its rows)", why="",
    too_few=(
        "the batch has {batch} rows for data_parallel={parts} groups; every group needs a row "
        "(a larger batch, or fewer data-parallel groups)"
    ),
)


def shard_sizes(shards: Sequence[int] | None, batch_size: int, parts: int, unit: ShardUnit = DDP_RANKS) -> tuple[int, ...]:
    """Rows per ``unit`` (``parts`` of them): ``shards`` checked to cover the batch with one
    count per unit, or as even as possible (the first units one row more) when None."""
    if shards is None:
        if unit.too_few and batch_size < parts:
            raise InvalidArgument(unit.too_few.format(batch=batch_size, parts=parts))
        return even_shards(batch_size, parts)
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
        raise InvalidArgument(f"shards={shards!r}: pass one row count per {unit.noun}, e.g. [3, 2]")
    sizes = tuple(shards)
    if len(sizes) != parts:
        raise InvalidArgument(
            f"shards={list(sizes)} has {len(sizes)} entries for {unit.count}={parts}; pass one row count "
            f"per {unit.noun}{unit.share}"
        )
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < unit.minimum:
            raise InvalidArgument(
                f"shards={list(sizes)} contains {size!r}; every {unit.noun} needs an int >= {unit.minimum} rows{unit.why}"
            )
    if sum(sizes) != batch_size:
        raise InvalidArgument(
            f"shards={list(sizes)} sums to {sum(sizes)} but the batch has {batch_size} rows; "
            "the shards must cover the batch exactly"
        )
    return sizes


def sendable(value: Any, name: str, expected: str) -> None:
    """A callable the ranks can unpickle (by name: a top-level function or a partial of one)."""
    require_callable(value, name, expected)
    require_picklable(value, name)


def training_code(optimizer: Any, after_backward: Any, example: str = "one calling clip_grad_norm_(ctx.module.parameters(), 1.0)") -> Any:
    """The training helpers' own code, checked before any rank starts: ``optimizer``, a
    factory ``params -> Optimizer``, and ``after_backward`` when given, each picklable by
    name; returns ``after_backward``."""
    sendable(optimizer, "optimizer", "a factory params -> Optimizer, e.g. functools.partial(torch.optim.SGD, lr=0.1)")
    if after_backward is not None:
        sendable(after_backward, "after_backward", f"a module-level function hook(ctx), e.g. {example}")
    return after_backward


def require_step(step: Any, context: str) -> None:
    """A custom step, when given, is a callable the ranks can unpickle, ``step(ctx: context)``."""
    if step is not None:
        sendable(step, "step", f"a top-level function step(ctx: {context})")


def forward_keywords(forward_kwargs: Mapping[str, Any] | None, argument: str = "forward_kwargs") -> dict[str, Any]:
    """The keyword forward arguments, checked: a mapping with string keys that pickles."""
    if forward_kwargs is None:
        return {}
    kwargs = dict(require_mapping(forward_kwargs, argument, "{'input_ids': ids}"))
    for key in kwargs:
        if not isinstance(key, str):
            raise InvalidArgument(f"{argument} has the key {key!r}; keyword arguments are named by strings")
    require_picklable(kwargs, argument)
    return kwargs


def callable_name(fn: Any) -> str:
    """A step, loss or optimizer factory as a reader knows it: its qualified name, with a
    partial's keywords (``SGD(lr=0.1)``)."""
    if isinstance(fn, functools.partial):
        kwargs = ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items())
        return f"{callable_name(fn.func)}({kwargs})"
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def describe_batches(batches: Any, forward_kwargs: Mapping[str, Any]) -> list[Batch]:
    """``(inputs, kwargs, target)`` per step, from ``(inputs, target)`` pairs and
    ``(inputs, kwargs, target)`` triples; ``forward_kwargs`` go to every batch (a triple's
    own keyword arguments win)."""
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or not batches:
        raise InvalidArgument(
            "batches must be a non-empty list of (inputs, target) pairs or (inputs, kwargs, "
            "target) triples, one per optimizer step"
        )
    found: list[Batch] = []
    for index, entry in enumerate(batches):
        if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
            raise InvalidArgument(f"batches[{index}] is not an (inputs, target) pair or an (inputs, kwargs, target) triple")
        own = forward_keywords(entry[1], f"batches[{index}][1]") if len(entry) == 3 else {}
        kwargs = {**forward_kwargs, **own}
        found.append((as_inputs(entry[0], keywords=bool(kwargs)), kwargs, entry[-1]))
    return found


def shard_items(
    module: nn.Module, batch: Batch, loss_fn: LossFn, sizes: Sequence[int], micro_batches: int = 1, items: Items | None = None,
) -> PieceItems:
    """What the mean loss of each rank's micro-batches averages over (``count_piece_items``)
    on one batch cut into shards of ``sizes`` rows; rows when some rank has none (the token
    count of an empty shard tells nothing)."""
    if 0 in sizes:
        rows = tuple((n,) for n in sizes)
        return PieceItems("rows", rows, rows)
    args, kwargs, target = batch
    return count_piece_items(module, args, kwargs, target, loss_fn, sizes, micro_batches, items)


@dataclass(frozen=True)
class TrainingBatches:
    """The batches of a training check, one per optimizer step: each batch, its shards, and
    what its ranks' mean losses average over."""

    pairs: tuple[Batch, ...]
    sizes: tuple[tuple[int, ...], ...]
    counted: tuple[PieceItems, ...]

    @property
    def uneven(self) -> bool:
        """In some batch the ranks hold different numbers of items."""
        return any(c.unequal_ranks for c in self.counted)


def exact_batches(check: RankedCheck, pairs: Sequence[Batch]) -> list[Batch]:
    """The batches a training check runs: in exact mode the grid copies of ``pairs``, each
    tensor on its own grid as ``ExactCase.of`` puts the check's first batch (the same map,
    so the first stays the check's own); ``pairs`` otherwise."""
    return [dyadic_tree(tuple(batch)) for batch in pairs] if check.exact else list(pairs)


def training_batches(check: RankedCheck, pairs: Sequence[Batch], shards: Sequence[int] | None, items: Items | None = None) -> TrainingBatches:
    """``pairs`` (``describe_batches``), each cut as ``check`` cuts its batch (``shards``, or
    evenly) and counted, and checked to reach the ranks; in exact mode their grid copies
    (``exact_batches``)."""
    sizes = tuple(
        shard_sizes(shards, batch_size_of(inputs, argument=f"batches[{i}] inputs", kwargs=kwargs), len(check.shard_sizes), check.UNIT)
        for i, (inputs, kwargs, _t) in enumerate(pairs)
    )
    pairs = exact_batches(check, pairs)
    counted = tuple(shard_items(check.module, batch, check.loss_fn, rows, 1, items) for batch, rows in zip(pairs, sizes, strict=True))
    require_picklable(list(pairs), "batches")
    return TrainingBatches(tuple(pairs), sizes, counted)


def trainable_names(module: nn.Module) -> frozenset[str]:
    """Qualified names (as in the gradient dictionaries) of the parameters that require grad."""
    return frozenset(
        name for name, path, attr in parameter_sites(module)
        if getattr(module.get_submodule(path)._parameters[attr], "requires_grad", False)
    )


def unused_names(module: nn.Module, grads: Mapping[str, torch.Tensor | None]) -> list[str]:
    """Parameters that require grad but got none on one device: they take no part in the
    loss. A frozen parameter has no gradient either, but the ranked wrappers ignore it."""
    trainable = trainable_names(module)
    return [name for name, grad in grads.items() if grad is None and name in trainable]


# --------------------------------------------------------------------------- measures


def optional(run: Callable[[], _T]) -> _T | None:
    """``run()``, or None when it raises: a second look that cannot be had (a BatchNorm
    given a one-row shard, a loss that refuses float32) leaves the first verdict standing."""
    try:
        return run()
    except Exception:
        return None


def relative_gap(actual: Mapping[str, torch.Tensor | None], reference: Mapping[str, torch.Tensor | None]) -> float:
    """The largest ``max |actual - reference| / max |reference|`` over the gradients both hold."""
    worst = 0.0
    for name, ref in reference.items():
        got = actual.get(name)
        if ref is None or got is None:
            continue
        scale = largest_abs(ref)
        if scale > 0:
            worst = max(worst, float((got.double() - ref.double()).abs().max()) / scale)
    return worst


def same_up_to_rounding(actual: Mapping[str, torch.Tensor | None], expected: Mapping[str, torch.Tensor | None]) -> bool:
    """Whether two sets of float32 gradients agree to about 1e-4 of their scale: enough to
    tell a step that reproduces another (a known mistake) from one that does not."""
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or want is None:
            present = got if got is not None else want
            if present is not None and bool(present.any()):
                return False
            continue
        scale = largest_abs(want)
        if want.numel() and float((got.double() - want.double()).abs().max()) > 1e-4 * scale + 1e-30:
            return False
    return True


def loss_reduction(
    module: nn.Module, args: tuple[Any, ...], target: Any, loss_fn: LossFn, shard_sizes: Sequence[int],
    kwargs: Mapping[str, Any] | None = None, weights: Sequence[int] | None = None,
) -> str | None:
    """``"sum"`` when ``loss_fn`` adds up its rows' losses, ``"mean"`` when it averages them,
    None when this batch does not tell (one shard, a zero loss, a loss that is neither).

    Measured on one device, in float64 (``measure_losses``): the loss of the whole batch is
    compared with the sum and with the mean of the shards' losses weighted by ``weights``
    (their items, e.g. tokens; default their rows).
    """
    if len(shard_sizes) < 2:
        return None
    counts = list(weights) if weights is not None else list(shard_sizes)
    if len(counts) != len(shard_sizes) or sum(counts) <= 0:
        return None
    keywords = dict(kwargs or {})
    try:
        losses, full = measure_losses(module, args, keywords, target, loss_fn, cut_pieces(args, keywords, target, shard_sizes, 1), sum(shard_sizes))
    except Exception:  # a loss that cannot take a slice tells nothing; the check goes on
        return None
    parts = [shard[0] for shard in losses]
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


# --------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class RankedCheck:
    """A validated ranked scenario: module, batch, shards, where it runs and how it compares.

    ``create`` is the one constructor every backend goes through; a backend's subclass adds
    its own fields (passed to ``create`` as keywords, already checked), says what a missing
    gradient means for it (``NO_GRAD``) and what an entry of ``shards`` is (``UNIT``), and
    words its scenario (``layout``).
    """

    module: nn.Module
    args: tuple[Any, ...]
    target: Any
    loss_fn: LossFn
    world_size: int
    shard_sizes: tuple[int, ...]
    runner: RankRunner
    tolerance: Tolerance
    dtype: torch.dtype
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: exact mode (``exact=True``): what ``prove`` established on the grid copies
    evidence: Evidence | None = None

    #: why a module without a parameter that requires grad is refused
    NO_GRAD: ClassVar[str] = "there would be no gradient to compare"
    #: what one entry of ``shards`` gives rows to
    UNIT: ClassVar[ShardUnit] = DDP_RANKS
    #: what divides the gradients by the number of ``UNIT``s (exact mode's refusals name it)
    AVERAGER: ClassVar[str] = "DistributedDataParallel"

    @classmethod
    def shard_parts(cls, world_size: int, fields: Mapping[str, Any]) -> int:
        """How many entries ``shards`` has: one per rank (a subclass may group ranks)."""
        return world_size

    @classmethod
    def exact_weights(cls, world_size: int, sizes: Sequence[int], fields: Mapping[str, Any]) -> list[float]:
        """What each piece's mean-loss gradient is multiplied by in the ranks' sum, for
        ``prove`` (one weight per entry of ``sizes``): ``n / B``, the rank's share of the
        rows (``1 / world_size`` on even shards: the average over the ranks; a weighted
        step's ``n_r * world_size / B`` over ``world_size`` on uneven ones), once the count
        the average divides by is a power of two (else ``InvalidArgument``)."""
        require_power_of_two(cls.shard_parts(world_size, fields), cls.UNIT.count, cls.AVERAGER)
        batch = sum(sizes)
        return [n / batch for n in sizes]

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
        forward_kwargs: Mapping[str, Any] | None = None,
        exact: bool = False,
        micro_batches: int = 1,
        **fields: Any,
    ) -> Self:
        """Validates every argument, in this process, before anything reaches the ranks (a
        list of arguments meant as a tuple, a target of other rows, a loss that is not
        callable, anything that cannot be pickled); ``fields``: the subclass's own, already
        checked.

        With ``exact`` the scenario becomes its dyadic float64 copies (``ExactCase``), the
        user's objects untouched, before anything is pickled to the ranks; ``prove`` shows
        the full-batch step and the ranks' cut of it (each shard cut into ``micro_batches``
        pieces, weighted by ``exact_weights``) exact, or refuses; the tolerance is
        ``EXACT``."""
        require_module_with_grads(module, why=cls.NO_GRAD)
        world = require_int_at_least(world_size, "world_size", 1)
        parts = cls.shard_parts(world, fields)
        kwargs = forward_keywords(forward_kwargs)
        require_arguments_fit(module, inputs)
        args = as_inputs(inputs, keywords=bool(kwargs))
        batch = batch_size_of(args, kwargs=kwargs)
        require_target_rows(target, batch)
        require_loss_fn(loss_fn)
        sizes = shard_sizes(shards, batch, parts, cls.UNIT)
        tolerance, evidence = Tolerance(rtol=rtol, atol=atol), None
        if require_bool(exact, "exact"):
            require_no_tolerance(rtol, atol)
            case = ExactCase.of(module, args, target, kwargs)
            module, args, target, kwargs = case.module, case.args, case.target, case.kwargs
            evidence = cls.prove_exact(case, loss_fn, world, sizes, micro_batches, fields)
            tolerance = EXACT
        for value, name in ((loss_fn, "loss_fn"), (module, "module"), (args, "inputs"), (target, "target")):
            require_picklable(value, name)
        return cls(
            module=module,
            args=args,
            target=target,
            loss_fn=loss_fn,
            world_size=world,
            shard_sizes=sizes,
            runner=runner(pool, world),
            tolerance=tolerance,
            dtype=first_parameter_dtype(module),
            kwargs=kwargs,
            evidence=evidence,
            **fields,
        )

    @classmethod
    def prove_exact(
        cls, case: ExactCase, loss_fn: LossFn, world_size: int, sizes: Sequence[int], micro_batches: int, fields: Mapping[str, Any],
    ) -> Evidence:
        """``prove`` on the pieces the ranks compute: each of ``sizes`` cut into
        ``micro_batches`` (as ``ShardContext.micro_batch_split`` cuts it), each piece's
        mean-loss gradient weighted by its share of the shard's weight
        (``exact_weights``), summed in rank order as the reduction sums them.

        A rank without rows (FSDP2 allows one) adds nothing and is left out. Tensor
        parallelism needs nothing more: its ranks compute slices of the same products and
        sums (a column block, or a partial sum over part of the inner dimension that the
        all-reduce completes), and the proof of each operation bounds every partial sum in
        any order (``dpverify.exact.rules``), so the full-batch step's proof covers them."""
        if micro_batches > 1:
            require_power_of_two(micro_batches, "micro_batches", "gradient accumulation")
        weights = cls.exact_weights(world_size, sizes, fields)
        pieces: list[int] = []
        scaled: list[float] = []
        for rows, weight in zip(sizes, weights, strict=True):
            # a shard with fewer rows than micro-batches is the helper's refusal, not the proof's
            for piece in even_shards(rows, min(micro_batches, rows)) if rows else ():
                pieces.append(piece)
                scaled.append(weight * piece / rows)
        return prove(case, loss_fn, pieces=pieces, gathered=False, weights=scaled)

    @property
    def exact(self) -> bool:
        """Whether the check runs in exact mode (``exact=True``)."""
        return self.evidence is not None

    @property
    def batch_size(self) -> int:
        return sum(self.shard_sizes)

    @property
    def uneven(self) -> bool:
        return len(set(self.shard_sizes)) > 1

    def shards_text(self) -> str:
        """The batch, its shards and the ranks, as the scenario line begins."""
        keywords = f" (keyword arguments {sorted(self.kwargs)})" if self.kwargs else ""
        return (
            f"batch of {self.batch_size} rows{keywords} in contiguous shards {list(self.shard_sizes)} on "
            f"{self.world_size} ranks ({self.runner.backend})"
        )

    def layout(self) -> str:
        """The scenario line without the step: how the batch is cut and the module wrapped."""
        return self.shards_text()

    def describe(self, step: Any = None) -> str:
        text = self.layout()
        return text if step is None else f"{text}; step {callable_name(step)}"

    def loss_reduction(self, items: PieceItems | None = None) -> str | None:
        """How ``loss_fn`` reduces on this batch and these shards (``loss_reduction``):
        over the ranks' items when counted (a token-mean loss is a mean), else their rows."""
        weights = items.per_rank if items is not None else None
        return loss_reduction(self.module, self.args, self.target, self.loss_fn, self.shard_sizes, self.kwargs, weights)

    def count_items(self, micro_batches: int = 1, items: Items | None = None) -> PieceItems:
        """What each rank's micro-batches' mean losses average over (``shard_items``)."""
        return shard_items(self.module, (self.args, self.kwargs, self.target), self.loss_fn, self.shard_sizes, micro_batches, items)

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

    def references(self, micro_batches: int = 1, *, expected: StepResult | None = None, items: PieceItems | None = None) -> References:
        """What the ranks' tensors are compared with: the single-device full-batch step
        (or ``expected``, e.g. DataParallel's step) and the float64 anchor, with the
        rounding samples a failing tensor gets (``References``). ``micro_batches``: the
        pieces each rank's shard is cut into, as the ranks cut it; ``items``: what each
        piece's loss averages over (default: rows)."""
        return References(self, self.reference(None) if expected is None else expected, self.anchor(), micro_batches, items)

    def step_fields(self, steps: Sequence[Callable[[Any], Any]], items: PieceItems | None = None) -> dict[str, Any]:
        """What every backend's ``RankStepTask`` takes from this check: the batch, its
        shards, the loss, ``steps``, and the items ``items`` counted (rows when None)."""
        return dict(
            module=self.module, inputs=self.args, target=self.target, loss_fn=self.loss_fn, shard_sizes=self.shard_sizes,
            steps=tuple(steps), kwargs=self.kwargs, item_kind=items.kind if items is not None else "rows",
            item_counts=items.counts if items is not None else (),
        )

    def send(self, fn: Callable[..., Any], task: Any, what: str) -> Any:
        """``fn(info, task)`` on every rank; a rank's failure names the check and scenario."""
        try:
            return self.runner.run(fn, task)
        except ParallelError as error:
            error.add_note(f"dpverify: raised by the ranks of: {what}. Scenario: {self.describe()}.")
            raise

    def rows(
        self, actual: RankStep, refs: References, shard: int, *, rank: int | None = None, variant: str = "", contrast: bool = False,
    ) -> list[TensorComparison]:
        """A rank's outputs (the rows of shard ``shard`` of the full-batch output) and
        gradients, identified by ``rank`` (default: ``shard``) and ``variant`` (which step
        ran). A ``contrast`` is expected to differ: it gets no second look
        (``References.compare``)."""
        who = shard if rank is None else rank
        found: list[TensorComparison] = []
        start, stop = shard_bounds(self.shard_sizes)[shard]
        mine = dict(actual.outputs)
        for path, tensor in refs.expected.outputs:
            if path not in mine or tensor.dim() == 0 or tensor.size(0) != self.batch_size:
                continue
            tensor_id = TensorId("output", path, rank=who, variant=variant, detail=f"[{start}:{stop}]")
            found.append(refs.compare(tensor_id, mine[path], Key.output(path, (start, stop)), contrast=contrast))
        for name in refs.expected.grads:
            found.append(refs.compare(TensorId("grad", name, rank=who, variant=variant), actual.grads.get(name), Key.grad(name), contrast=contrast))
        return found

    def rank_rows(self, steps: Sequence[RankStep], refs: References, *, variant: str = "", contrast: bool = False) -> list[TensorComparison]:
        """Every rank's outputs and gradients (``rows``), rank ``r`` holding shard ``r``."""
        return [row for r, s in enumerate(steps) for row in self.rows(s, refs, r, variant=variant, contrast=contrast)]

    def outcome(
        self,
        title: str,
        step: Any,
        rows: Sequence[TensorComparison],
        *,
        contrasts: Sequence[TensorComparison] = (),
        notes: Sequence[str] = (),
        failures: Sequence[str] = (),
        divergence: bool = True,
        scale: float | None = None,
        scenario: str | None = None,
        replayed: Collection[str] = (),
    ) -> StepComparison:
        """The comparison of this check; ``scenario`` replaces ``describe(step)``;
        ``replayed``: Dropout layers whose masks the reference replayed from the ranks."""
        if self.evidence is not None:
            notes = [*notes, self.evidence.note()]
        return step_comparison(
            title, self.describe(step) if scenario is None else scenario, self.tolerance, self.dtype, self.module, rows,
            contrasts=contrasts, notes=notes, failures=failures, scale=scale, divergence=divergence, replayed=replayed,
        )


def grads_only(rows: Sequence[TensorComparison]) -> list[TensorComparison]:
    """The gradients among ``rows``: a contrast shows how far a known mistake's gradients are."""
    return [row for row in rows if row.id.kind == "grad"]


# --------------------------------------------------------------------------- references


@dataclass(frozen=True)
class _Rounding:
    """What measures the rounding of a correct ranked step beyond the single-device step's
    own (see ``References``): the terms of every gradient, and two more single-device runs."""

    terms: dict[str, Terms]
    probe: StepResult | None
    jitter: StepResult | None


@dataclass
class References:
    """The single-device tensors a ranked check compares the ranks' with, and a second look
    for the tensors that fail against them.

    ``expected`` is the full-batch step in the working dtype (DataParallel's step for
    ``assert_dp_ddp_agree``) and ``anchor`` its float64 twin (None with explicit
    tolerances, exact mode's ``EXACT`` among them: without an anchor there is no second
    look, which exact mode, comparing bit for bit, has no use for). A tensor that fails is compared again with the scale of the terms a
    correct ranked step sums (``_all_reduce_terms``: the all-reduce adds ``n_r / B`` times
    each rank's mean-loss gradient, whose cancelling terms round like the terms, not like
    the near-zero total), and with a float32 ``probe`` and a jittered float64 run for
    float64 models, or a working-dtype run from parameters one unit in the last place off
    for other dtypes, as the DataParallel checks do (docs/tolerance.md, "The scale"). These
    steps run once per check, and only when a tensor fails.
    """

    check: RankedCheck
    expected: StepResult
    anchor: StepResult | None
    micro_batches: int = 1
    items: PieceItems | None = None

    def compare(
        self, tensor_id: TensorId, actual: torch.Tensor | None, key: Callable[[StepResult], torch.Tensor | None], *, contrast: bool = False,
    ) -> TensorComparison:
        """``actual`` against the tensor ``key`` picks, as ``tensor_id`` (the terms of the
        second look apply to a ``"grad"``, of the parameter it names). A ``contrast`` is
        expected to differ and gets no second look."""
        expected = key(self.expected)
        anchor = key(self.anchor) if self.anchor is not None else None
        first = compare_tensors(tensor_id, actual, expected, anchor, self.check.tolerance)
        if first.ok or first.problem is not None or contrast or self.anchor is None:
            return first
        second = self.rounding
        return compare_tensors(
            tensor_id, actual, expected, anchor, self.check.tolerance,
            probe=key(second.probe) if second.probe is not None else None,
            terms=second.terms.get(tensor_id.name) if tensor_id.kind == "grad" else None,
            jitter=key(second.jitter) if second.jitter is not None else None,
        )

    @functools.cached_property
    def rounding(self) -> _Rounding:
        """The second look's steps (``References``), run once, on first need."""
        check = self.check
        if check.dtype == torch.float64:
            probe = optional(lambda: check.reference(torch.float32))
            jitter = optional(lambda: check.reference(torch.float64, jitter=FLOAT64_JITTER))
        else:
            probe, jitter = None, optional(lambda: check.reference(None, jitter=torch.finfo(check.dtype).eps))
        terms = optional(lambda: _all_reduce_terms(check, self.micro_batches, self.items)) or {}
        return _Rounding(terms, probe, jitter)


def _loss_against(loss_fn: LossFn, target: Any, output: Any) -> torch.Tensor:
    return loss_fn(output, target)


def _all_reduce_terms(check: RankedCheck, micro_batches: int, items: PieceItems | None = None) -> dict[str, Terms]:
    """The magnitude of what a correct ranked step sums into every gradient: each rank's
    shard, cut into ``micro_batches`` pieces as the ranks cut it (``micro_batch_split``),
    contributes ``t / T`` times its piece's mean-loss gradient (each piece's loss weighted
    by its share of the items, ``t * world_size / T``, rows or tokens, the all-reduce's
    average dividing by ``world_size``). Measured with a single-device step on each
    piece's rows, in the working dtype."""
    largest: dict[str, float] = {}
    norms: dict[str, float] = {}
    loss_fn = check.loss_fn
    total = items.total if items is not None else check.batch_size
    for rank, shard in enumerate(cut_pieces(check.args, check.kwargs, check.target_as(None), check.shard_sizes, micro_batches)):
        for piece, part in enumerate(shard):
            loss = functools.partial(_loss_against, loss_fn, part.target)
            step = run_step(check.module, part.args, loss, kwargs=part.kwargs)
            weight = (items.counts[rank][piece] if items is not None else part.rows) / total
            for name, grad in step.grads.items():
                if grad is None or not grad.numel():
                    continue
                size, norm = magnitudes(grad)
                if math.isfinite(size) and math.isfinite(norm):
                    largest[name] = largest.get(name, 0.0) + weight * size
                    norms[name] = norms.get(name, 0.0) + weight * norm
    return {name: Terms(largest[name], norms[name]) for name in largest}


# --------------------------------------------------------------------------- training


@dataclass
class TrainingTrace:
    """What single-device training left after every step besides its parameters: the
    buffers, and the optimizer's state (``optimizer_state_of``), one dict per step."""

    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state: list[dict[str, torch.Tensor]] = field(default_factory=list)


def train_single_device(
    module: nn.Module,
    batches: Sequence[Batch],
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    dtype: torch.dtype | None,
    after_backward: AfterBackward | None = None,
    *,
    context: Callable[..., ReferenceContext] = ReferenceContext,
    before_step: Callable[[nn.Module], None] | None = None,
    on_step: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
    trace: TrainingTrace | None = None,
    jitter: float = 0.0,
    dropout: Sequence[Masks] | None = None,
    exact: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], list[list[str]]]:
    """Parameters after every step on one device, and the parameters that required grad
    but got none in each step (``unused_names``); ``after_backward(ctx)`` runs between each
    backward and its optimizer step, with a ``ReferenceContext`` over the full batch (or the
    subclass ``context`` makes, with the same fields: a backend's, that hooks written for it
    read). ``before_step(model)`` sees the gradients each optimizer step uses;
    ``on_step(index, model, optimizer)`` runs after each optimizer step, to read what else
    the step left (buffers, the optimizer's state). ``trace``, when given, receives the
    buffers and the optimizer's state after every step (``optimizer_state_of``);
    ``jitter``: start from parameters multiplied by ``1 +- jitter`` (``jitter_parameters``),
    a sample of how far rounding alone moves the run. ``dropout``: the masks the ranks'
    Dropout layers drew in each step (``replay_masks``), applied by the same layers in
    that step's forward; without it they draw their own. ``exact``: every operation of every
    step, the optimizer's included, shown exact as it runs (``proving``), else
    ``InvalidArgument`` naming it and the step (a learning rate of 0.1 rounds)."""
    model = copy_module(module, dtype)
    if jitter:
        jitter_parameters(model, jitter)
    opt = optimizer(model.parameters())
    history = []
    unused: list[list[str]] = []
    with torch.random.fork_rng(devices=[]), default_dtype(dtype), _group_if(after_backward) as group, _proving_if(exact, model) as prover:
        torch.manual_seed(0)
        for index, (inputs, kwargs, target) in enumerate(batches):
            _stage(prover, f"the code around the model in step {index + 1}")
            opt.zero_grad(set_to_none=True)
            args, keywords, goal = (convert_tensors(part, dtype, CPU) for part in (inputs, kwargs, target))
            with replaying(model, dropout[index] if dropout else None):
                output = model(*args, **keywords)
            _stage(prover, f"the loss of step {index + 1}")
            loss_fn(output, goal).backward()
            unused.append(unused_names(model, {name: p.grad for name, p in model.named_parameters()}))
            if after_backward is not None:
                _stage(prover, f"after_backward={callable_name(after_backward)} of step {index + 1}")
                rows = batch_size_of(tuple(args), kwargs=keywords)
                ctx = context(
                    rank=0, world_size=1, module=model, inputs=args, target=goal, loss_fn=loss_fn,
                    shard_sizes=(rows,), device=CPU, kwargs=dict(keywords), step_index=index, one_rank=group,
                )
                with after_backward_note(after_backward):
                    after_backward(ctx)
            if before_step is not None:
                before_step(model)
            _stage(prover, f"the optimizer step of step {index + 1} ({callable_name(optimizer)})")
            opt.step()
            history.append({name: p.detach().clone() for name, p in model.named_parameters()})
            if trace is not None:
                trace.buffers.append({name: b.detach().clone() for name, b in model.named_buffers()})
                trace.state.append(optimizer_state_of(opt, model))
            if on_step is not None:
                on_step(index, model, opt)
    return history, unused


def exact_training_notes(check: RankedCheck, steps: int, optimizer: OptimizerFactory) -> list[str]:
    """In exact mode, what a training check proved besides the first batch's step
    (``RankedCheck.evidence``): the whole single-device run (``train_single_device``)."""
    if not check.exact:
        return []
    return [
        f"Exact: single-device training ran under the proof, every operation of its {steps} steps exact, the "
        f"optimizer's ({callable_name(optimizer)}) included."
    ]


def _proving_if(exact: bool, model: nn.Module) -> contextlib.AbstractContextManager[Prover | None]:
    """``proving(model)`` in exact mode, else nothing."""
    return proving(model, stage="the code around the model") if exact else contextlib.nullcontext()


def _stage(prover: Prover | None, stage: str) -> None:
    """Names the code about to run outside the model, for an exact-mode refusal."""
    if prover is not None:
        prover.stage = stage


def _group_if(after_backward: AfterBackward | None) -> contextlib.AbstractContextManager[Any]:
    """A group of one rank for the reference's hook, only when there is a hook."""
    return one_rank_group() if after_backward is not None else contextlib.nullcontext()


def training_rows(
    check: RankedCheck,
    ranks: Sequence[Any],
    expected: Sequence[dict[str, torch.Tensor]],
    anchor: Sequence[dict[str, torch.Tensor]] | None,
    *,
    trace: TrainingTrace | None = None,
    trace_anchor: TrainingTrace | None = None,
    jittered: Callable[[], tuple[Sequence[dict[str, torch.Tensor]], TrainingTrace]] | None = None,
) -> tuple[list[TensorComparison], int]:
    """Each rank's parameters (``ranks[r].params``, one dict per step) against one device's:
    the rows of the first step at which some rank diverges, else of the last step. With
    ``trace`` (and its float64 twin ``trace_anchor``), each rank's buffers and optimizer
    state after every step (``ranks[r].step_buffers``, ``step_state``) are compared too.

    ``jittered``: single-device training from parameters a few units of roundoff off
    (``train_single_device(..., jitter=)``), run once, when a step first fails: its tensors
    are a further sample of rounding for that step's comparison (``compare_tensors``'
    ``jitter``), as the one-step checks' second look. A momentum buffer or Adam moment after
    the first step is a gradient, whose entries may cancel to nearly zero over the batch
    and keep rounding of the size of the terms that cancelled.
    """
    rows: list[TensorComparison] = []

    def rows_of(index: int, second: tuple[Sequence[dict[str, torch.Tensor]], TrainingTrace] | None) -> list[TensorComparison]:
        return _step_rows(check, ranks, index, expected[index], anchor, trace, trace_anchor, second)

    for index, rows in enumerate(steps_with_second_look(len(expected), rows_of, jittered)):
        if not all(row.ok for row in rows):
            return rows, index
    return rows, len(expected) - 1


def _step_rows(
    check: RankedCheck, ranks: Sequence[Any], index: int, reference: Mapping[str, torch.Tensor],
    anchor: Sequence[dict[str, torch.Tensor]] | None, trace: TrainingTrace | None, trace_anchor: TrainingTrace | None,
    second: tuple[Sequence[dict[str, torch.Tensor]], TrainingTrace] | None,
) -> list[TensorComparison]:
    """Every rank's rows of step ``index`` (``training_rows``), with ``second``'s tensors as
    the jittered sample when given."""
    params_j = second[0][index] if second is not None else {}
    rows = [
        compare_tensors(
            TensorId("param", name, rank=r, variant=f"step {index + 1}"),
            rank.params[index].get(name),
            value,
            anchor[index][name] if anchor else None,
            check.tolerance,
            jitter=params_j.get(name),
        )
        for r, rank in enumerate(ranks)
        for name, value in reference.items()
    ]
    if trace is not None:
        jittered = second[1] if second is not None else None
        rows += _traced_rows(
            check, ranks, index, "buffer", trace.buffers, trace_anchor.buffers if trace_anchor else None, jittered.buffers if jittered else None,
        )
        rows += _traced_rows(
            check, ranks, index, "optimizer state", trace.state, trace_anchor.state if trace_anchor else None, jittered.state if jittered else None,
        )
    return rows


def _traced_rows(
    check: RankedCheck, ranks: Sequence[Any], index: int, kind: str,
    expected: Sequence[dict[str, torch.Tensor]], anchor: Sequence[dict[str, torch.Tensor]] | None,
    jittered: Sequence[dict[str, torch.Tensor]] | None = None,
) -> list[TensorComparison]:
    """Each rank's buffers (``kind`` "buffer") or optimizer state after step ``index``
    against one device's; none for a rank that did not read them. Floating-point buffers
    only: an integer buffer counts (batches, rows seen), each rank its own, as torch keeps
    it; a running statistic that enters the computation is a floating-point one."""
    if index >= len(expected):
        return []
    rows = []
    for r, rank in enumerate(ranks):
        mine = rank.step_buffers if kind == "buffer" else rank.step_state
        if index >= len(mine):
            continue
        for name, value in expected[index].items():
            if kind == "buffer" and not value.is_floating_point():
                continue  # a count (rows seen, num_batches_tracked): each rank keeps its own, as torch does
            rows.append(compare_tensors(
                TensorId(kind, name, rank=r, variant=f"step {index + 1}"), mine[index].get(name), value,
                anchor[index].get(name) if anchor and index < len(anchor) else None, check.tolerance,
                jitter=jittered[index].get(name) if jittered and index < len(jittered) else None,
            ))
    return rows


def _factor(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float | None:
    """``c`` when ``actual`` is ``c`` times ``expected`` on every tensor (1.0 included), to
    1e-3 of its norm; None when not a clean multiple or nothing moved."""
    return scale_factor(actual, expected, 1e-3)


def _changes(after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.double() - before[name].double() for name, value in after.items() if name in before and before[name].shape == value.shape}


def _agreed(factors: Sequence[float | None]) -> float | None:
    """The factor every entry of ``factors`` gives, to 1e-3 of its size; None when one is
    missing or they differ."""
    found = [f for f in factors if f is not None]
    if not found or len(found) != len(factors) or max(found) - min(found) > 1e-3 * max(abs(f) for f in found):
        return None
    return found[0]


def _distinct(factors: Sequence[float | None]) -> list[float]:
    """``factors`` when every one is present and they differ beyond 1e-3 of their size."""
    found = [f for f in factors if f is not None]
    if not found or len(found) != len(factors) or max(found) - min(found) <= 1e-3 * max(abs(f) for f in found):
        return []
    return found


def _not_one(c: float | None) -> float | None:
    return None if c is None or abs(c - 1.0) <= 1e-3 else c


def training_scale_note(
    ranks: Sequence[Any],
    expected: Sequence[Mapping[str, torch.Tensor]],
    initial: Mapping[str, torch.Tensor],
    index: int,
    world_size: int,
    *,
    hook: str | None = None,
    shards: int = 0,
    trace: TrainingTrace | None = None,
) -> tuple[str | None, float | None]:
    """The cause of a training mismatch at step ``index`` when the evidence shows a gradient
    scale: every rank's update of its parameters (after minus before the step: the change,
    not the parameters) ``c`` times the single-device update on every parameter; or, with
    ``shards`` ranks sharding dim 0 (FSDP2), ``c_j`` times on the rows rank ``j`` stores; or,
    at the first step, the first-order optimizer state (SGD's ``momentum_buffer``, Adam's
    ``exp_avg``: what Adam's sign-like first update hides) ``c`` times. ``hook``: the
    ``after_backward`` hook's name, where one ran. Returns the sentence and ``c`` (None, None
    when the evidence shows no such scale)."""
    ref = _changes(expected[index], expected[index - 1] if index else initial)
    present = [rank for rank in ranks if index < len(rank.params)]
    updates = [_changes(rank.params[index], rank.params[index - 1] if index else initial) for rank in present]
    c = _not_one(_agreed([_factor(update, ref) for update in updates])) if updates else None
    per_shard: list[float] = []
    if c is None and shards > 1 and updates:

        def piece(tensors: Mapping[str, torch.Tensor], j: int) -> dict[str, torch.Tensor]:
            return {n: t.chunk(shards)[j] for n, t in tensors.items() if t.dim() and len(t.chunk(shards)) > j}

        per_shard = _distinct([_factor(piece(updates[0], j), piece(ref, j)) for j in range(shards)])
    what = "update"
    if c is None and not per_shard and index == 0 and trace is not None and trace.state:
        first_order = ("momentum_buffer", "exp_avg")
        ref_state = {n: t for n, t in trace.state[0].items() if n.rsplit(".", 1)[-1] in first_order}
        if ref_state:
            c = _not_one(_agreed([
                _factor({n: t for n, t in rank.step_state[0].items() if n in ref_state}, ref_state) for rank in ranks if rank.step_state
            ]))
            what = "optimizer state (" + "/".join(sorted({n.rsplit(".", 1)[-1] for n in ref_state})) + ")"
    cause = (
        f"a gradient scale applied in after_backward={hook}" if hook
        else "the gradients the optimizer stepped with were scaled (by the step, or the loss)"
    )
    if per_shard:
        factors_text = ", ".join(f"{p:.6g}" for p in per_shard)
        return (
            f"At step {index + 1} the update of the parameters is [{factors_text}] times the single-device one on the "
            f"rows each rank stores (FSDP2 shards dim 0 over the {shards} ranks, rank j holding the j-th piece): "
            f"{cause} that differs from rank to rank: a clip norm computed from each rank's local shard "
            "(p.grad.to_local()) rather than from the whole gradient? torch.nn.utils.clip_grad_norm_ on the "
            "DTensor parameters computes the norm over every shard."
        ), None
    if c is None:
        return None, None
    root = ""
    if hook and world_size > 1 and abs(c * world_size**0.5 - 1.0) < 1e-3:
        root = (
            f" {c:.6g} is 1/sqrt({world_size}): a norm whose square was summed over the {world_size} ranks "
            f"(dist.all_reduce) when every rank already held the whole averaged gradient, so the norm came out "
            f"sqrt({world_size}) times too large."
        )
    return (
        f"At step {index + 1} the {what} is {c:.6g} times the single-device one on every parameter, on every rank: "
        f"{cause}{' (a clip norm computed over part of the gradient, or reduced twice?)' if hook else ''}.{root}"
    ), c


def per_shard_buffers(module: nn.Module) -> set[str]:
    """Buffers a rank updates from its own shard as torch means it to, not compared with one
    device's full-batch update: BatchNorm's running statistics (without SyncBatchNorm each
    rank normalises by its shard's statistics, a known divergence named with the module's
    divergence sources) and integer buffers (counts: batches, rows seen)."""
    batch_norm = {
        f"{path}.{name}" if path else name
        for path, sub in module.named_modules() if isinstance(sub, _BatchNorm)
        for name, _b in sub.named_buffers(recurse=False)
    }
    return batch_norm | {name for name, b in module.named_buffers() if not b.is_floating_point()}


def local_buffer_notes(module: nn.Module, rows: Sequence[TensorComparison], sync: str) -> list[str]:
    """Why buffers differ from single-device training, when some do that are not
    ``per_shard_buffers``: a running statistic updated in forward from the rank's own shard.
    ``sync``: what the backend does with buffers, one sentence."""
    names = sorted({row.id.name for row in rows if row.id.kind == "buffer" and not row.ok} - per_shard_buffers(module))
    if not names:
        return []
    return [
        f"Buffers {names} differ from what one device computes over the full batch: each rank's forward updated "
        f"them from its own shard (a running statistic of the local batch: an EMA, a batch-statistic buffer). {sync} "
        "Average the statistic over the ranks where forward computes it (dist.all_reduce(stat); stat /= "
        "dist.get_world_size(), under `if dist.is_initialized():` for single-device runs: the single-device "
        "reference has no process group, or with an after_backward hook one of a single rank, where the average "
        "changes nothing), or for BatchNorm use SyncBatchNorm."
    ]


def jittered_training(
    check: RankedCheck, batches: Sequence[Batch], optimizer: OptimizerFactory, after_backward: AfterBackward | None = None,
    dropout: Sequence[Masks] | None = None,
) -> Callable[[], tuple[list[dict[str, torch.Tensor]], TrainingTrace]]:
    """The ``jittered`` run of ``training_rows`` for ``check``: single-device training in
    ``jitter_for(check.dtype)``'s dtype from parameters so perturbed, replaying ``dropout``
    (``train_single_device``)."""

    def run() -> tuple[list[dict[str, torch.Tensor]], TrainingTrace]:
        trace = TrainingTrace()
        dtype, size = jitter_for(check.dtype)
        history, _unused = train_single_device(
            check.module, batches, check.loss_fn, optimizer, dtype, after_backward, trace=trace, jitter=size, dropout=dropout,
        )
        return history, trace

    return run
