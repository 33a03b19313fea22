"""The loss-averaging trap: a loss computed in ``forward`` and averaged after DataParallel.

A forward that returns its own chunk's mean loss makes DataParallel gather one scalar per
replica. ``loss.mean()`` of that vector weights each sample ``1 / (k * n_i)`` instead of
``1 / B`` (``k`` replicas, chunk sizes ``n_i``): exact for equal chunks, biased otherwise.
Weighting replica ``i`` by ``n_i / B`` is exact for any split.

"Biased" is judged against this model's own rounding noise, measured: the ``n_i / B``
weighted replica losses equal the full-batch loss in exact arithmetic, so their difference
(and that of their gradients) is what rounding alone produces in the dtype the forward
really computes in, which can be float32 inside a float64 module.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dpverify.checks.dp import Check, Parallel, raise_unless_ok
from dpverify.core.comparison import Msg, StepComparison
from dpverify.core.errors import InvalidArgument
from dpverify.core.items import Items, choose_items, count_items, ignore_indices_of, item_candidates
from dpverify.core.numerics import JITTER_ROUNDOFFS, largest_abs
from dpverify.core.step import (
    ReplicaGradRecorder,
    ReplicaRecord,
    convert_tensors,
    default_dtype,
    jitter_parameters,
    seed_step,
)
from dpverify.core.tree import tensor_leaves
from dpverify.core.validation import require_callable
from dpverify.core.virtual import SCALAR_GATHER_WARNING

__all__ = [
    "LossAverageReport",
    "assert_loss_reduction_matches_full_batch",
    "check_forward_loss_average",
    "extract_loss",
    "loss_average_of",
    "reduction_matches",
]

#: ``reduce(losses, chunk_sizes)`` or ``reduce(losses, chunk_sizes, item_counts)``
Reduce = Callable[..., torch.Tensor]

# A bias counts only when it exceeds the measured rounding noise this many times: noise is
# estimated from one sample (the weighted-vs-full difference), so the margin is generous.
_NOISE_FACTOR = 32.0


def extract_loss(output: Any, loss_at: int) -> torch.Tensor:
    """The loss in a forward's output: the tensor itself, ``output[loss_at]`` of a tuple or
    list, a namedtuple's ``loss`` field, or a mapping's ``"loss"`` key."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and "loss" in getattr(output, "_fields", ()):
        value = output.loss  # type: ignore[attr-defined]
    elif isinstance(output, Mapping):
        if "loss" not in output:
            raise InvalidArgument(
                f"the forward returned a mapping with keys {list(output)}; the loss must be "
                "under the key 'loss'"
            )
        value = output["loss"]
    elif isinstance(output, (tuple, list)):
        if isinstance(loss_at, bool) or not isinstance(loss_at, int):
            raise InvalidArgument(f"loss_at={loss_at!r} must be an int index")
        if not -len(output) <= loss_at < len(output):
            raise InvalidArgument(
                f"loss_at={loss_at} is out of range for the forward's {len(output)} outputs; "
                "pass the index of the loss"
            )
        value = output[loss_at]
    else:
        raise InvalidArgument(
            f"the forward returned {type(output).__name__}; it must return the loss, a "
            "tuple or list holding it (loss_at), or a mapping with a 'loss' key"
        )
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(
            f"the forward's loss is {type(value).__name__}, not a tensor (loss_at={loss_at})"
        )
    return value


def _replica_losses(output: Any, loss_at: int, replicas: int) -> torch.Tensor:
    """One loss per replica: from the gathered output, or, for a wrapper that returns one
    output per replica (a list or tuple of ``replicas`` of them), from each of those."""
    try:
        losses = extract_loss(output, loss_at).reshape(-1)
    except InvalidArgument:
        losses = None
    if losses is None or losses.numel() != replicas:
        per_replica = _per_replica_losses(output, loss_at, replicas)
        if per_replica is not None:
            return per_replica
    if losses is None:
        extract_loss(output, loss_at)  # raises, with the message for the gathered output
    assert losses is not None
    if losses.numel() == 1 and replicas > 1:
        raise InvalidArgument(
            f"the parallel step returned one loss for {replicas} replicas: the wrapper reduces the replica "
            "losses itself, so no replica's loss can be checked. These checks take one loss per replica, "
            "as DataParallel gathers them, and test the reduction on its own: let the wrapper return the "
            "gathered replica losses and pass the reduction as reduce=fn(losses, chunk_sizes[, item_counts]) "
            "(assert_loss_reduction_matches_full_batch); or, with the loss computed outside the forward, "
            "check the pair on the command line with --parallel WRAPPER --parallel-loss CRITERION_WRAPPER, "
            "the criterion wrapper being what combines the replica losses"
        )
    if losses.numel() != replicas:
        raise InvalidArgument(
            f"the forward's loss gathered into {losses.numel()} values for {replicas} replicas; "
            "each replica's forward must return one scalar loss (its chunk's mean)"
        )
    return losses


def _per_replica_losses(output: Any, loss_at: int, replicas: int) -> torch.Tensor | None:
    if not isinstance(output, (list, tuple)) or hasattr(output, "_fields") or len(output) != replicas:
        return None
    try:
        values = [extract_loss(part, loss_at).reshape(-1) for part in output]
    except InvalidArgument:
        return None
    if not all(value.numel() == 1 for value in values):
        return None
    return torch.cat([value.to(values[0].device) for value in values])


@dataclass
class _Seen(ReplicaRecord):
    """One replica forward (``ReplicaRecord``), with the item counts its chunk offers and
    the per-call count it received (None when none)."""

    counts: dict[str, int] = field(default_factory=dict)
    given: float | None = None


