"""``dpverify explain`` in words: the numbered answers built from an ``Explanation``.

``dpverify.explain.measure`` measures (``explain`` returns an ``Explanation`` of facts); this
module only reads those facts and writes them as prose, so that the wording can change
without touching the measurement, and the measurement never depends on the wording.
``dpverify.cli.explain_view`` shows both: the tables from the facts, the text from here.

The questions, their order and their numbers are those of ``docs/questions.md``. Under a
user's wrapper (``Explanation.wrapper``) an answer speaks of what that wrapper did, never of
what torch's DataParallel would do, and a question it could not measure says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dpverify.checks.loss_average import LossAverageReport
from dpverify.core.text import and_list, plural
from dpverify.explain.measure import Explanation, GradFact

__all__ = ["QUESTIONS", "Answer", "answers"]

#: The questions of docs/questions.md, in its order: answer ``i`` answers ``QUESTIONS[i - 1]``.
QUESTIONS: tuple[str, ...] = (
    "When the batch is sliced, does the first GPU receive its own slice again? Is the model copied to the first GPU again?",
    "Is the loss computed once on the gathered output of the whole batch, and how does its gradient get back to each replica?",
    "Why are replica gradients summed and not averaged?",
    "If forward returns the loss and I call loss.mean() on what DataParallel returns, is that the right loss?",
    "How are parameters such as an embedding table shared and kept in sync across GPUs?",
    "Why is the returned loss a vector with one entry per GPU, or a single number?",
    "Why does the first GPU use more memory than the others?",
    "Can the loss be computed on a device other than the first one?",
    "Must the batch be larger than the number of GPUs? What happens when it is not, or when it does not divide evenly?",
    "Can any model that fits on one GPU be wrapped in DataParallel unchanged?",
    "DataParallel or DistributedDataParallel: do they give the same gradients for the same training loop?",
)


@dataclass(frozen=True)
class Answer:
    """The answer to question ``number`` of docs/questions.md, with the values measured."""

    number: int
    question: str
    answer: str


def _list(items: Sequence[Any]) -> str:
    """``0``, ``0 and 1``, ``0, 1 and 2``: devices, replicas or byte counts as words."""
    return and_list([str(item) for item in items]) if items else ""


def _bytes(n: int) -> str:
    return f"{n:,} B"


_EVAL_NOTE = (
    "Measured on an eval-mode copy: in train mode BatchNorm/Dropout make every replica "
    "differ from the full batch anyway (question 10). "
)


def answers(e: Explanation) -> tuple[Answer, ...]:
    """The answer to every question of ``QUESTIONS``, in order, in words built from the
    values ``e`` holds; an answer measured on an eval-mode copy says so first, and a
    question the wrapper could not measure says why instead."""
    builders = (
        _answer_views, _answer_loss_once, _answer_sum, _answer_loss_mean,
        _answer_sharing, _answer_vector, _answer_memory, _answer_output_device,
        _answer_batch_size, _answer_unchanged, _answer_ddp,
    )
    unanswered = dict(e.unanswered)
    texts = []
    for number, build in enumerate(builders, start=1):
        if number in unanswered:
            texts.append(
                f"Not answered for {e.under_test}: the measurement runs the wrapper, and {unanswered[number]}. "
                "torch's DataParallel's numbers would not be the wrapper's, so none are given."
            )
            continue
        text = build(e)
        texts.append(_EVAL_NOTE + text if e.eval_mode_for_losses and number in (3, 4, 6, 8, 11) else text)
    return tuple(Answer(i + 1, QUESTIONS[i], text) for i, text in enumerate(texts))


def _answer_views(e: Explanation) -> str:
    first = e.chunks[0]
    copies = [c for c in e.chunks[1:] if c.kind == "copy"]
    r0 = e.replicas[0]
    total = r0.shared_parameters + r0.copied_parameters
    if first.kind == "view":
        text = (
            f"No. Device {first.device}'s chunk ({_span(e, first.rows)}) is a view of the batch, "
            f"which already lives there: nothing is sent. "
        )
    elif first.kind == "copy":
        text = (
            f"Yes: device {first.device}'s chunk ({_span(e, first.rows)}) is a copy "
            f"({_bytes(first.copied_bytes)}), made although the batch already lives there. "
        )
    else:
        text = f"Device {first.device} received no chunk: {e.under_test} left it idle. "
    if copies:
        which = f"Devices {_list([c.device for c in copies])} received copies" if len(copies) > 1 else f"Device {copies[0].device} received a copy"
        text += f"{which} ({_list([_bytes(c.copied_bytes) for c in copies])}). "
    if r0.copied_parameters == 0:
        text += (
            f"Nor is the model copied to device {r0.device}: replica 0 shares storage with the module "
            f"for {r0.shared_parameters} of {total} parameters ({_bytes(r0.parameter_bytes)} extra)"
        )
    else:
        text += (
            f"The model is copied for replica 0 on device {r0.device} too: it shares storage with the "
            f"module for {r0.shared_parameters} of {total} parameters only ({_bytes(r0.parameter_bytes)} extra)"
        )
    others = e.replicas[1:]
    if others:
        holders = (
            f"; replicas {_list([r.replica for r in others])} hold copies" if len(others) > 1
            else f"; replica {others[0].replica} holds a copy"
        )
        text += f"{holders} ({_list([_bytes(r.parameter_bytes) for r in others])})"
    return text + "."


def _weighting(e: Explanation) -> tuple[str, str]:
    """How the step reduces the replica losses of a forward that returns its loss:
    ``("t_i/T", "its share of the 38 tokens, t_i/T")``, or by rows ``n_i/B``."""
    if e.weighting == "t_i/T":
        noun = e.loss_items.split(" (")[0]
        return e.weighting, f"its share of the {sum(e.loss_counts)} {noun} its loss is a mean over, t_i/T"
    return "n_i/B", f"its share of the {e.batch_size} {_unit(e, e.batch_size)}, n_i/B"


def _unit(e: Explanation, n: int) -> str:
    """What ``n`` entries of the batch are called: rows (dim 0), or entries along dim D."""
    if e.dim == 0:
        return "row" if n == 1 else "rows"
    return f"{'entry' if n == 1 else 'entries'} along dim {e.dim}"


def _span(e: Explanation, rows: str) -> str:
    """``rows 0-1``, or ``entries 0-1 along dim 1``: a chunk's place in the batch."""
    return f"rows {rows}" if e.dim == 0 else f"entries {rows} along dim {e.dim}"


