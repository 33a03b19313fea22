"""Public DistributedDataParallel checks: real DDP on real ranks against one device.

Every check is a ``RankedCheck`` (``dpverify.ranked.check``: how a ranked check runs and
compares); ``DDPCheck`` adds DistributedDataParallel's keyword arguments and what DDP makes
of parameters without a gradient. See docs/semantics.md, DistributedDataParallel.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Unpack

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpverify.checks.dp import Check, raise_unless_ok
from dpverify.core.comparison import (
    StepComparison,
    TensorComparison,
    TensorId,
    compare_tensors,
    uniform_scale,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.items import Items
from dpverify.core.step import (
    Key,
    StepResult,
    convert_tensors,
    copy_module,
    default_dtype,
    flatten_tensors,
)
from dpverify.core.validation import (
    require_bool,
    require_int_at_least,
    require_mapping,
    require_module_with_grads,
)
from dpverify.ddp.pool import ParallelError, require_picklable
from dpverify.ddp.rank import (
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
from dpverify.ranked.check import (
    CPU,
    RankedCheck,
    References,
    TrainingTrace,
    callable_name,
    describe_batches,
    exact_training_notes,
    forward_keywords,
    grads_only,
    jittered_training,
    local_buffer_notes,
    per_shard_buffers,
    relative_gap,
    require_step,
    train_single_device,
    trainable_names,
    training_batches,
    training_code,
    training_rows,
    training_scale_note,
    unused_names,
)
from dpverify.ranked.items import PieceItems, cut_pieces, require_items
from dpverify.ranked.notes import (
    fraction,
    items_notes,
    ranks_disagree,
    same_end_state_note,
    same_random_numbers_failure,
    scale_note,
    sum_loss_note,
    token_trap_note,
    training_stream_findings,
    trap_fits,
    trap_note,
    wrong_micro_batch_failure,
)
from dpverify.ranked.options import (
    ShardedKeywords,
    TrainingKeywords,
    accepted,
    check_keywords,
    documented,
)
from dpverify.ranked.randomness import (
    dropout_layers,
    replaying_dropout,
    same_random_numbers,
    training_masks,
)
from dpverify.ranked.rank import (
    LossFn,
    OptimizerFactory,
    RankStep,
    RankTraining,
    even_shards,
)

__all__ = [
    "DDPKeywords",
    "assert_ddp_accumulation_matches",
    "assert_ddp_buffers_match",
    "assert_ddp_grads_match",
    "assert_ddp_sync_batchnorm_matches",
    "assert_ddp_training_matches",
    "assert_dp_ddp_agree",
]

_RESERVED_DDP_KWARGS = ("module", "device_ids", "output_device", "process_group")


# --------------------------------------------------------------------------- validation


class DDPKeywords(ShardedKeywords, total=False):
    """The optional keywords of the DDP helpers (each takes those its docstring lists)."""

    ddp_kwargs: Mapping[str, Any] | None
    items: Items | None


class DDPStepKeywords(DDPKeywords, total=False):
    """The optional keywords of the one-step DDP helpers that run the user's step
    (``assert_ddp_grads_match``, ``assert_ddp_accumulation_matches``)."""

    same_seed: bool


class DDPTrainingKeywords(DDPKeywords, TrainingKeywords, total=False):
    """The optional keywords of ``assert_ddp_training_matches``."""

    same_seed: bool


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


@dataclass(frozen=True)
class DDPCheck(RankedCheck):
    """A validated DDP scenario: ``RankedCheck``'s, DistributedDataParallel's keywords, and
    whether every rank starts from the same random state (``same_seed``) rather than its own."""

    ddp_kwargs: tuple[tuple[str, Any], ...] = ()
    same_seed: bool = False

    NO_GRAD: ClassVar[str] = "DistributedDataParallel refuses such a module, and there is no gradient to compare"

    @classmethod
    def of(
        cls, module: nn.Module, inputs: Any, target: Any, loss_fn: LossFn, world_size: int, options: Mapping[str, Any], micro_batches: int = 1,
    ) -> DDPCheck:
        """The scenario of one call of a DDP helper: its arguments and ``options``
        (``micro_batches``: per rank, for exact mode's proof)."""
        return cls.create(
            module, inputs, target, loss_fn=loss_fn, world_size=world_size, micro_batches=micro_batches, **check_keywords(options),
            ddp_kwargs=_ddp_kwargs(options.get("ddp_kwargs")),
            same_seed=require_bool(options.get("same_seed", False), "same_seed"),
        )

    @property
    def find_unused(self) -> bool:
        return bool(dict(self.ddp_kwargs).get("find_unused_parameters", False))

    def unused_findings(self, unused: Sequence[str], *, wrapped: bool = True) -> tuple[list[str], list[str]]:
        """(failures, notes) for parameters that get no gradient on one device.

        Without ``find_unused_parameters`` (or ``static_graph``) torch's DDP fails on such a
        model whatever the gradients of this step look like: it refuses the next forward. A
        step that never wraps the module in DDP is not concerned.
        """
        if not unused or not wrapped or self.find_unused:
            return [], []
        if dict(self.ddp_kwargs).get("static_graph", False):
            return [], [
                f"Parameters {list(unused)} get no gradient on one device. DistributedDataParallel("
                "static_graph=True) copes with parameters the forward never uses, but (torch 2.13) "
                "not with a module output that the loss leaves out: from the second step on, the "
                "gradients are no longer averaged. If a later step fails, pass "
                "ddp_kwargs={'find_unused_parameters': True} instead."
            ]
        return [
            f"Parameters {list(unused)} get no gradient (they take no part in the loss; on one "
            "device their .grad stays None), and DistributedDataParallel runs without "
            "find_unused_parameters=True: it waits for their gradients, so the step's all-reduce "
            "never completes (the ranks' gradients are not averaged), and the next forward raises "
            "'Expected to have finished reduction in the prior iteration before starting a new "
            "one'. Pass ddp_kwargs={'find_unused_parameters': True} (dpverify check: --ddp-kwargs "
            "find_unused_parameters=true; their .grad then stays None "
            "on every rank, as on one device), or make them take part in the loss, or freeze them "
            "with requires_grad_(False)."
        ], []

    def layout(self) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.ddp_kwargs)
        return f"{self.shards_text()}; DistributedDataParallel({kwargs})"

    def send(self, fn: Callable[..., Any], task: Any, what: str) -> Any:
        try:
            return super().send(fn, task, what)
        except ParallelError as error:
            if _UNFINISHED_REDUCTION in str(error):
                error.add_note(_UNUSED_HINT)
            raise

    def step_task(self, steps: Sequence[Step], items: PieceItems | None = None, **options: Any) -> StepTask:
        """The ranks' task: ``steps`` on this batch, with the items ``items`` counted
        (``ShardContext.item_counts``; rows when None)."""
        return StepTask(**self.step_fields(steps, items), ddp_kwargs=self.ddp_kwargs, same_seed=self.same_seed, **options)

    def replayed_references(self, steps: Sequence[RankStep], micro_batches: int = 1, items: PieceItems | None = None) -> tuple[References, tuple[str, ...]]:
        """``references``, from a copy of the module whose Dropout layers apply the masks the
        ranks drew (``steps[r].dropout``, concatenated along the batch in rank order), and
        the layers replayed; the plain references and none when the masks cannot replay."""
        rows = [even_shards(n, micro_batches) for n in self.shard_sizes]
        replay = replaying_dropout(self.module, [s.dropout for s in steps], rows)
        if replay is None:
            return self.references(micro_batches, items=items), ()
        return replace(self, module=replay).references(micro_batches, items=items), tuple(dropout_layers(self.module))

    def same_stream_findings(self, steps: Sequence[RankStep]) -> tuple[list[str], list[str]]:
        """(failures, notes) when the ranks drew the same random numbers (none when
        ``same_seed`` asked for it): a failure when two ranks drew their dropout masks from
        the same random state, else a note when every rank left the step in one state."""
        if self.same_seed:
            return [], []
        same = same_random_numbers([s.dropout for s in steps])
        if same is not None:
            return [same_random_numbers_failure(same, self.world_size)], []
        note = same_end_state_note(steps)
        return [], [] if note is None else [note]


