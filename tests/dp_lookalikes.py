"""Look-alikes of DataParallel variants found in public projects, written for these tests.

Each follows a pattern seen in the wild (the code is this suite's own): the names of torch's
parallel primitives are imported at module level, as those projects do, so that running
them inside ``dpverify.core.patching.virtual_devices`` shows the in-place switches reach
names bound before the block opened.

* ``BalancedDataParallel``: device 0 gets a smaller chunk (``gpu0_bsz`` rows) to leave room
  for the loss on GPU 0; own ``scatter`` with chunk sizes, own ``parallel_apply`` calling
  torch's ``parallel_apply`` function.
* ``OutputsPerDevice`` + ``CriterionParallel``: the model's outputs stay on their devices
  (no gather), the loss is computed per device with ``parallel_apply`` and the per-device
  losses are reduced by a custom autograd Function (``ReduceAddBroadcast`` or
  ``ReduceAddCommBroadcast``) built on ``torch.cuda.comm.reduce_add``.
* ``DeviceLoopDataParallel``: runs the replicas one after another in the caller's thread,
  each inside ``with torch.cuda.device(i):``.
* ``FunctionsDataParallel``: scatters and gathers with the autograd Functions ``Scatter``
  and ``Gather`` called directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.cuda.comm as cuda_comm
from torch import nn
from torch.autograd import Function
from torch.cuda.comm import reduce_add
from torch.nn.parallel import DataParallel, replicate
from torch.nn.parallel._functions import Broadcast, Gather, Scatter
from torch.nn.parallel.parallel_apply import parallel_apply

__all__ = [
    "BalancedDataParallel",
    "CriterionParallel",
    "DeviceLoopDataParallel",
    "DroppedKeywords",
    "FunctionsDataParallel",
    "IgnoredDim",
    "MangledDict",
    "OutputsPerDevice",
    "ReduceAddBroadcast",
    "ReduceAddCommBroadcast",
    "ZeroedReplicaBuffers",
]


# --- balanced first chunk -----------------------------------------------------------------


def _scatter_sized(obj: Any, devices: Sequence[int], sizes: Sequence[int], dim: int) -> list[Any]:
    """One entry per device: tensors split by ``sizes``, containers walked, the rest shared."""
    if isinstance(obj, torch.Tensor):
        return list(Scatter.apply(devices, sizes, dim, obj))
    if isinstance(obj, (tuple, list)) and obj:
        return [type(obj)(parts) for parts in zip(*(_scatter_sized(o, devices, sizes, dim) for o in obj), strict=True)]
    if isinstance(obj, dict) and obj:
        keys = list(obj)
        columns = [_scatter_sized(obj[k], devices, sizes, dim) for k in keys]
        return [dict(zip(keys, values, strict=True)) for values in zip(*columns, strict=True)]
    return [obj for _ in devices]


class BalancedDataParallel(DataParallel):
    """DataParallel whose first device gets ``gpu0_bsz`` rows and the others share the rest."""

    def __init__(self, gpu0_bsz: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gpu0_bsz = gpu0_bsz

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        scattered, scattered_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if len(self.device_ids) == 1:
            return self.module(*scattered[0], **scattered_kwargs[0])
        used = self.device_ids[: len(scattered)]
        replicas = replicate(self.module, used, not torch.is_grad_enabled())
        outputs = self.parallel_apply(replicas, used, scattered, scattered_kwargs)
        return self.gather(outputs, self.output_device)

    def parallel_apply(
        self, replicas: Sequence[nn.Module], device_ids: Sequence[int], inputs: Sequence[Any], kwargs: Any
    ) -> list[Any]:
        return parallel_apply(replicas, inputs, kwargs, device_ids[: len(replicas)])

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[Any]) -> Any:
        rows = inputs[0].size(self.dim)
        others = len(device_ids) - 1
        if others == 0 or self.gpu0_bsz >= rows // len(device_ids):
            return super().scatter(inputs, kwargs, device_ids)
        share, extra = divmod(rows - self.gpu0_bsz, others)
        sizes = [self.gpu0_bsz] + [share + (1 if i < extra else 0) for i in range(others)]
        per_device = _scatter_sized(inputs, device_ids, sizes, self.dim)
        kwargs_per_device = _scatter_sized(kwargs, device_ids, sizes, self.dim) if kwargs else [{} for _ in device_ids]
        return tuple(per_device), tuple(kwargs_per_device)


# --- criterion parallel -------------------------------------------------------------------


class ReduceAddBroadcast(Function):
    """Sums one tensor per device with ``reduce_add``; backward broadcasts with ``Broadcast``."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.devices = [t.get_device() for t in inputs]
        return reduce_add(inputs)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        return Broadcast.apply(ctx.devices, grad_output)