def _answer_loss_once_in_forward(e: Explanation) -> str:
    """Question 2 for a forward that returns its loss: each replica computed its own, and
    the step reduced the gathered replica losses."""
    if not e.replicated:
        runs = "DataParallel runs the module itself" if e.wrapper is None else f"{e.under_test} ran one replica"
        return (
            f"With one device {runs}: there is no gather, the forward computed the loss ({e.loss}) once, "
            f"on the whole batch on device {e.gathered_on} ({e.loss_value:.6g}), and backward starts from it."
        )
    symbol, share = _weighting(e)
    weights = [r.loss_grad for r in e.replicas]
    where = f"on device {e.gathered_on}" if e.gathered_on is not None else "(no gather() call dpverify could see)"
    text = (
        f"No: this forward returns its loss, so each replica computed the loss of its own chunk on its own device, "
        f"and the {plural(e.replicas_used, 'replica loss', 'replica losses')} were gathered into one "
        f"{tuple(e.output_shape)} vector {where}. The step reduces that vector, weighting replica i by {share} "
        f"(the exact reduction, question 4): {e.loss_value:.6g}. "
    )
    if all(w is not None for w in weights):
        shown = ", ".join(f"{w:.4g}" for w in weights if w is not None)
        text += (
            f"In backward, Gather's backward sent each replica one number, the gradient of the reduced loss with "
            f"respect to its own loss, its weight {symbol}: [{shown}]."
        )
    else:
        text += "In backward, Gather's backward sent each replica the gradient of the reduced loss with respect to its own loss."
    return text


