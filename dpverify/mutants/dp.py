"""DataParallel mutants: wrappers with ``DataParallel``'s signature, criterion wrappers,
reductions of per-replica losses and user models (``model(module)``) written with state
DataParallel's replicas lose, each with one real bug; ``ScratchDataParallel`` and
``weighted_replica_losses`` are the correct implementations they are compared with."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel.scatter_gather import gather

from dpverify.checks.loss_average import chunk_weighted_loss
from dpverify.core.tree import concatenate, first_batched, map_tensors, tensor_leaves
from dpverify.core.virtual import VirtualDataParallel
from dpverify.mutants.ulp import one_ulp_up

__all__ = [
    "AveragingDataParallel",
    "BalancedDropsChunkDataParallel",
    "BalancedOffsetDataParallel",
    "DeepCopyDataParallel",
    "DetachedReplicasDataParallel",
    "LastReplicaBuffersDataParallel",
    "LocalBatchStatistic",
    "LostForwardState",
    "MeanCriterionParallel",
    "OneUlpDataParallel",
    "OutputDeviceFirstDataParallel",
    "ReplicaOutputsDataParallel",
    "ReversedGatherDataParallel",
    "ScratchDataParallel",
    "TinyErrorDataParallel",
    "WeightedCriterionParallel",
    "mean_of_replica_losses",
    "weighted_replica_losses",
]


def _replica_parameters(replica: nn.Module) -> list[torch.Tensor]:
    """A replica's parameter copies (torch stores them as plain attributes, not Parameters)."""
    found = []
    for sub in replica.modules():
        for name in getattr(sub, "_former_parameters", {}):
            tensor = getattr(sub, name)
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                found.append(tensor)
    return found


class AveragingDataParallel(VirtualDataParallel[Any]):
    """Averages replica gradients instead of summing them.

    The classic misreading of DataParallel: "each GPU computed a gradient, so average
    them". With a mean loss over the gathered batch each replica already contributes
    (1/B) x its rows' sum, so dividing by the number of replicas shrinks every gradient.
    """

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        count = len(replicas)
        for replica in replicas:
            for tensor in _replica_parameters(replica):
                tensor.register_hook(lambda g: g / count)
        return replicas


class DetachedReplicasDataParallel(VirtualDataParallel[Any]):
    """Detaches every replica but the first, so only replica 0's gradient arrives.

    What ``replicate(..., detach=True)`` does for all replicas when someone "saves memory"
    for the copies: the parameters only learn from the first chunk.
    """

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        for replica in replicas[1:]:
            for sub in replica.modules():
                for name in list(getattr(sub, "_former_parameters", {})):
                    setattr(sub, name, getattr(sub, name).detach())
        return replicas


class ReversedGatherDataParallel(VirtualDataParallel[Any]):
    """Gathers the replicas' outputs in reverse order: rows no longer line up with targets."""

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        return super().gather(list(reversed(outputs)), output_device)


class OutputDeviceFirstDataParallel(VirtualDataParallel[Any]):
    """Puts the output device's own chunk first when gathering, as if "local results come
    first". Harmless with the default ``output_device`` (``device_ids[0]``); with any other
    output device the rows are out of order."""

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        used = self.device_ids[: len(outputs)]
        target = int(output_device) if not isinstance(output_device, torch.device) else output_device.index
        if target in used and target != used[0]:
            i = used.index(target)
            outputs = [outputs[i], *outputs[:i], *outputs[i + 1 :]]
        return super().gather(outputs, output_device)


class LastReplicaBuffersDataParallel(VirtualDataParallel[Any]):
    """Keeps the buffers of the last replica instead of the first: BatchNorm running
    statistics (and any buffer updated in place in forward) come from the wrong chunk."""

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        outputs = super().parallel_apply(replicas, inputs, kwargs)
        if len(replicas) > 1:
            # Rebinds rather than copies: replica 0's buffers may be saved for backward.
            for own, theirs in zip(self.module.modules(), replicas[-1].modules(), strict=True):
                for name, buffer in theirs._buffers.items():
                    if buffer is not None:
                        own._buffers[name] = buffer.detach()
        return outputs


