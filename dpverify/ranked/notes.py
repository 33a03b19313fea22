"""The notes a ranked check adds to a failure: the factor a gradient is off by and its
likely causes, a sum-reduction loss under an averaging wrapper, a loss all-reduced outside
autograd, the loss-averaging trap (rows or tokens) and when it applies, ranks that disagree
with each other, ranks that draw the same random numbers, and a synchronisation on the
wrong micro-batch.

Every backend whose wrapper averages the ranks' gradients (DDP's all-reduce, FSDP2's
reduce-scatter, FSDP2 over the data-parallel groups of tensor parallelism) words the same
facts; ``averager`` names the wrapper in the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpverify.core.comparison import explain_scale, uniform_scale
from dpverify.core.step import StepResult
from dpverify.ranked.check import RankedCheck, relative_gap, same_up_to_rounding
from dpverify.ranked.items import PieceItems
from dpverify.ranked.randomness import SameStream, same_random_numbers

__all__ = [
    "fraction",
    "items_notes",
    "ranks_disagree",
    "same_end_state_note",
    "same_random_numbers_failure",
    "scale_note",
    "sum_loss_note",
    "token_trap_note",
    "training_stream_findings",
    "trap_fits",
    "trap_note",
    "untracked_all_reduce_note",
    "wrong_micro_batch_failure",
]


def sum_loss_note(world_size: int, averager: str = "DDP", size: str = "world size") -> str:
    """Why a sum-reduction loss is wrong under a wrapper that averages the ranks' gradients
    (``averager``, over ``world_size`` of what ``size`` names)."""
    return (
        "loss_fn sums over the rows (the full batch's loss is the sum of the shards' losses, "
        f"not their mean, e.g. reduction='sum'). {averager} averages the ranks' gradients, which is "
        "right for a mean loss; with a sum loss each rank sums only its own rows and the "
        f"average divides by the {size}, {world_size}, so the gradients are not the "
        "single-device ones. Use a mean loss; or keep the sum and multiply each rank's loss by "
        "world_size (loss * ctx.world_size in a step, instead of ctx.loss_weight); "
        "DataParallel, which sums its replicas' gradients, gives the single-device gradient "
        "for the same sum loss."
    )


def ranks_disagree(steps: Sequence[Any]) -> list[str]:
    """A note when two ranks hold different gradients after a step (``steps[r].grads``)."""
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


def scale_note(
    steps: Sequence[Any], expected: StepResult, world_size: int, micro_batches: int = 1,
    shard_sizes: Sequence[int] = (), reduction: str | None = None, averager: str = "DDP", size: str = "world size",
) -> tuple[list[str], float | None]:
    """The uniform factor between rank 0's gradients and one device's, with its sentence
    (``explain_scale``) and the sum-loss note when the sentence did not name it.
    ``averager``: what averages the ranks' gradients, in the text; ``size``: what
    ``world_size`` counts. A step seen all-reducing a tensor that requires grad
    (``steps[r].grad_all_reduces``, where recorded) has that named as the cause of a
    ``1/world_size`` factor, and no sum loss is suspected."""
    c = uniform_scale(steps[0].grads, expected.grads)
    # a loss summed over each rank's rows gives B / world_size on any shards
    per_rank = sum(shard_sizes) / len(shard_sizes) if shard_sizes else None
    untracked = any(getattr(step, "grad_all_reduces", ()) for step in steps)
    notes = [] if c is None else [
        explain_scale(
            c, world_size, averager=averager, micro_batches=micro_batches, shard_size=per_rank, reduction=reduction, size=size,
            untracked_all_reduce=untracked,
        )
    ]
    if untracked:
        notes.append(untracked_all_reduce_note(steps))
    elif reduction == "sum" and not any("sum-reduction loss" in note for note in notes):
        notes.append(sum_loss_note(world_size, averager, size))
    return notes, c


def untracked_all_reduce_note(steps: Sequence[Any]) -> str:
    """What the ranks passed to ``torch.distributed.all_reduce`` that requires grad
    (``steps[r].grad_all_reduces``)."""
    seen = {rank: list(step.grad_all_reduces) for rank, step in enumerate(steps) if step.grad_all_reduces}
    shapes = "; ".join(f"rank {rank}: {', '.join(str(list(shape)) for shape in shapes)}" for rank, shapes in seen.items())
    return (
        f"Seen on the ranks: the step passed tensors that require grad to torch.distributed.all_reduce "
        f"(shapes {shapes}; a shape [] is a scalar such as the loss). all_reduce has no gradient formula: "
        "the gradient passes through it unchanged (torch warns that no autograd kernel is registered for "
        "c10d::allreduce_), so each rank's gradient is its own loss's, times whatever the step did to the "
        "reduced value."
    )


def trap_fits(step: Any, ok: bool, reduction: str | None, verified: Sequence[Any], naive: Sequence[Any]) -> bool:
    """Whether a loss-averaging trap note (``trap_note``, ``token_trap_note``) belongs with a
    check on shards of unequal items: for the harness's own step (``step`` None: the note
    says why the weighted step ran and what the plain one, shown for contrast, gets wrong);
    for the user's step only when it failed as the trap predicts, its gradients equal to the
    plain per-rank mean-loss step's (``naive``, the counterfactual). Never for a sum loss,
    which no weighting of means concerns."""
    if reduction == "sum":
        return False
    if step is None:
        return True
    return not ok and same_up_to_rounding(verified[0].grads, naive[0].grads)


def same_random_numbers_failure(same: SameStream, world_size: int) -> str:
    """Two ranks drew their Dropout masks from the same random state (``same_random_numbers``)."""
    first, other = same.ranks
    masks = (
        f"their masks agree on all {same.elements} entries they share" if same.identical
        else f"(their masks differ only where their rows do, {same.elements} entries shared)"
    )
    return (
        f"Every rank draws the same random numbers: ranks {first} and {other} drew the dropout mask of "
        f"{same.module!r} from the same random generator state, and {masks}. The step seeds every rank "
        "alike (torch.manual_seed(seed) with one seed on every rank), so the ranks drop the same units of "
        "their rows: the data-parallel noise is correlated, where one device over the full batch draws an "
        f"independent mask for every row. Seed each rank in its own stream, torch.manual_seed(seed + rank) "
        f"(rank = torch.distributed.get_rank(), {world_size} ranks; accelerate's set_seed(seed, "
        "device_specific=True)); dpverify seeds rank r with seed + r, and same_seed=True when identical "
        "streams are meant."
    )


def same_end_state_note(steps: Sequence[Any]) -> str | None:
    """A note when every rank left the step in the same random state (``steps[r].end_state``),
    though each started in its own stream: the step seeded every rank alike."""
    states = [step.end_state for step in steps]
    if len(states) < 2 or states[0] is None or any(state != states[0] for state in states):
        return None
    return (
        f"All {len(states)} ranks left the step in the same random state, though dpverify started each in "
        "its own stream (seed + rank): the step seeds every rank alike (torch.manual_seed with one seed), so "
        "whatever it draws after that (F.dropout, noise, augmentation, a random crop) is the same on every "
        "rank. Seed each rank in its own stream, torch.manual_seed(seed + rank)."
    )


@dataclass(frozen=True)
class _StepEnd:
    """The random state a rank's training step left (what ``same_end_state_note`` reads)."""

    end_state: str | None