def _answer_loss_once(e: Explanation) -> str:
    if e.loss_in_forward:
        return _answer_loss_once_in_forward(e)
    rows = e.output_shape[e.dim] if len(e.output_shape) > e.dim else 0
    if not e.replicated:
        runs = "DataParallel runs the module itself" if e.wrapper is None else f"{e.under_test} ran one replica"
        return (
            f"With one device {runs}: there is no gather, the loss "
            f"({e.loss}) was computed once on device {e.gathered_on} on the whole "
            f"{tuple(e.output_shape)} output ({e.loss_value:.6g}), and its gradient "
            f"({e.replicas[0].output_grad_rows} {_unit(e, e.replicas[0].output_grad_rows)}) flows straight into the module."
        )
    sizes = [r.output_grad_rows for r in e.replicas]
    if e.gathered_on is None:
        where = f"into one {tuple(e.output_shape)} output without a gather() call dpverify could see (on which device is not measured)"
        there = "on them"
    else:
        passed = "torch's forward passed to gather" if e.wrapper is None else "the wrapper passed to its gather"
        where = f"into one {tuple(e.output_shape)} tensor on device {e.gathered_on} (the output_device {passed})"
        there = "there"
    along = "" if e.dim == 0 else f" along dim {e.dim}"
    return (
        f"Yes. The {plural(e.replicas_used, 'replica output')} were gathered{along} {where}, and the loss "
        f"({e.loss}) was computed once {there}: "
        f"{e.loss_value:.6g}. In backward, Gather's backward split d loss/d output ({rows} {_unit(e, rows)}) "
        f"by chunk size and sent each replica its part: {sizes} {_unit(e, 2)}."
    )


def _worst(grads: Sequence[GradFact], key: Callable[[GradFact], float]) -> float:
    return max((key(g) for g in grads), default=0.0)


def _answer_sum(e: Explanation) -> str:
    k = e.replicas_used
    sum_error = _worst(e.grads, lambda g: g.sum_error)
    if k == 1:
        return (
            f"With one replica there is nothing to sum or average: its gradient is the "
            f"full-batch gradient (greatest difference {sum_error:.2g}, float64). Run with more "
            f"rows or devices to see the sum at work."
        )
    ratio = _worst(e.grads, lambda g: g.average_ratio)
    if e.loss_in_forward:
        symbol, _share = _weighting(e)
        items = "tokens" if symbol == "t_i/T" else _unit(e, 2)
        setting = f"With the replica losses weighted by {symbol}"
        why = f"replica i's gradient is (1/{symbol[-1]}) times the sum over its own {items}"
    else:
        setting = "With a mean loss over the gathered batch"
        why = f"replica i's gradient is (1/B) times the sum over its own {_unit(e, 2)}"
    if not e.grads_add_up:
        # float64: a sum that misses the full-batch gradient by more than rounding is not one
        return (
            f"{setting} the replica gradients should add up to the "
            f"full-batch gradient, but under {e.under_test} they do not: greatest |sum - full| = "
            f"{sum_error:.3g} over all parameters (float64), |average| / |full| = {ratio:.3g}. "
            "dpverify check names the parameters and the likely bug."
        )
    return (
        f"{setting}, {why}, so the replica gradients add up to the full-batch gradient: "
        f"greatest |sum - full| = {sum_error:.2g} over all parameters (float64). Their average "
        f"is the full gradient divided by the {k} replicas a second time: greatest "
        f"|average - full| = {_worst(e.grads, lambda g: g.average_error):.3g}, "
        f"|average| / |full| = {ratio:.3g} (1/{k})."
    )


def _answer_loss_mean(e: Explanation) -> str:
    r = e.loss_average
    assert r is not None  # measured, or question 4 is unanswered
    moved = "" if e.loss.startswith("computed in forward") else "Measured with your loss moved into forward. "
    if r.by_tokens:
        return moved + _answer_loss_mean_tokens(r)
    uneven = len(set(r.chunk_sizes)) > 1
    if r.is_biased:
        reason = (
            f"the chunks {list(r.chunk_sizes)} are uneven" if uneven and r.weighted_is_exact
            else f"the replica losses are not per-row means (chunks {list(r.chunk_sizes)})"
        )
        verdict = (
            f"No: {reason}, so loss.mean() = {r.mean_of_means:.6g} is biased by "
            f"{r.loss_bias:+.3g} against the full-batch loss {r.full_batch_loss:.6g}, and its "
            f"gradients differ by up to {r.grad_bias:.3g} (relative)."
        )
    else:
        why = "the chunks are equal" if not uneven else "the replica losses happen to agree"
        verdict = (
            f"Here yes, because {why} ({list(r.chunk_sizes)}): loss.mean() = "
            f"{r.mean_of_means:.6g}, full batch {r.full_batch_loss:.6g}; chunks of different "
            "sizes would bias it."
        )
    return (
        f"{moved}{verdict} The exact reduction weights replica i by n_i/B: {r.weighted_mean:.6g} "
        f"(off the full-batch loss by {abs(r.weighted_error):.1g})."
    )