class TinyErrorDataParallel(VirtualDataParallel[Any]):
    """Correct, except the first parameter's gradient is off by a relative 1e-4: the kind of
    error a fixed ``atol`` hides (a wrong epsilon, a stray rescale)."""

    relative_error = 1e-4

    def __init__(self, module: nn.Module, device_ids: Sequence[int] | None = None, output_device: int | None = None) -> None:
        super().__init__(module, device_ids, output_device)
        first = next(module.parameters(), None)
        if first is not None:
            first.register_hook(lambda g: g * (1 + self.relative_error))


class OneUlpDataParallel(VirtualDataParallel[Any]):
    """Correct, except one element of the first parameter's reduced gradient (the sum of
    the replicas' gradients, as it reaches the module) is one unit in the last place too
    large: the smallest error a float can carry (a reduction that rounds once where it
    should not), below every tolerance; exact mode (``exact=True``) sees it."""

    def __init__(self, module: nn.Module, device_ids: Sequence[int] | None = None, output_device: int | None = None) -> None:
        super().__init__(module, device_ids, output_device)
        first = next((p for p in module.parameters() if p.requires_grad), None)
        if first is not None:
            # the replicas' gradients arrive summed: the hook sees the reduced gradient
            first.register_hook(lambda g: one_ulp_up(g.clone()))


