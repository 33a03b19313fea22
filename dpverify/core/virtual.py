"""DataParallel on any machine: ``VirtualDataParallel``, torch's own orchestration over
virtual devices, with its four extension points overridden: ``scatter``, ``replicate`` and
``gather`` run torch's functions inside ``virtual_primitives``, and ``parallel_apply`` is
``virtual_parallel_apply``. Any other DataParallel needs ``virtual_devices(n)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any, TypeVar

import torch
from torch import nn

from dpverify.core.devices import cuda_device_count, normalize_device_ids, normalize_output_device
from dpverify.core.errors import InvalidArgument
from dpverify.core.patching import virtual_devices, virtual_primitives
from dpverify.core.primitives import (
    SCALAR_GATHER_WARNING,
    current_virtual_device,
    observe_gathers,
    replica_device,
    virtual_parallel_apply,
)

__all__ = [
    "SCALAR_GATHER_WARNING",
    "VirtualDataParallel",
    "current_virtual_device",
    "data_parallel",
    "observe_gathers",
    "replica_device",
    "virtual_devices",
    "virtual_primitives",
]

T = TypeVar("T", bound=nn.Module)


def _check_on_host(module: nn.Module) -> None:
    for name, tensor in chain(module.named_parameters(), module.named_buffers()):
        if tensor.device.type != "cpu":
            raise InvalidArgument(
                f"module has {name!r} on {tensor.device}; VirtualDataParallel runs on the host, "
                "where the CPU stands for device_ids[0]: move the module there with module.cpu()"
            )


class VirtualDataParallel(nn.DataParallel[T]):
    """``torch.nn.DataParallel`` over virtual devices, on any machine.

    Runs torch's own ``DataParallel.forward`` (and through it ``scatter_kwargs``,
    ``replicate`` and ``gather``); only the CUDA primitives are virtual, so chunking,
    idle devices, replica aliasing, lost replica state, scalar gathering, gradient
    summation and autocast behave as on GPUs (docs/dataparallel.md lists where the model
    differs).

    Args:
        module: the module to parallelize; its parameters and buffers must be on the CPU,
            which stands for ``device_ids[0]``.
        device_ids: distinct non-negative virtual device indices (default ``[0, 1]``).
        output_device: where outputs are gathered: a device index (default
            ``device_ids[0]``), or -1 for the host. Like torch, "cpu" is rejected.
        dim: the scatter and gather dimension.

    Raises:
        InvalidArgument: repeated, negative or malformed device ids, an unusable
            ``output_device``, a non-integer ``dim``, or a module that is not on the CPU.
    """

    def __init__(
        self,
        module: T,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
    ) -> None:
        nn.Module.__init__(self)
        ids = [0, 1] if device_ids is None else normalize_device_ids(device_ids)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise InvalidArgument(f"dim={dim!r} must be an int, the batch dimension")
        if not isinstance(module, nn.Module):
            raise InvalidArgument(f"module={type(module).__name__} is not a torch.nn.Module")
        _check_on_host(module)
        self.dim = dim
        self.module = module
        self.device_ids = ids
        self.output_device = normalize_output_device(output_device, ids)
        self.src_device_obj = torch.device("cpu")

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[int | torch.device]
    ) -> Any:
        with virtual_primitives():
            return super().scatter(inputs, kwargs, device_ids)

    def replicate(self, module: T, device_ids: Sequence[int | torch.device]) -> list[T]:
        with virtual_primitives():
            return super().replicate(module, device_ids)

    def parallel_apply(
        self, replicas: Sequence[T], inputs: Sequence[Any], kwargs: Sequence[dict[str, Any]] | None
    ) -> list[Any]:
        return virtual_parallel_apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)])

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        with virtual_primitives(self.device_ids[: len(outputs)]):
            return super().gather(outputs, output_device)

    def extra_repr(self) -> str:
        return f"device_ids={self.device_ids}, output_device={self.output_device}, dim={self.dim}"


def data_parallel(
    module: nn.Module,
    device_ids: Sequence[int | torch.device],
    output_device: int | torch.device | None = None,
    dim: int = 0,
) -> nn.DataParallel[Any]:
    """The real ``torch.nn.DataParallel`` when the devices exist, else ``VirtualDataParallel``,
    splitting and gathering along ``dim``.

    Real devices are used when CUDA is available and every id in ``device_ids`` is a
    visible CUDA device; the module must then be on ``cuda:device_ids[0]``.

    Raises:
        InvalidArgument: as ``VirtualDataParallel``, or ``output_device`` is not a visible
            CUDA device on a machine that runs the real DataParallel.
    """
    ids = normalize_device_ids(device_ids)
    target = normalize_output_device(output_device, ids)
    count = cuda_device_count()
    if count and max(ids) < count:
        if target >= count:
            raise InvalidArgument(
                f"output_device={target} is not a visible CUDA device (found {count}); "
                "pass one of them, or -1 for the host"
            )
        return nn.DataParallel(module, device_ids=ids, output_device=target, dim=dim)
    return VirtualDataParallel(module, ids, target, dim)