def _answer_loss_mean_tokens(r: LossAverageReport) -> str:
    """Question 4 for a loss that is a mean over tokens: the token counts decide."""
    total = sum(r.counts)
    if r.is_biased:
        reason = (
            f"the replicas hold different numbers of tokens, {r.counted}"
            + (f", although the chunks have equal rows {list(r.chunk_sizes)}" if len(set(r.chunk_sizes)) == 1 else "")
            if r.weighted_is_exact
            else f"the replica losses are not means over their tokens {r.counted}"
        )
        verdict = (
            f"No: each replica's loss is a mean over its own tokens and {reason}, so loss.mean() = "
            f"{r.mean_of_means:.6g} is biased by {r.loss_bias:+.3g} (the token counts predict "
            f"{r.predicted_bias:+.3g}) against the full-batch loss {r.full_batch_loss:.6g}."
        )
    else:
        verdict = (
            f"Here yes: every replica holds the same number of tokens, {r.counted}, so "
            f"loss.mean() = {r.mean_of_means:.6g} equals the full-batch loss {r.full_batch_loss:.6g}; "
            "replicas with different numbers of tokens would bias it, even on chunks of equal rows."
        )
    return (
        f"{verdict} The exact reduction weights replica i by its share of the {total} tokens, "
        f"t_i/T: {r.weighted_mean:.6g} (off the full-batch loss by {abs(r.weighted_error):.1g}); "
        "weighting by rows, n_i/B, is not exact for a mean over tokens."
    )


def _answer_sharing(e: Explanation) -> str:
    copies = e.replicas[1:]
    equal = all(r.equal_to_module for r in e.replicas)
    leaves = sum(r.leaf_parameters for r in e.replicas)
    if e.wrapper is not None:
        return _answer_sharing_wrapper(e, equal, leaves)
    text = (
        f"Each parameter exists once, in the module, and every forward calls "
        f"replicate() again ({e.replicas_built_over_two_forwards} distinct replicas over two "
        f"forwards of {e.replicas_used}): replica 0's parameters are the module's own tensors"
    )
    if copies:
        text += (
            f", the others are fresh copies {'equal' if equal else 'NOT equal'} to them at forward time"
        )
    text += (
        f". {'No replica parameter is a leaf' if leaves == 0 else f'{leaves} replica parameters are leaves'} "
        f"(they are outputs of Broadcast), so backward sums every replica's gradient into the "
        f"module's single .grad; the next forward broadcasts the updated weights again, so "
        f"nothing has to be kept in sync."
    )
    return text


def _answer_sharing_wrapper(e: Explanation, equal: bool, leaves: int) -> str:
    """Question 5 for a user's wrapper: what its replicas were, measured, without torch's
    replicate() and Broadcast as the reasons."""
    built = e.replicas_built_over_two_forwards
    text = (
        f"Under {e.under_test}: {built} distinct replicas over two forwards of {e.replicas_used} "
        f"({'rebuilt on every forward' if built is not None and built >= 2 * e.replicas_used else 'not all rebuilt on every forward'}), "
        f"{'all' if equal else 'NOT all'} equal to the module's parameters at forward time"
    )
    if leaves == 0:
        text += (
            ". No replica parameter is a leaf: each was computed from the module's own parameters, "
            "so backward carries every replica's gradient into the module's .grad (question 3 shows their sum)."
        )
    else:
        text += (
            f". {leaves} replica parameters are leaves: their gradients stay on the replicas and never "
            "reach the module's .grad unless the wrapper copies them back."
        )
    return text