_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"

#: What DDP does with buffers, for the note on buffers updated from the local batch.
DDP_BUFFER_SYNC = (
    "DistributedDataParallel broadcasts rank 0's buffers before each forward (broadcast_buffers=True), so every "
    "rank goes on from rank 0's local-batch update, not from the full batch's."
)

_UNUSED_HINT = (
    "dpverify: 'Expected to have finished reduction in the prior iteration' means some "
    "parameters got no gradient in the previous step: without find_unused_parameters=True, "
    "DDP waits for them and never reduces their bucket. Pass "
    "ddp_kwargs={'find_unused_parameters': True} (dpverify check: --ddp-kwargs find_unused_parameters=true), or make every parameter take part in the loss."
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


def _accumulation_trap_note(check: DDPCheck, items: PieceItems, micro_batches: int, plain: Sequence[RankStep], reference: StepResult) -> str:
    """Dividing each micro-batch's mean loss by the number of micro-batches, when the
    micro-batches hold different numbers of items: the weights, the bias the counts
    predict, how far its gradients are, and the exact recipe."""
    world, total, noun = check.world_size, items.total, items.noun
    pieces = [list(rank) for rank in items.counts]
    weights = ", ".join(f"1/{fraction(world * micro_batches * t)}" for t in items.flat)
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
        facts.append(f"its gradients differ from the full-batch gradients by up to {relative_gap(plain[0].grads, reference.grads):.3g} (relative)")
    if facts:
        text += " Here " + ", and ".join(facts) + "."
    text += (
        f" Exact: weight each micro-batch's mean loss by t_p * world_size / T (part.items * "
        f"ctx.world_size / ctx.total_items; no_sync_accumulation_step), that is divide its summed "
        f"loss by the total count over every micro-batch and rank, not by {micro_batches}."
    )
    return text


# --------------------------------------------------------------------------- gradients


@documented
def assert_ddp_grads_match(
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, **options: Unpack[DDPStepKeywords],
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
        <shared: pool, ddp_kwargs, rtol, atol, msg, forward_kwargs, exact>
        items: ``items(args, kwargs) -> int``, the items one shard's mean loss averages
            over (its tokens), called in this process on each shard's forward arguments
            with the shard's target appended as the last positional argument (``args[-1]``).
            Default: found from the evidence (see above).
        same_seed: start every rank's step from the same random state. Default False:
            rank ``r`` starts from seed ``r``, its own stream, as launchers seed ranks.

    Returns:
        The comparison (``str()`` summarises it).

    Parameters that require grad but take no part in the loss (an unused layer, a pooler
    whose output the loss ignores) must have ``.grad`` None on every rank, as on one device:
    that needs ``ddp_kwargs={'find_unused_parameters': True}``, and without it the check
    fails naming them (torch's DDP never completes the step's all-reduce and refuses the next
    forward). Frozen parameters (``requires_grad=False``) are ignored by DDP and compared as
    None. A gradient that is uniformly off by a factor gets its likely causes named, among
    them a sum-reduction loss (``1/world_size``: DDP averages the ranks' gradients), or,
    where a rank was seen passing a tensor that requires grad to
    ``torch.distributed.all_reduce``, that all-reduce, which autograd does not differentiate.

    Randomness: the ``nn.Dropout`` layers of the rank's module in train mode draw their masks
    through a hook that records them; the single-device step replays them, concatenated
    along the batch in rank order, so a train-mode Dropout model is compared exactly, and
    two ranks that drew a mask from the same random state (one ``torch.manual_seed`` on
    every rank) fail the check, unless ``same_seed``.

    Raises:
        ParallelMismatch: a rank's gradient or output differs beyond tolerance, or parameters
            get no gradient under DDP without ``find_unused_parameters``.
        ParallelError: a rank raised, died or hung; the pool restarts for the next check.
        InvalidArgument: an argument cannot be used (unpicklable loss or step included), or
            the module has no parameter that requires grad.
    """
    __tracebackhide__ = True
    accepted(assert_ddp_grads_match, options, DDPStepKeywords)
    check = DDPCheck.of(module, inputs, target, loss_fn, world_size, options)
    step = options.get("step")
    require_step(step, "ShardContext")
    counted = check.count_items(1, require_items(options.get("items")))
    trap = counted.unequal_ranks
    chosen = step or (weighted_ddp_step if trap else ddp_step)
    steps: list[Step] = [chosen, ddp_step] if trap else [chosen]
    title = "DistributedDataParallel gradients must match the single-device full-batch gradient on every rank"
    results = check.send(run_step_task, check.step_task(steps, counted), title)
    verified = [rank_steps[0] for rank_steps in results]
    refs, replayed = check.replayed_references(verified, items=counted)
    expected, anchor = refs.expected, refs.anchor
    rows = check.rank_rows(verified, refs)
    ok = all(row.ok for row in rows)
    notes: list[str] = items_notes(counted, trap) + _replay_notes(replayed)
    contrasts: list[TensorComparison] = []
    reduction = None if ok else check.loss_reduction(counted)
    if trap:
        naive = [rank_steps[1] for rank_steps in results]
        if trap_fits(step, ok, reduction, verified, naive):  # the trap is about per-rank mean losses
            reference = anchor or expected
            notes.append(token_trap_note(check, counted, naive, reference) if counted.by_tokens else trap_note(check, naive, reference))
        if step is None:
            contrasts = grads_only(check.rank_rows(naive, refs, variant="plain ddp_step", contrast=True))
        elif trap_fits(step, ok, reduction, verified, naive):
            share = f" (t_r * world_size / T, its share of the {counted.noun})" if counted.by_tokens else ""
            notes.append(
                "The step's gradients equal the plain per-rank mean-loss step's: it falls into "
                f"the loss-averaging trap. Multiply the rank's loss by ctx.loss_weight{share}."
            )
    failures, unused_notes = check.unused_findings(unused_names(module, expected.grads), wrapped=all(s.wrapped for s in verified))
    same_failures, same_notes = check.same_stream_findings(verified)
    failures += same_failures
    notes += unused_notes + same_notes
    scale = None
    if not ok:
        more, scale = scale_note(verified, expected, check.world_size, shard_sizes=check.shard_sizes, reduction=reduction)
        notes += more + ranks_disagree(verified)
    outcome = check.outcome(title, chosen, rows, contrasts=contrasts, notes=notes, failures=failures, scale=scale, replayed=replayed)
    return raise_unless_ok(outcome, options.get("msg"))


def _replay_notes(replayed: Sequence[str]) -> list[str]:
    if not replayed:
        return []
    return [
        f"Dropout layers {list(replayed)} ran in train mode: each rank drew its masks from its own random "
        "stream (seed + rank), and the single-device step applied them, concatenated along the batch in "
        "rank order."
    ]


# --------------------------------------------------------------------------- accumulation


@documented
def assert_ddp_accumulation_matches(
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, micro_batches: int,
    **options: Unpack[DDPStepKeywords],
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

    The one synchronisation must come on the last micro-batch: the counter records the
    micro-batch each synchronisation came on, and a step that synchronises on an earlier
    one (``no_sync() if i != 0``) fails, naming it. Dropout masks are recorded and replayed,
    and ``same_seed`` is taken, as in ``assert_ddp_grads_match``.

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
    accepted(assert_ddp_accumulation_matches, options, DDPStepKeywords)
    k = require_int_at_least(micro_batches, "micro_batches", 1)
    check = DDPCheck.of(module, inputs, target, loss_fn, world_size, options, micro_batches=k)
    step = options.get("step")
    if min(check.shard_sizes) < k:
        raise InvalidArgument(
            f"micro_batches={k} but the shards are {list(check.shard_sizes)}; every shard "
            f"needs at least {k} rows (pass a larger batch or fewer micro-batches)"
        )
    require_step(step, "ShardContext")
    counted = check.count_items(k, require_items(options.get("items")))
    trap = counted.unequal_pieces
    chosen = step or no_sync_accumulation_step
    steps: list[Step] = [chosen, micro_mean_accumulation_step] if trap else [chosen]
    title = f"DDP gradient accumulation over {k} micro-batches must match one full-batch step"
    task = check.step_task(steps, counted, micro_batches=k, count_syncs=True)
    sent = check.send(run_step_task, task, title)
    results = [rank_steps[0] for rank_steps in sent]
    refs, replayed = check.replayed_references(results, k, items=counted)
    expected = refs.expected
    rows = check.rank_rows(results, refs)
    ok = all(row.ok for row in rows)
    failures, notes = check.unused_findings(unused_names(module, expected.grads), wrapped=all(s.wrapped for s in results))
    same_failures, same_notes = check.same_stream_findings(results)
    failures += same_failures
    notes += items_notes(counted, trap) + _replay_notes(replayed) + same_notes
    reduction = None if ok else check.loss_reduction(counted)
    contrasts: list[TensorComparison] = []
    plain = [rank_steps[1] for rank_steps in sent] if trap else []
    if trap and trap_fits(step, ok, reduction, results, plain):
        notes.append(_accumulation_trap_note(check, counted, k, plain, refs.anchor or expected))
        if step is None:
            contrasts = grads_only(check.rank_rows(plain, refs, variant="micro_mean_accumulation_step", contrast=True))
        else:
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
    elif (wrong := wrong_micro_batch_failure(results, k)) is not None:
        failures.append(wrong)
    scale = None
    if not ok:
        more, scale = scale_note(results, expected, check.world_size, k, shard_sizes=check.shard_sizes, reduction=reduction)
        notes += more + ranks_disagree(results)
    notes.append(f"Gradient synchronisations per rank: {counts} (one expected).")
    outcome = check.outcome(title, chosen, rows, contrasts=contrasts, notes=notes, failures=failures, scale=scale, replayed=replayed)
    return raise_unless_ok(outcome, options.get("msg"))


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


@documented
def assert_ddp_training_matches(
    module: nn.Module, batches: Sequence[tuple[Any, ...]], *, loss_fn: LossFn, optimizer: OptimizerFactory, world_size: int,
    **options: Unpack[DDPTrainingKeywords],
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
        <shared: after_backward>
        Others: as ``assert_ddp_grads_match``.

    Randomness: every rank trains in its own random stream (seed + rank; ``same_seed``: one
    for all), and the masks the ``nn.Dropout`` layers of each rank's module draw in train
    mode are recorded in every step; single-device training applies each step's masks,
    concatenated along the batch in rank order, in that step's forward, so a train-mode
    Dropout model is compared exactly over every step. Two ranks that drew a mask from the
    same random state in some step (a step that reseeds every rank alike) fail the check,
    unless ``same_seed``. Other random draws (``F.dropout`` in a forward, ``Dropout2d``) are
    not replayed: such a model differs from one device by its randomness.

    Raises:
        ParallelMismatch: a rank's parameters differ after some step; the message shows the
            first such step.
        ParallelError: a rank raised. When torch's DDP refuses a forward because parameters
            got no gradient in the step before (no ``find_unused_parameters``), the message
            names them, the step, and the fix.
    """
    __tracebackhide__ = True
    accepted(assert_ddp_training_matches, options, DDPTrainingKeywords)
    after_backward = training_code(optimizer, options.get("after_backward"))
    pairs = describe_batches(batches, forward_keywords(options.get("forward_kwargs")))
    first_inputs, first_kwargs, first_target = pairs[0]
    check = DDPCheck.of(module, first_inputs, first_target, loss_fn, world_size, {**options, "forward_kwargs": first_kwargs})
    step = options.get("step")
    require_step(step, "ShardContext")
    training = training_batches(check, pairs, options.get("shards"), require_items(options.get("items")))
    counted, uneven = training.counted, training.uneven
    chosen = step or (weighted_ddp_step if uneven else ddp_step)
    task = TrainingTask(
        check.module, training.pairs, check.loss_fn, optimizer, training.sizes, chosen, check.ddp_kwargs,
        item_kinds=tuple(c.kind for c in counted), item_counts=tuple(c.per_rank for c in counted),
        after_backward=after_backward, same_seed=check.same_seed,
    )
    title = f"{len(pairs)} steps of DDP training with {callable_name(optimizer)} must match single-device training"
    trace = TrainingTrace()
    # One device first, unless it must replay the ranks' Dropout masks: if the ranks fail,
    # it tells which parameters got no gradient.
    first = None if dropout_layers(check.module) else train_single_device(check.module, training.pairs, loss_fn, optimizer, None, after_backward, trace=trace, exact=check.exact)
    try:
        ranks: tuple[RankTraining, ...] = check.send(run_training_task, task, title)
    except ParallelError as error:
        unused_found = (first or train_single_device(check.module, training.pairs, loss_fn, optimizer, None, after_backward))[1]
        retold = _unused_training_error(error, unused_found, check)
        if retold is None:
            raise
        raise retold from None
    masks = None if first is not None else training_masks(check.module, [rank.dropout for rank in ranks], training.sizes)
    replayed = tuple(dropout_layers(check.module)) if masks is not None else ()
    expected, unused_by_step = first or train_single_device(
        check.module, training.pairs, loss_fn, optimizer, None, after_backward, trace=trace, dropout=masks, exact=check.exact,
    )
    trace64 = None if check.tolerance.explicit else TrainingTrace()
    anchor = None if trace64 is None else train_single_device(
        check.module, training.pairs, loss_fn, optimizer, torch.float64, after_backward, trace=trace64, dropout=masks,
    )[0]
    jittered = None if trace64 is None else jittered_training(check, training.pairs, optimizer, after_backward, masks)
    rows, failing_step = training_rows(check, ranks, expected, anchor, trace=trace, trace_anchor=trace64, jittered=jittered)
    notes = [
        f"Parameters, buffers and optimizer state compared after each of the {len(pairs)} optimizer steps; "
        f"the table shows step {failing_step + 1}.",
        *exact_training_notes(check, len(pairs), optimizer),
    ]
    if replayed:
        notes.append(
            f"Dropout layers {list(replayed)} ran in train mode: in every step each rank drew its masks from its own "
            f"random stream ({'one seed on every rank, same_seed=True' if check.same_seed else 'seed + rank'}), and "
            "single-device training applied them, concatenated along the batch in rank order, in that step's forward."
        )
    if after_backward is not None:
        notes.append(f"{callable_name(after_backward)}(ctx) ran after every backward, on every rank and in the single-device run.")
    ok = all(row.ok for row in rows)
    scale = None
    if not ok:
        initial = {name: p.detach() for name, p in check.module.named_parameters()}
        hook = callable_name(after_backward) if after_backward is not None else None
        factor_note, scale = training_scale_note(ranks, expected, initial, failing_step, check.world_size, hook=hook, trace=trace)
        notes += [factor_note] if factor_note else []
        notes += local_buffer_notes(module, rows, DDP_BUFFER_SYNC)
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
    trainable = trainable_names(module)
    none_ranks = sorted({name for r in ranks for name in r.grads_none if name in trainable})
    if none_ranks:
        notes.append(f"Parameters whose .grad stayed None on the ranks (the optimizer skipped them): {none_ranks}.")
    unused = list(dict.fromkeys(name for names in unused_by_step for name in names))
    failures, unused_notes = check.unused_findings(unused, wrapped=all(r.wrapped for r in ranks))
    notes += unused_notes
    same_failures, same_notes = ([], []) if check.same_seed else training_stream_findings(ranks, check.world_size)
    failures += same_failures
    notes += same_notes
    if not ok and check.loss_reduction(counted[0]) == "sum":
        notes.append(sum_loss_note(check.world_size))
    outcome = check.outcome(title, chosen, rows, notes=notes, failures=failures, scale=scale, replayed=replayed)
    return raise_unless_ok(outcome, options.get("msg"))


# --------------------------------------------------------------------------- buffers


def _no_exact(options: Mapping[str, Any], helper: str, why: str) -> None:
    """Refuses ``exact=True`` for a helper that has no exact mode, saying why."""
    if options.get("exact", False) is not False:
        raise InvalidArgument(f"exact={options['exact']!r}: {helper} has no exact mode: {why}. Check without exact=True")


def _buffers_after_train_forward(module: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    model = copy_module(module, dtype)
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
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, **options: Unpack[DDPKeywords],
) -> StepComparison:
    """Asserts every rank's buffers after a DDP step are what one device computes, and come
    from rank 0 at the next forward, as DDP promises.

    Each rank runs one train-mode DDP step on its shard, then an eval-mode forward under
    ``torch.no_grad()``. Checked against one device:

    - after the step, rank ``r``'s floating-point buffers (a running statistic updated in
      forward: an EMA, a batch-statistic buffer) are the module's buffers updated by one
      forward over the full batch, as single-device training leaves them; a statistic each
      rank updates from its own shard differs, unless forward averages it over the ranks
      (``dist.all_reduce``). BatchNorm's running statistics and integer buffers (counts) are
      the module's updated by rank ``r``'s own shard: without SyncBatchNorm each rank's
      BatchNorm normalises by its shard's statistics, a known divergence
      (``assert_ddp_sync_batchnorm_matches`` checks SyncBatchNorm);
    - at the next forward, every rank uses rank 0's buffers (``broadcast_buffers=True``
      broadcasts them before a forward), so every rank's buffers and eval outputs are those
      of rank 0's model.

    DDP broadcasts buffers before a forward only when the previous forward ran with grad
    enabled outside ``no_sync()`` (``require_forward_param_sync``): after a forward under
    ``torch.no_grad()``, the next forward keeps every rank's own buffers.

    ``forward_kwargs`` are keyword forward arguments, sharded like ``inputs`` (which may then
    be ``()``); the other arguments are as in ``assert_ddp_grads_match``.

    Raises:
        ParallelMismatch: a rank's buffers or eval outputs differ (a running statistic
            updated from the rank's own shard; with ``broadcast_buffers=False`` the ranks
            keep their own statistics).
    """
    __tracebackhide__ = True
    accepted(assert_ddp_buffers_match, options, DDPKeywords, without=("step", "items"))
    _no_exact(options, "assert_ddp_buffers_match", "it compares running statistics, which a momentum such as BatchNorm's 0.1 rounds")
    check = DDPCheck.of(module, inputs, target, loss_fn, world_size, options)
    if not any(True for _ in module.buffers()):
        raise InvalidArgument("module has no buffers; there is nothing for DDP to broadcast")
    title = "DDP buffers must match one device after the step, and come from rank 0 at the next forward"
    ranks: tuple[RankBuffers, ...] = check.send(run_buffer_task, check.step_task([]), title)
    rows = _buffer_rows(check, ranks)
    per_shard = sorted(per_shard_buffers(module))
    notes = [
        "DDP broadcasts rank 0's buffers at the start of a forward that follows a grad-enabled "
        "forward outside no_sync(); each rank's own forward then updates them from its shard.",
    ]
    if per_shard:
        notes.append(
            f"Buffers {per_shard} (BatchNorm's running statistics, counts) were compared with each rank's own shard's "
            "update: without SyncBatchNorm each rank's BatchNorm normalises by its shard's statistics, a known "
            "divergence from one device; the other buffers with one forward over the full batch."
        )
    notes += local_buffer_notes(module, rows, DDP_BUFFER_SYNC)
    failures = _broadcast_failures(ranks)
    outcome = check.outcome(title, None, rows, notes=notes, failures=failures, divergence=False)
    return raise_unless_ok(outcome, options.get("msg"))


def _expected_after_step(full: nn.Module, own: nn.Module, per_shard: set[str]) -> nn.Module:
    """The module a rank should hold after its step: the full batch's buffers, but
    ``per_shard``'s updated from the rank's own shard (``own``)."""
    model = copy.deepcopy(full)
    with torch.no_grad():
        for name in per_shard:
            model.get_buffer(name).copy_(own.get_buffer(name))
    return model


def _buffer_rows(check: DDPCheck, ranks: Sequence[RankBuffers]) -> list[TensorComparison]:
    shards = [piece for (piece,) in cut_pieces(check.args, check.kwargs, check.target, check.shard_sizes, 1)]
    dtypes: list[torch.dtype | None] = [None] if check.tolerance.explicit else [None, torch.float64]
    per_shard = per_shard_buffers(check.module)
    wanted: dict[torch.dtype | None, list[nn.Module]] = {}
    for dtype in dtypes:
        full = _buffers_after_train_forward(check.module, check.args, dtype, check.kwargs)
        wanted[dtype] = [
            _expected_after_step(full, _buffers_after_train_forward(check.module, p.args, dtype, p.kwargs), per_shard) for p in shards
        ]

    def anchor_of(rank: int, name: str) -> torch.Tensor | None:
        if check.tolerance.explicit:
            return None
        return dict(wanted[torch.float64][rank].named_buffers())[name]

    rows: list[TensorComparison] = []
    rank0 = dict(wanted[None][0].named_buffers())
    for r, rank in enumerate(ranks):
        own = dict(wanted[None][r].named_buffers())
        for name, value in own.items():
            rows.append(compare_tensors(TensorId("buffer", name, rank=r, detail="after its step"), rank.after_step.get(name), value, anchor_of(r, name), check.tolerance))
        for name, value in rank0.items():
            rows.append(compare_tensors(TensorId("buffer", name, rank=r, detail="at the next forward"), rank.after_next_forward.get(name), value, anchor_of(0, name), check.tolerance))
    for r, (rank, shard) in enumerate(zip(ranks, shards, strict=True)):
        expected = _eval_outputs(copy.deepcopy(wanted[None][0]), shard.args, None, shard.kwargs)
        anchors = {} if check.tolerance.explicit else _eval_outputs(copy.deepcopy(wanted[torch.float64][0]), shard.args, torch.float64, shard.kwargs)
        mine = dict(rank.next_outputs)
        for path, value in expected.items():
            rows.append(compare_tensors(TensorId("output", path, rank=r, variant="eval"), mine.get(path), value, anchors.get(path), check.tolerance))
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
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, **options: Unpack[DDPKeywords],
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
    accepted(assert_ddp_sync_batchnorm_matches, options, DDPKeywords, without=("step",))
    _no_exact(options, "assert_ddp_sync_batchnorm_matches", "BatchNorm divides by the square root of the batch's variance, which rounds")
    check = DDPCheck.of(module, inputs, target, loss_fn, world_size, options)
    layers = [name for name, sub in module.named_modules() if isinstance(sub, _BatchNorm)]
    if not layers:
        raise InvalidArgument("module has no BatchNorm layer; SyncBatchNorm would change nothing")
    if not module.training:
        raise InvalidArgument("module is in eval mode; BatchNorm only synchronises in train mode (call module.train())")
    counted = check.count_items(1, require_items(options.get("items")))
    chosen = weighted_ddp_step if counted.unequal_ranks else ddp_step
    title = "SyncBatchNorm under DDP must match BatchNorm on the full batch on one device"
    synced = [s[0] for s in check.send(run_step_task, check.step_task([chosen], counted, sync_batchnorm=True), title)]
    plain = [s[0] for s in check.send(run_step_task, check.step_task([chosen], counted), title)]
    refs = check.references(items=counted)
    expected, anchor = refs.expected, refs.anchor
    rows = check.rank_rows(synced, refs)
    buffers = dict(_buffers_after_train_forward(module, check.args, None, check.kwargs).named_buffers())
    anchors = None if anchor is None else dict(_buffers_after_train_forward(module, check.args, torch.float64, check.kwargs).named_buffers())
    for r, s in enumerate(synced):
        for name, value in buffers.items():
            rows.append(compare_tensors(TensorId("buffer", name, rank=r), s.buffers.get(name), value, anchors.get(name) if anchors else None, check.tolerance))
    contrasts = grads_only(check.rank_rows(plain, refs, variant="plain BatchNorm", contrast=True))
    where = "torch's nn.SyncBatchNorm" if check.runner.backend == "nccl" else (
        "HostSyncBatchNorm (torch's SyncBatchNorm autograd function, host stand-ins for its "
        "CUDA-only kernels; torch refuses SyncBatchNorm on CPU)"
    )
    failures, unused_notes = check.unused_findings(unused_names(module, expected.grads), wrapped=all(s.wrapped for s in synced))
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
        notes.append(sum_loss_note(check.world_size))
    outcome = check.outcome(title, chosen, rows, contrasts=contrasts, notes=notes, failures=failures, divergence=False)
    return raise_unless_ok(outcome, options.get("msg"))


# --------------------------------------------------------------------------- DP and DDP


def assert_dp_ddp_agree(
    module: nn.Module, inputs: Any, target: Any, *, loss_fn: LossFn, world_size: int, **options: Unpack[DDPKeywords],
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
    ``assert_ddp_grads_match``). ``exact=True`` runs both on the same dyadic float64 copies
    and compares them bit for bit (as in ``assert_ddp_grads_match``).

    Raises:
        ParallelMismatch: the gradients differ (with the factor and its cause).
        InvalidArgument: the batch is too small for DataParallel to use every device, or the
            module has no parameter that requires grad.
    """
    __tracebackhide__ = True
    accepted(assert_dp_ddp_agree, options, DDPKeywords, without=("shards", "step"))
    require_module_with_grads(module, why=DDPCheck.NO_GRAD)
    items = require_items(options.get("items"))
    dp = Check.create(
        module, inputs, device_ids=list(range(require_int_at_least(world_size, "world_size", 1))), rtol=options.get("rtol"),
        atol=options.get("atol"), forward_kwargs=options.get("forward_kwargs"),
    )
    if dp.plan.n_replicas != world_size:
        raise InvalidArgument(
            f"DataParallel splits {sum(dp.plan.chunk_sizes)} rows into only {dp.plan.n_replicas} "
            f"chunks for {world_size} devices; pass a batch that gives every device rows "
            f"(at least {world_size} rows, e.g. a multiple of {world_size})"
        )
    check = DDPCheck.of(module, inputs, target, loss_fn, world_size, {**options, "shards": list(dp.plan.chunk_sizes)})
    if check.exact:
        # DataParallel on the grid copies: its gathered loss runs the full batch's operations
        # and its reduce-add forms partial sums of the proven sums, exact by the same bounds
        dp = Check.create(check.module, check.args, device_ids=list(dp.device_ids), forward_kwargs=check.kwargs or None)
    title = "DataParallel and DistributedDataParallel must give the same gradients for the same training code"
    ranks = [s[0] for s in check.send(run_step_task, check.step_task([ddp_step]), title)]
    target_now = check.target_as(None)
    dp_step = dp.run(lambda output: loss_fn(output, target_now), parallel=True)
    refs = check.references(expected=dp_step)
    rows = [
        refs.compare(TensorId("grad", name, rank=r, detail="vs DataParallel"), s.grads.get(name), Key.grad(name))
        for r, s in enumerate(ranks)
        for name in dp_step.grads
    ]
    notes = [f"DataParallel over devices {dp.device_ids}: {dp.plan.describe()}."]
    single = refs.anchor or check.reference(None)
    # One device, not DataParallel: its reduce-add gives unused parameters zeros, not None.
    failures, unused_notes = check.unused_findings(unused_names(module, single.grads))
    notes += unused_notes
    scale = None
    if not all(row.ok for row in rows):
        more, scale = _dp_ddp_diagnosis(check, ranks, dp_step, single, items)
        notes += more
    outcome = check.outcome(title, ddp_step, rows, notes=notes, failures=failures, scale=scale)
    return raise_unless_ok(outcome, options.get("msg"))


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
        notes.append(token_trap_note(check, counted, ranks, reference) if counted.by_tokens else trap_note(check, ranks, reference))
    return notes, c
