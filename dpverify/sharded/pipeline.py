"""Pipeline parallelism (``torch.distributed.pipelining``) checked against one device:
``assert_pipeline_grads_match`` (its docstring and docs/distributed.md say what is
compared, and what evidence from the ranks, ``pipeline_rank``, fails the check).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
    uniform_scale,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.step import (
    Key,
    StepResult,
    as_inputs,
    batch_size_of,
    flatten_tensors,
    parameter_sites,
)
from dpverify.core.validation import (
    require_bool,
    require_int_at_least,
    require_loss_fn,
    require_module_with_grads,
)
from dpverify.ddp.pool import require_picklable
from dpverify.ranked.check import RankedCheck, References, ShardUnit, callable_name
from dpverify.ranked.options import RankedKeywords, accepted, check_keywords, documented
from dpverify.ranked.rank import LossFn, even_shards, shard_bounds, take_rows
from dpverify.sharded.pipeline_rank import PipelineRankStep, PipelineTask, run_pipeline_task

__all__ = [
    "SCHEDULES",
    "PipelineCheck",
    "assert_pipeline_grads_match",
    "pipeline_check",
    "stage_children",
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


def _require_chain(module: nn.Module, args: tuple[Any, ...], stages: Sequence[Sequence[str]]) -> None:
    """A pipeline runs the children in order, each stage sending one tensor to the next:
    refuse a module whose forward is something else (checked on this batch), or a stage
    boundary that is not one tensor."""
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
        if not isinstance(end, torch.Tensor):
            raise InvalidArgument(
                f"stage {stage} ends with child {stages[stage][-1]!r}, which returns "
                f"{type(end).__name__}, not one tensor; a pipeline stage passes one tensor to "
                "the next, and dpverify chains children on a single value. Move split_points "
                "to a boundary where one tensor flows"
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

    NO_GRAD: ClassVar[str] = "there is no gradient for a pipeline stage to compare"
    UNIT: ClassVar[ShardUnit] = ShardUnit("microbatch", "n_microbatches", why="")

    @classmethod
    def shard_parts(cls, world_size: int, fields: Mapping[str, Any]) -> int:
        return int(fields["n_microbatches"])

    def describe(self, step: Any = None) -> str:
        stages = "; ".join(f"stage {s} children {list(names)}" for s, names in enumerate(self.stages))
        return (
            f"batch of {self.batch_size} rows in {self.n_microbatches} microbatches of "
            f"{list(self.shard_sizes)} rows; {len(self.stages)} pipeline stages on "
            f"{self.world_size} ranks ({self.runner.backend}): {stages}; "
            f"{self.schedule.__name__}(n_microbatches={self.n_microbatches}, "
            f"scale_grads={self.scale_grads}), loss_fn {callable_name(self.loss_fn)}"
        )

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
    args = as_inputs(inputs)
    batch = _tensor_batch(args, target)
    sizes = _microbatches(batch, microbatches)
    stages = stage_children(module, world, options.get("split_points"))
    _require_chain(module, args, stages)
    return PipelineCheck.create(
        module, args, target, loss_fn=loss_fn, world_size=world, shards=sizes, **check_keywords(options),
        stages=stages, schedule=chosen, n_microbatches=microbatches, scale_grads=scale,
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
    ``scale_grads=True``, or a mean loss without it, is named with its factor and the fix;
    uneven microbatches are refused before anything runs (docs/distributed.md tells why).

    Args:
        module: an ``nn.Sequential``, or a module whose forward runs its top-level
            children in ``named_children()`` order, each on the previous one's output
            (checked on ``inputs``).
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
        <shared: pool, rtol, atol, msg>

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
    failures = _evidence_failures(check, ranks, refs.expected, aliases)
    notes = [_evidence_note(check, ranks)]
    scale = None
    if not all(row.ok for row in rows):
        more, scale = _scale_notes(check, ranks, refs.expected, aliases)
        notes += more
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


def _evidence_failures(check: PipelineCheck, ranks: Sequence[PipelineRankStep], expected: StepResult, aliases: dict[str, str]) -> list[str]:
    """What the ranks ran, held against what a pipeline step must run."""
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
    used = [name for name, grad in expected.grads.items() if grad is not None]
    orphans = [name for name in used if not holders.get(name)]
    if orphans:
        failures.append(
            f"Parameters {orphans} are held by no stage: they belong to the module itself, not "
            "to one of its top-level children, so no stage trains them. Move them into a child."
        )
    shared = {name: where for name, where in holders.items() if len(where) > 1}
    if shared:
        described = ", ".join(f"{name!r} by stages {where}" for name, where in shared.items())
        failures.append(
            f"Parameters are held by more than one stage: {described}. A weight tied between "
            "children of different stages becomes one copy per stage, and each stage's "
            "gradient is only its own children's part (PipelineStage does not add them up). "
            "Put the children that share it in one stage (split_points), or untie it."
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