class _ObservedRows(ReplicaGradRecorder):
    """The rows each replica forward received, in device order: the split the wrapper really
    made (a balanced first chunk), which is what its replica losses are means over. Every
    replica forward, with rows or not, is in ``replicas``: the evidence that the step ran in
    parallel."""

    record_type = _Seen

    def __init__(self, model: nn.Module, check: Check, items: Items | None, given: Mapping[str, Any]) -> None:
        super().__init__([], keep=False, dim=check.dim)
        self.given_names = tuple(given)
        self.items = items
        self.ignore_indices = ignore_indices_of(model)
        # replica i runs on device_ids[i] and its loss is the i-th gathered value
        self.order = {device: position for position, device in enumerate(check.device_ids)}
        self.attach(model)

    def new_record(self, replica: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Seen:
        seen = cast(_Seen, super().new_record(replica, args, kwargs))
        if seen.rows is not None:
            if self.items is None:
                seen.counts = {"rows": seen.rows, **item_candidates(args, kwargs, self.ignore_indices)}
            else:
                seen.counts = {"items": count_items(self.items, args, kwargs)}
            seen.given = _count_value(kwargs.get(self.given_names[0])) if self.given_names else None
        return seen

    @property
    def forwards(self) -> int:
        return len(self.replicas)

    def in_order(self) -> list[_Seen]:
        """The replica forwards seen with rows, in device order (a forward outside any
        replica, on one device, is the module itself on device_ids[0])."""
        seen = [cast(_Seen, record) for record in self.replicas if record.rows is not None]
        return sorted(seen, key=lambda record: 0 if record.device is None else self.order.get(record.device, len(self.order)))

    def sizes(self, replicas: int, batch: int) -> list[int] | None:
        """The observed chunk sizes when they account for every replica loss and the whole
        batch, else None (the planned split stands)."""
        sizes = [seen.rows for seen in self.in_order() if seen.rows is not None]
        return sizes if len(sizes) == replicas and sum(sizes) == batch else None

    def item_counts(self, replicas: int) -> dict[str, list[int]]:
        """Every candidate count of items (``item_candidates``) that every replica has, as
        per-replica lists in device order; empty unless each replica's forward was seen."""
        per_replica = [seen.counts for seen in self.in_order()]
        if len(per_replica) != replicas:
            return {}
        shared = [name for name in per_replica[0] if all(name in counts for counts in per_replica)]
        return {name: [counts[name] for counts in per_replica] for name in shared}

    def given(self) -> list[float | None]:
        """The per-call count (``per_call_kwargs``' first keyword) each replica received."""
        return [seen.given for seen in self.in_order()]


#: ``per_call_kwargs(devices)``: the keyword arguments of a call that spans ``devices``
#: devices (1: the single-device reference; the device count: the parallel call), such as
#: the ``num_items_in_batch`` a trainer passes.
PerCall = Callable[[int], Mapping[str, Any]]


def _per_call(per_call_kwargs: PerCall | None, devices: int, forward_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``per_call_kwargs(devices)``, checked: a mapping whose keys are not forward_kwargs'."""
    if per_call_kwargs is None:
        return {}
    require_callable(per_call_kwargs, "per_call_kwargs", "per_call_kwargs(devices) -> {'num_items_in_batch': count}")
    given = per_call_kwargs(devices)
    if not isinstance(given, Mapping):
        raise InvalidArgument(
            f"per_call_kwargs({devices}) returned {type(given).__name__}; it must return a mapping "
            "of keyword arguments, e.g. {'num_items_in_batch': count}"
        )
    clash = sorted(set(given) & set(forward_kwargs))
    if clash:
        raise InvalidArgument(f"per_call_kwargs and forward_kwargs both give {clash}; give each keyword once")
    return dict(given)


def _require_items(items: Items | None) -> None:
    if items is not None:
        require_callable(items, "items", "items(args, kwargs) -> the number of items (rows, tokens) one chunk's loss averages over")


def _count_value(value: Any) -> float | None:
    """The number a per-call count holds (a Python number, or a tensor's first entry)."""
    if isinstance(value, torch.Tensor) and value.numel() >= 1:
        return float(value.reshape(-1)[0])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def chunk_weighted_loss(losses: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The exact reduction of per-replica mean losses: ``sum(n_i / B * loss_i)``.

    Each weight ``n_i / B`` is formed first, in this order of rounding: the loss-average
    report measures its noise on gradients that are zero in exact arithmetic from this
    reduction, and ``tests/test_loss_average.py`` pins that measurement.
    """
    weights = torch.tensor(sizes, dtype=losses.dtype, device=losses.device) / sum(sizes)
    return (losses * weights).sum()


@dataclass(frozen=True)
class LossAverageReport:
    """What ``loss.mean()`` of DataParallel's gathered per-replica losses gives.

    Computed in float64 (or the coarser dtype the forward really computes in), and judged
    against that computation's measured rounding noise, so that a bias is never confused
    with rounding.

    Attributes:
        batch_size: rows in the batch.
        device_ids: DataParallel's devices.
        chunk_sizes: rows per replica (torch.chunk's rule; can be fewer than devices).
        replica_losses: the loss each replica returned.
        mean_of_means: ``loss.mean()`` of the gathered vector.
        weighted_mean: ``sum(t_i / T * loss_i)`` with the item counts ``t_i`` (the rows
            ``n_i`` by default), the exact reduction.
        full_batch_loss: the module's loss on the whole batch on one device.
        loss_bias: ``mean_of_means - full_batch_loss``.
        weighted_error: ``weighted_mean - full_batch_loss`` (zero up to rounding).
        grad_bias: greatest relative gradient difference, mean of means vs full batch. Each
            parameter's difference is relative to its largest full-batch gradient entry, or to
            the model's largest one when the whole parameter's gradient is within the noise
            (zero in exact arithmetic), so rounding on a zero gradient never reads as a bias.
        grad_bias_by_parameter: the same per parameter, model order.
        weighted_grad_error: greatest relative gradient difference, weighted vs full batch.
        is_biased: the mean of means differs from the full-batch loss or its gradients by
            clearly more (32 times) than the rounding noise.
        loss_noise: the loss's rounding noise: ``|weighted_error|``, at least one roundoff
            of ``compute_dtype`` times the largest loss, and at most ``sqrt(eps)`` times it
            (a larger difference is no rounding); just that roundoff when the weighted
            reduction is not exact, since its difference then measured no rounding. Where
            the weighted reduction looks inexact against that, the full-batch step from
            parameters 8 roundoffs off measures the rounding again: a loss far smaller than
            the terms it is a difference of (a near-converged target) rounds with those
            terms; within 32 times that distance the reduction is exact, and the distance
            is the noise.
        grad_noise: the same for the gradients (absolute), from the weighted-vs-full
            gradient differences and the model's largest gradient entry.
        compute_dtype: the coarsest floating dtype the forward computed in (for example
            float32 for a loss computed with ``.float()`` inside a float64 module).
        weighted_is_exact: the ``t_i / T``-weighted replica losses and their gradients equal
            the full batch's up to the noise, that is each replica returned the mean of its
            chunk's items. False for a summed loss, a mean over items that were not found,
            or a forward that depends on the whole batch or on randomness.
        item_counts: the items each replica's loss is a mean over: its rows, or its tokens
            (``items``), in replica order.
        normalizer: the keyword argument of ``per_call_kwargs`` that the loss divides by
            (``num_items_in_batch``), or ``""``.
        normalizer_full: its value in the single-device call (the batch's count).
        normalizer_given: the value each replica received, in replica order.
        items: what is counted: ``"rows"``, ``"tokens (labels != -100, shifted)"``, or
            ``"items"`` for a count given with ``items=``.
        replicas: the replica forwards seen to run (forward hooks), None when not counted;
            one ran nothing in parallel (a one-device or one-row split).
    """

    batch_size: int
    device_ids: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    replica_losses: tuple[float, ...]
    mean_of_means: float
    weighted_mean: float
    full_batch_loss: float
    loss_bias: float
    weighted_error: float
    grad_bias: float
    grad_bias_by_parameter: tuple[tuple[str, float], ...]
    weighted_grad_error: float
    is_biased: bool
    loss_noise: float = 0.0
    grad_noise: float = 0.0
    compute_dtype: str = "float64"
    weighted_is_exact: bool = True
    item_counts: tuple[int, ...] = ()
    items: str = "rows"
    normalizer: str = ""
    normalizer_full: float | None = None
    normalizer_given: tuple[float, ...] = ()
    replicas: int | None = None

    @property
    def counts(self) -> tuple[int, ...]:
        """The item counts, or the chunk sizes when none were recorded."""
        return self.item_counts or self.chunk_sizes

    @property
    def by_tokens(self) -> bool:
        """The replica losses are means over something other than rows (tokens)."""
        return self.items != "rows"

    @property
    def sample_weights(self) -> tuple[float, ...]:
        """The weight ``loss.mean()`` gives one item of each replica: ``1 / (k * t_i)``
        (``inf`` for a replica without items)."""
        k = len(self.counts)
        return tuple(1.0 / (k * n) if n else math.inf for n in self.counts)

    @property
    def predicted_bias(self) -> float:
        """``sum((1/k - t_i/T) * loss_i)``: the bias the item counts predict. For a loss
        divided by a count given to forward: ``loss_i = S_i / c_i``, so ``loss.mean()`` is
        ``sum(c_i * loss_i) / N`` scaled by ``N / (k * c_i)``: ``sum(loss_i) / k -
        sum(c_i * loss_i) / N``."""
        if self.normalizer_full and len(self.normalizer_given) == len(self.replica_losses):
            k = len(self.replica_losses)
            summed = sum(c * loss for c, loss in zip(self.normalizer_given, self.replica_losses, strict=True))
            return sum(self.replica_losses) / k - summed / self.normalizer_full
        k, total = len(self.counts), sum(self.counts)
        return sum(
            (1.0 / k - n / total) * loss
            for n, loss in zip(self.counts, self.replica_losses, strict=True)
        )

    @property
    def empty_replicas(self) -> tuple[int, ...]:
        """The replicas whose loss is NaN where the full batch's is not: a mean over no
        items (a chunk whose labels are all ignored)."""
        if math.isnan(self.full_batch_loss):
            return ()
        return tuple(i for i, loss in enumerate(self.replica_losses) if math.isnan(loss))

    @property
    def unequal_items(self) -> bool:
        """The replicas hold different numbers of items, so ``loss.mean()`` weights them
        unequally (equal chunks of rows can still hold different numbers of tokens)."""
        return len(set(self.counts)) > 1

    def __str__(self) -> str:
        k = len(self.chunk_sizes)
        losses = ", ".join(f"{x:.6g}" for x in self.replica_losses)
        lines = [
            f"Batch of {self.batch_size} rows on devices {list(self.device_ids)}: "
            f"chunk sizes {list(self.chunk_sizes)}, {k} replica{'s' if k != 1 else ''} used.",
        ]
        if self.normalizer:
            lines.append(
                f"Each replica divided its summed loss by the {self.normalizer} it was given: "
                f"{self._given_text}; the single-device call divides by {self._full_text}."
            )
        elif self.by_tokens:
            lines.append(f"Each replica's loss is a mean over its {self._noun}: {self.counted}, {sum(self.counts)} in all.")
        returned = "Each replica returned" if self.normalizer else "Each replica returned its own chunk's mean loss"
        lines += [f"{returned}: [{losses}].", f"loss.mean() of those      = {self.mean_of_means:.8g}"]
        if not self.normalizer:
            weighted = "item-weighted sum(t_i/T) " if self.by_tokens else "chunk-weighted sum(n_i/B)"
            lines.append(f"{weighted} = {self.weighted_mean:.8g}")
        lines.append(f"full-batch loss           = {self.full_batch_loss:.8g}")
        if self.empty_replicas:
            return "\n".join(lines + self._empty_lines(list(self.empty_replicas)))
        uneven = self.unequal_items
        weights = "item counts" if self.by_tokens else "chunk weights"
        if self.normalizer:
            return "\n".join(lines + self._normalizer_lines())
        if self.is_biased:
            lines += [
                f"loss.mean() is biased by {self.loss_bias:+.3g} (the {weights} predict "
                f"{self.predicted_bias:+.3g}; {self.compute_dtype} rounding noise here is "
                f"~{self.loss_noise:.1g}), and its gradients differ from the full-batch "
                f"gradients by up to {self.grad_bias:.3g} (relative).",
                *self._why(uneven),
            ]
        else:
            equal = f"the replicas hold equal numbers of {self._noun}" if self.by_tokens else "the chunks are equal"
            reason = equal if not uneven else "the replica losses happen to agree"
            # "chunks that differ in size", not "uneven": an even split never reads "uneven".
            line = (
                f"loss.mean() equals the full-batch loss here because {reason}; it would be "
                "biased for a batch whose chunks differ in size."
            )
            if self.loss_bias != 0:
                line += (
                    f" The {self.loss_bias:+.1g} left is {self.compute_dtype} rounding "
                    f"(noise ~{self.loss_noise:.1g})."
                )
            lines.append(line)
        return "\n".join(lines)

    def _empty_lines(self, empty: list[int]) -> list[str]:
        """Replicas whose loss is NaN where the full batch's is not: a mean over nothing."""
        which = ", ".join(map(str, empty))
        return [
            f"loss.mean() is NaN: replica{'s' if len(empty) > 1 else ''} {which} returned NaN while the "
            "full-batch loss is finite.",
            f"Why: a mean over no items is 0/0. The chunk{'s' if len(empty) > 1 else ''} of replica "
            f"{which} hold{'' if len(empty) > 1 else 's'} no counted item (every label is the ignore "
            "index, for a token-mean loss), and NaN spreads to loss.mean() and to every gradient; "
            "no weighting of the replica losses repairs it (0 x NaN is NaN).",
            "Fix: return each replica's summed loss and its count of items from forward and divide "
            "the sum by the total after the gather, or keep batches from leaving a replica without items.",
        ]

    @property
    def _given_text(self) -> str:
        return "[" + ", ".join(f"{c:g}" for c in self.normalizer_given) + "]" if self.normalizer_given else "(not a number)"

    @property
    def _full_text(self) -> str:
        return f"{self.normalizer_full:g}" if self.normalizer_full is not None else "(not a number)"

    def _normalizer_lines(self) -> list[str]:
        """The verdict, Why and Fix for a loss divided by a count given to forward."""
        k = len(self.replica_losses)
        total = sum(self.normalizer_given)
        if not self.is_biased:
            return [
                f"loss.mean() equals the full-batch loss here: the {k} replicas' counts add up "
                f"to {total:g} = {self._full_text}, the batch's."
                + (f" The {self.loss_bias:+.1g} left is {self.compute_dtype} rounding." if self.loss_bias else "")
            ]
        return [
            f"loss.mean() is biased by {self.loss_bias:+.3g} (the counts predict "
            f"{self.predicted_bias:+.3g}; {self.compute_dtype} rounding noise here is "
            f"~{self.loss_noise:.1g}), and its gradients differ from the full-batch gradients "
            f"by up to {self.grad_bias:.3g} (relative).",
            f"Why: replica i's loss is its summed loss over {self.normalizer} c_i, so "
            f"loss.mean() is sum(S_i / c_i) / k, which is the full-batch sum(S_i) / "
            f"{self._full_text} only when k * c_i = {self._full_text}; the replicas got "
            f"{self._given_text}, which add up to {total:g}: an integer division of the count by "
            "the number of devices does this when it does not divide evenly.",
            f"Fix: give every replica the whole count {self._full_text} and add the replica "
            f"losses (loss.sum()), or give each {self._full_text} / k without rounding and keep "
            "loss.mean().",
        ]

    @property
    def _noun(self) -> str:
        return "tokens" if self.items.startswith("tokens") else self.items

    @property
    def counted(self) -> str:
        """The counts with what they count: ``[7, 10] (labels != -100, shifted)``."""
        detail = self.items.partition("(")[2].rstrip(")")
        return f"{list(self.counts)}" + (f" ({detail})" if detail else "")

    def _why(self, uneven: bool) -> list[str]:
        """Why the mean of means is biased, and the fix: the chunk weights (uneven chunks),
        replica losses that are not per-row means, or both."""
        weights = ", ".join(f"1/{self._fraction(w)}" for w in self.sample_weights)
        if self.by_tokens:
            return self._why_items(uneven, weights)
        not_means = (
            f"the replica losses are not the per-row means of their chunks: even the exact "
            f"chunk weighting sum(n_i/B * loss_i) is off the full-batch loss by "
            f"{self.weighted_error:+.3g}, its gradients by up to {self.weighted_grad_error:.3g} "
            "(relative). A summed loss, a mean over tokens or labels whose count differs "
            "between replicas, or a forward that depends on the whole batch (BatchNorm) or "
            "on randomness (dropout) does this."
        )
        uneven_why = (
            f"Why: the chunks are uneven, so loss.mean() gives each sample of replica i the "
            f"weight 1/(k*n_i) = [{weights}] instead of 1/B = 1/{self.batch_size}"
        )
        if uneven and self.weighted_is_exact:
            return [
                f"{uneven_why}.",
                "Fix: weight each replica's loss by n_i/B (sum(loss_i * n_i) / B), or return "
                "per-sample (or summed) losses from forward and reduce after the gather.",
            ]
        fix = (
            "Fix: return per-sample losses (or each replica's summed loss and its count of "
            "rows or tokens) from forward and reduce them after the gather; weighting the "
            "replica losses cannot make them exact."
        )
        if uneven:
            return [f"{uneven_why}; and {not_means}", fix]
        if not self.weighted_is_exact:
            return [
                f"Why: the chunks {list(self.chunk_sizes)} are equal, so loss.mean() weights "
                f"every sample 1/B = 1/{self.batch_size} as it should; but {not_means}",
                fix,
            ]
        # Equal chunks and exact weighting, yet the mean differs: only the gathered vector or
        # the wrapper itself can be at fault, so say that instead of blaming the split.
        return [
            f"Why: the chunks {list(self.chunk_sizes)} are equal, so loss.mean() should equal "
            f"the chunk-weighted sum {self.weighted_mean:.8g}, yet it does not: the gathered "
            "replica losses, or the wrapper, differ from what the chunks give.",
        ]

    def _why_items(self, uneven: bool, weights: str) -> list[str]:
        """The Why and Fix when the replica losses are means over tokens, not rows."""
        noun, total = self._noun, sum(self.counts)
        if uneven and self.weighted_is_exact:
            return [
                f"Why: the replicas hold different numbers of {noun}, {self.counted}"
                f"{', although the chunks have equal rows' if len(set(self.chunk_sizes)) == 1 else ''}, "
                f"so loss.mean() gives each of replica i's {noun} the weight 1/(k*t_i) = [{weights}] "
                f"instead of 1/T = 1/{total}.",
                f"Fix: weight each replica's loss by its share of the {noun}, t_i/T "
                f"(sum(loss_i * t_i) / T); or return each replica's summed loss and its count of "
                f"{noun} from forward and divide the sum by the total after the gather. Weighting "
                "by rows (n_i/B) is not exact here.",
            ]
        return [
            f"Why: the replica losses are not the means over their {noun}, {self.counted}: "
            "even the exact weighting sum(t_i/T * loss_i) is off the "
            f"full-batch loss by {self.weighted_error:+.3g}, its gradients by up to "
            f"{self.weighted_grad_error:.3g} (relative).",
            "Fix: return each replica's summed loss and its count of items from forward and "
            "divide the sum by the total after the gather.",
        ]

    @staticmethod
    def _fraction(weight: float) -> str:
        inverse = 1 / weight if weight else math.inf
        return str(round(inverse)) if abs(inverse - round(inverse)) < 1e-9 else f"{inverse:.4g}"


class _Precision(TorchFunctionMode):
    """Records the coarsest floating dtype among the results of the torch functions run
    under it: the dtype a forward really computes in, since a float64 module can still
    compute (its loss, say) in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.dtype = torch.float64

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        self._see(result)
        return result

    def _see(self, value: Any) -> None:
        # Every tensor of the result, in dicts too: a function that takes part in
        # __torch_function__ dispatch runs its own ops with this mode off, so a dtype it
        # computes in shows only in what it returns.
        for _path, _keys, tensor in tensor_leaves(value):
            if tensor.is_floating_point() and _eps(tensor.dtype) > _eps(self.dtype):
                self.dtype = tensor.dtype


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def _noise(measured: float, eps: float, scale: float) -> float:
    """Rounding noise of a quantity whose terms reach ``scale``, computed with roundoff
    ``eps``: the measured exact-vs-computed difference, at least one roundoff of the terms.
    A difference beyond ``sqrt(eps)`` of the terms (half the digits lost) is not believed to
    be rounding: otherwise a real error there would pass itself off as noise and hide the
    bias."""
    return max(eps * scale, min(measured, math.sqrt(eps) * scale))


def _grads(loss: torch.Tensor, model: nn.Module, *, retain: bool = False) -> list[torch.Tensor]:
    # Frozen parameters have no gradient to compare (autograd.grad refuses them).
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def check_forward_loss_average(
    module: nn.Module,
    inputs: Any,
    *,
    device_ids: Sequence[int],
    parallel: Parallel | None = None,
    loss_at: int = -1,
    forward_kwargs: Mapping[str, Any] | None = None,
    dim: int = 0,
    items: Items | None = None,
    per_call_kwargs: PerCall | None = None,
) -> LossAverageReport:
    """Measures what averaging DataParallel's per-replica losses does for this module.

    For modules whose ``forward`` receives the targets among ``inputs`` and returns the
    loss (a scalar, the ``loss_at`` element of a tuple, or a ``"loss"`` key). The module
    runs in float64; the bias counts only beyond the rounding noise measured on this model
    (see ``LossAverageReport.loss_noise``), so a loss computed in float32 inside forward is
    judged by float32's noise. ``parallel``, ``device_ids``, ``forward_kwargs`` and ``dim``
    are as in ``assert_dp_grads_match``; the chunk sizes are those the wrapper really made.

    Each replica's loss is a mean over its items: its rows, or for a token-level loss its
    tokens that are not ignored. Which, is read from the evidence: among the rows and, for
    every integer tensor argument (``labels``), its entries that are not an ignore index
    (-100, or an ``ignore_index`` of a loss module inside ``module``), whole or shifted by
    one for a causal language model, the counts whose weighting ``sum(t_i * L_i) / sum(t_i)``
    reproduces the full-batch loss (rows when they do as well). ``items(args, kwargs)``
    gives the count of one replica's chunk instead. The report's ``item_counts`` are those
    counts, its predicted bias and the exact recipe (weight each replica's loss by
    ``t_i / T``) use them.

    ``per_call_kwargs(devices)`` gives keyword arguments that differ between the calls: the
    single-device reference gets ``per_call_kwargs(1)``, the parallel call
    ``per_call_kwargs(len(device_ids))`` (scattered like the others). A loss that divides
    its summed token loss by a count given to forward (the trainers' ``num_items_in_batch``)
    is checked so: the report says what each replica divided by, and predicts the bias of
    ``loss.mean()`` from the counts (exact only when the replicas' counts add up to the
    batch's).

    Returns:
        The report; ``str(report)`` explains it in plain words.

    Raises:
        InvalidArgument: bad arguments, or a forward that returns no per-replica scalar loss.
        ParallelMismatch: the wrapper ran fewer than two replica forwards where the split
            calls for two or more (one loss of the whole batch measures nothing parallel).
    """
    check = Check.create(module, inputs, device_ids=device_ids, parallel=parallel, forward_kwargs=forward_kwargs, dim=dim)
    return loss_average_of(check, loss_at=loss_at, items=items, per_call_kwargs=per_call_kwargs)


def loss_average_of(
    check: Check, *, loss_at: int = -1, items: Items | None = None, per_call_kwargs: PerCall | None = None,
) -> LossAverageReport:
    """``check_forward_loss_average`` on a built ``check``."""
    module = check.module
    single_given = _per_call(per_call_kwargs, 1, check.kwargs)
    parallel_given = _per_call(per_call_kwargs, len(check.device_ids), check.kwargs)
    sizes = list(check.plan.chunk_sizes)
    batch = sum(sizes)
    args = convert_tensors(check.args, torch.float64, check.device)
    kwargs = convert_tensors(check.kwargs, torch.float64, check.device)
    single_kwargs = {**kwargs, **convert_tensors(single_given, torch.float64, check.device)}
    parallel_kwargs = {**kwargs, **convert_tensors(parallel_given, torch.float64, check.device)}
    fork_devices = [check.device] if check.device.type == "cuda" else []
    precision = _Precision()
    with default_dtype(torch.float64), torch.random.fork_rng(devices=fork_devices), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        parallel_model = copy.deepcopy(module).to(dtype=torch.float64, device=check.device)
        seed_step(0, check.device)
        _require_items(items)
        observed = _ObservedRows(parallel_model, check, items, parallel_given)
        try:
            with check.devices():
                output = check.wrap(parallel_model)(*args, **parallel_kwargs)
            failures = check.replica_failures(observed.forwards)
            if failures:
                # one loss of the whole batch is no replica loss: nothing to measure
                title = "loss.mean() of replica losses needs a loss from each replica"
                raise_unless_ok(check.outcome(title, [], failures=failures, replicas=observed.forwards), None)
            # the replicas that ran (a balanced wrapper can run more than torch's scatter would)
            losses = _replica_losses(output, loss_at, len(observed.in_order()) or check.plan.n_replicas)
        except IndexError as error:
            check.explain_gather_error(error)
            raise
        finally:
            observed.detach()
        sizes = observed.sizes(losses.numel(), batch) or sizes

        single = copy.deepcopy(module).to(dtype=torch.float64, device=check.device)
        seed_step(0, check.device)
        # Only the single-device forward is traced: it runs the same code as each replica,
        # on this thread (the replicas run on DataParallel's threads).
        with precision:
            full = extract_loss(single(*args, **single_kwargs), loss_at)
        if full.numel() != 1:
            raise InvalidArgument(
                f"the forward's loss has shape {tuple(full.shape)} on the whole batch; it must "
                "be a scalar (the batch's mean loss)"
            )
        grads_full = _grads(full.reshape(()), single)

        candidates = observed.item_counts(losses.numel()) or {"rows": list(sizes)}
        item_kind, counts = choose_items(candidates, [float(x) for x in losses.detach()], float(full.detach()))
        if sum(counts) <= 0:
            raise InvalidArgument(
                f"items= counts {counts} add up to no item; each replica's loss must average over at least one"
            )
        mean_of_means = losses.mean()
        weighted = chunk_weighted_loss(losses, counts)
        grads_mean = _grads(mean_of_means, parallel_model, retain=True)
        grads_weighted = _grads(weighted, parallel_model)

    dtype = max((precision.dtype, losses.dtype, full.dtype), key=_eps)  # the coarsest
    eps = _eps(dtype)

    def jittered() -> tuple[float, float]:
        # How far parameters a few units of roundoff off move the full-batch loss and
        # gradients: the rounding of this model's step, measured on the single device, so
        # that no bias can inflate it. Its loss can be a difference of terms far larger than
        # itself (a near-converged target), whose rounding the loss values cannot show.
        with default_dtype(torch.float64), torch.random.fork_rng(devices=fork_devices):
            model = copy.deepcopy(module).to(dtype=torch.float64, device=check.device)
            jitter_parameters(model, JITTER_ROUNDOFFS * eps)
            seed_step(0, check.device)
            loss = extract_loss(model(*args, **single_kwargs), loss_at).reshape(())
            grads = _grads(loss, model)
        gaps = [largest_abs(g - gf) for g, gf in zip(grads, grads_full, strict=True)]
        return abs(float(loss.detach()) - full_value), max(gaps, default=0.0)

    values = [float(x) for x in losses.detach()]
    full_value = float(full.detach())
    weighted_error = float(weighted.detach()) - full_value
    loss_bias = float(mean_of_means.detach()) - full_value
    loss_terms = max([abs(full_value), *map(abs, values)])
    loss_noise = _noise(abs(weighted_error), eps, loss_terms)

    scales = [largest_abs(g) for g in grads_full]
    gaps_mean = [largest_abs(gm - gf) for gm, gf in zip(grads_mean, grads_full, strict=True)]
    gaps_weighted = [largest_abs(gw - gf) for gw, gf in zip(grads_weighted, grads_full, strict=True)]
    grad_scale = max(scales, default=0.0)
    grad_noise = _noise(max(gaps_weighted, default=0.0), eps, grad_scale)
    if abs(weighted_error) <= _NOISE_FACTOR * eps * loss_terms:
        # The exact recipe reproduces the full-batch loss to the roundoff itself, so what
        # still separates its gradients from the full batch's is rounding, however large:
        # an ill-conditioned model (a saturated softmax) can lose every digit of a gradient
        # to it. A recipe that were wrong would show in the loss first.
        grad_noise = max(grad_noise, max(gaps_weighted, default=0.0))
    exact = (
        abs(weighted_error) <= _NOISE_FACTOR * loss_noise
        and max(gaps_weighted, default=0.0) <= _NOISE_FACTOR * grad_noise
    )
    if not exact and math.isfinite(weighted_error):
        # A second measure of the rounding before the exact recipe is called wrong: the
        # jittered step's distance (only here, so that the common case never pays for it).
        # The recipe reproduces the loss to its rounding when within that distance, and
        # then what separates its gradients is rounding too (as above).
        jitter_loss, jitter_grad = jittered()
        if abs(weighted_error) <= _NOISE_FACTOR * jitter_loss:
            loss_noise = max(loss_noise, jitter_loss)
            grad_noise = max(grad_noise, jitter_grad, max(gaps_weighted, default=0.0))
            exact = True
    if not exact:
        # The weighted reduction is itself wrong (the replica losses are not per-row means),
        # so its difference measured no rounding: only the roundoff floor is left as noise.
        loss_noise = _noise(0.0, eps, loss_terms)
        grad_noise = _noise(0.0, eps, grad_scale)
    zero = _NOISE_FACTOR * grad_noise

    def relative(gap: float, scale: float) -> float:
        # A gradient whose largest entry is within the noise is zero in exact arithmetic
        # (an attention key bias, say): its rounding is measured against the model's largest
        # gradient, since against itself any rounding would read as a 100% difference.
        reference = scale if scale > zero else grad_scale
        if reference > 0:
            return gap / reference
        return 0.0 if gap == 0 else math.inf

    names = [name for name, p in parallel_model.named_parameters() if p.requires_grad]
    by_param = tuple(
        (name, relative(gap, scale)) for name, gap, scale in zip(names, gaps_mean, scales, strict=True)
    )
    biased = (
        abs(loss_bias) > _NOISE_FACTOR * loss_noise
        or max(gaps_mean, default=0.0) > _NOISE_FACTOR * grad_noise
        # a replica loss that is NaN where the full batch's is not (a mean over no items)
        or (math.isfinite(full_value) and not all(math.isfinite(v) for v in values))
    )
    return LossAverageReport(
        batch_size=batch,
        device_ids=tuple(check.device_ids),
        chunk_sizes=tuple(sizes),
        replica_losses=tuple(values),
        mean_of_means=float(mean_of_means.detach()),
        weighted_mean=float(weighted.detach()),
        full_batch_loss=full_value,
        loss_bias=loss_bias,
        weighted_error=weighted_error,
        grad_bias=max((gap for _, gap in by_param), default=0.0),
        grad_bias_by_parameter=by_param,
        weighted_grad_error=max(
            (relative(gap, scale) for gap, scale in zip(gaps_weighted, scales, strict=True)), default=0.0
        ),
        is_biased=biased,
        loss_noise=loss_noise,
        grad_noise=grad_noise,
        compute_dtype=str(dtype).removeprefix("torch."),
        weighted_is_exact=exact,
        item_counts=tuple(counts),
        items=item_kind,
        **_normalizer_fields(single_given, observed, losses.numel()),
        replicas=observed.forwards,
    )


def _normalizer_fields(single_given: Mapping[str, Any], observed: _ObservedRows, replicas: int) -> dict[str, Any]:
    """The report's fields for a count given to forward: its name, the single-device
    call's value and each replica's (device order), when they are numbers."""
    if not single_given:
        return {}
    name = next(iter(single_given))
    full = _count_value(single_given[name])
    given = observed.given()
    if full is None or len(given) != replicas or any(value is None for value in given):
        return {"normalizer": name}
    return {"normalizer": name, "normalizer_full": full, "normalizer_given": tuple(float(v) for v in given if v is not None)}


def assert_loss_reduction_matches_full_batch(
    module: nn.Module,
    inputs: Any,
    *,
    device_ids: Sequence[int],
    reduce: Reduce,
    parallel: Parallel | None = None,
    loss_at: int = -1,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    dim: int = 0,
    items: Items | None = None,
    per_call_kwargs: PerCall | None = None,
) -> StepComparison:
    """Asserts the user's reduction of per-replica losses equals the full-batch loss.

    ``reduce(replica_losses, chunk_sizes)`` receives the gathered vector of replica losses
    and the chunk sizes, and returns the scalar to backpropagate; it must match the module's
    full-batch loss and gradients (float64-anchored tolerance, or ``rtol``/``atol``).
    ``lambda losses, sizes: losses.mean()`` fails on uneven chunks;
    ``lambda losses, sizes: (losses * torch.tensor(sizes)).sum() / sum(sizes)`` passes.
    ``chunk_sizes`` are the rows (along ``dim``) each replica really received. A ``reduce``
    that takes a third argument also receives the item counts each replica's loss is a mean
    over (rows, or tokens for a token-level loss; found as in ``check_forward_loss_average``,
    or counted by ``items``): ``lambda losses, sizes, counts: chunk_weighted_loss(losses,
    counts)`` is exact for a token-mean loss where rows are not. ``per_call_kwargs`` gives
    the single-device and the parallel call their own keyword arguments, as in
    ``check_forward_loss_average`` (the trainers' ``num_items_in_batch`` with
    ``lambda losses, sizes: losses.mean()`` is their DataParallel recipe). The other
    arguments are as in ``assert_dp_grads_match``.

    Raises:
        ParallelMismatch: the reduced loss or its gradients differ, with the bias; or the
            wrapper ran fewer than two replica forwards where the split calls for more.
    """
    __tracebackhide__ = True
    require_callable(reduce, "reduce", "reduce(replica_losses, chunk_sizes) -> scalar")
    check = Check.create(
        module, inputs, device_ids=device_ids, parallel=parallel, rtol=rtol, atol=atol,
        forward_kwargs=forward_kwargs, dim=dim,
    )
    return raise_unless_ok(reduction_matches(check, reduce, loss_at=loss_at, items=items, per_call_kwargs=per_call_kwargs), msg)


def reduction_matches(
    check: Check, reduce: Reduce, *, loss_at: int = -1, items: Items | None = None, per_call_kwargs: PerCall | None = None,
) -> StepComparison:
    """``assert_loss_reduction_matches_full_batch`` on a built ``check``, returning its
    comparison whatever it found."""
    require_callable(reduce, "reduce", "reduce(replica_losses, chunk_sizes) -> scalar")
    _require_items(items)
    sizes = list(check.plan.chunk_sizes)
    counted: list[tuple[str, list[int]]] = []
    seen: list[torch.Tensor] = []
    whole = functools.partial(extract_loss, loss_at=loss_at)
    single_given = _per_call(per_call_kwargs, 1, check.kwargs)
    parallel_given = _per_call(per_call_kwargs, len(check.device_ids), check.kwargs)
    # the references first: the full-batch loss tells which item counts the replica
    # losses are means over
    refs = replace(check, kwargs={**check.kwargs, **single_given}).references(lambda _dtype: whole, loss_argument="the forward's loss")
    expected = refs.expected
    observed = _ObservedRows(check.module, check, items, parallel_given)
    with_counts = _takes_three(reduce)

    def reduced(output: Any) -> torch.Tensor:
        nonlocal sizes
        losses = _replica_losses(output, loss_at, len(observed.in_order()) or check.plan.n_replicas)
        seen.append(losses.detach())
        # the split the wrapper made, which its replica losses are means over
        sizes = observed.sizes(losses.numel(), sum(sizes)) or sizes
        candidates = observed.item_counts(losses.numel()) or {"rows": list(sizes)}
        counted.append(choose_items(candidates, [float(x) for x in losses.detach()], float(expected.loss)))
        if with_counts:
            return reduce(losses, list(sizes), list(counted[-1][1]))
        return reduce(losses, list(sizes))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        try:
            parallel_check = replace(check, kwargs={**check.kwargs, **parallel_given})
            parallel_step = parallel_check.run(reduced, parallel=True, loss_argument="reduce", record_replicas="magnitudes")
        finally:
            observed.detach()
    rows = check.compare(parallel_step, refs, outputs=False)
    losses = ", ".join(f"{float(x):.6g}" for x in seen[0]) if seen else ""
    notes = [
        f"Replica losses [{losses}] with chunk sizes {sizes}: reduce gave "
        f"{float(parallel_step.loss):.8g}, the full batch gives {float(expected.loss):.8g} "
        f"(bias {float(parallel_step.loss) - float(expected.loss):+.3g}).",
    ]
    kind, counts = counted[0] if counted else ("rows", sizes)
    given = observed.given()
    if single_given:
        name = next(iter(single_given))
        notes.append(
            f"Each replica divided by the {name} it was given, {given}; the single-device call by "
            f"{_count_value(single_given[name])}."
        )
    elif kind != "rows":
        notes.append(
            f"Each replica's loss is a mean over its {kind}: {counts}. Weight replica i by "
            "t_i/T (reduce's third argument, the counts), not by its rows."
        )
    elif len(set(sizes)) > 1:
        notes.append(
            "The chunks are uneven: losses.mean() weights each sample 1/(k*n_i); weight replica "
            "i by n_i/B instead."
        )
    title = "The reduced per-replica loss must equal the full-batch loss"
    ran = len(parallel_step.contributions)
    return check.outcome(title, rows, notes=notes, failures=check.replica_failures(ran), step=parallel_step)


def _takes_three(reduce: Callable[..., Any]) -> bool:
    """Whether ``reduce`` accepts a third positional argument (the item counts)."""
    try:
        parameters = inspect.signature(reduce).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in parameters)