def _answer_vector(e: Explanation) -> str:
    moved = "" if e.loss.startswith("computed in forward") else "Measured with your loss moved into forward. "
    if not e.replicated:
        return (
            f"{moved}On one device DataParallel runs the module itself and returns its scalar "
            f"loss, shape {tuple(e.one_device_loss_shape or ())}. With several devices Gather "
            f"concatenates one scalar per replica used into a vector (try --devices 4)."
        )
    assert e.returned_loss_shape is not None  # measured, or question 6 is unanswered
    if e.wrapper is not None and e.returned_loss_shape != (e.replicas_used,):
        return (
            f"{moved}Each replica's forward returns a scalar; on {len(e.device_ids)} devices with "
            f"B={e.batch_size} {e.under_test} returned the loss with shape {tuple(e.returned_loss_shape)} "
            f"({e.replicas_used} replicas ran). On one device: shape {tuple(e.one_device_loss_shape or ())}."
        )
    text = (
        f"{moved}Each replica's forward returns a scalar and Gather concatenates what the "
        f"replicas return: on {len(e.device_ids)} devices with B={e.batch_size} the loss came back "
        f"with shape {tuple(e.returned_loss_shape)}, one entry per replica used (not per device"
    )
    text += f": device {_list(list(e.idle_devices))} sat idle)" if e.idle_devices else ")"
    if e.scalar_warning:
        text += ", and torch warned 'Was asked to gather along dimension 0, but all input tensors were scalars'"
    return text + f". On one device there is no gather: shape {tuple(e.one_device_loss_shape or ())}."


def _answer_memory(e: Explanation) -> str:
    first, *rest = e.bytes
    if not rest:
        return f"With one device everything is on device {first.device}: an estimated {_bytes(first.total)} (see the table)."
    others = max(b.total for b in rest)
    return (
        f"Estimated from the sizes of the tensors each device holds, device {first.device} holds "
        f"{_bytes(first.total)} and the busiest other device {_bytes(others)}: device "
        f"{first.device} keeps the whole batch ({_bytes(first.inputs)}, the source of the scatter), "
        f"the module's parameters ({_bytes(first.parameters)}) and their summed .grad, and, as "
        f"output_device {e.output_device if e.gathered_on is None else e.gathered_on}, the gathered outputs and their gradient."
    )


def _answer_output_device(e: Explanation) -> str:
    if e.gathered_on is None:
        called = f"no gather() call of {e.under_test} was seen, so where it computes the loss is not measured here."
    else:
        who = "torch's forward" if e.wrapper is None else "the wrapper"
        called = f"{who} called gather(..., output_device={e.gathered_on}) here."
    text = (
        f"Yes. output_device decides where Gather concatenates the outputs, and so where the loss "
        f"is computed; {called}"
    )
    if e.other_output_device is not None:
        gap = e.other_output_device_grad_gap or 0.0
        changed = "changed no gradient" if gap == 0 else "changed the gradients"
        text += (
            f" Gathering on device {e.other_output_device} instead {changed} "
            f"(greatest difference {gap:.2g})."
        )
    return text


def _answer_batch_size(e: Explanation) -> str:
    n = len(e.device_ids)
    if e.wrapper is not None:
        return _answer_batch_size_wrapper(e, n)
    text = (
        f"No. torch.chunk gives chunks of ceil(B/{n}) {_unit(e, 2)} and the last may be smaller: "
        f"B={e.batch_size} on {n} devices gives {list(e.chunk_sizes)}, so {e.replicas_used} "
        f"replica{'s' if e.replicas_used != 1 else ''} run"
    )
    text += f" and device {_list(list(e.idle_devices))} sits idle. " if e.idle_devices else ". "
    tokens = e.loss_average is not None and e.loss_average.by_tokens
    text += (
        f"Fewer {_unit(e, 2)} than devices leaves devices idle; uneven chunks still give the exact "
        "gradient (question 3), but bias a loss averaged after forward (question 4)"
        + (", as do equal chunks holding different numbers of tokens. " if tokens else ". ")
        + "Other batch sizes are in the table."
    )
    return text


