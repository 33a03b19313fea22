"""The loss-averaging trap: a loss computed in ``forward`` and averaged after DataParallel.

A forward that returns its own chunk's mean loss makes DataParallel gather one scalar per
replica. ``loss.mean()`` of that vector weights each sample ``1 / (k * n_i)`` instead of
``1 / B`` (``k`` replicas, chunk sizes ``n_i``): exact for equal chunks, biased otherwise.
Weighting replica ``i`` by ``n_i / B`` is exact for any split.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpverify._assertions import Check, Parallel, raise_unless_ok
from dpverify._comparison import Msg, StepComparison
from dpverify._errors import InvalidArgument
from dpverify._step import convert_tensors, default_dtype, seed_step
from dpverify._virtual import SCALAR_GATHER_WARNING

__all__ = [
    "LossAverageReport",
    "assert_loss_reduction_matches_full_batch",
    "check_forward_loss_average",
    "extract_loss",
]

Reduce = Callable[[torch.Tensor, list[int]], torch.Tensor]

# Bias below this, relative to the loss or gradient scale, is float64 rounding, not bias.
_FLOAT64_NOISE = 1e-9


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
    losses = extract_loss(output, loss_at).reshape(-1)
    if losses.numel() != replicas:
        raise InvalidArgument(
            f"the forward's loss gathered into {losses.numel()} values for {replicas} replicas; "
            "each replica's forward must return one scalar loss (its chunk's mean)"
        )
    return losses


@dataclass(frozen=True)
class LossAverageReport:
    """What ``loss.mean()`` of DataParallel's gathered per-replica losses gives.

    Computed in float64, so that a bias is never confused with rounding.

    Attributes:
        batch_size: rows in the batch.
        device_ids: DataParallel's devices.
        chunk_sizes: rows per replica (torch.chunk's rule; can be fewer than devices).
        replica_losses: the loss each replica returned.
        mean_of_means: ``loss.mean()`` of the gathered vector.
        weighted_mean: ``sum(n_i / B * loss_i)``, the exact reduction.
        full_batch_loss: the module's loss on the whole batch on one device.
        loss_bias: ``mean_of_means - full_batch_loss``.
        weighted_error: ``weighted_mean - full_batch_loss`` (zero up to rounding).
        grad_bias: greatest relative gradient difference, mean of means vs full batch.
        grad_bias_by_parameter: the same per parameter, model order.
        weighted_grad_error: greatest relative gradient difference, weighted vs full batch.
        is_biased: the mean of means differs from the full-batch loss or its gradients.
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

    @property
    def sample_weights(self) -> tuple[float, ...]:
        """The weight ``loss.mean()`` gives one sample of each replica: ``1 / (k * n_i)``."""
        k = len(self.chunk_sizes)
        return tuple(1.0 / (k * n) for n in self.chunk_sizes)

    @property
    def predicted_bias(self) -> float:
        """``sum((1/k - n_i/B) * loss_i)``: the bias the chunk weights predict."""
        k = len(self.chunk_sizes)
        return sum(
            (1.0 / k - n / self.batch_size) * loss
            for n, loss in zip(self.chunk_sizes, self.replica_losses, strict=True)
        )

    def __str__(self) -> str:
        k = len(self.chunk_sizes)
        losses = ", ".join(f"{x:.6g}" for x in self.replica_losses)
        weights = ", ".join(f"1/{round(1 / w)}" if abs(1 / w - round(1 / w)) < 1e-9 else f"{w:.4g}" for w in self.sample_weights)
        lines = [
            f"Batch of {self.batch_size} rows on devices {list(self.device_ids)}: "
            f"chunk sizes {list(self.chunk_sizes)}, {k} replica{'s' if k != 1 else ''} used.",
            f"Each replica returned its own chunk's mean loss: [{losses}].",
            f"loss.mean() of those      = {self.mean_of_means:.8g}",
            f"chunk-weighted sum(n_i/B) = {self.weighted_mean:.8g}",
            f"full-batch loss           = {self.full_batch_loss:.8g}",
        ]
        if self.is_biased:
            lines += [
                f"loss.mean() is biased by {self.loss_bias:+.3g} (the chunk weights predict "
                f"{self.predicted_bias:+.3g}), and its gradients differ from the full-batch "
                f"gradients by up to {self.grad_bias:.3g} (relative).",
                f"Why: the chunks are uneven, so loss.mean() gives each sample of replica i the "
                f"weight 1/(k*n_i) = [{weights}] instead of 1/B = 1/{self.batch_size}.",
                "Fix: weight each replica's loss by n_i/B (sum(loss_i * n_i) / B), or return "
                "per-sample (or summed) losses from forward and reduce after the gather.",
            ]
        else:
            reason = "the chunks are equal" if len(set(self.chunk_sizes)) <= 1 else "the replica losses happen to agree"
            lines.append(
                f"loss.mean() equals the full-batch loss here because {reason}; it would be "
                "biased for a batch that splits unevenly."
            )
        return "\n".join(lines)


def _grads(loss: torch.Tensor, params: Sequence[torch.Tensor], *, retain: bool = False) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    gap = float((a - b).abs().max()) if a.numel() else 0.0
    return gap / scale if scale > 0 else (0.0 if gap == 0 else float("inf"))


def check_forward_loss_average(
    module: nn.Module,
    inputs: Any,
    *,
    device_ids: Sequence[int],
    parallel: Parallel | None = None,
    loss_at: int = -1,
    forward_kwargs: Mapping[str, Any] | None = None,
) -> LossAverageReport:
    """Measures what averaging DataParallel's per-replica losses does for this module.

    For modules whose ``forward`` receives the targets among ``inputs`` and returns the
    loss (a scalar, the ``loss_at`` element of a tuple, or a ``"loss"`` key).

    Returns:
        The report; ``str(report)`` explains it in plain words.

    Raises:
        InvalidArgument: bad arguments, or a forward that returns no per-replica scalar loss.
    """
    check = Check.create(module, inputs, device_ids=device_ids, parallel=parallel, forward_kwargs=forward_kwargs)
    sizes = list(check.plan.chunk_sizes)
    batch = sum(sizes)
    args = convert_tensors(check.args, torch.float64, check.device)
    kwargs = convert_tensors(check.kwargs, torch.float64, check.device)
    fork_devices = [check.device] if check.device.type == "cuda" else []
    with default_dtype(torch.float64), torch.random.fork_rng(devices=fork_devices), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        parallel_model = copy.deepcopy(module).to(dtype=torch.float64, device=check.device)
        params = list(parallel_model.parameters())
        seed_step(0, check.device)
        losses = _replica_losses(check.wrap(parallel_model)(*args, **kwargs), loss_at, check.plan.n_replicas)
        weights = torch.tensor(sizes, dtype=losses.dtype, device=losses.device) / batch
        mean_of_means = losses.mean()
        weighted = (losses * weights).sum()
        grads_mean = _grads(mean_of_means, params, retain=True)
        grads_weighted = _grads(weighted, params)

        single = copy.deepcopy(module).to(dtype=torch.float64, device=check.device)
        seed_step(0, check.device)
        full = extract_loss(single(*args, **kwargs), loss_at)
        if full.numel() != 1:
            raise InvalidArgument(
                f"the forward's loss has shape {tuple(full.shape)} on the whole batch; it must "
                "be a scalar (the batch's mean loss)"
            )
        grads_full = _grads(full.reshape(()), list(single.parameters()))

    names = [name for name, _ in parallel_model.named_parameters()]
    by_param = tuple(
        (name, _relative_gap(gm, gf)) for name, gm, gf in zip(names, grads_mean, grads_full, strict=True)
    )
    values = [float(x) for x in losses.detach()]
    full_value = float(full.detach())
    loss_scale = max([abs(full_value), *map(abs, values), 1e-300])
    loss_bias = float(mean_of_means.detach()) - full_value
    grad_bias = max((gap for _, gap in by_param), default=0.0)
    biased = abs(loss_bias) > _FLOAT64_NOISE * loss_scale or grad_bias > _FLOAT64_NOISE
    return LossAverageReport(
        batch_size=batch,
        device_ids=tuple(check.device_ids),
        chunk_sizes=tuple(sizes),
        replica_losses=tuple(values),
        mean_of_means=float(mean_of_means.detach()),
        weighted_mean=float(weighted.detach()),
        full_batch_loss=full_value,
        loss_bias=loss_bias,
        weighted_error=float(weighted.detach()) - full_value,
        grad_bias=grad_bias,
        grad_bias_by_parameter=by_param,
        weighted_grad_error=max(
            (_relative_gap(gw, gf) for gw, gf in zip(grads_weighted, grads_full, strict=True)), default=0.0
        ),
        is_biased=biased,
    )


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
) -> StepComparison:
    """Asserts the user's reduction of per-replica losses equals the full-batch loss.

    ``reduce(replica_losses, chunk_sizes)`` receives the gathered vector of replica losses
    and the chunk sizes, and returns the scalar to backpropagate; it must match the module's
    full-batch loss and gradients (float64-anchored tolerance, or ``rtol``/``atol``).
    ``lambda losses, sizes: losses.mean()`` fails on uneven chunks;
    ``lambda losses, sizes: (losses * torch.tensor(sizes)).sum() / sum(sizes)`` passes.

    Raises:
        ParallelMismatch: the reduced loss or its gradients differ, with the bias.
    """
    __tracebackhide__ = True
    if not callable(reduce):
        raise InvalidArgument(
            f"reduce={reduce!r} is not callable; pass reduce(replica_losses, chunk_sizes) -> scalar"
        )
    check = Check.create(
        module, inputs, device_ids=device_ids, parallel=parallel, rtol=rtol, atol=atol,
        forward_kwargs=forward_kwargs,
    )
    sizes = list(check.plan.chunk_sizes)
    seen: list[torch.Tensor] = []

    def reduced(output: Any) -> torch.Tensor:
        losses = _replica_losses(output, loss_at, check.plan.n_replicas)
        seen.append(losses.detach())
        return reduce(losses, list(sizes))

    def whole(output: Any) -> torch.Tensor:
        return extract_loss(output, loss_at)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCALAR_GATHER_WARNING)
        parallel_step = check.run(reduced, parallel=True, loss_argument="reduce", record_replicas="magnitudes")
    refs = check.references(lambda _dtype: whole, loss_argument="the forward's loss")
    expected = refs.expected
    rows = check.compare(parallel_step, refs, outputs=False)
    losses = ", ".join(f"{float(x):.6g}" for x in seen[0]) if seen else ""
    notes = [
        f"Replica losses [{losses}] with chunk sizes {sizes}: reduce gave "
        f"{float(parallel_step.loss):.8g}, the full batch gives {float(expected.loss):.8g} "
        f"(bias {float(parallel_step.loss) - float(expected.loss):+.3g}).",
    ]
    if len(set(sizes)) > 1:
        notes.append(
            "The chunks are uneven: losses.mean() weights each sample 1/(k*n_i); weight replica "
            "i by n_i/B instead."
        )
    title = "The reduced per-replica loss must equal the full-batch loss"
    return raise_unless_ok(check.outcome(title, rows, notes=notes), msg)