def training_stream_findings(ranks: Sequence[Any], world_size: int) -> tuple[list[str], list[str]]:
    """(failures, notes) of a training check whose ranks recorded each step's Dropout masks
    and end state (``ranks[r].dropout``, ``ranks[r].end_states``): a failure at the first
    step in which two ranks drew a mask from the same random state, else a note at the first
    step every rank left in one state (``same_end_state_note``)."""
    for index in range(min((len(rank.dropout) for rank in ranks), default=0)):
        same = same_random_numbers([rank.dropout[index] for rank in ranks])
        if same is not None:
            return [f"In optimizer step {index + 1}: {same_random_numbers_failure(same, world_size)}"], []
    for index in range(min((len(rank.end_states) for rank in ranks), default=0)):
        note = same_end_state_note([_StepEnd(rank.end_states[index]) for rank in ranks])
        if note is not None:
            return [], [f"In optimizer step {index + 1}: {note}"]
    return [], []


def wrong_micro_batch_failure(steps: Sequence[Any], micro_batches: int) -> str | None:
    """The ranks that synchronised once, but before their last forward: on a micro-batch
    other than the last (``steps[r].sync_forwards``, the forwards seen at each of rank r's
    synchronisations, and ``steps[r].forwards``, all of them)."""
    wrong = [
        (rank, step.sync_forwards[0]) for rank, step in enumerate(steps)
        if len(step.sync_forwards) == 1 and step.forwards is not None and step.sync_forwards[0] < step.forwards
    ]
    if not wrong:
        return None
    where = "; ".join(f"rank {rank} synchronised on micro-batch {index} of {micro_batches}" for rank, index in wrong)
    return (
        f"{where}. DDP must synchronise on the last: the gradients of later micro-batches never reach the "
        "other ranks (they stay on the rank that computed them, added after the all-reduce). Run every "
        "micro-batch but the last inside no_sync(): `with model.no_sync() if i < k - 1 else "
        "contextlib.nullcontext():`."
    )


def fraction(value: float) -> str:
    """``8`` for 8.0, ``8.5`` for 8.5: the denominator of a weight ``1/value``."""
    return str(round(value)) if abs(value - round(value)) < 1e-9 else f"{value:.4g}"


