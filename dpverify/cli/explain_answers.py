"""``dpverify explain`` in words: the numbered answers built from an ``Explanation``.

``dpverify.cli.explain`` measures (``explain`` returns an ``Explanation`` of facts); this
module only reads those facts and writes them as prose, so that the wording can change
without touching the measurement, and the measurement never depends on the wording.
``dpverify.cli.explain_view`` shows both: the tables from the facts, the text from here.

The questions, their order and their numbers are those of ``docs/questions.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dpverify.cli.explain import Explanation, GradFact
from dpverify.core.text import and_list, plural

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
    values ``e`` holds; an answer measured on an eval-mode copy says so first."""
    texts = [
        _answer_views(e), _answer_loss_once(e), _answer_sum(e), _answer_loss_mean(e),
        _answer_sharing(e), _answer_vector(e), _answer_memory(e), _answer_output_device(e),
        _answer_batch_size(e), _answer_unchanged(e), _answer_ddp(e),
    ]
    if e.eval_mode_for_losses:
        for number in (3, 4, 6, 8, 11):
            texts[number - 1] = _EVAL_NOTE + texts[number - 1]
    return tuple(Answer(i + 1, QUESTIONS[i], text) for i, text in enumerate(texts))


def _answer_views(e: Explanation) -> str:
    first = e.chunks[0]
    copies = [c for c in e.chunks if c.kind == "copy"]
    r0 = e.replicas[0]
    total = r0.shared_parameters + r0.copied_parameters
    text = (
        f"No. Device {first.device}'s chunk (rows {first.rows}) is a {first.kind} of the batch, "
        f"which already lives there: nothing is sent. "
    )
    if copies:
        which = f"Devices {_list([c.device for c in copies])} received copies" if len(copies) > 1 else f"Device {copies[0].device} received a copy"
        text += f"{which} ({_list([_bytes(c.copied_bytes) for c in copies])}). "
    text += (
        f"Nor is the model copied to device {r0.device}: replica 0 shares storage with the module "
        f"for {r0.shared_parameters} of {total} parameters ({_bytes(r0.parameter_bytes)} extra)"
    )
    others = e.replicas[1:]
    if others:
        holders = (
            f"; replicas {_list([r.replica for r in others])} hold copies" if len(others) > 1
            else f"; replica {others[0].replica} holds a copy"
        )
        text += f"{holders} ({_list([_bytes(r.parameter_bytes) for r in others])})"
    return text + "."


def _answer_loss_once(e: Explanation) -> str:
    rows = e.output_shape[0] if e.output_shape else 0
    if not e.replicated:
        return (
            f"With one device DataParallel runs the module itself: there is no gather, the loss "
            f"({e.loss}) was computed once on device {e.gathered_on} on the whole "
            f"{_shape(e.output_shape)} output ({e.loss_value:.6g}), and its gradient "
            f"({e.replicas[0].output_grad_rows} rows) flows straight into the module."
        )
    sizes = [r.output_grad_rows for r in e.replicas]
    return (
        f"Yes. The {plural(e.replicas_used, 'replica output')} were gathered into one "
        f"{_shape(e.output_shape)} tensor on device {e.gathered_on} (the output_device torch's "
        f"forward passed to gather), and the loss ({e.loss}) was computed once there: "
        f"{e.loss_value:.6g}. In backward, Gather's backward split d loss/d output ({rows} rows) "
        f"by chunk size and sent each replica its part: {sizes} rows."
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
    return (
        f"With a mean loss over the gathered batch, replica i's gradient is (1/B) times the sum "
        f"over its own rows, so the replica gradients add up to the full-batch gradient: "
        f"greatest |sum - full| = {sum_error:.2g} over all parameters (float64). Their average "
        f"is the full gradient divided by the {k} replicas a second time: greatest "
        f"|average - full| = {_worst(e.grads, lambda g: g.average_error):.3g}, "
        f"|average| / |full| = {ratio:.3g} (1/{k})."
    )


def _answer_loss_mean(e: Explanation) -> str:
    r = e.loss_average
    moved = "" if e.loss.startswith("computed in forward") else "Measured with your loss moved into forward. "
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


def _answer_sharing(e: Explanation) -> str:
    copies = e.replicas[1:]
    equal = all(r.equal_to_module for r in e.replicas)
    leaves = sum(r.leaf_parameters for r in e.replicas)
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


def _answer_vector(e: Explanation) -> str:
    moved = "" if e.loss.startswith("computed in forward") else "Measured with your loss moved into forward. "
    if not e.replicated:
        return (
            f"{moved}On one device DataParallel runs the module itself and returns its scalar "
            f"loss, shape {_shape(e.one_device_loss_shape)}. With several devices Gather "
            f"concatenates one scalar per replica used into a vector (try --devices 4)."
        )
    text = (
        f"{moved}Each replica's forward returns a scalar and Gather concatenates what the "
        f"replicas return: on {len(e.device_ids)} devices with B={e.batch_size} the loss came back "
        f"with shape {_shape(e.returned_loss_shape)}, one entry per replica used (not per device"
    )
    text += f": device {_list(list(e.idle_devices))} sat idle)" if e.idle_devices else ")"
    if e.scalar_warning:
        text += ", and torch warned 'Was asked to gather along dimension 0, but all input tensors were scalars'"
    return text + f". On one device there is no gather: shape {_shape(e.one_device_loss_shape)}."


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
        f"output_device {e.output_device}, the gathered outputs and their gradient."
    )


