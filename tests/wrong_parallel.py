"""Hand-written wrong DataParallel implementations the helpers must reject."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dpverify import VirtualDataParallel


class AveragingDataParallel(VirtualDataParallel[Any]):
    """Divides every replica's gradient by the number of replicas: averages instead of summing."""

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        n = len(replicas)
        for replica in replicas:
            for sub in replica.modules():
                for name in sub._former_parameters:
                    tensor = getattr(sub, name)
                    if tensor.requires_grad:
                        tensor.register_hook(lambda g, n=n: g / n)
        return replicas


class DeepCopyDataParallel(nn.Module):
    """Runs a deep copy of the module per chunk: gradients never reach the module."""

    def __init__(self, module: nn.Module, device_ids: Sequence[int], output_device: int | None = None) -> None:
        super().__init__()
        self.module = module
        self.n = len(device_ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([copy.deepcopy(self.module)(chunk) for chunk in x.chunk(self.n)])


class PerturbingDataParallel(VirtualDataParallel[Any]):
    """Correct, except one parameter's gradient is off by a relative ``error``."""

    error = 1e-4

    def __init__(self, module: nn.Module, device_ids: Sequence[int], output_device: int | None = None) -> None:
        super().__init__(module, device_ids, output_device)
        first = next(module.parameters())
        first.register_hook(lambda g: g * (1 + self.error))