class ReduceAddCommBroadcast(Function):
    """As ``ReduceAddBroadcast``, with ``torch.cuda.comm.broadcast`` in backward."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.devices = list(range(len(inputs)))
        return cuda_comm.reduce_add(inputs, destination=torch.cuda.current_device())

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        return cuda_comm.broadcast(grad_output, ctx.devices)


class OutputsPerDevice(DataParallel):
    """DataParallel that leaves each replica's output on its device: a list, no gather."""

    def gather(self, outputs: Any, output_device: Any) -> Any:
        return outputs


class CriterionParallel(DataParallel):
    """Computes the loss on each device from ``OutputsPerDevice``'s outputs and averages
    the per-device losses with ``reducer`` (a custom autograd Function)."""

    def __init__(self, module: nn.Module, reducer: type[Function] = ReduceAddBroadcast, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self.reducer = reducer

    def forward(self, outputs: Any, *targets: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(outputs, *targets, **kwargs)
        if not isinstance(outputs, (list, tuple)):  # one device: DataParallel ran the module itself
            return self.module(outputs, *targets, **kwargs)
        used = self.device_ids[: len(outputs)]
        scattered, scattered_kwargs = self.scatter(targets, kwargs, used)
        replicas = self.replicate(self.module, used)
        arguments = [(output, *target) for output, target in zip(outputs, scattered, strict=True)]
        losses = parallel_apply(replicas, arguments, scattered_kwargs, used)
        return self.reducer.apply(*losses) / len(losses)


# --- a loop over torch.cuda.device --------------------------------------------------------


class DeviceLoopDataParallel(DataParallel):
    """Runs each replica in turn, in this thread, inside ``with torch.cuda.device(i):``."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        scattered, scattered_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        used = self.device_ids[: len(scattered)]
        replicas = self.replicate(self.module, used)
        outputs = []
        for device, replica, args, kw in zip(used, replicas, scattered, scattered_kwargs, strict=True):
            with torch.cuda.device(device):
                outputs.append(replica(*args, **kw))
        return self.gather(outputs, self.output_device)


# --- Scatter and Gather called directly -----------------------------------------------------


class FunctionsDataParallel(DataParallel):
    """Scatters positional tensors with ``Scatter.apply`` and gathers with ``Gather.apply``."""

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[Any]) -> Any:
        per_argument = [Scatter.apply(device_ids, None, self.dim, x) for x in inputs]
        chunks = len(per_argument[0])
        return tuple(tuple(parts[i] for parts in per_argument) for i in range(chunks)), tuple({} for _ in range(chunks))

    def gather(self, outputs: Any, output_device: Any) -> Any:
        return Gather.apply(output_device, self.dim, *outputs)


# --- bugs that only some models show (``dpverify verify`` must catch each) -------------------


class WholeBatch(nn.Module):
    """Calls the module once on the whole batch, whatever the devices: nothing parallel."""

    def __init__(self, module: nn.Module, device_ids: list[int], output_device: int | None = None) -> None:
        super().__init__()
        self.module = module

    def forward(self, *inputs: Any) -> Any:
        return self.module(*inputs)


class ZeroedReplicaBuffers(DataParallel):
    """Gives every replica but the first zeroed buffers (a replicate that copies parameters
    only and makes fresh buffers): invisible to a model that reads no buffer in forward."""

    def replicate(self, module: nn.Module, device_ids: Sequence[Any]) -> Any:
        replicas = super().replicate(module, device_ids)
        for replica in replicas[1:]:
            for sub in replica.modules():
                for name, buffer in sub._buffers.items():
                    if buffer is not None:
                        sub._buffers[name] = torch.zeros_like(buffer)
        return replicas


class DroppedKeywords(DataParallel):
    """Scatters the positional inputs only: keyword arguments never reach the replicas."""

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[Any]) -> Any:
        return super().scatter(inputs, {}, device_ids)


class IgnoredDim(DataParallel):
    """Takes ``dim=`` and drops it: splits and gathers along dim 0 whatever it is asked."""

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0) -> None:
        super().__init__(module, device_ids=device_ids, output_device=output_device)


class MangledDict(DataParallel):
    """Gathers a dict output's values under each other's keys (values taken in reverse key
    order): tensors, tuples and the loss are gathered right."""

    def gather(self, outputs: Any, output_device: Any) -> Any:
        gathered = super().gather(outputs, output_device)
        if isinstance(gathered, dict):
            return dict(zip(gathered, reversed(list(gathered.values())), strict=True))
        return gathered