def _answer_output_device(e: Explanation) -> str:
    text = (
        f"Yes. output_device decides where Gather concatenates the outputs, and so where the loss "
        f"is computed; torch's forward called gather(..., output_device={e.gathered_on}) here."
    )
    if e.other_output_device is not None:
        text += (
            f" Gathering on device {e.other_output_device} instead changed no gradient "
            f"(greatest difference {e.other_output_device_grad_gap:.2g})."
        )
    return text


def _answer_batch_size(e: Explanation) -> str:
    n = len(e.device_ids)
    text = (
        f"No. torch.chunk gives chunks of ceil(B/{n}) rows and the last may be smaller: "
        f"B={e.batch_size} on {n} devices gives {list(e.chunk_sizes)}, so {e.replicas_used} "
        f"replica{'s' if e.replicas_used != 1 else ''} run"
    )
    text += f" and device {_list(list(e.idle_devices))} sits idle. " if e.idle_devices else ". "
    text += (
        "Fewer rows than devices leaves devices idle; uneven chunks still give the exact "
        "gradient (question 3), but bias a loss averaged after forward (question 4). "
        "Other batch sizes are in the table."
    )
    return text


def _answer_unchanged(e: Explanation) -> str:
    if not e.state:
        return (
            "This one, yes: one forward on one device and one under DataParallel left the same "
            "buffers and attributes, no module depends on the batch split or on random draws "
            "(BatchNorm or Dropout in train mode), and no rows are dropped. Models that count "
            "calls in forward, update buffers in place, or use BatchNorm/Dropout would not."
        )
    kinds = _list(sorted({s.kind for s in e.state}))
    return (
        f"Not this one: {plural(len(e.state), 'finding')} ({kinds}), measured by running one "
        f"forward on one device and one under DataParallel; see the table."
    )


def _answer_ddp(e: Explanation) -> str:
    d = e.ddp
    k = e.replicas_used
    text = (
        f"Simulated in one process (DDP's arithmetic: per-shard gradients averaged over ranks), "
        f"with the chunks {list(e.chunk_sizes)} as shards on {k} ranks: with a mean loss DDP's "
        f"gradient differs from DataParallel's by up to {d.mean_loss_gap:.3g} (relative) "
        + ("(exact: equal shards). " if d.mean_loss_gap < 1e-9 else "(biased: uneven shards; weight rank r's loss by n_r*W/B). ")
    )
    if d.sum_loss_ratio is not None:
        text += f"With a summed loss DDP's gradients are {d.sum_loss_ratio:.3g} of DataParallel's (1/{k}): DataParallel sums, DDP averages. "
    if d.detail:
        text += f"{'Measured' if d.mode == 'measured' else 'Not measured'}: {d.detail}."
    else:
        text += "Run with --ddp to measure real DDP ranks."
    return text.rstrip()


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"
