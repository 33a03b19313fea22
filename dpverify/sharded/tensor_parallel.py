"""Public tensor-parallel check: torch's ``parallelize_module`` on real ranks against one device.

The check sends one task to the pooled ranks (``tensor_parallel_rank``), compares the
tensors with the single-device step as every ranked check does (``RankedCheck``), fails a
step that sharded nothing, and explains a plan whose layouts do not compose (or whose
output stays a local shard) from the layouts the ranks recorded (docs/distributed.md).
"""

from __future__ import annotations

import functools
import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Unpack

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from dpverify.checks.dp import raise_unless_ok
from dpverify.core.comparison import (
    StepComparison,
    TensorComparison,
    TensorId,
    compare_tensors,
    steps_with_second_look,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.numerics import jitter_for
from dpverify.core.step import StepResult
from dpverify.core.validation import (
    require_int_at_least,
    require_module_with_grads,
)
from dpverify.ddp.pool import ParallelError
from dpverify.ranked.check import (
    TP_GROUPS,
    Batch,
    RankedCheck,
    References,
    ShardUnit,
    callable_name,
    describe_batches,
    exact_training_notes,
    forward_keywords,
    grads_only,
    optional,
    require_step,
    same_up_to_rounding,
    train_single_device,
    training_batches,
    training_code,
)
from dpverify.ranked.notes import items_notes, scale_note, sum_loss_note
from dpverify.ranked.options import (
    ShardedKeywords,
    TrainingKeywords,
    accepted,
    check_keywords,
    documented,
)
from dpverify.ranked.rank import AfterBackward, LossFn, OptimizerFactory, shard_bounds, take_rows
from dpverify.ranked.sharded import module_paths, send_steps, trap_text
from dpverify.sharded.fsdp import _shard_modules
from dpverify.sharded.tensor_parallel_rank import (
    DP_DIM,
    TP_DIM,
    Placed,
    Seen,
    TPContext,
    TPRankStep,
    TPRankTraining,
    TPReferenceContext,
    TPStepTask,
    TPTrainingTask,
    _matched,
    full_output,
    optimizer_state,
    placement_text,
    run_tp_step_task,
    run_tp_training_task,
    style_name,
    tp_step,
    weighted_tp_step,
)

__all__ = [
    "TPCheck",
    "TPContext",
    "assert_tensor_parallel_grads_match",
    "assert_tensor_parallel_training_matches",
    "full_output",
    "tp_step",
    "weighted_tp_step",
]

class TPKeywords(ShardedKeywords, total=False):
    """The optional keywords of the tensor-parallel helper."""

    data_parallel: int


class TPTrainingKeywords(TPKeywords, TrainingKeywords, total=False):
    """The optional keywords of the tensor-parallel training helper."""


# --------------------------------------------------------------------------- validation


def _plan(module: nn.Module, plan: Any) -> dict[str, ParallelStyle]:
    """The plan, checked as ``parallelize_module`` would read it, before any rank sees it:
    a dict of module paths (``fnmatch`` patterns per dotted part) to ``ParallelStyle``s, each
    key matching a submodule, Colwise and Rowwise styles only on what they can shard."""
    if not isinstance(plan, Mapping) or not plan:
        raise InvalidArgument(
            f"plan={plan!r}: pass a non-empty dict from module path to ParallelStyle, e.g. "
            "{'0': ColwiseParallel(), '2': RowwiseParallel()}"
        )
    checked: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise InvalidArgument(
                f"plan has the key {key!r}; name submodules by their qualified paths (non-empty strings such as "
                f"'0' or 'layers.*.mlp'): {module_paths(module)}"
            )
        if not isinstance(style, ParallelStyle):
            raise InvalidArgument(
                f"plan[{key!r}] is {style!r} ({type(style).__name__}), not a ParallelStyle; pass an instance such as "
                "ColwiseParallel(), RowwiseParallel(), SequenceParallel() or PrepareModuleInput(...)"
            )
        matched = _matched(module, {key: style})
        if not matched:
            raise InvalidArgument(
                f"plan key {key!r} matches no submodule of {type(module).__name__} (parallelize_module would "
                f"only warn and shard nothing there); the module paths are: {module_paths(module)}"
            )
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            for path, _style in matched:
                sub = module.get_submodule(path)
                if not isinstance(sub, (nn.Linear, nn.Embedding)):
                    raise InvalidArgument(
                        f"plan[{key!r}] is {type(style).__name__}, which shards nn.Linear and nn.Embedding only, but "
                        f"{path!r} is {type(sub).__name__}; name a Linear, or use SequenceParallel / "
                        "PrepareModuleInput on other modules"
                    )
        checked[key] = style
    try:
        pickle.dumps(checked)
    except Exception as error:
        raise InvalidArgument(
            f"plan cannot be sent to the ranks ({type(error).__name__}: {error}); use torch's styles, or a "
            "ParallelStyle subclass defined at the top level of an importable module"
        ) from None
    return checked


def _style_text(style: ParallelStyle) -> str:
    """A style as its constructor call, with the layouts that matter (a labelled style,
    ``style_name``: its label)."""
    if getattr(style, "label", None) is not None:
        return style_name(style)
    fields = []
    for attribute in ("input_layouts", "desired_input_layouts", "output_layouts", "sequence_sharding", "use_local_output"):
        if hasattr(style, attribute):
            value = getattr(style, attribute)
            if isinstance(value, tuple):
                value = value[0] if len(value) == 1 else value
            fields.append(f"{attribute}={placement_text(value) if not isinstance(value, (bool, tuple)) else value}")
    return f"{type(style).__name__}({', '.join(fields)})"


@dataclass(frozen=True)
class TPCheck(RankedCheck):
    """A validated tensor-parallel scenario: ``RankedCheck``'s, with ``shard_sizes`` the rows of
    each data-parallel group (one entry without data parallelism), and the plan."""

    plan: Mapping[str, ParallelStyle] = field(default_factory=dict)
    data_parallel: int = 1
    fsdp_modules: tuple[str, ...] = ()

    UNIT: ClassVar[ShardUnit] = TP_GROUPS
    AVERAGER: ClassVar[str] = "FSDP2's reduce-scatter over the data-parallel groups"

    @classmethod
    def shard_parts(cls, world_size: int, fields: Mapping[str, Any]) -> int:
        return int(fields["data_parallel"])

    @classmethod
    def of(
        cls, module: nn.Module, inputs: Any, target: Any, loss_fn: LossFn, world_size: int, plan: Any, options: TPKeywords,
    ) -> TPCheck:
        """The scenario of one call of the tensor-parallel helper: its arguments and ``options``."""
        require_module_with_grads(module, why=cls.NO_GRAD)
        world = require_int_at_least(world_size, "world_size", 1)
        dp = require_int_at_least(options.get("data_parallel", 1), "data_parallel", 1)
        if world % dp:
            raise InvalidArgument(
                f"world_size={world} is not divisible by data_parallel={dp}; the mesh is (data_parallel, "
                f"world_size // data_parallel) = ('dp', 'tp'): pass a data_parallel that divides {world}"
            )
        return cls.create(
            module, inputs, target, loss_fn=loss_fn, world_size=world, **check_keywords(options),
            plan=_plan(module, plan), data_parallel=dp,
            fsdp_modules=_shard_modules(module, None) if dp > 1 else (),
        )

    @property
    def tp_size(self) -> int:
        return self.world_size // self.data_parallel

    def layout(self) -> str:
        keywords = f" (keyword arguments {sorted(self.kwargs)})" if self.kwargs else ""
        plan = "{" + ", ".join(f"{key!r}: {_style_text(style)}" for key, style in self.plan.items()) + "}"
        if self.data_parallel == 1:
            return (
                f"batch of {self.batch_size} rows{keywords}, whole on each of {self.world_size} ranks "
                f"({self.runner.backend}); parallelize_module plan {plan} on a mesh ({self.world_size},) named ({TP_DIM!r},)"
            )
        shown = [name if name else "(root)" for name in self.fsdp_modules]
        return (
            f"batch of {self.batch_size} rows{keywords} in contiguous shards {list(self.shard_sizes)}, one per "
            f"data-parallel group, on {self.world_size} ranks ({self.runner.backend}); parallelize_module plan "
            f"{plan} on a mesh ({self.data_parallel}, {self.tp_size}) named ({DP_DIM!r}, {TP_DIM!r}), "
            f"FSDP2 fully_shard over {DP_DIM!r} on {shown}"
        )

    def tp_rows(self, rank: int, actual: TPRankStep, refs: References, *, variant: str = "") -> list[TensorComparison]:
        """Rank ``rank``'s output (its group's rows of the full-batch output), its loss and
        its gradients against the single-device step."""
        rows = self.rows(actual, refs, actual.dp_rank, rank=rank, variant=variant)
        if actual.loss is not None:
            start, stop = shard_bounds(self.shard_sizes)[actual.dp_rank]
            key = functools.partial(_group_loss, self, start, stop)
            where = "" if self.data_parallel == 1 else f"(rows [{start}:{stop}])"
            loss = torch.tensor(actual.loss, dtype=refs.expected.loss.dtype)
            rows.insert(0, refs.compare(TensorId("loss", rank=rank, variant=variant, detail=where), loss, key))
        return rows


def _group_loss(check: TPCheck, start: int, stop: int, step: StepResult) -> torch.Tensor | None:
    """The single-device loss on one data-parallel group's rows (the whole batch's loss
    when there is one group)."""
    if start == 0 and stop == check.batch_size:
        return step.loss.detach()
    if step.output is None:
        return None
    output = take_rows(step.output, start, stop, check.batch_size)
    target = take_rows(check.target_as(step.loss.dtype), start, stop, check.batch_size)
    with torch.no_grad():
        return check.loss_fn(output, target).detach()


# --------------------------------------------------------------------------- evidence


def _sharding_findings(check: TPCheck, steps: Sequence[TPRankStep | TPRankTraining]) -> tuple[list[str], str]:
    """(failures, the evidence for the scenario line): whether the plan was applied and sharded
    some parameter over ``"tp"`` on every rank."""
    failures: list[str] = []
    lazy = [r for r, s in enumerate(steps) if not s.wrapped]
    if lazy:
        failures.append(
            f"The step never called ctx.parallelize() on ranks {lazy}: the plan was not applied, so nothing of "
            "tensor parallelism was checked. Call model = ctx.parallelize() and run forward and backward through it."
        )
        return failures, "no parameter sharded (ctx.parallelize() never ran)"
    unsharded = [r for r, s in enumerate(steps) if not any(p.tp_sharded for p in s.held)]
    if unsharded and check.tp_size > 1:
        keys = list(check.plan)
        failures.append(
            f"No parameter was sharded over the {TP_DIM!r} mesh dimension on ranks {unsharded}: the plan "
            f"(keys {keys}) matched no module whose parameters its styles shard (ColwiseParallel and "
            "RowwiseParallel shard Linear and Embedding weights; SequenceParallel and PrepareModuleInput shard "
            "none), so every rank computed the whole model and the check would pass vacuously."
        )
    sharded = [p for p in steps[0].held if p.tp_sharded]
    others = [p.name for p in steps[0].held if p.placements and not p.tp_sharded]
    shown = "; ".join(f"{p.name}: {p.placements} local {list(p.local)}" for p in sharded if p.placements) or "none"
    evidence = f"rank 0 held {len(sharded)} of {len(steps[0].held)} parameters sharded over {TP_DIM!r} ({shown})"
    if others:
        evidence += f", and {others} as DTensors not sharded over {TP_DIM!r}"
    return failures, evidence


def _style_of(check: TPCheck, path: str) -> ParallelStyle | None:
    return next((style for p, style in _matched(check.module, check.plan) if p == path), None)


def _output_shape(check: TPCheck, expected: StepResult, dp_rank: int) -> tuple[int, ...] | None:
    """The shape of the first tensor one device outputs, cut to a data-parallel group's rows."""
    if not expected.outputs:
        return None
    shape = tuple(expected.outputs[0][1].shape)
    if check.data_parallel > 1 and shape:
        return (check.shard_sizes[dp_rank], *shape[1:])
    return shape


def _module_text(check: TPCheck, seen: Seen) -> str:
    """A module of the plan as messages name it: its path and its style."""
    style = _style_of(check, seen.path)
    return f"{seen.path!r} ({_style_text(style) if style is not None else seen.style})"


def _local_output_findings(check: TPCheck, steps: Sequence[TPRankStep], expected: StepResult) -> list[str]:
    """A model output whose shape on a rank is not one device's (the root's output as the
    hooks saw it handed on): name the styled module that handed on a local shard (its output
    a DTensor sharded over ``"tp"``, handed on as a plain tensor), its layouts, and the fix."""
    for r, step in enumerate(steps):
        root = next((s for s in step.seen if s.path == "" and s.handed is not None), None)
        want = _output_shape(check, expected, step.dp_rank)
        if root is None or root.handed is None or want is None or root.handed.dtensor or root.handed.shape == want:
            continue
        culprit = next(
            (s for s in reversed(step.seen) if s.style and s.produced is not None and s.produced.dtensor
             and s.produced.sharded and s.handed is not None and not s.handed.dtensor),
            None,
        )
        text = f"Rank {r}'s model output has shape {list(root.handed.shape)} where one device gives {list(want)}"
        if culprit is not None and culprit.produced is not None:
            text += (
                f": module {_module_text(check, culprit)} produced "
                f"{culprit.produced.describe()} and handed on its local shard as a plain tensor (use_local_output=True), "
                f"so the output left the model sharded, {culprit.produced.placements} local "
                f"{list(culprit.produced.local)}, where one device gives {list(culprit.produced.shape)} replicated. Fix: "
                "ColwiseParallel(use_local_output=False) (a DTensor the step makes whole), or "
                "output_layouts=Replicate() (an all-gather), or follow it with a RowwiseParallel Linear."
            )
        else:
            # A style that converts inside the module's forward (transformers' styles wrap
            # ``forward`` itself) shows no DTensor to the hooks: name the last styled module
            # that handed on the shape the model returned.
            last = next(
                (s for s in reversed(step.seen) if s.style and s.path and s.handed is not None and s.handed.shape == root.handed.shape),
                None,
            )
            if last is not None and last.handed is not None:
                text += (
                    f": module {_module_text(check, last)} handed on "
                    f"{list(last.handed.shape)}, the shape the model returned: its output left the model as this rank's "
                    f"piece. Fix: that module's entry of the plan (an output layout that gathers, e.g. "
                    "ColwiseParallel(output_layouts=Replicate()), transformers' 'colwise_gather_output' for a head)."
                )
            else:
                text += "; no module of the plan handed on a sharded DTensor as a plain tensor, so the step itself changed the shape."
        return [text]
    return []


def _partial_findings(check: TPCheck, steps: Sequence[TPRankStep]) -> list[str]:
    """A styled module whose forward produced a ``Partial`` DTensor (a sum still spread over
    the ranks) and handed it on as a plain tensor: the reduction never ran."""
    for step in steps:
        for seen in step.seen:
            produced, handed = seen.produced, seen.handed
            if seen.style and produced is not None and produced.partial and handed is not None and seen.kept_local:
                style = _style_of(check, seen.path)
                return [
                    f"Module {seen.path!r} ({_style_text(style) if style is not None else seen.style}) produced "
                    f"{produced.describe()}, a sum spread over the {TP_DIM!r} ranks, and handed on its local part as a "
                    "plain tensor (its own storage: no collective ran on it). The all-reduce (or reduce-scatter) that "
                    "makes a RowwiseParallel output whole never ran, so each rank went on with its own partial sum."
                ]
    return []


def _partial_sum_note(check: TPCheck, steps: Sequence[TPRankStep], expected: StepResult) -> list[str]:
    """When the ranks' outputs differ and their sum over a tensor-parallel group is the
    single-device output (up to the replicated bias counted on every rank), say so."""
    if check.tp_size < 2:
        return []
    group = [s for s in steps if s.dp_rank == 0]
    want = dict(expected.outputs)
    for path, first in group[0].outputs:
        if path not in want:
            continue
        rows = want[path][: first.shape[0]] if first.dim() else want[path]
        found = [dict(s.outputs).get(path) for s in group]
        parts = [p for p in found if p is not None and p.shape == rows.shape]
        if len(parts) < len(found) or all(torch.equal(parts[0], p) for p in parts):
            continue
        total = torch.stack([p.double() for p in parts]).sum(0)
        scale = float(rows.double().abs().max()) or 1.0
        exact = float((total - rows.double()).abs().max()) / scale
        offset = total - rows.double()
        shifted = float((offset - offset.mean(0, keepdim=True)).abs().max()) / scale if offset.dim() else exact
        if exact < 1e-4 or shifted < 1e-4:
            extra = "" if exact < 1e-4 else " plus a constant per column (a replicated bias added on every rank)"
            return [
                f"The tensor-parallel ranks' {path} differ from each other, and their sum over the {check.tp_size} "
                f"ranks of a group is the single-device {path}{extra}: each rank's output is a partial sum, off by the "
                "other ranks' partial sums. The all-reduce of the RowwiseParallel output is missing."
            ]
    return []


def _own_columns_note(check: TPCheck, steps: Sequence[TPRankStep], expected: StepResult) -> list[str]:
    """When each rank's output equals one device's in its own block of columns and is zero
    elsewhere: a local colwise shard padded and used as the whole output."""
    want = dict(expected.outputs)
    found = []
    for r, step in enumerate(steps):
        for path, got in step.outputs:
            ref = want.get(path)
            if ref is None or got.dim() < 2 or got.shape[1:] != ref.shape[1:]:
                continue
            start, stop = shard_bounds(check.shard_sizes)[step.dp_rank]
            ref = ref[start:stop] if check.data_parallel > 1 else ref
            if got.shape != ref.shape:
                continue
            width = got.shape[-1]
            scale = float(ref.double().abs().max()) or 1.0
            same = ((got.double() - ref.double()).abs() <= 1e-4 * scale).all(dim=tuple(range(got.dim() - 1)))
            zero = (got == 0).all(dim=tuple(range(got.dim() - 1)))
            if bool(same.all()) or not bool((same | zero).all()):
                continue
            cols = [c for c in range(width) if bool(same[c]) and not bool(zero[c])]
            # a rank whose shard holds no column (fewer columns than ranks) hands on zeros
            found.append(f"rank {r} columns [{cols[0]}:{cols[-1] + 1}]" if cols else f"rank {r} no column")
    if not found:
        return []
    return [
        f"Each rank's output equals the single-device output only in its own block of columns ({', '.join(found)}) "
        "and is zero elsewhere: the local shard of a ColwiseParallel output was used as the whole output (padded to "
        "the full width) instead of being gathered. Keep the DTensor (use_local_output=False) or set "
        "output_layouts=Replicate()."
    ]


def _expects(style: ParallelStyle | None) -> str:
    if style is None:
        return ""
    layouts = getattr(style, "input_layouts", None) or getattr(style, "sequence_sharding", None)
    if not layouts:
        return ""
    layout = placement_text(layouts[0])
    desired = getattr(style, "desired_input_layouts", None)
    wanted = f", then redistributed to {placement_text(desired[0])}" if desired and desired != layouts else ""
    return f" It reads a plain input as input_layouts={layout} (DTensor.from_local: this rank's local piece of that layout){wanted}."


def _layout_error(check: TPCheck, steps: Sequence[TPRankStep]) -> list[str]:
    """The failure for a step that raised on the ranks: where (the module call that had not
    finished), with which layouts (what arrived, from which module, what its forward saw),
    what the style expects, and torch's own message last."""
    failed = steps[0].failed_ranks
    rank = failed[0]
    step = steps[rank]
    error = step.error or "(no message)"
    if not step.wrapped:
        return [f"The step raised on ranks {list(failed)} before ctx.parallelize() applied the plan: {error}"]
    if not step.seen:
        return [f"parallelize_module raised on ranks {list(failed)} while applying the plan: {error}"]
    call = next((s for s in reversed(step.seen) if s.handed is None), None)  # the innermost unfinished call
    if call is None:
        return [
            f"The step raised on ranks {list(failed)} after the forward finished (in the loss or the backward), "
            f"with the layouts every module handed on recorded: {error}"
        ]
    style = _style_of(check, call.path)
    name = _style_text(style) if style is not None else (call.style or "no style of the plan")
    where = f"module {call.path!r} ({name})"
    received = call.received.describe() if call.received is not None else "no tensor"
    source = ""
    if call.source is not None:
        producer = next((s for s in step.seen if s.path == call.source and s.handed is not None), None)
        source_style = _style_of(check, call.source)
        if producer is not None and producer.produced is not None and producer.handed is not None:
            source = (
                f", handed on by module {call.source!r} ({_style_text(source_style) if source_style is not None else producer.style}), "
                f"whose forward produced {producer.produced.describe()} and handed on {producer.handed.describe()}"
            )
    text = f"The plan's layouts do not compose: {where} raised on ranks {list(failed)}. It received {received}{source}."
    if call.entered is not None:
        text += f" Its forward saw {call.entered.describe()}."
    else:
        text += " The style's input hook failed before its forward ran."
    text += _expects(style)
    widths = _received_widths(steps, call.path, step.dp_rank)
    if call.style and len(widths) > 1:
        text += (
            f" The ranks received different widths {sorted(widths)}: a sharded dimension not divisible by the "
            f"{check.tp_size} tensor-parallel ranks, which DTensor.from_local (the plain-tensor input of a style) assumes "
            "is cut evenly. Make the width divisible, or hand on DTensors (use_local_output=False)."
        )
    elif call.entered is not None and call.entered.dtensor and _plain_params(step, call.path):
        text += (
            f" Its parameters {_plain_params(step, call.path)} are plain tensors (the plan shards none of them), so "
            "its forward mixed a DTensor input with plain parameters. Hand it a plain tensor (use_local_output=True "
            "on the style that feeds it), or shard the module with a style of its own."
        )
    elif (
        call.entered is not None and call.entered.dtensor and call.received is not None and not call.received.dtensor
        and call.entered.shape != call.received.shape
    ):
        text += (
            f" Read so, the plain {list(call.received.shape)} became global {list(call.entered.shape)}, which this module's "
            "weights cannot take: the producer's output layout and this style's input layout disagree (a "
            "RowwiseParallel expects a ColwiseParallel's Shard(-1) output; a ColwiseParallel expects a replicated "
            "input). Pair ColwiseParallel then RowwiseParallel, or set input_layouts to what the previous module hands on."
        )
    return [text, f"torch's message (rank {rank}): {error}"]


def _plain_params(step: TPRankStep, path: str) -> list[str]:
    """The parameters of module ``path`` (its own, not its children's) held as plain tensors."""
    prefix = f"{path}." if path else ""
    return [p.name for p in step.held if p.name.startswith(prefix) and "." not in p.name[len(prefix):] and not p.placements]


def _received_widths(steps: Sequence[TPRankStep], path: str, dp_rank: int) -> set[int]:
    """The last dimension of what the first call of ``path`` received on each rank of one
    tensor-parallel group."""
    found = set()
    for step in steps:
        call = next((s for s in step.seen if s.path == path and s.received is not None), None)
        if step.dp_rank == dp_rank and call is not None and call.received is not None and call.received.local:
            found.add(call.received.local[-1])
    return found


# --------------------------------------------------------------------------- the check


@documented
def assert_tensor_parallel_grads_match(
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, plan: Mapping[str, ParallelStyle],
    **options: Unpack[TPKeywords],
) -> StepComparison:
    """Asserts one tensor-parallel step (``parallelize_module`` with ``plan``) gives every
    rank the single-device output, loss and gradients.

    Each rank takes a copy of ``module`` (same weights everywhere) and runs ``step``, which
    applies ``plan`` with ``ctx.parallelize()`` over the ``"tp"`` dimension of a device mesh.
    With ``data_parallel=1`` the mesh is ``("tp",)`` over every rank and each rank sees the
    whole batch. With ``data_parallel=d`` > 1 it is ``(d, world_size // d)`` named
    ``("dp", "tp")``: after the plan, FSDP2's ``fully_shard`` over ``"dp"`` shards each child
    with parameters, then the root, and data-parallel group g takes the g-th contiguous shard
    of the batch. Every rank's output (made whole: its group's rows), its loss, and every
    parameter's full gradient (``DTensor.full_tensor()``) must equal the single-device
    full-batch step (float64-anchored tolerance, as ``assert_ddp_grads_match``). ``module`` is
    left untouched.

    A step that never applied the plan, or a plan that sharded no parameter, fails; a plan
    whose output is left a local shard, or whose layouts do not compose, fails with the
    module paths and the layouts the ranks recorded instead of a traceback. With uneven
    data-parallel shards the plain ``tp_step`` (the loss-averaging trap) is run for contrast
    and ``weighted_tp_step`` verified (docs/distributed.md).

    Args:
        module: the model to check.
        inputs: the batch tensor, or a tuple of positional forward arguments; ``()`` for a
            keyword-only forward (the batch in ``forward_kwargs``).
        target: the second argument of ``loss_fn``.
        loss_fn: ``loss_fn(output, target)``, a scalar loss; picklable.
        world_size: number of ranks.
        plan: what ``parallelize_module`` takes: module path (``fnmatch`` patterns per dotted
            part) to ``ParallelStyle``.
        data_parallel: data-parallel groups (a divisor of ``world_size``).
        shards: rows per data-parallel group (default: as even as possible).
        step: the per-rank step, ``step(ctx: TPContext)``, picklable; it must apply the plan
            with ``ctx.parallelize()``. Default ``tp_step``, or ``weighted_tp_step`` when the
            data-parallel groups hold different numbers of items.
        <shared: pool, rtol, atol, msg, forward_kwargs, exact>

    Returns:
        The comparison (``str()`` summarises it).

    Raises:
        ParallelMismatch: a rank's output, loss or gradient differs; the plan sharded nothing
            or was never applied; the output stayed sharded; the layouts did not compose.
        ParallelError: a rank died or hung; the pool restarts for the next check.
        InvalidArgument: an argument cannot be used (a plan key that matches no submodule, a
            value that is not a ParallelStyle, a world size that data_parallel does not divide).
    """
    __tracebackhide__ = True
    accepted(assert_tensor_parallel_grads_match, options, TPKeywords)
    check = TPCheck.of(module, inputs, target, loss_fn, world_size, plan, options)
    step, msg = options.get("step"), options.get("msg")
    require_step(step, "TPContext")
    title = "Tensor-parallel (parallelize_module) output, loss and gradients must match the single-device full-batch step on every rank"
    counted, chosen, verified, naive = send_steps(
        check, step, tp_step, weighted_tp_step, run_tp_step_task, title, TPStepTask,
        plan=dict(check.plan), data_parallel=check.data_parallel, fsdp_modules=check.fsdp_modules,
    )
    if verified[0].failed_ranks:
        one_device = optional(lambda: check.reference(None))
        local = _local_output_findings(check, verified, one_device) if one_device is not None else []
        failures = [*local, f"torch's message (rank {verified[0].failed_ranks[0]}): {verified[verified[0].failed_ranks[0]].error}"] if local else _layout_error(check, verified)
        outcome = check.outcome(title, chosen, (), failures=failures, divergence=False)
        return raise_unless_ok(outcome, msg)
    refs = check.references(items=counted if counted.by_tokens else None)
    expected, anchor = refs.expected, refs.anchor
    rows = [row for r, s in enumerate(verified) for row in check.tp_rows(r, s, refs)]
    ok = all(row.ok for row in rows)
    notes: list[str] = items_notes(counted, naive is not None)
    contrasts: list[TensorComparison] = []
    if naive is not None:
        token_intro = (
            "FSDP2 averages the data-parallel groups' gradients as DDP's all-reduce averages the ranks', so "
            "DDP's token trap holds here with the groups for ranks: "
        )
        averages = f"FSDP2's reduce-scatter over {DP_DIM!r} averages the {check.data_parallel} groups' gradients"
        notes.append(
            trap_text(
                check, counted, naive, anchor or expected, token_intro, averages=averages, plain="tp_step",
                weighted="weighted_tp_step", parts=check.data_parallel, groups=True,
            )
        )
        if step is None:
            contrasts = grads_only([c for r, s in enumerate(naive) for c in check.tp_rows(r, s, refs, variant="plain tp_step")])
        elif not ok and same_up_to_rounding(verified[0].grads, naive[0].grads):
            notes.append(
                "The step's gradients equal the plain per-group mean-loss step's (tp_step): it falls into the "
                "loss-averaging trap. Multiply the group's loss by ctx.loss_weight (weighted_tp_step)."
            )
    failures, evidence = _sharding_findings(check, verified)
    failures += _local_output_findings(check, verified, expected)
    failures += _partial_findings(check, verified)
    scale = None
    if not ok:
        notes += _own_columns_note(check, verified, expected) or _partial_sum_note(check, verified, expected)
        notes += _partial_grads_note(check, [(s.dp_rank, s.grads) for s in verified], expected.grads)
        if check.data_parallel > 1:
            reduction = check.loss_reduction(counted)
            more, scale = scale_note(
                verified, expected, check.data_parallel, shard_sizes=check.shard_sizes, reduction=reduction,
                averager=f"FSDP2 over {DP_DIM!r}", size="number of data-parallel groups",
            )
            notes += more
    scenario = f"{check.describe(chosen)}; evidence: {evidence}"
    outcome = check.outcome(title, chosen, rows, contrasts=contrasts, notes=notes, failures=failures, scale=scale, scenario=scenario)
    return raise_unless_ok(outcome, msg)


# --------------------------------------------------------------------------- gradients explained

#: how close a sum over ranks, or a scaled reference, must come to count as the explanation
_FIT = 1e-4


def _partial_grads_note(
    check: TPCheck, grads: Sequence[tuple[int, Mapping[str, torch.Tensor | None]]], expected: Mapping[str, torch.Tensor | None],
) -> list[str]:
    """Gradients that differ between the ranks of a tensor-parallel group while their sum
    over the group is the single-device gradient: each rank's is a partial sum over its own
    part of the activations (a norm over a sequence shard, with plain parameters whose
    gradients nothing all-reduces). ``grads``: each rank's (data-parallel group, whole
    gradients)."""
    if check.tp_size < 2:
        return []
    found: list[str] = []
    for name, want in expected.items():
        if want is None:
            continue
        scale = float(want.double().abs().max()) or 1.0
        for dp_rank in range(check.data_parallel):
            parts = [g.get(name) for d, g in grads if d == dp_rank]
            if any(p is None or p.shape != want.shape for p in parts):
                break
            tensors = [p for p in parts if p is not None]
            if all(torch.equal(tensors[0], t) for t in tensors):
                break
            total = torch.stack([t.double() for t in tensors]).sum(0)
            if float((total - want.double()).abs().max()) / scale > _FIT:
                break
        else:
            found.append(name)
    if not found:
        return []
    modules = dict.fromkeys(name.rpartition(".")[0] for name in found)
    kinds = "/".join(dict.fromkeys(type(check.module.get_submodule(path)).__name__ for path in modules))
    return [
        f"The gradients of {found} differ between the {check.tp_size} tensor-parallel ranks, and their sum over the ranks "
        f"is the single-device gradient: the {kinds}'s gradients are per-rank partial sums over the sequence shards "
        f"(each rank's over the rows of the activations it holds; its parameters are plain tensors, which no "
        "collective reduces). All-reduce them over the tensor-parallel group (dist.all_reduce(p.grad, "
        "group=ctx.tp_group) in after_backward), or use SequenceParallel, which does: it makes them Replicate() "
        "DTensors whose Partial() gradients are summed over the ranks where they are used."
    ]


def _own_part(check: TPCheck, placed: Placed | None, grad: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The part of a whole gradient that rank ``tp_rank`` computed: its shard of a
    parameter sharded over ``"tp"`` (``Shard(d)``: ``torch.chunk``'s pieces, as DTensor
    cuts them), else all of it."""
    if placed is None or not placed.tp_sharded or check.data_parallel > 1:
        return grad
    dim = re.fullmatch(r"Shard\((-?\d+)\)", placed.placements)
    if dim is None:
        return grad
    pieces = grad.chunk(check.tp_size, int(dim.group(1)))
    return pieces[tp_rank] if tp_rank < len(pieces) else grad.new_empty(0)


def _rank_factors(
    check: TPCheck, ranks: Sequence[TPRankTraining], index: int, expected: Mapping[str, torch.Tensor | None],
) -> list[float] | None:
    """Per rank, the factor c_r such that the gradients it computed in step ``index`` (its
    own shards, and the gradients it holds whole) are c_r times the single-device ones;
    None when some rank's are not a multiple of them."""
    factors = []
    for rank in ranks:
        held = {p.name: p for p in rank.held}
        pairs = [
            (_own_part(check, held.get(name), got.double(), rank.tp_rank), _own_part(check, held.get(name), want.double(), rank.tp_rank))
            for name, want in expected.items()
            if want is not None and (got := rank.step_grads[index].get(name)) is not None and got.shape == want.shape
        ]
        if not pairs:
            return None
        dot = sum(float((a * e).sum()) for a, e in pairs)
        norm = sum(float((e * e).sum()) for _a, e in pairs)
        if norm == 0.0:
            return None
        factor = dot / norm
        scale = max(float(e.abs().max()) for _a, e in pairs if e.numel()) or 1.0
        if max(float((a - factor * e).abs().max()) for a, e in pairs if e.numel()) > _FIT * scale * max(1.0, abs(factor)):
            return None
        factors.append(factor)
    return factors


def _scaled_grads_note(
    check: TPCheck, ranks: Sequence[TPRankTraining], index: int, expected: Mapping[str, torch.Tensor | None], hook: AfterBackward,
) -> list[str]:
    """When in the first diverging step each rank's gradients are the single-device ones
    times a factor of its own: the hook scaled them (clipped them) by a coefficient the
    ranks did not agree on."""
    factors = _rank_factors(check, ranks, index, expected)
    if factors is None or max(factors) - min(factors) <= 1e-3 * max(abs(f) for f in factors):
        return []
    shown = ", ".join(f"rank {r} x{f:.6g}" for r, f in enumerate(factors))
    name = callable_name(hook)
    ones = [r for r, f in enumerate(factors) if abs(f - 1.0) <= 1e-3]
    others = [r for r, f in enumerate(factors) if abs(f - 1.0) > 1e-3]
    head = (
        f"In step {index + 1} the gradients the optimizer used (after {name}(ctx)) are the single-device ones times a "
        f"factor of each rank's own ({shown}), where every rank must use exactly them."
    )
    if ones:
        return [
            f"{head} Ranks {ones} scaled them as the single device did, ranks {others} did not: the gradient clipping "
            f"(or other scaling) in after_backward={name} did not run alike on every rank, e.g. it ran under "
            "`if ctx.rank == 0`, or each rank computed its own norm. Clip on every rank, with the norm of the full "
            "gradients."
        ]
    return [
        f"{head} after_backward={name} scaled them by a coefficient each rank computed from what it holds alone, e.g. "
        "a clip norm from its local shards (p.grad.to_local()) never all-reduced over the tensor-parallel group. "
        "Compute the norm of the full gradients: torch.nn.utils.clip_grad_norm_ over the DTensor gradients, or "
        "all-reduce the local sums of squares over ctx.tp_group, counting a replicated gradient once."
    ]


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class _Trace:
    """Single-device training, per optimizer step: the parameters after it, the gradients
    it used, the buffers and the optimizer state after it."""

    params: list[dict[str, torch.Tensor]]
    grads: list[dict[str, torch.Tensor | None]]
    buffers: list[dict[str, torch.Tensor]]
    states: list[dict[str, torch.Tensor]]


def _clones(named: Sequence[tuple[str, torch.Tensor | None]]) -> dict[str, torch.Tensor | None]:
    return {name: None if t is None else t.detach().clone() for name, t in named}


def _single_device(
    module: nn.Module, pairs: Sequence[Batch], loss_fn: LossFn, optimizer: OptimizerFactory, dtype: torch.dtype | None,
    after_backward: AfterBackward | None, *, exact: bool = False, jitter: float = 0.0,
) -> _Trace:
    """``train_single_device`` with ``TPReferenceContext`` for the hook, read after every step
    (``exact``: proven, as there; ``jitter``: from parameters that far off, as there)."""
    trace = _Trace([], [], [], [])

    def before(model: nn.Module) -> None:
        trace.grads.append(_clones([(name, p.grad) for name, p in model.named_parameters()]))

    def after(_index: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        trace.buffers.append({name: b.detach().clone() for name, b in model.named_buffers()})
        names = {id(p): name for name, p in model.named_parameters()}
        trace.states.append(optimizer_state(opt, names, _clones))

    try:
        params, _unused = train_single_device(
            module, pairs, loss_fn, optimizer, dtype, after_backward, context=TPReferenceContext, before_step=before,
            on_step=after, exact=exact, jitter=jitter,
        )
    except AttributeError as error:
        if any(name in str(error) for name in ("to_local", "full_tensor", "placements", "device_mesh")):
            error.add_note(
                "dpverify: in the single-device reference (ctx.reference True) the gradients are plain tensors, not "
                "DTensors: take p.grad.to_local() only where isinstance(p.grad, DTensor)"
            )
        raise
    trace.params.extend(params)
    return trace


def _jittered_reference(
    check: TPCheck, pairs: Sequence[Batch], loss_fn: LossFn, optimizer: OptimizerFactory, after_backward: AfterBackward | None,
) -> _Trace:
    """Single-device training from parameters a few units of roundoff off
    (``jitter_for``): how far rounding alone moves the run."""
    dtype, size = jitter_for(check.dtype)
    return _single_device(check.module, pairs, loss_fn, optimizer, dtype, after_backward, jitter=size)


def _training_rows(
    check: TPCheck, ranks: Sequence[TPRankTraining], expected: _Trace, anchor: _Trace | None,
    jittered: Callable[[], _Trace] | None = None,
) -> tuple[list[TensorComparison], int]:
    """Each rank's whole parameters, buffers and optimizer state after every step against
    one device's: the rows of the first step at which some rank diverges, else of the last.
    A step that fails is compared again with ``jittered()`` (single-device training from
    parameters a few units of roundoff off, run once) as a further sample of rounding, as
    the other training checks do: an Adam moment may cancel from terms far larger than
    itself and keep their rounding."""
    rows: list[TensorComparison] = []

    def rows_of(index: int, second: _Trace | None) -> list[TensorComparison]:
        return _step_rows(check, ranks, expected, anchor, index, second)

    for index, rows in enumerate(steps_with_second_look(len(expected.params), rows_of, jittered)):
        if not all(row.ok for row in rows):
            return rows, index
    return rows, len(expected.params) - 1


def _step_rows(
    check: TPCheck, ranks: Sequence[TPRankTraining], expected: _Trace, anchor: _Trace | None, index: int, second: _Trace | None,
) -> list[TensorComparison]:
    """Every rank's rows of step ``index`` (``_training_rows``), ``second``'s tensors the
    jittered sample when given."""
    rows: list[TensorComparison] = []
    kinds = (
        ("param", expected.params, anchor.params if anchor else None, second.params if second else None, [r.params for r in ranks]),
        ("buffer", expected.buffers, anchor.buffers if anchor else None, second.buffers if second else None, [r.step_buffers for r in ranks]),
        (
            "optimizer state", expected.states, anchor.states if anchor else None, second.states if second else None,
            [r.step_states for r in ranks],
        ),
    )
    for kind, want, anchored, sampled, got in kinds:
        for r, per_step in enumerate(got):
            for name, value in want[index].items():
                rows.append(
                    compare_tensors(
                        TensorId(kind, name, rank=r, variant=f"step {index + 1}"), per_step[index].get(name), value,
                        anchored[index].get(name) if anchored else None, check.tolerance,
                        jitter=sampled[index].get(name) if sampled else None,
                    )
                )
    return rows


#: what DTensor's dispatch says of an operator given DTensors and plain tensors together
#: (torch/distributed/tensor/_dispatch.py), e.g. ``clip_grad_norm_``'s ``_foreach_norm``
_MIXED = "got mixed torch.Tensor and DTensor"


def _mixed_grads_note(check: TPCheck) -> str:
    """The fix for a hook that handed DTensor and plain gradients to one operator."""
    styled = {path for path, _style in _matched(check.module, check.plan)}
    plain = [
        f"{path}.{name}" if path else name
        for path, sub in check.module.named_modules() if path not in styled
        for name, _p in sub.named_parameters(recurse=False)
    ]
    return (
        f"dpverify: the plan leaves the parameters {plain} plain tensors, so their gradients are not DTensors like "
        "the others', and torch.nn.utils.clip_grad_norm_ (its _foreach_norm) refuses the mix. Take the norm of each "
        "kind, torch.nn.utils.get_total_norm(dtensor_grads).full_tensor() and get_total_norm(plain_grads), combine "
        "them with torch.linalg.vector_norm, and scale every gradient (p.grad.to_local() of a DTensor) by "
        "min(1, max_norm / (norm + 1e-6))."
    )


@documented
def assert_tensor_parallel_training_matches(
    module: nn.Module, batches: Sequence[tuple[Any, ...]], *, loss_fn: LossFn, optimizer: OptimizerFactory, world_size: int,
    plan: Mapping[str, ParallelStyle], **options: Unpack[TPTrainingKeywords],
) -> StepComparison:
    """Asserts ``len(batches)`` optimizer steps of tensor-parallel training match one device.

    Every rank takes a copy of ``module`` and, for each ``(inputs, target)`` in ``batches``,
    zeroes the gradients, runs ``step`` (whose first call applies ``plan`` with
    ``ctx.parallelize()``, as in ``assert_tensor_parallel_grads_match``), runs
    ``after_backward`` and steps the optimizer, ``optimizer(params)`` built after the first
    step over the DTensor parameters. After every step each rank's whole parameters,
    buffers and optimizer state (``full_tensor()``) must match single-device training on
    the full batches, in which ``after_backward`` runs too (float64-anchored: the float64
    run uses the same optimizer); the message names the first step that differs.

    When they differ, the gradients of that step explain it where they can: gradients whose
    sum over the tensor-parallel ranks is one device's (a sequence-parallel norm's, left as
    per-rank partial sums), or gradients each rank scaled by a factor of its own (a clip
    norm from the local shard, a clip on one rank only).

    Args:
        batches: one ``(inputs, target)`` pair, or ``(inputs, kwargs, target)`` triple, per
            optimizer step.
        optimizer: picklable factory ``params -> Optimizer``, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``.
        plan: what ``parallelize_module`` takes: module path to ``ParallelStyle``.
        data_parallel: data-parallel groups (a divisor of ``world_size``).
        shards: rows per data-parallel group, for every batch (default: even per batch).
        step: per-rank forward/backward, ``step(ctx: TPContext)`` (default ``tp_step``,
            ``weighted_tp_step`` when in some batch the groups hold different numbers of
            items); it applies the plan with ``ctx.parallelize()`` (once: later calls return
            the parallelized module). The optimizer step is the harness's.
        <shared: after_backward>
        forward_kwargs: keyword forward arguments of every batch (sharded with its rows).
        Others: as ``assert_tensor_parallel_grads_match``. In the hook, ``ctx.tp_group``
            is the tensor-parallel group (also ``ctx.group``), ``ctx.dp_group`` the
            data-parallel one; in the single-device reference both are a group of one rank
            and the gradients are plain tensors.

    Returns:
        The comparison (``str()`` summarises it).

    Raises:
        ParallelMismatch: a rank's parameters, buffers or optimizer state differ after some
            step (the message shows the first such step); the plan sharded nothing or was
            never applied.
        ParallelError: a rank raised, died or hung.
        InvalidArgument: an argument cannot be used (as ``assert_tensor_parallel_grads_match``).
    """
    __tracebackhide__ = True
    accepted(assert_tensor_parallel_training_matches, options, TPTrainingKeywords)
    after_backward = training_code(optimizer, options.get("after_backward"))
    pairs = describe_batches(batches, forward_keywords(options.get("forward_kwargs")))
    first_inputs, first_kwargs, first_target = pairs[0]
    first = options.copy()
    first["forward_kwargs"] = first_kwargs
    check = TPCheck.of(module, first_inputs, first_target, loss_fn, world_size, plan, first)
    step = options.get("step")
    require_step(step, "TPContext")
    training = training_batches(check, pairs, options.get("shards"))
    counted, uneven = training.counted, training.uneven
    chosen = step or (weighted_tp_step if uneven else tp_step)
    task = TPTrainingTask(
        check.module, training.pairs, check.loss_fn, optimizer, training.sizes, chosen,
        item_kinds=tuple(c.kind for c in counted), item_counts=tuple(c.per_rank for c in counted),
        after_backward=after_backward, plan=dict(check.plan), data_parallel=check.data_parallel,
        fsdp_modules=check.fsdp_modules,
    )
    title = f"{len(pairs)} steps of tensor-parallel training with {callable_name(optimizer)} must match single-device training"
    # one device first: a hook that cannot run there fails before the ranks start
    expected = _single_device(check.module, training.pairs, loss_fn, optimizer, None, after_backward, exact=check.exact)
    try:
        ranks: tuple[TPRankTraining, ...] = check.send(run_tp_training_task, task, title)
    except ParallelError as error:
        if _MIXED in str(error) and "raised in after_backward=" in str(error):
            error.add_note(_mixed_grads_note(check))
        raise
    anchor = None if check.tolerance.explicit else _single_device(check.module, training.pairs, loss_fn, optimizer, torch.float64, after_backward)
    rows, failing = _training_rows(check, ranks, expected, anchor, jittered=None if anchor is None else functools.partial(
        _jittered_reference, check, training.pairs, loss_fn, optimizer, after_backward,
    ))
    ok = all(row.ok for row in rows)
    notes = [
        f"Parameters, buffers and optimizer state compared after each of the {len(pairs)} optimizer steps; the table "
        f"shows step {failing + 1}.",
        *exact_training_notes(check, len(pairs), optimizer),
    ]
    if after_backward is not None:
        notes.append(f"{callable_name(after_backward)}(ctx) ran after every backward, on every rank and in the single-device run.")
    if uneven and step is None:
        notes.append(
            "Some batches split unevenly over the data-parallel groups: each group's loss was weighted by its share of "
            "the items (weighted_tp_step)."
        )
    failures, evidence = _sharding_findings(check, ranks)
    if not ok:
        reference_grads = expected.grads[failing]
        notes += _partial_grads_note(check, [(r.dp_rank, r.step_grads[failing]) for r in ranks], reference_grads)
        if after_backward is not None:
            notes += _scaled_grads_note(check, ranks, failing, reference_grads, after_backward)
        if check.loss_reduction(counted[0]) == "sum" and check.data_parallel > 1:
            notes.append(sum_loss_note(check.data_parallel))
    scenario = f"{check.describe(chosen)}; evidence: {evidence}"
    outcome = check.outcome(title, chosen, rows, notes=notes, failures=failures, scenario=scenario)
    return raise_unless_ok(outcome, options.get("msg"))
