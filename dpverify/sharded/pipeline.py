"""Pipeline parallelism (``torch.distributed.pipelining``) checked against one device:
``assert_pipeline_grads_match`` (its docstring and docs/distributed.md say what is
compared, and what evidence from the ranks, ``pipeline_rank``, fails the check).
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Unpack

import torch
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from dpverify.checks.dp import raise_unless_ok
from dpverify.core.comparison import (
    StepComparison,
    TensorComparison,
    TensorId,
    compare_tensors,
    steps_with_second_look,
    uniform_scale,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.numerics import jitter_for, scale_factor
from dpverify.core.step import (
    Key,
    StepResult,
    as_inputs,
    batch_size_of,
    flatten_tensors,
    parameter_sites,
    run_step,
)
from dpverify.core.validation import (
    require_bool,
    require_callable,
    require_int_at_least,
    require_loss_fn,
    require_module_with_grads,
)
from dpverify.ddp.pool import require_picklable
from dpverify.ranked.check import (
    Batch,
    RankedCheck,
    References,
    ShardUnit,
    callable_name,
    describe_batches,
    exact_batches,
    exact_training_notes,
    optional,
    relative_gap,
    same_up_to_rounding,
    train_single_device,
    training_code,
)
from dpverify.ranked.items import PieceItems
from dpverify.ranked.notes import fraction
from dpverify.ranked.options import (
    RankedKeywords,
    TrainingKeywords,
    accepted,
    check_keywords,
    documented,
)
from dpverify.ranked.rank import (
    AfterBackward,
    LossFn,
    OptimizerFactory,
    buffers_of,
    even_shards,
    grads_of,
    shard_bounds,
    take_rows,
)
from dpverify.sharded.pipeline_rank import (
    PipelineContext,
    PipelineRankStep,
    PipelineRankTraining,
    PipelineReferenceContext,
    PipelineTask,
    PipelineTrainingTask,
    optimizer_state,
    run_pipeline_task,
    run_pipeline_training,
    sync_tied_grads,
)

__all__ = [
    "SCHEDULES",
    "PipelineCheck",
    "PipelineContext",
    "PipelineTrainingKeywords",
    "assert_pipeline_grads_match",
    "assert_pipeline_training_matches",
    "pipeline_check",
    "stage_children",
    "sync_tied_grads",
]

#: The schedules ``schedule=`` takes by name.
SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


# --------------------------------------------------------------------------- validation


def _schedule(schedule: Any) -> type[PipelineScheduleSingle]:
    """The schedule class ``schedule`` names, or ``schedule`` itself when it is one."""
    if isinstance(schedule, str):
        found = SCHEDULES.get(schedule.lower())
        if found is None:
            raise InvalidArgument(
                f"schedule={schedule!r} is not a schedule dpverify knows; pass one of "
                f"{sorted(SCHEDULES)}, or a subclass of "
                "torch.distributed.pipelining.schedules.PipelineScheduleSingle"
            )
        return found
    if not isinstance(schedule, type) or not issubclass(schedule, PipelineScheduleSingle):
        raise InvalidArgument(
            f"schedule={schedule!r} is neither a schedule name ({sorted(SCHEDULES)}) nor a "
            "subclass of torch.distributed.pipelining.schedules.PipelineScheduleSingle (one "
            "stage per rank); pass 'gpipe', '1f1b' or such a class"
        )
    require_picklable(schedule, "schedule")
    return schedule


def _split_index(point: Any, names: Sequence[str]) -> int:
    if isinstance(point, str):
        if point not in names:
            raise InvalidArgument(
                f"split_points names the child {point!r}, which the module does not have; its "
                f"top-level children are {list(names)}"
            )
        return names.index(point)
    if isinstance(point, bool) or not isinstance(point, int):
        raise InvalidArgument(
            f"split_points contains {point!r}; pass the index (int) or the name (str) of the "
            "top-level child each stage after the first begins with"
        )
    return point


def stage_children(module: nn.Module, world_size: int, split_points: Sequence[int | str] | None = None) -> tuple[tuple[str, ...], ...]:
    """The names of the top-level children of each of ``world_size`` stages: stage ``s + 1``
    begins at child ``split_points[s]`` (an index into ``named_children()``, or a name);
    default as even as possible, the first stages one child more.

    Raises:
        InvalidArgument: too few children for the stages, or ``split_points`` of the wrong
            length, out of range, unsorted, or leaving a stage empty.
    """
    names = [name for name, _child in module.named_children()]
    if len(names) < world_size:
        raise InvalidArgument(
            f"module={type(module).__name__} has {len(names)} top-level children "
            f"({names}), too few for world_size={world_size} pipeline stages of at least one "
            f"child each; pass world_size <= {len(names)}, or a module with more children"
        )
    if split_points is None:
        starts = [start for start, _stop in shard_bounds(even_shards(len(names), world_size))][1:]
    else:
        if isinstance(split_points, (str, bytes)) or not isinstance(split_points, Sequence):
            raise InvalidArgument(
                f"split_points={split_points!r}: pass a list of where stages 1.. begin, e.g. "
                f"{[start for start, _stop in shard_bounds(even_shards(len(names), world_size))][1:]}"
            )
        if len(split_points) != world_size - 1:
            raise InvalidArgument(
                f"split_points={list(split_points)} has {len(split_points)} entries for "
                f"world_size={world_size} stages; pass world_size - 1 = {world_size - 1} points "
                "(where each stage after the first begins)"
            )
        starts = [_split_index(point, names) for point in split_points]
    bounds = [0, *starts, len(names)]
    for stage, (start, stop) in enumerate(itertools.pairwise(bounds)):
        if not 0 <= start < stop <= len(names):
            raise InvalidArgument(
                f"split_points={list(split_points or starts)} leaves stage {stage} without a child "
                f"(it would hold children {start}:{stop} of {len(names)}): the points must be "
                f"strictly increasing indices in 1..{len(names) - 1} (or child names in "
                "module order), so that every stage holds at least one child"
            )
    return tuple(tuple(names[start:stop]) for start, stop in itertools.pairwise(bounds))


def _tensor_batch(args: tuple[Any, ...], target: Any) -> int:
    """The batch's rows, once every input and the target are tensors with that many rows:
    the schedule splits each along dim 0 with ``torch.tensor_split``."""
    batch = batch_size_of(args)
    for index, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor) or arg.dim() == 0 or arg.size(0) != batch:
            what = f"a tensor of shape {tuple(arg.shape)}" if isinstance(arg, torch.Tensor) else type(arg).__name__
            raise InvalidArgument(
                f"inputs[{index}] is {what}; the pipeline's first stage takes tensors with the "
                f"batch's {batch} rows along dim 0 (the schedule splits each into microbatches)"
            )
    if not isinstance(target, torch.Tensor) or target.dim() == 0 or target.size(0) != batch:
        what = f"a tensor of shape {tuple(target.shape)}" if isinstance(target, torch.Tensor) else type(target).__name__
        raise InvalidArgument(
            f"target is {what}; pass a tensor with the batch's {batch} rows along dim 0 (the "
            "last stage's schedule splits it into microbatches like the inputs)"
        )
    return batch


def _microbatches(batch: int, n_microbatches: int) -> tuple[int, ...]:
    """Equal microbatches, or InvalidArgument (see ``assert_pipeline_grads_match``)."""
    if batch < n_microbatches:
        raise InvalidArgument(
            f"n_microbatches={n_microbatches} is more than the batch's {batch} rows; torch's "
            "schedule needs at least one row per microbatch. Pass n_microbatches <= "
            f"{batch}, or a larger batch"
        )
    if batch % n_microbatches:
        sizes = [len(c) for c in torch.tensor_split(torch.empty(batch), n_microbatches)]
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        larger = batch + n_microbatches - batch % n_microbatches
        raise InvalidArgument(
            f"n_microbatches={n_microbatches} does not divide the batch of {batch} rows: "
            f"torch.tensor_split makes microbatches of {sizes} rows, and torch 2.13's "
            "PipelineStage sizes the buffers it receives activations and gradients in from the "
            f"first microbatch ({sizes[0]} rows), so the smaller ones do not fit: the loss or "
            "a stage's backward fails with a shape error. (Were they to run, the mean of "
            "unequal microbatches' mean losses would also weight each row 1/(n * rows of its "
            "microbatch) instead of 1/B.) Pass a batch divisible by n_microbatches (e.g. "
            f"{larger} rows), pad the batch, or pick n_microbatches among {divisors}"
        )
    return even_shards(batch, n_microbatches)


def _chain_outputs(module: nn.Module, args: tuple[Any, ...], stages: Sequence[Sequence[str]]) -> tuple[Any, list[Any]]:
    """``module``'s children run in order on ``args``: the final output, and each stage's."""
    children = dict(module.named_children())
    value: Any = None
    ends: list[Any] = []
    first = True
    for names in stages:
        for name in names:
            value = children[name](*args) if first else children[name](value)
            first = False
        ends.append(value)
    return value, ends


def _sendable(value: Any) -> bool:
    """What a ``PipelineStage`` sends to the next stage: a tensor, or a non-empty tuple of
    tensors (the next stage's module gets them as positional arguments)."""
    if isinstance(value, tuple):
        return bool(value) and all(isinstance(item, torch.Tensor) for item in value)
    return isinstance(value, torch.Tensor)


def _require_chain(module: nn.Module, args: tuple[Any, ...], stages: Sequence[Sequence[str]]) -> None:
    """A pipeline runs the children in order, each stage sending a tensor or a tuple of
    tensors to the next: refuse a module whose forward is something else (checked on this
    batch), or a stage boundary that is neither."""
    sequential = type(module).forward is nn.Sequential.forward
    module = copy.deepcopy(module)  # a train-mode forward updates BatchNorm's statistics
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            chained, ends = _chain_outputs(module, args, stages)
        except Exception as error:
            if sequential:
                raise  # the module's own forward fails the same way: its error is the answer
            names = [name for names in stages for name in names]
            raise InvalidArgument(
                f"module={type(module).__name__} is not the chain of its top-level children: running "
                f"{names} in order, each on the previous one's output, raised {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}. A pipeline runs exactly that chain, "
                "one stage after the other; pass an nn.Sequential, or a module whose forward calls its "
                "children in named_children() order"
            ) from error
        whole = None
        if not sequential:
            torch.manual_seed(0)
            whole = module(*args)
    for stage, end in enumerate(ends[:-1]):
        if not _sendable(end):
            raise InvalidArgument(
                f"stage {stage} ends with child {stages[stage][-1]!r}, which returns "
                f"{type(end).__name__}, not a tensor or a tuple of tensors; a pipeline stage sends "
                "those to the next (whose first child takes them as its arguments). Move "
                "split_points to a boundary where tensors flow"
            )
    if sequential:
        return
    got = dict(flatten_tensors(chained, "output"))
    want = dict(flatten_tensors(whole, "output"))
    same = got.keys() == want.keys() and all(
        got[k].shape == want[k].shape and torch.equal(got[k], want[k]) for k in want
    )
    if not same:
        names = [name for names in stages for name in names]
        raise InvalidArgument(
            f"module={type(module).__name__} is not the chain of its top-level children: running "
            f"{names} in order on these inputs does not give module(inputs). A pipeline runs "
            "exactly that chain, one stage after the other; pass an nn.Sequential, or a module "
            "whose forward calls its children in named_children() order, each on the previous "
            "one's output"
        )


def _aliases(module: nn.Module) -> dict[str, str]:
    """Every name of every parameter, mapped to its first name (the one the gradient
    dictionaries use): a tied weight has several."""
    first = {}
    for name, path, attr in parameter_sites(module):
        first[id(module.get_submodule(path)._parameters[attr])] = name
    return {name: first[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}


# --------------------------------------------------------------------------- the check


class PipelineKeywords(RankedKeywords, total=False):
    """The optional keywords of the pipeline helper (``pipeline_check`` takes them but ``msg``)."""

    split_points: Sequence[int | str] | None
    schedule: str | type[PipelineScheduleSingle]
    scale_grads: bool
    objective: LossFn | None


@dataclass(frozen=True)
class PipelineCheck(RankedCheck):
    """A validated pipeline scenario.

    It is a ``RankedCheck`` whose ``shard_sizes`` are the microbatches' rows: a schedule adds
    up its microbatches' gradients (divided by their number, with ``scale_grads``) as DDP
    averages its shards', so ``references()`` and the second look for rounding of
    ``References`` (the terms summed into each gradient, one per microbatch) apply as
    they are, and ``loss_reduction()`` tells a sum loss from a mean one on the microbatches.
    """

    stages: tuple[tuple[str, ...], ...] = ()
    schedule: type[PipelineScheduleSingle] = ScheduleGPipe
    n_microbatches: int = 1
    scale_grads: bool = True
    objective: LossFn | None = None

    NO_GRAD: ClassVar[str] = "there is no gradient for a pipeline stage to compare"
    UNIT: ClassVar[ShardUnit] = ShardUnit("microbatch", "n_microbatches", why="")
    AVERAGER: ClassVar[str] = "the schedule (scale_grads=True)"

    @classmethod
    def shard_parts(cls, world_size: int, fields: Mapping[str, Any]) -> int:
        return int(fields["n_microbatches"])

    @classmethod
    def exact_weights(cls, world_size: int, sizes: Sequence[int], fields: Mapping[str, Any]) -> list[float]:
        """Each microbatch's loss gradient, summed by the schedule: divided by their number
        with ``scale_grads`` (which must then be a power of two), else as it is. With an
        ``objective`` the single-device step is another loss than the microbatches' and no
        proof covers both."""
        if fields.get("objective") is not None:
            raise InvalidArgument(
                "exact=True with objective=...: the single-device step would run objective and the stages loss_fn, "
                "and exact mode proves one loss; pass exact=True without objective, or check without exact=True"
            )
        if not fields.get("scale_grads", True):
            return [1.0 for _ in sizes]
        return super().exact_weights(world_size, sizes, fields)

    def describe(self, step: Any = None) -> str:
        stages = "; ".join(f"stage {s} children {list(names)}" for s, names in enumerate(self.stages))
        return (
            f"batch of {self.batch_size} rows in {self.n_microbatches} microbatches of "
            f"{list(self.shard_sizes)} rows; {len(self.stages)} pipeline stages on "
            f"{self.world_size} ranks ({self.runner.backend}): {stages}; "
            f"{self.schedule.__name__}(n_microbatches={self.n_microbatches}, "
            f"scale_grads={self.scale_grads}), loss_fn {callable_name(self.loss_fn)}"
            + (f", objective {callable_name(self.objective)}" if self.objective is not None else "")
        )

    @property
    def goal(self) -> LossFn:
        """The loss one device trains on over the full batch: ``objective``, else ``loss_fn``."""
        return self.loss_fn if self.objective is None else self.objective

    def reference(self, dtype: torch.dtype | None, *, jitter: float = 0.0) -> StepResult:
        """The single-device full-batch step of ``goal`` (``RankedCheck.reference``)."""
        target = self.target_as(dtype)
        goal = self.goal
        return run_step(self.module, self.args, lambda output: goal(output, target), dtype=dtype, jitter=jitter, kwargs=self.kwargs)

    def schedule_loss(self, output: Any, target: Any) -> torch.Tensor:
        """The loss whose gradient the schedule computes from a full-batch ``output``:
        ``loss_fn`` on each microbatch's rows, their mean with ``scale_grads``, else their sum."""
        return self.combined([
            self.loss_fn(take_rows(output, start, stop, self.batch_size), take_rows(target, start, stop, self.batch_size))
            for start, stop in shard_bounds(self.shard_sizes)
        ])

    def task(self) -> PipelineTask:
        return PipelineTask(
            module=self.module, inputs=self.args, target=self.target, loss_fn=self.loss_fn,
            stages=self.stages, schedule=self.schedule, n_microbatches=self.n_microbatches,
            scale_grads=self.scale_grads,
        )

    def combined(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The loss the schedule's gradients are the gradient of: the mean of the
        microbatch losses with ``scale_grads`` (it divides by their number), else their sum."""
        stacked = torch.stack([loss.reshape(()) for loss in losses])
        return stacked.mean() if self.scale_grads else stacked.sum()


def pipeline_check(
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, n_microbatches: int,
    **options: Unpack[PipelineKeywords],
) -> PipelineCheck:
    """The validated scenario of ``assert_pipeline_grads_match`` (same arguments): its
    ``task()`` is what the ranks run (``run_pipeline_task``), for a caller that wants the
    ranks' evidence itself.

    Raises:
        InvalidArgument: an argument cannot be used.
    """
    accepted(pipeline_check, options, PipelineKeywords, without=("msg",))
    require_module_with_grads(module, why=PipelineCheck.NO_GRAD)
    if isinstance(world_size, int) and not isinstance(world_size, bool) and world_size == 1:
        raise InvalidArgument(
            "world_size=1: one stage is not a pipeline (nothing is sent between ranks); pass "
            "world_size >= 2, one stage per rank. Microbatches on one device are gradient "
            "accumulation: assert_ddp_accumulation_matches checks that"
        )
    world = require_int_at_least(world_size, "world_size", 2)
    microbatches = require_int_at_least(n_microbatches, "n_microbatches", 1)
    scale = require_bool(options.get("scale_grads", True), "scale_grads")
    chosen = _schedule(options.get("schedule", "gpipe"))
    if issubclass(chosen, Schedule1F1B) and microbatches < world:
        raise InvalidArgument(
            f"n_microbatches={microbatches} is fewer than the {world} stages; "
            f"{chosen.__name__} (1F1B) needs at least one microbatch per stage (torch raises "
            f"otherwise): pass n_microbatches >= {world}, or schedule='gpipe'"
        )
    require_loss_fn(loss_fn)
    require_picklable(loss_fn, "loss_fn")
    objective = options.get("objective")
    if objective is not None:
        require_callable(objective, "objective", "objective(output, target) -> scalar over the full batch, e.g. F.cross_entropy")
    args = as_inputs(inputs)
    batch = _tensor_batch(args, target)
    sizes = _microbatches(batch, microbatches)
    stages = stage_children(module, world, options.get("split_points"))
    _require_chain(module, args, stages)
    return PipelineCheck.create(
        module, args, target, loss_fn=loss_fn, world_size=world, shards=sizes, **check_keywords(options),
        stages=stages, schedule=chosen, n_microbatches=microbatches, scale_grads=scale, objective=objective,
    )


@documented
def assert_pipeline_grads_match(
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, n_microbatches: int,
    **options: Unpack[PipelineKeywords],
) -> StepComparison:
    """Asserts one pipeline-parallel step gives every stage the full-batch gradient.

    ``module``'s top-level children are cut into ``world_size`` stages, one per rank of the
    pool; each rank wraps a fresh copy of its children in torch's ``PipelineStage`` (over
    the ranks' default process group) and runs one ``step`` of the schedule, rank 0 feeding
    ``inputs`` and the last rank ``target``. Each stage's parameters' gradients, the last
    stage's output (every row of the batch), each microbatch's loss (against ``loss_fn`` on
    the same rows of the single-device output) and the schedule's combined loss (the mean
    of the microbatch losses with ``scale_grads``, else their sum) must equal the
    single-device full-batch step (float64-anchored tolerance, as the DDP checks).

    The check also fails, whatever the gradients, when the ranks' evidence shows a skipped
    or repeated microbatch, or a parameter held by no stage or by two. A sum loss with
    ``scale_grads=True``, or a mean loss without it, is named with its factor and the fix,
    and so is a token-mean loss over microbatches of different token counts (the
    loss-averaging trap); uneven microbatches are refused before anything runs
    (docs/distributed.md tells why).

    Args:
        module: an ``nn.Sequential``, or a module whose forward runs its top-level
            children in ``named_children()`` order, each on the previous one's output
            (checked on ``inputs``). A stage may end with a tuple of tensors: torch's
            ``PipelineStage`` sends each, and the next stage's first child gets them as
            its positional arguments (within a stage a child gets the previous child's
            output as one argument, so a child that may begin a stage takes both).
        inputs: the batch tensor, or a tuple of tensors for the first child.
        target: the second argument of ``loss_fn``, a tensor with the batch's rows.
        loss_fn: the schedule's ``loss_fn(output, target)``, picklable.
        world_size: the number of stages and ranks, at least 2.
        n_microbatches: microbatches the schedule splits the batch into; must divide it.
        split_points: where stages 1 .. world_size - 1 begin, as indices into the top-level
            children or their names (default: as even as possible, the first stages one
            child more).
        schedule: ``"gpipe"`` (``ScheduleGPipe``), ``"1f1b"`` (``Schedule1F1B``), or a
            ``PipelineScheduleSingle`` subclass (top-level, picklable).
        scale_grads: passed to the schedule.
        objective: the loss one device computes over the full batch, when it is not
            ``loss_fn`` (the schedule's per-microbatch loss): the schedule's gradients, of
            the mean of the microbatch losses (``scale_grads``) or of their sum, must be
            ``objective``'s.
        <shared: pool, rtol, atol, msg, exact>

    Returns:
        The comparison (``str()`` summarises it; its notes hold what each stage ran).

    Raises:
        ParallelMismatch: a gradient, the output or a loss differs, or the ranks' evidence
            shows skipped microbatches or parameters held by no stage or by two.
        ParallelError: a rank raised, died or hung; the pool restarts for the next check.
        InvalidArgument: an argument cannot be used (see above).
    """
    __tracebackhide__ = True
    accepted(assert_pipeline_grads_match, options, PipelineKeywords)
    scenario = options.copy()
    msg = scenario.pop("msg", None)
    check = pipeline_check(module, inputs, target, loss_fn=loss_fn, world_size=world_size, n_microbatches=n_microbatches, **scenario)
    title = "Pipeline-parallel gradients must match the single-device full-batch gradient on every stage"
    ranks: tuple[PipelineRankStep, ...] = check.send(run_pipeline_task, check.task(), title)
    refs = check.references()
    aliases = _aliases(module)
    rows = _grad_rows(check, ranks, refs, aliases) + _output_rows(check, ranks[-1], refs) + _loss_rows(check, ranks[-1], refs)
    failures = _evidence_failures(check, ranks, refs.expected.grads, aliases)
    notes = [_evidence_note(check, ranks)]
    scale = None
    if not all(row.ok for row in rows):
        more, scale = _scale_notes(check, ranks, refs.expected, aliases)
        notes += more + _schedule_loss_notes(check, _grads_by_name(ranks, aliases), refs.expected, check.module)
    outcome = check.outcome(title, None, rows, notes=notes, failures=failures, scale=scale)
    return raise_unless_ok(outcome, msg)


# --------------------------------------------------------------------------- comparison


def _grads_by_name(ranks: Sequence[PipelineRankStep], aliases: dict[str, str]) -> dict[str, torch.Tensor | None]:
    """Every stage's gradients under the module's names (the first stage's, for a weight
    two stages hold)."""
    grads: dict[str, torch.Tensor | None] = {}
    for rank in ranks:
        for name, grad in rank.grads.items():
            grads.setdefault(aliases.get(name, name), grad)
    return grads


def _grad_rows(check: PipelineCheck, ranks: Sequence[PipelineRankStep], refs: References, aliases: dict[str, str]) -> list[TensorComparison]:
    rows = []
    for r, rank in enumerate(ranks):
        for local, grad in rank.grads.items():
            name = aliases.get(local, local)
            if name in refs.expected.grads:
                rows.append(refs.compare(TensorId("grad", name, variant=f"stage {r}"), grad, Key.grad(name)))
    return rows


def _output_rows(check: PipelineCheck, last: PipelineRankStep, refs: References) -> list[TensorComparison]:
    mine = dict(last.outputs)
    stage = len(check.stages) - 1
    return [
        refs.compare(TensorId("output", path, variant=f"stage {stage}"), mine.get(path), Key.output(path))
        for path, _tensor in refs.expected.outputs
    ]


def _microbatch_losses(check: PipelineCheck, step: StepResult, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """``loss_fn`` on each microbatch's rows of the single-device output."""
    target = check.target_as(dtype)
    with torch.no_grad():
        return [
            check.loss_fn(take_rows(step.output, start, stop, check.batch_size), take_rows(target, start, stop, check.batch_size)).detach()
            for start, stop in shard_bounds(check.shard_sizes)
        ]


def _loss_rows(check: PipelineCheck, last: PipelineRankStep, refs: References) -> list[TensorComparison]:
    """The schedule's combined loss against the full-batch loss, and each microbatch's."""
    if len(last.losses) != check.n_microbatches:
        return []  # the evidence fails the check, and says why
    n = check.n_microbatches
    anchor = refs.anchor
    rows = [
        compare_tensors(
            TensorId("loss", variant="schedule", detail=f"({'mean' if check.scale_grads else 'sum'} of {n} microbatch losses)"),
            check.combined(last.losses), refs.expected.loss.detach(),
            anchor.loss.detach() if anchor is not None else None, check.tolerance,
        )
    ]
    expected = _microbatch_losses(check, refs.expected, None)
    anchors = _microbatch_losses(check, anchor, torch.float64) if anchor is not None else [None] * n
    for index, ((start, stop), loss) in enumerate(zip(shard_bounds(check.shard_sizes), last.losses, strict=True)):
        rows.append(compare_tensors(TensorId("loss", variant=f"microbatch {index}", detail=f"[{start}:{stop}]"), loss, expected[index], anchors[index], check.tolerance))
    return rows


# --------------------------------------------------------------------------- evidence


def _evidence_failures(
    check: PipelineCheck, ranks: Sequence[PipelineRankStep], expected: Mapping[str, torch.Tensor | None], aliases: dict[str, str], *,
    tied_ok: bool = False,
) -> list[str]:
    """What the ranks ran, held against what a pipeline step must run; ``tied_ok``: a
    weight held by several stages is allowed (the training check, whose ``after_backward``
    hook can sum its gradients, judges it by the parameters it trains)."""
    n = check.n_microbatches
    every = list(range(n))
    failures = []
    for r, rank in enumerate(ranks):
        where = f"Stage {rank.stage_index} (rank {r})"
        if rank.stage_index != r or rank.num_stages != len(check.stages):
            failures.append(f"Rank {r} ran as stage {rank.stage_index} of {rank.num_stages}; it should be stage {r} of {len(check.stages)}.")
        for what, ran, skipped in (
            ("forward", rank.forwards, "microbatches, so its gradients are not those of the full batch"),
            ("backward", rank.backwards, "microbatches' backward"),
        ):
            if sorted(ran) != every:
                failures.append(
                    f"{where} ran {what} for microbatches {list(ran)}, not each of the "
                    f"n_microbatches={n} once: the schedule skipped or repeated {skipped}."
                )
        if len(rank.forwards) == n and rank.output_grads != n:
            failures.append(f"{where}: a gradient reached its output {rank.output_grads} times for {n} microbatches.")
        if len(rank.forward_rows) == n and list(rank.forward_rows) != list(check.shard_sizes):
            failures.append(
                f"{where}'s children received {list(rank.forward_rows)} rows per microbatch; the "
                f"batch's microbatches have {list(check.shard_sizes)}."
            )
    if len(ranks[-1].losses) != n:
        failures.append(f"The last stage reported {len(ranks[-1].losses)} microbatch losses for n_microbatches={n}.")
    holders: dict[str, list[int]] = {}
    for r, rank in enumerate(ranks):
        for name in {aliases.get(local, local) for local in rank.held}:
            holders.setdefault(name, []).append(r)
    used = [name for name, grad in expected.items() if grad is not None]
    orphans = [name for name in used if not holders.get(name)]
    if orphans:
        failures.append(
            f"Parameters {orphans} are held by no stage: they belong to the module itself, not "
            "to one of its top-level children, so no stage trains them. Move them into a child."
        )
    shared = {name: where for name, where in holders.items() if len(where) > 1}
    if shared and not tied_ok:
        described = ", ".join(f"{name!r} by stages {where}" for name, where in shared.items())
        failures.append(
            f"Parameters are held by more than one stage: {described}. A weight tied between "
            "children of different stages becomes one copy per stage, and each stage's "
            "gradient is only its own children's part (PipelineStage does not add them up). "
            "Put the children that share it in one stage (split_points), or untie it; or, if your "
            "training sums the copies' gradients between backward and the optimizer step, check "
            "that with assert_pipeline_training_matches(..., after_backward=your hook) "
            "(dpverify.sync_tied_grads does it)."
        )
    return failures


def _evidence_note(check: PipelineCheck, ranks: Sequence[PipelineRankStep]) -> str:
    parts = []
    for r, rank in enumerate(ranks):
        parts.append(
            f"stage {rank.stage_index} on rank {r} (children {list(rank.children)}, "
            f"{len(rank.grads)} parameters) ran {len(rank.forwards)} forwards of "
            f"{list(rank.forward_rows)} rows and {len(rank.backwards)} backwards"
        )
    losses = len(ranks[-1].losses)
    return f"What the ranks ran: {'; '.join(parts)}; the last stage returned {losses} microbatch losses."


def _scale_notes(check: PipelineCheck, ranks: Sequence[PipelineRankStep], expected: StepResult, aliases: dict[str, str]) -> tuple[list[str], float | None]:
    """A uniform factor between the stages' gradients and one device's, and its cause."""
    c = uniform_scale(_grads_by_name(ranks, aliases), expected.grads)
    reduction = check.loss_reduction()
    n = check.n_microbatches
    notes = []
    if c is not None:
        notes.append(_explain_factor(check, c, reduction))
    if reduction == "sum" and check.scale_grads and (c is None or not math.isclose(c, 1 / n, rel_tol=1e-3)):
        notes.append(
            f"loss_fn sums over its rows, and scale_grads=True divides the accumulated gradients "
            f"by n_microbatches={n}: that is right for a mean loss only."
        )
    return notes, c


def _explain_factor(check: PipelineCheck, c: float, reduction: str | None) -> str:
    n, batch = check.n_microbatches, check.batch_size
    text = f"Every stage's gradient is {c:.6g} times the single-device full-batch gradient"
    if n > 1 and math.isclose(c, 1 / n, rel_tol=1e-3) and check.scale_grads and reduction != "mean":
        return text + (
            f" (1/{n}, one over n_microbatches={n}): loss_fn is a sum-reduction loss (e.g. "
            "reduction='sum') and scale_grads=True makes the schedule divide the accumulated "
            f"gradients by n_microbatches, which is right for a mean loss only: the microbatch "
            f"sums' gradients already add up to the full batch's, and dividing by {n} leaves "
            f"1/{n} of it. Use a mean loss (reduction='mean') with scale_grads=True; or keep "
            "the sum loss and pass scale_grads=False (divide the loss by the full batch's "
            f"{batch} rows, not the microbatch's, if you want the mean's gradient)."
        )
    if n > 1 and math.isclose(c, n, rel_tol=1e-3):
        if not check.scale_grads and reduction != "sum":
            return text + (
                f" ({n}, n_microbatches): loss_fn averages over its rows (a mean loss) and "
                f"scale_grads=False, so the schedule adds up the {n} microbatch means' gradients "
                "without dividing by their number. Pass scale_grads=True (torch's default) with "
                "a mean loss; scale_grads=False is for a sum loss."
            )
        return text + (
            f" ({n}, n_microbatches): the schedule did not divide the accumulated gradients by "
            f"n_microbatches={n} although scale_grads={check.scale_grads}: its step adds up "
            f"the {n} microbatch gradients and never calls stage.scale_grads(n_microbatches) "
            "(torch's ScheduleGPipe and Schedule1F1B do, through perform_reduce_grad at the "
            "end of _step_microbatches)."
        )
    return text + "."


# --------------------------------------------------------------------------- the schedule's loss


def _schedule_step(check: PipelineCheck, module: nn.Module, dtype: torch.dtype | None) -> StepResult:
    """The gradient, on one device, of the loss the schedule backpropagates
    (``PipelineCheck.schedule_loss``), from ``module``'s weights."""
    target = check.target_as(dtype)
    return run_step(module, check.args, lambda output: check.schedule_loss(output, target), dtype=dtype, kwargs=check.kwargs)


def _schedule_loss_notes(check: PipelineCheck, grads: Mapping[str, torch.Tensor | None], expected: StepResult, module: nn.Module) -> list[str]:
    """Why the stages' gradients (``grads``, by the module's names) differ from one
    device's, when the evidence shows they are exactly the gradients of the schedule's own
    loss (the microbatch losses of ``loss_fn``, averaged or summed) and that loss is not
    the objective: the token-mean trap, or an objective the microbatch losses do not add up
    to. ``module``: the weights the step started from. Empty otherwise: then the schedule
    or the stages did something else, and other notes say what."""
    found = optional(lambda: _schedule_step(check, module, None))
    if found is None:
        return []
    ran = {name: grad for name, grad in found.grads.items() if name in grads}
    want = {name: grad for name, grad in expected.grads.items() if name in grads}
    if not same_up_to_rounding(dict(grads), ran) or same_up_to_rounding(ran, want):
        return []
    gap = relative_gap(ran, want)
    items = optional(check.count_items)
    if items is not None and items.by_tokens and items.unequal_ranks and check.loss_reduction(items) != "sum":
        return [_token_trap_note(check, items, gap)]
    if check.objective is None:
        return []  # a factor between loss_fn's microbatches and its full batch: _scale_notes
    with torch.no_grad():
        output = copy.deepcopy(module)(*check.args)
        ours, goal = float(check.schedule_loss(output, check.target)), float(check.goal(output, check.target))
    ratio = f" ({ours / goal:.6g} times it)" if goal else ""
    how = f"the mean of the {check.n_microbatches} microbatch losses (scale_grads=True)" if check.scale_grads else (
        f"the sum of the {check.n_microbatches} microbatch losses (scale_grads=False)"
    )
    return [
        f"The stages computed exactly the gradients of the schedule's loss, {how} of "
        f"loss_fn={callable_name(check.loss_fn)}: {ours:.8g} on this batch, where "
        f"objective={callable_name(check.objective)} is {goal:.8g}{ratio}; their gradients differ by up "
        f"to {gap:.3g} (relative). The schedule optimises a different loss than the objective. Make each "
        "microbatch's loss its share of the objective: for a mean over the batch's B rows, a mean over the "
        "microbatch's rows with scale_grads=True (equal microbatches), or the sum over its rows divided by B "
        "(the whole batch's rows, not the microbatch's) with scale_grads=False."
    ]


def _token_trap_note(check: PipelineCheck, items: PieceItems, gap: float) -> str:
    """The loss-averaging trap over microbatches that hold different numbers of tokens."""
    n, counts, total = check.n_microbatches, items.per_rank, items.total
    noun = items.noun
    divide = n if check.scale_grads else 1
    weights = ", ".join(f"1/{fraction(divide * t)}" for t in counts)
    how = f"averages the microbatch losses' gradients (scale_grads=True divides their sum by n_microbatches={n})" if check.scale_grads else (
        "sums the microbatch losses' gradients (scale_grads=False)"
    )
    text = (
        f"Each microbatch's loss is a mean over its {noun}: {list(counts)}{items.detail}, {total} in all, on "
        f"microbatches of {list(check.shard_sizes)} rows. The schedule {how}, so a per-microbatch mean loss "
        f"gives each of microbatch i's {noun} the weight 1/({'n_microbatches * ' if check.scale_grads else ''}t_i) "
        f"= [{weights}] instead of 1/T = 1/{total} (the loss-averaging trap under a pipeline)."
    )
    losses = items.rank_losses()
    if losses is not None and items.full_loss is not None:
        combined = math.fsum(losses) / divide
        text += f" The schedule's loss is {combined:.8g} against the full batch's {items.full_loss:.8g} (bias {combined - items.full_loss:+.3g});"
    return text + (
        f" the stages' gradients are exactly that loss's (on one device) and differ from the full-batch gradients by up to "
        f"{gap:.3g} (relative). Exact: count the batch's {noun} T before schedule.step, make loss_fn sum its {items.singular} "
        f"losses and divide by T (the same T for every microbatch), and pass scale_grads=False."
    )


# --------------------------------------------------------------------------- training


class PipelineTrainingKeywords(PipelineKeywords, TrainingKeywords, total=False):
    """The optional keywords of ``assert_pipeline_training_matches``."""


@dataclass(frozen=True)
class _Reference:
    """Single-device training, after every optimizer step: parameters, the gradients the
    step used, buffers and the optimizer's state, by the module's names."""

    params: list[dict[str, torch.Tensor]]
    grads: list[dict[str, torch.Tensor | None]]
    buffers: list[dict[str, torch.Tensor]]
    state: list[dict[str, dict[str, torch.Tensor]]]


def _train_reference(
    check: PipelineCheck, batches: Sequence[Batch], optimizer: OptimizerFactory, dtype: torch.dtype | None, after_backward: AfterBackward | None,
    *, exact: bool = False, jitter: float = 0.0,
) -> _Reference:
    """Single-device training on the full batches in ``dtype``, from parameters ``jitter``
    off (``train_single_device``), with what each step left."""
    grads: list[dict[str, torch.Tensor | None]] = []
    buffers: list[dict[str, torch.Tensor]] = []
    state: list[dict[str, dict[str, torch.Tensor]]] = []

    def record(index: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        grads.append(grads_of(model))
        buffers.append(buffers_of(model))
        state.append(optimizer_state(opt, model))

    params, _unused = train_single_device(
        check.module, batches, check.goal, optimizer, dtype, after_backward, context=PipelineReferenceContext, on_step=record, exact=exact,
        jitter=jitter,
    )
    return _Reference(params, grads, buffers, state)


def _jittered_reference(check: PipelineCheck, batches: Sequence[Batch], optimizer: OptimizerFactory, after_backward: AfterBackward | None) -> _Reference:
    """Single-device training from parameters a few units of roundoff off
    (``jitter_for``): a further sample of how far rounding alone moves the run."""
    dtype, size = jitter_for(check.dtype)
    return _train_reference(check, batches, optimizer, dtype, after_backward, jitter=size)


def _module_at(module: nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> nn.Module:
    """A copy of ``module`` with these parameters and buffers (by name)."""
    model = copy.deepcopy(module)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in params:
                param.copy_(params[name])
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
    return model


def _training_rows(
    check: PipelineCheck, ranks: Sequence[PipelineRankTraining], expected: _Reference, anchor: _Reference | None, index: int, aliases: dict[str, str],
    second: _Reference | None = None,
) -> list[TensorComparison]:
    """Every stage's parameters, buffers and optimizer state after step ``index`` against
    one device's, by the module's names (a tied weight's copies against its one parameter);
    ``second``, a jittered single-device run, as a further sample of rounding
    (``compare_tensors``' ``jitter``)."""
    rows = []
    step = f"step {index + 1}"

    def compare(
        kind: str, name: str, local: str, r: int, actual: torch.Tensor | None, want: torch.Tensor | None, anchored: torch.Tensor | None,
        jitter: torch.Tensor | None, key: str = "",
    ) -> None:
        detail = " ".join(part for part in (key, f"(as {local!r})" if local != name else "") if part)
        tensor_id = TensorId(kind, name, variant=f"{step} stage {r}", detail=detail)
        rows.append(compare_tensors(tensor_id, actual, want, anchored, check.tolerance, jitter=jitter))

    def at(reference: _Reference | None, kind: str, name: str, key: str = "") -> torch.Tensor | None:
        """``reference``'s tensor of this step, if it has one."""
        if reference is None:
            return None
        if kind == "param":
            return reference.params[index].get(name)
        if kind == "buffer":
            return reference.buffers[index].get(name)
        return reference.state[index].get(name, {}).get(key)

    for r, rank in enumerate(ranks):
        for local, value in rank.params[index].items():
            name = aliases.get(local, local)
            if name in expected.params[index]:
                compare("param", name, local, r, value, expected.params[index][name], at(anchor, "param", name), at(second, "param", name))
        for name, value in rank.buffers[index].items():
            if name in expected.buffers[index] and value.is_floating_point():
                compare("buffer", name, name, r, value, expected.buffers[index][name], at(anchor, "buffer", name), at(second, "buffer", name))
        for local, entries in rank.state[index].items():
            name = aliases.get(local, local)
            want = expected.state[index].get(name, {})
            for key, value in entries.items():
                compare(
                    "optimizer state", name, local, r, value.double() if not value.is_floating_point() else value,
                    want.get(key), at(anchor, "state", name, key), at(second, "state", name, key), f"[{key!r}]",
                )
    return rows


def _tied_notes(
    ranks: Sequence[PipelineRankTraining], expected: _Reference, index: int, aliases: dict[str, str], hook: AfterBackward | None,
    others_ok: bool,
) -> list[str]:
    """What happened to each weight tied across stages in step ``index``: its copies'
    gradients against each other and against one device's gradient of the one parameter.
    Copies that agree are blamed only when the other gradients (``others_ok``) are right:
    otherwise what is wrong with them is wrong with every gradient."""
    copies: dict[str, list[tuple[int, str, torch.Tensor | None]]] = {}
    for r, rank in enumerate(ranks):
        for local, name in rank.tied.items():
            grads = rank.steps[index].grads
            own = next((grads[key] for key in grads if aliases.get(key, key) == name), None)
            copies.setdefault(name, []).append((r, local, own))
    notes = []
    ran = f"after_backward={callable_name(hook)}" if hook is not None else "no after_backward hook"
    for name, held in copies.items():
        where = ", ".join(f"{local!r} on stage {r}" for r, local, _g in held)
        want = expected.grads[index].get(name)
        got = [g for _r, _l, g in held]
        text = (
            f"{name!r} is one weight tied across stages in the module, held as {where}: each stage "
            f"computes only its own children's part of its gradient (PipelineStage does not add them up), "
            f"so the copies must be summed over the stages that hold them (ctx.tied_group) between backward "
            f"and the optimizer step, as one device's single parameter gets the sum."
        )
        present = [g for g in got if g is not None]
        if len(present) < len(got) or want is None:
            notes.append(text)
            continue
        scale = max(float(present[0].abs().max()), 1e-30)
        same = all(torch.allclose(g, present[0], rtol=1e-5, atol=1e-7 * scale) for g in present)
        total = uniform_scale({name: present[0]}, {name: want})
        if not same and hook is not None and all(_factor({name: g}, {name: want}) is not None for g in present):
            continue  # each copy is the whole gradient, scaled by its stage's own factor: summed, then scaled per stage
        if not same:
            text += f" In step {index + 1}, with {ran}, the copies' gradients differ from each other: they were not summed."
        elif not others_ok:
            continue
        elif total is not None and math.isclose(total, 1 / len(held), rel_tol=1e-3):
            text += (
                f" In step {index + 1}, with {ran}, the copies' gradients agree but are 1/{len(held)} of one "
                f"device's: they were averaged over the {len(held)} stages instead of summed (an all-reduce "
                f"followed by a division by the group's size, the habit of data parallelism, where every rank "
                f"holds a whole gradient; here each holds a part)."
            )
        elif total is not None:
            text += f" In step {index + 1}, with {ran}, the copies' gradients agree but are {total:.6g} times one device's."
        else:
            continue  # the tied weight's gradient is right: something else differs
        notes.append(text)
    return notes


@documented
def assert_pipeline_training_matches(
    module: nn.Module, batches: Sequence[tuple[Any, ...]], *, loss_fn: LossFn, optimizer: OptimizerFactory, world_size: int,
    n_microbatches: int, **options: Unpack[PipelineTrainingKeywords],
) -> StepComparison:
    """Asserts ``len(batches)`` optimizer steps of pipeline-parallel training match one device.

    ``module``'s top-level children are cut into ``world_size`` stages, one per rank, as
    ``assert_pipeline_grads_match`` cuts them. Every rank builds its stage, the schedule
    around it and ``optimizer(stage parameters)``; for each ``(inputs, target)`` in
    ``batches`` it zeroes the gradients, runs one ``schedule.step`` (rank 0 feeding the
    inputs, the last rank the target), runs ``after_backward(ctx)`` when given (a
    ``PipelineContext``: ``ctx.stage_index``, ``ctx.num_stages``, ``ctx.group``,
    ``ctx.tied``, ``ctx.tied_group``), and steps the optimizer. After every step each
    stage's parameters, buffers and optimizer state must match single-device training on
    the full batches (float64-anchored tolerance) under the module's names: a weight tied
    between children of different stages (an input embedding shared with the output
    projection) is a copy on each stage, and each copy must match the one parameter. The
    message shows the first step that differs, and names a tied weight whose copies were
    not summed, the token-mean trap over microbatches, and a schedule whose loss is not
    ``objective``.

    The single-device run trains on ``objective`` (default ``loss_fn``) over each whole
    batch; the stages run ``loss_fn`` on each microbatch, and torch's schedules
    backpropagate the mean of the microbatch losses with ``scale_grads=True`` (they divide
    the accumulated gradients by ``n_microbatches``), their sum without.

    Args:
        module: as ``assert_pipeline_grads_match``.
        batches: one ``(inputs, target)`` pair per optimizer step, each as the ``inputs``
            and ``target`` of ``assert_pipeline_grads_match``, all of the same shapes (a
            ``PipelineStage`` sizes its buffers on the first step).
        loss_fn: the schedule's per-microbatch ``loss_fn(output, target)``, picklable.
        optimizer: picklable factory ``params -> Optimizer``, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``, built by every
            stage over its own parameters.
        world_size: the number of stages and ranks, at least 2.
        n_microbatches: microbatches per step; must divide every batch.
        objective: the loss you mean to minimise, ``objective(output, target)`` over a whole
            batch, when it is not ``loss_fn`` itself (e.g. the batch's token mean, where
            ``loss_fn`` divides each microbatch's summed token loss by a count).
        <shared: after_backward>
        Others: as ``assert_pipeline_grads_match``.

    Raises:
        ParallelMismatch: a stage's parameters, buffers or optimizer state differ after
            some step (the message shows the first such step), or the ranks' evidence shows
            skipped microbatches or parameters held by no stage.
        ParallelError: a rank raised, died or hung.
        InvalidArgument: an argument cannot be used.
    """
    __tracebackhide__ = True
    accepted(assert_pipeline_training_matches, options, PipelineTrainingKeywords)
    after_backward = training_code(optimizer, options.get("after_backward"), "one all-reducing a tied weight's gradient over ctx.tied_group")
    pairs = describe_batches(batches, {})
    scenario: dict[str, Any] = {key: value for key, value in options.items() if key not in ("after_backward", "msg")}
    first_inputs, _kwargs, first_target = pairs[0]
    check = pipeline_check(module, first_inputs, first_target, loss_fn=loss_fn, world_size=world_size, n_microbatches=n_microbatches, **scenario)
    pairs = exact_batches(check, pairs)
    _require_same_batches(pairs)
    require_picklable([(inputs, target) for inputs, _k, target in pairs], "batches")
    task = PipelineTrainingTask(
        check.module, tuple((inputs, target) for inputs, _k, target in pairs), check.loss_fn, optimizer, check.stages,
        check.schedule, check.n_microbatches, check.scale_grads, after_backward,
    )
    title = (
        f"{len(pairs)} steps of pipeline-parallel training with {callable_name(optimizer)} must match "
        "single-device training on every stage"
    )
    expected = _train_reference(check, pairs, optimizer, None, after_backward, exact=check.exact)
    ranks: tuple[PipelineRankTraining, ...] = check.send(run_pipeline_training, task, title)
    anchor = None if check.tolerance.explicit else _train_reference(check, pairs, optimizer, torch.float64, after_backward)
    aliases = _aliases(module)
    failing = len(pairs) - 1
    rows: list[TensorComparison] = []

    def rows_of(index: int, second: _Reference | None) -> list[TensorComparison]:
        return _training_rows(check, ranks, expected, anchor, index, aliases, second)

    jittered = None if anchor is None else functools.partial(_jittered_reference, check, pairs, optimizer, after_backward)
    for index, rows in enumerate(steps_with_second_look(len(pairs), rows_of, jittered)):
        if not all(row.ok for row in rows):
            failing = index
            break
    failures: list[str] = []
    for index in range(len(pairs)):
        found = _evidence_failures(check, [rank.steps[index] for rank in ranks], expected.grads[index], aliases, tied_ok=True)
        if found:
            failures = [f"In optimizer step {index + 1}: {text}" for text in found]
            break
    notes = [
        f"Parameters, buffers and optimizer state compared after each of the {len(pairs)} optimizer steps; the "
        f"table shows step {failing + 1}.",
        _evidence_note(check, [rank.steps[failing] for rank in ranks]),
        *exact_training_notes(check, len(pairs), optimizer),
    ]
    if after_backward is not None:
        notes.append(f"{callable_name(after_backward)}(ctx) ran after every schedule step, on every stage and in the single-device run.")
    if check.objective is not None:
        notes.append(
            f"The single-device run trained on objective={callable_name(check.objective)} over each whole batch; the "
            f"stages ran loss_fn={callable_name(check.loss_fn)} on each microbatch."
        )
    if not all(row.ok for row in rows):
        notes += _training_diagnosis(check, ranks, expected, failing, aliases, after_backward, pairs)
    outcome = check.outcome(title, None, rows, notes=notes, failures=failures)
    return raise_unless_ok(outcome, options.get("msg"))


def _require_same_batches(pairs: Sequence[Batch]) -> None:
    """Every batch of the shapes of the first: a ``PipelineStage`` infers the shapes it
    sends and receives once, on its first step (torch/distributed/pipelining/stage.py)."""
    for index, (inputs, kwargs, target) in enumerate(pairs):
        if kwargs:
            raise InvalidArgument(
                f"batches[{index}] has keyword arguments {sorted(kwargs)}; the pipeline's first stage takes "
                "positional tensors: pass (inputs, target) pairs"
            )
        if index == 0:
            continue
        first_inputs, _k, first_target = pairs[0]
        _tensor_batch(tuple(inputs), target)
        shapes = [tuple(t.shape) for t in (*inputs, target) if isinstance(t, torch.Tensor)]
        first = [tuple(t.shape) for t in (*first_inputs, first_target) if isinstance(t, torch.Tensor)]
        if shapes != first:
            raise InvalidArgument(
                f"batches[{index}] has shapes {shapes}, batches[0] {first}: a PipelineStage sizes the "
                "activations it sends and receives on its first step, so every step's batch must have the "
                "first one's shapes (pad the batches, or drop the last, smaller one)"
            )


def _inference_notes(ranks: Sequence[PipelineRankTraining], index: int) -> list[str]:
    """Stages with buffers whose module ran forward outside the microbatches of step
    ``index``: torch's shape inference, one forward more than one device runs."""
    notes = []
    for r, rank in enumerate(ranks):
        extra = rank.steps[index].outside
        if extra and rank.buffers[index]:
            notes.append(
                f"Stage {r}'s module ran forward {extra} time{'s' if extra > 1 else ''} outside any microbatch in step "
                f"{index + 1}: torch's PipelineStage runs it once before the first step to infer the shapes it sends "
                "(_forward_metadata_inference, on the first stage's inputs, on empty tensors of the received shapes on "
                "the others), so buffers updated in forward (running statistics, counters) "
                f"{sorted(rank.buffers[index])} get an update one device never makes. Give every stage's "
                "PipelineStage input_args= and output_args= (static shapes: the stages then vote to skip the "
                "inference), or update such buffers outside forward."
            )
    return notes


def _training_diagnosis(
    check: PipelineCheck, ranks: Sequence[PipelineRankTraining], expected: _Reference, index: int, aliases: dict[str, str],
    hook: AfterBackward | None, pairs: Sequence[Batch],
) -> list[str]:
    """The notes of a failing step ``index``: the tied weights, then the gradients the
    step used against one device's (a uniform factor, the schedule's own loss). Before
    that step the stages matched one device, so the step's gradients are comparable."""
    grads = _grads_by_name([rank.steps[index] for rank in ranks], aliases)
    tied = {name for rank in ranks for name in rank.tied.values()}
    untied = {name: grad for name, grad in grads.items() if name not in tied}
    want = {name: grad for name, grad in expected.grads[index].items() if name not in tied}
    notes = _tied_notes(ranks, expected, index, aliases, hook, same_up_to_rounding(untied, want)) + _inference_notes(ranks, index)
    if index == 0:
        start = check.module
        step_check = check
    else:
        start = _module_at(check.module, expected.params[index - 1], expected.buffers[index - 1])
        inputs, _kwargs, target = pairs[index]
        step_check = replace(check, args=tuple(inputs), target=target, module=start)
    c = uniform_scale(untied, want)
    if c is not None and not notes:
        notes.append(_explain_factor(step_check, c, step_check.loss_reduction()))
    one = optional(lambda: step_check.reference(None))
    if hook is not None and c is None:
        notes += _stage_scale_notes(ranks, expected.grads[index], one.grads if one is not None else None, index, aliases, hook)
    if one is not None:
        notes += _schedule_loss_notes(step_check, untied, one, start)
    return notes


def _factor(actual: Mapping[str, torch.Tensor | None], expected: Mapping[str, torch.Tensor | None]) -> float | None:
    """``c`` when ``actual`` is ``c`` times ``expected`` on every tensor both hold (1.0
    included), to 1e-4 of its norm; None when not a clean multiple or nothing to compare."""
    return scale_factor(actual, expected, 1e-4)


def _norm(grads: Mapping[str, torch.Tensor | None], names: Collection[str]) -> float:
    return math.sqrt(math.fsum(float(grads[n].double().pow(2).sum()) for n in names if grads.get(n) is not None))  # type: ignore[union-attr]


#: The hook a pipeline's clip must be, shown with the per-stage clip's diagnosis.
GLOBAL_CLIP_HOOK = """\
    def clip(ctx):  # after_backward: clip by the whole model's gradient norm
        params = [p for p in ctx.module.parameters() if p.grad is not None]
        square = sum((p.grad.detach().double().pow(2).sum() for p in params), torch.zeros((), dtype=torch.float64))
        dist.all_reduce(square, group=ctx.group)  # the sum over the stages (a group of one rank on one device)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, square.sqrt())"""


def _stage_scale_notes(
    ranks: Sequence[PipelineRankTraining], want: Mapping[str, torch.Tensor | None], raw: Mapping[str, torch.Tensor | None] | None,
    index: int, aliases: dict[str, str], hook: AfterBackward,
) -> list[str]:
    """When in the failing step ``index`` each stage's gradients (as its optimizer used
    them, after ``hook``) are one device's (``want``, after the hook too) times a factor of
    the stage's own: the hook scaled each stage by a coefficient computed from what the
    stage holds. ``raw``: one device's gradients of that step before the hook; when each
    stage's factor against them is ``min(1, T / n_s)`` (``n_s`` the norm of the stage's
    own part of them, ``T`` the norm one device's clipped gradient came out with), the
    evidence is that of a clip by each stage's own norm, and the note says so."""
    factors: list[float] = []
    which: list[int] = []
    stages: list[tuple[dict[str, torch.Tensor | None], set[str]]] = []
    tied = {name for rank in ranks for name in rank.tied.values()}
    for r, rank in enumerate(ranks):
        grads: dict[str, torch.Tensor | None] = {
            aliases.get(local, local): grad for local, grad in rank.steps[index].grads.items() if grad is not None
        }
        names = {name for name in grads if name not in tied} or set(grads)
        if not names:
            continue
        found = _factor({n: grads[n] for n in names}, {n: want.get(n) for n in names})
        if found is None:
            return []
        factors.append(found)
        which.append(r)
        stages.append((grads, names))
    if len(factors) < 2 or max(factors) - min(factors) <= 1e-3 * max(abs(f) for f in factors):
        return []
    name = callable_name(hook)
    shown = ", ".join(f"stage {s} x{f:.6g}" for s, f in zip(which, factors, strict=True))
    head = (
        f"In step {index + 1} the gradients each stage's optimizer used (after {name}(ctx)) are the single-device ones "
        f"times a factor of the stage's own ({shown}), where every stage must use exactly them."
    )
    fix = (
        f" A pipeline stage holds only its own parameters, so a norm over ctx.module.parameters() is the stage's "
        "alone: a pipeline's global norm sums the squared norms over the stages; all-reduce it over ctx.group (every "
        "stage), counting a weight tied across stages once (on one of the stages in ctx.tied_group), then clip every "
        f"stage with it:\n{GLOBAL_CLIP_HOOK}"
    )
    if raw is not None:
        everything = [n for n, g in raw.items() if g is not None]
        total, clipped = _norm(raw, everything), _norm(want, everything)
        # the stage's own norm before the hook, and its factor against one device's unclipped gradients
        norms = [_norm(raw, grads) for grads, _names in stages]
        kept = [_factor({n: grads[n] for n in names}, {n: raw.get(n) for n in names}) for grads, names in stages]
        fits = clipped < total * (1 - 1e-4) and all(
            k is not None and n > 0 and math.isclose(k, min(1.0, clipped / n), rel_tol=1e-3) for k, n in zip(kept, norms, strict=True)
        )
        if fits and any(k is not None and k < 1 - 1e-3 for k in kept):
            shown_norms = ", ".join(f"stage {s} {n:.6g}" for s, n in zip(which, norms, strict=True))
            return [
                f"{head} Each stage clipped by the norm of its own parameters' gradients: before the hook their norms "
                f"were {shown_norms}, and each stage whose own norm exceeded {clipped:.6g} (the norm one device clipped "
                f"the whole gradient to, from {total:.6g}) was scaled to that norm on its own.{fix}"
            ]
        like_one = [s for s, f in zip(which, factors, strict=True) if math.isclose(f, 1.0, rel_tol=1e-3)]
        unscaled = [s for s, k in zip(which, kept, strict=True) if k is not None and math.isclose(k, 1.0, rel_tol=1e-3)]
        if like_one and unscaled and sorted(like_one + unscaled) == which:
            return [
                f"{head} Stages {like_one} scaled them as one device did (by {clipped / total:.6g}), stages {unscaled} "
                f"left them as the backward made them: the clip (or other scaling) in after_backward={name} ran on some "
                "stages only, e.g. under `if ctx.is_last`. Every stage must clip, with the norm of the whole model's "
                f"gradients (its squared norm all-reduced over ctx.group):\n{GLOBAL_CLIP_HOOK}"
            ]
    return [
        f"{head} after_backward={name} scaled each stage by a coefficient it computed from what it holds alone, e.g. a "
        f"clip norm over the stage's own parameters.{fix}"
    ]