def _answer_batch_size_wrapper(e: Explanation, n: int) -> str:
    """Question 9 for a user's wrapper: the split it made, measured, against torch.chunk's."""
    sizes, planned = list(e.chunk_sizes), list(e.planned_chunk_sizes)
    text = (
        f"{e.under_test} split B={e.batch_size} on {plural(n, 'device')} into {sizes} (the rows each replica's "
        f"forward received"
    )
    text += f"; torch.chunk gives {planned})" if planned and planned != sizes else ", as torch.chunk does)"
    text += f", so {plural(e.replicas_used, 'replica')} ran"
    text += f" and device {_list(list(e.idle_devices))} sat idle. " if e.idle_devices else ". "
    if sum(sizes) < e.batch_size:
        text += f"Only {sum(sizes)} of the {e.batch_size} rows reached a replica (question 10). "
    failed = [s.batch_size for s in e.splits if s.note]
    if failed:
        text += f"It raised on batches of {_list(failed)} rows (see the table). "
    else:
        text += "It ran every batch size in the table, measured the same way. "
    return text + (
        "Uneven chunks still give the exact gradient when the replica gradients are summed "
        "(question 3), but bias a loss averaged after forward (question 4)."
    )


def _answer_unchanged(e: Explanation) -> str:
    if not e.state:
        if e.wrapper is not None:
            ran = [c for c in e.chunks if c.kind != "idle"]
            rows = (
                "every row of the batch reached exactly one replica" if all(c.start is not None for c in ran)
                else f"the replicas' forwards received {sum(c.size for c in ran)} of the {e.batch_size} rows "
                "between them (which rows is not known: some chunks are no contiguous rows of the batch)"
            )
            return (
                f"This one, under {e.under_test}, yes: one forward on one device and one under the wrapper "
                "left the same buffers and attributes, no module depends on the batch split or on random "
                f"draws (BatchNorm or Dropout in train mode), and {rows}."
            )
        return (
            "This one, yes: one forward on one device and one under DataParallel left the same "
            "buffers and attributes, no module depends on the batch split or on random draws "
            f"(BatchNorm or Dropout in train mode), and no {_unit(e, 2)} are dropped. Models that count "
            "calls in forward, update buffers in place, or use BatchNorm/Dropout would not."
        )
    kinds = _list(sorted({s.kind for s in e.state}))
    return (
        f"Not this one: {plural(len(e.state), 'finding')} ({kinds}), measured by running one "
        f"forward on one device and one under {e.under_test}; see the table."
    )


def _answer_ddp(e: Explanation) -> str:
    d = e.ddp
    k = e.replicas_used
    # DataParallel's side is the full-batch gradient, which torch's step gives; a user's
    # wrapper is not assumed to (question 3 and dpverify check measure whether it does)
    dp = "DataParallel's" if e.wrapper is None else "the full-batch gradient a correct DataParallel gives"
    text = (
        f"Simulated in one process (DDP's arithmetic: per-shard gradients averaged over ranks), "
        f"with the chunks {list(e.chunk_sizes)} as shards on {k} ranks: with a mean loss DDP's "
        f"gradient differs from {dp} by up to {d.mean_loss_gap:.3g} (relative) ({_ddp_why(e)}). "
    )
    if d.sum_loss_ratio is not None:
        theirs = "DataParallel's" if e.wrapper is None else "a correct DataParallel's"
        text += f"With a summed loss DDP's gradients are {d.sum_loss_ratio:.3g} of {theirs} (1/{k}): DataParallel sums, DDP averages. "
    if d.detail:
        against = "" if e.wrapper is None or d.mode != "measured" else f" (against torch's DataParallel, not {e.under_test})"
        text += f"{'Measured' if d.mode == 'measured' else 'Not measured'}{against}: {d.detail}."
    else:
        text += "Run with --ddp to measure real DDP ranks."
    return text.rstrip()


def _ddp_why(e: Explanation) -> str:
    """Why DDP's averaged gradient is exact or biased here, from the measured split: the
    shards' rows, or the items (tokens) their mean losses are over (question 4)."""
    r = e.loss_average
    tokens = r is not None and r.by_tokens and len(r.counts) == len(e.chunk_sizes)
    if e.ddp.mean_loss_gap < 1e-9:
        return "exact: equal shards" + (f" holding equal numbers of tokens, {r.counted}" if tokens and r is not None else "")
    if len(set(e.chunk_sizes)) > 1:
        return "biased: uneven shards; weight rank r's loss by n_r*W/B"
    if tokens and r is not None and r.unequal_items:
        return f"biased: the shards hold different numbers of tokens, {r.counted}; weight rank r's loss by t_r*W/T"
    return (
        "biased although the shards are equal: each rank's loss is not the mean over its share of the batch "
        "(question 4 measures the replica losses)"
    )
