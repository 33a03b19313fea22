"""A bit-exact replay of DataParallel's algorithm on one device.

The replay computes what a correct DataParallel computes, operation for operation: torch's
scatter of the batch (its ``ScatterPlan``), a deep copy of the module per chunk, each
chunk's forward (``virtual_parallel_apply``: each replica in its own thread with the
caller's intra-op thread count, drawing from its device's generator as the virtual
devices do), the outputs gathered along ``dim`` as torch's ``gather`` does, the loss on
the gathered output, one backward, and the replicas' gradients summed in replica order
(``sum_in_order``, the reduce-add of the virtual devices). A parallel step whose tensor is
bit-identical to the replay's is correct by construction; what remains is whether the
chunking itself is neutral, which its twin in another precision tells (``settle_by_replay``).

Where the replay cannot be bit-exact: on real GPUs, where the replicas run on other
devices (kernels may choose other algorithms there, and torch reduces gradients with NCCL
in an order of its own) and random layers draw from per-device CUDA generators; and for
kernels whose rounding depends on where a tensor sits in memory or on the thread that
runs them, which this replay matches only as far as it runs them the same way. It never
settles a tensor it does not reproduce bit for bit: such a tensor keeps its verdict.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from dpverify.core.comparison import ReplayMatch, TensorComparison
from dpverify.core.numerics import largest_abs
from dpverify.core.primitives import sum_in_order, virtual_parallel_apply
from dpverify.core.scatter import ScatterPlan
from dpverify.core.step import StepResult, run_step
from dpverify.core.tree import map_tensors
from dpverify.core.virtual import virtual_primitives

__all__ = ["CHUNK_SCALING", "Replay", "ReplayCase", "replay_dataparallel", "replay_step", "settle_by_replay"]

#: How much smaller the chunking's move must be in the more precise of two precisions
#: than in the other for it to count as rounding (float64 against float32 it is about
#: 2^-29 when it is; a result that depends on the chunk moves as much in both).
CHUNK_SCALING = 2.0**-10


class ReplayCase(Protocol):
    """What a replay needs of a check (``dpverify.checks.dp.Check`` has it)."""

    @property
    def module(self) -> nn.Module: ...
    @property
    def args(self) -> tuple[Any, ...]: ...
    @property
    def kwargs(self) -> dict[str, Any]: ...
    @property
    def plan(self) -> ScatterPlan: ...
    @property
    def dim(self) -> int: ...
    @property
    def output_device(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(frozen=True)
class Replay:
    """The replay in the working dtype, and its twin in the other precision (float64, or
    float32 for a float64 module), each with the single-device step of that precision it
    is measured against."""

    step: StepResult
    twin: StepResult
    full: StepResult
    twin_full: StepResult


class _Replicas:
    """The ``wrap`` of a step that runs DataParallel's algorithm around ``model`` without
    its ``replicate``: a deep copy per chunk of torch's scatter."""

    def __init__(self, case: ReplayCase) -> None:
        self.case = case

    def __call__(self, model: nn.Module) -> Callable[..., Any]:
        case = self.case

        def run(*args: Any, **kwargs: Any) -> Any:
            with virtual_primitives():  # with autograd on, as DataParallel.forward scatters
                inputs, chunk_kwargs = scatter_kwargs(args, kwargs, list(case.plan.device_ids), case.dim)
            if not inputs and not chunk_kwargs:  # as DataParallel.forward: one call without arguments
                inputs, chunk_kwargs = ((),), ({},)
            devices = list(case.plan.device_ids[: len(inputs)])
            # deepcopy keeps a ReplicaGradRecorder's hook on each copy (it copies to itself)
            replicas = [copy.deepcopy(model) for _ in devices]
            outputs = virtual_parallel_apply(replicas, inputs, chunk_kwargs, devices)
            with virtual_primitives(devices):
                gathered = gather(outputs, case.output_device, dim=case.dim)
            if case.output_device == -1 and case.device.type == "cuda":
                gathered = map_tensors(gathered, lambda tensor: tensor.cpu())
            return gathered

        return run