class _BalancedScatter(nn.DataParallel[Any]):
    """The scatter of a balanced-chunk DataParallel, as projects write to leave room for the
    loss on the first GPU: device 0 takes one row fewer than an even share (at least one),
    the others split the rest (the first of them one row more each, as many as the remainder). Each
    device's rows start at ``chunk_starts(sizes)``; batches of no more rows than devices
    keep torch's scatter."""

    def chunk_starts(self, sizes: Sequence[int]) -> list[int]:
        """Where each device's rows start: right after the devices before it."""
        return [sum(sizes[:i]) for i in range(len(sizes))]

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> Any:
        first_input = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        n = len(device_ids)
        rows = first_input.size(self.dim) if first_input is not None else 0
        if n < 2 or rows <= n:
            return super().scatter(inputs, kwargs, device_ids)
        first = max(1, rows // n - 1)
        share, extra = divmod(rows - first, n - 1)
        sizes = [first] + [share + (1 if i < extra else 0) for i in range(n - 1)]
        starts = self.chunk_starts(sizes)

        def rows_of(device: int) -> Callable[[torch.Tensor], torch.Tensor]:
            def take(x: torch.Tensor) -> torch.Tensor:
                if x.dim() == 0 or x.size(self.dim) != rows:
                    return x
                return x.narrow(self.dim, starts[device], sizes[device])

            return take

        scattered = tuple(tuple(map_tensors(inputs, rows_of(i))) for i in range(n))
        scattered_kwargs = tuple(map_tensors(dict(kwargs or {}), rows_of(i)) for i in range(n))
        return scattered, scattered_kwargs


class BalancedOffsetDataParallel(_BalancedScatter):
    """A balanced-chunk DataParallel (``_BalancedScatter``'s chunks, which leave room for
    the loss on the first GPU). The bug: each other device's rows start at a fixed stride
    from the first chunk, which forgets the extra row given to the devices before it, so
    chunks overlap and the last rows are never seen, in a batch of the right size.

    A plain ``torch.nn.DataParallel`` subclass (its own ``scatter`` only): dpverify runs it
    through ``virtual_devices`` where the CUDA devices are missing.
    """

    def chunk_starts(self, sizes: Sequence[int]) -> list[int]:
        first, share = sizes[0], min(sizes[1:])
        return [0] + [first + i * share for i in range(len(sizes) - 1)]  # bug: the running offset is sum(sizes[:i])


class BalancedDropsChunkDataParallel(_BalancedScatter):
    """A balanced-chunk DataParallel (``_BalancedScatter``'s chunks, with the right offsets).
    The bug: it replicates the module for one device fewer ("device 0 is busy with the
    loss") but still splits the batch over all of them, and zips replicas with chunks, so
    the last chunk never runs.

    A plain ``torch.nn.DataParallel`` subclass (its own ``scatter`` and ``forward``).
    """

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        scattered, scattered_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if len(scattered) < 3:
            return super().forward(*inputs, **kwargs)
        used = self.device_ids[: len(scattered) - 1]  # bug: one replica fewer than chunks
        replicas = self.replicate(self.module, used)
        chunks = list(zip(replicas, scattered, scattered_kwargs, strict=False))
        outputs = self.parallel_apply([r for r, _a, _k in chunks], [a for _r, a, _k in chunks], [k for _r, _a, k in chunks])
        return self.gather(outputs, self.output_device)


class ReplicaOutputsDataParallel(nn.DataParallel[Any]):
    """The model half of a model/criterion pair: torch's DataParallel that leaves each
    replica's output where it was computed, one per replica, instead of gathering them
    (the criterion wrapper computes the loss next to them). Correct; pass it as
    ``parallel=`` with a criterion wrapper as ``parallel_loss_fn=``."""

    def gather(self, outputs: Any, output_device: Any) -> Any:
        return list(outputs)


class _CriterionParallel(nn.DataParallel[Any]):
    """The criterion half of a model/criterion pair: scatters the target like the inputs,
    runs a replica of the criterion next to each replica's output, and combines the
    replicas' losses (gathered to the output device, one entry each) with ``combine``."""

    def forward(self, outputs: Any, *targets: Any, **kwargs: Any) -> Any:
        if not isinstance(outputs, list):  # one device: DataParallel ran the module on the batch
            return self.module(outputs, *targets, **kwargs)
        used = self.device_ids[: len(outputs)]
        scattered, scattered_kwargs = self.scatter(targets, kwargs, used)
        replicas = self.replicate(self.module, used)
        arguments = [(output, *target) for output, target in zip(outputs, scattered, strict=True)]
        losses = self.parallel_apply(replicas, arguments, scattered_kwargs)
        gathered = gather([loss.reshape(1) for loss in losses], self.output_device)  # along dim 0
        rows = [_first_rows(output, self.dim) for output in outputs]
        return self.combine(gathered, rows)

    def combine(self, losses: torch.Tensor, rows: list[int]) -> torch.Tensor:
        raise NotImplementedError


def _first_rows(output: Any, dim: int) -> int:
    """Rows along ``dim`` of the first batched tensor of one replica's output."""
    first = first_batched(output)
    return int(first.size(dim)) if first is not None else 1


class MeanCriterionParallel(_CriterionParallel):
    """A criterion wrapper that averages the replicas' mean losses with ``.mean()``: each
    replica's loss gets weight ``1/n`` whatever its rows, so on uneven chunks the loss and
    every gradient are off (the loss-averaging trap, inside a criterion wrapper)."""

    def combine(self, losses: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return losses.mean()


class WeightedCriterionParallel(_CriterionParallel):
    """A correct criterion wrapper: each replica's mean loss weighted by its share of the
    rows, ``sum(n_i * loss_i) / B``, the full-batch mean loss on any split (what
    ``MeanCriterionParallel`` is compared with)."""

    def combine(self, losses: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return chunk_weighted_loss(losses, rows)


class DeepCopyDataParallel(nn.Module):
    """Runs a ``copy.deepcopy`` of the module on each chunk: the copies are not connected
    to the module by autograd, so no gradient ever reaches its parameters."""

    def __init__(self, module: nn.Module, device_ids: Sequence[int] | None = None, output_device: int | None = None) -> None:
        super().__init__()
        self.module = module
        self.n = len(device_ids) if device_ids else 2

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return concatenate([copy.deepcopy(self.module)(*a, **k) for a, k in _chunk_call(inputs, kwargs, self.n)])


def _chunk_call(inputs: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """torch.chunk every batched tensor argument; other arguments go to every chunk."""

    def chunks(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return list(value.chunk(n))
        return [value] * n

    columns = [chunks(a) for a in inputs]
    kw_columns = {k: chunks(v) for k, v in kwargs.items()}
    count = min([len(c) for c in columns] + [len(c) for c in kw_columns.values()] + [n])
    return [
        (tuple(c[i] for c in columns), {k: c[i] for k, c in kw_columns.items()}) for i in range(count)
    ]


def _replicate(module: nn.Module, index: int, aliases: dict[int, torch.Tensor]) -> nn.Module:
    """A replica of ``module``: the same code and Python state, parameters replaced by
    ``aliases`` (autograd views of them), and buffers shared by replica 0 only."""
    replicas: dict[int, nn.Module] = {}
    buffer_copies: dict[int, torch.Tensor] = {}

    def build(sub: nn.Module) -> nn.Module:
        if id(sub) in replicas:
            return replicas[id(sub)]
        # Module's own replication hook (RNNs override it to copy their weight list).
        replica: nn.Module = sub._replicate_for_data_parallel()
        replicas[id(sub)] = replica
        for name, child in sub._modules.items():
            replica._modules[name] = None if child is None else build(child)
        for name, param in sub._parameters.items():
            if param is None:
                replica._parameters[name] = None
            else:
                setattr(replica, name, aliases[id(param)])
        for name, buffer in sub._buffers.items():
            if buffer is not None and index > 0:
                buffer = buffer_copies.setdefault(id(buffer), buffer.clone())
            replica._buffers[name] = buffer
        return replica

    return build(module)


class ScratchDataParallel(nn.Module):
    """A correct DataParallel written from scratch, without torch.nn.parallel.

    Chunks every batched argument with ``torch.chunk`` (so there can be fewer replicas than
    devices), builds one replica per chunk whose parameters are autograd views of the
    module's (gradients of every replica then sum into the parameters), gives replica 0 the
    module's own buffers and the others copies (so only replica 0's in-place updates
    persist), and concatenates the outputs, stacking scalars into one entry per replica.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int] | None = None, output_device: int | None = None) -> None:
        super().__init__()
        self.module = module
        self.device_ids = list(device_ids) if device_ids else [0, 1]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.device_ids) == 1:
            return self.module(*inputs, **kwargs)
        outputs = []
        for i, (args, kw) in enumerate(_chunk_call(inputs, kwargs, len(self.device_ids))):
            aliases = {id(p): p.view_as(p) for p in self.module.parameters()}
            outputs.append(_replicate(self.module, i, aliases)(*args, **kw))
        if all(isinstance(o, torch.Tensor) and o.dim() == 0 for o in outputs):
            warnings.warn(
                "Was asked to gather along dimension 0, but all input tensors were scalars; "
                "will instead unsqueeze and return a vector.",
                stacklevel=2,
            )
        return concatenate(outputs)


def mean_of_replica_losses(losses: torch.Tensor, chunk_sizes: list[int]) -> torch.Tensor:
    """``loss.mean()`` of DataParallel's per-replica losses: biased when chunks are uneven."""
    return losses.mean()


def weighted_replica_losses(losses: torch.Tensor, chunk_sizes: list[int]) -> torch.Tensor:
    """Each replica's loss weighted by its share of the batch: exact for any split (the
    correct reduction the ``mean-of-means`` mutant is compared with)."""
    return chunk_weighted_loss(losses, chunk_sizes)


# --------------------------------------------------------------------------- user models


class LostForwardState(nn.Module):
    """Counts its forwards in a Python attribute (``self.calls += 1``) and scales the
    module's output by a warm-up factor ``min(1, calls / warmup)``, as a step-dependent
    schedule written inside ``forward`` does. On one device the factor grows step by step;
    under DataParallel every forward runs on replicas, whose attribute changes are lost, so
    each forward sees ``calls == 1`` and the outputs diverge from the second step on."""

    def __init__(self, module: nn.Module, warmup: int = 4) -> None:
        super().__init__()
        self.module = module
        self.warmup = warmup
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        scale = min(1.0, self.calls / self.warmup)
        return map_tensors(self.module(*args, **kwargs), lambda t: t * scale if t.is_floating_point() else t)


class LocalBatchStatistic(nn.Module):
    """Tracks an exponential moving average of its output's mean in a buffer, updated in
    place in ``forward`` from the rows it sees (as a VQ-VAE tracks its codebook usage).
    Under DataParallel only replica 0's update reaches the module, made from its chunk
    alone, so the buffer is not what one device computes over the full batch."""

    output_mean: torch.Tensor

    def __init__(self, module: nn.Module, momentum: float = 0.1) -> None:
        super().__init__()
        self.module = module
        self.momentum = momentum
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
        self.register_buffer("output_mean", torch.zeros((), dtype=dtype))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.module(*args, **kwargs)
        first = next((t for _path, _keys, t in tensor_leaves(output) if t.is_floating_point() and t.dim() > 0), None)
        if first is not None:
            with torch.no_grad():
                self.output_mean.mul_(1 - self.momentum).add_(self.momentum * first.detach().mean().to(self.output_mean.dtype))
        return output