def _plain_bias(losses: Sequence[float | None], world: int, reference: StepResult, who: str, said: str = "") -> str | None:
    """How far the average of the plain step's per-``who`` mean losses is from the full
    batch's loss; None when some loss is missing."""
    if not losses or any(loss is None for loss in losses):
        return None
    mean_of_means = sum(float(loss) for loss in losses if loss is not None) / world
    full = float(reference.loss)
    return (
        f"the {who}s' mean losses average to {mean_of_means:.8g} against the full batch's "
        f"{full:.8g} (bias {mean_of_means - full:+.3g}{said})"
    )


def trap_note(
    check: RankedCheck,
    naive: Sequence[Any],
    reference: StepResult,
    *,
    averages: str = "DDP averages the ranks' gradients",
    plain: str = "ddp_step",
    weighted: str = "weighted_ddp_step",
    parts: int | None = None,
    groups: bool = False,
) -> str:
    """The loss-averaging trap on uneven shards, with the bias the plain step really had.

    ``averages`` says what averages the shards' gradients, ``plain`` and ``weighted`` name
    the plain per-shard mean-loss step and the exact one, ``parts`` is the number of shards
    the average divides by (default the world size), and ``groups`` words the shards as the
    data-parallel groups of tensor parallelism (``naive[r].dp_rank`` says whose loss each is).
    """
    sizes, batch = check.shard_sizes, check.batch_size
    world = check.world_size if parts is None else parts
    weights = ", ".join(f"1/{world * n}" if n else "0 (no rows)" for n in sizes)
    factors = ", ".join(f"{n * world / batch:.4g}" for n in sizes)
    who, each, size, count = ("group", "group g", "n_g", "data_parallel") if groups else ("rank", "rank r", "n_r", "world_size")
    text = (
        f"Uneven {'data-parallel ' if groups else ''}shards {list(sizes)}: {averages}, so a per-{who} mean "
        f"loss gives each sample of {each} the weight 1/({count} * {size}) = [{weights}] "
        f"instead of 1/B = 1/{batch} (the loss-averaging trap)."
    )
    losses = list({s.dp_rank: s.loss for s in naive}.values()) if groups else [step.loss for step in naive]
    averaged = _plain_bias(losses, world, reference, who) if len(losses) == world else None
    text += f" With the plain step ({plain})" + (f" {averaged}, and" if averaged else "")
    gap = relative_gap(naive[0].grads, reference.grads)
    return text + (
        f" its gradients differ from the full-batch gradients by up to {gap:.3g} (relative). "
        f"Exact for any shards: multiply each {who}'s mean loss by {size} * {count} / B = [{factors}] "
        f"(ctx.loss_weight; {weighted})."
    )


def token_trap_note(check: RankedCheck, items: PieceItems, naive: Sequence[Any], reference: StepResult) -> str:
    """The loss-averaging trap when each rank's loss is a mean over its tokens: the counts,
    the weights plain ``ddp_step`` gives, the bias it had and the bias the counts predict,
    and the exact recipe."""
    world, counts, total = check.world_size, items.per_rank, items.total
    noun = items.noun
    equal_rows = ", although the shards have equal rows" if not check.uneven else ""
    weights = ", ".join(f"1/{fraction(world * t)}" for t in counts)
    factors = ", ".join(f"{t * world / total:.4g}" for t in counts)
    text = (
        f"Each rank's loss is a mean over its {noun}: {list(counts)}{items.detail}, {total} in "
        f"all, on shards {list(check.shard_sizes)}{equal_rows}. DDP averages the ranks' "
        f"gradients, so a per-rank mean loss gives each of rank r's {noun} the weight "
        f"1/(world_size * t_r) = [{weights}] instead of 1/T = 1/{total} (the loss-averaging trap)."
    )
    predicted = items.predicted_rank_bias()
    said = f"; the {items.singular} counts predict {predicted:+.3g}" if predicted is not None else ""
    averaged = _plain_bias([step.loss for step in naive], world, reference, "rank", said)
    facts = [averaged] if averaged else []
    if not averaged and predicted is not None:
        facts.append(f"the {items.singular} counts predict a bias of {predicted:+.3g} in the average of the ranks' mean losses")
    facts.append(f"its gradients differ from the full-batch gradients by up to {relative_gap(naive[0].grads, reference.grads):.3g} (relative)")
    text += (
        " With the plain step (ddp_step) " + ", and ".join(facts) + ". "
        f"Exact: multiply each rank's mean loss by its share of the {noun}, t_r * world_size / T "
        f"= [{factors}] (ctx.loss_weight; weighted_ddp_step), or all-reduce the {items.singular} count and "
        f"divide each rank's summed loss by it (ctx.total_items), times world_size. Weighting by "
        "rows (n_r * world_size / B) is not exact here."
    )
    return text


def items_notes(items: PieceItems, trap: bool) -> list[str]:
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