def replay_step(
    case: ReplayCase, loss_of_output: Callable[[Any], torch.Tensor], dtype: torch.dtype | None = None,
) -> StepResult:
    """DataParallel's algorithm for ``case``, on its device, in ``dtype`` (None: the
    module's own): the step's outputs and loss, its ``contributions`` (each replica's
    gradients, in device order) and its gradients, their sums in replica order. torch's
    warnings about the step (a gathered scalar) were given by the parallel step already."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_step(
            case.module, case.args, loss_of_output, wrap=_Replicas(case), dtype=dtype, device=case.device,
            record_replicas=True, kwargs=case.kwargs, dim=case.dim, device_ids=case.plan.device_ids,
        )
    return replace(result, grads={name: _summed(result.contributions, name) for name in result.grads})


def _summed(contributions: Sequence[tuple[int | None, dict[str, torch.Tensor]]], name: str) -> torch.Tensor | None:
    """The replicas' gradients of ``name`` summed in replica order, as torch's reduce-add
    sums them (a replica that did not use the parameter adds torch's zeros: nothing)."""
    grads = [grads[name] for _device, grads in contributions if name in grads]
    return sum_in_order(grads) if grads else None


def replay_dataparallel(
    case: ReplayCase, loss_in: Callable[[torch.dtype | None], Callable[[Any], torch.Tensor]],
    full: StepResult, twin_full: StepResult,
) -> Replay:
    """The replay of ``case`` in its working dtype and in the other precision;
    ``loss_in(dtype)`` is the loss of a run in ``dtype`` (None: the working dtype), ``full``
    and ``twin_full`` the single-device steps in those two precisions."""
    other = torch.float32 if case.dtype == torch.float64 else torch.float64
    return Replay(replay_step(case, loss_in(None)), replay_step(case, loss_in(other), other), full, twin_full)


def settle_by_replay(
    result: TensorComparison, actual: torch.Tensor | None, replay: Replay,
    pick: Callable[[StepResult], torch.Tensor | None], key: Callable[[StepResult], torch.Tensor | None],
    compare: Callable[[torch.Tensor], TensorComparison],
) -> TensorComparison:
    """``result`` (a tensor that failed the tolerance), passed by the replay where it can be.

    It passes when ``actual`` is bit-identical to the replay's tensor (``pick`` finds it in
    a replay, ``key`` in a single-device step) and the chunking is neutral: the replay's distance from the single-device step
    shrinks with the precision (in the more precise of the two, below ``CHUNK_SCALING`` of
    it in the other), as rounding does and a result that depends on the chunk (train-mode
    BatchNorm, ``x - x.mean(0)``, a loss computed in forward) does not. The comparison then
    made is ``compare(replayed)``, with the replay as a further sample of the rounding, and
    its ``replay`` says what the chunking moves the tensor by; otherwise ``result``.
    """
    mine = pick(replay.step)
    if actual is None or mine is None or actual.dtype != mine.dtype or actual.shape != mine.shape:
        return result
    if not torch.equal(actual.detach(), mine.to(actual.device)):
        return result
    shift = _moved(mine, key(replay.full))
    twin_shift = _moved(pick(replay.twin), key(replay.twin_full))
    if shift is None or twin_shift is None:
        return result
    precise, coarse = (shift, twin_shift) if mine.dtype == torch.float64 else (twin_shift, shift)
    if not precise <= coarse * CHUNK_SCALING:
        return result
    settled = compare(mine)
    if not settled.ok:
        return result
    return replace(settled, replay=ReplayMatch(shift, result.ratio))


def _moved(replayed: torch.Tensor | None, full: torch.Tensor | None) -> float | None:
    """The greatest absolute difference between a replay's tensor and the single-device
    one, in float64; None when either is missing or their shapes differ."""
    if replayed is None or full is None or replayed.shape != full.shape:
        return None
    return largest_abs(replayed.detach().double() - full.detach().to(replayed.device).double())
