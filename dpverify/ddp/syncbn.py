"""SyncBatchNorm on CPU ranks: torch's synchronisation, with host stand-ins for its kernels.

torch 2.13 refuses SyncBatchNorm on CPU three times over: DistributedDataParallel raises
"SyncBatchNorm layers only work with GPU modules" (``_passing_sync_batchnorm_handle``),
``SyncBatchNorm.forward`` raises "SyncBatchNorm expected input tensor to be on GPU", and
the five ATen kernels its autograd function calls (``batch_norm_stats``,
``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``) have CUDA implementations
only. Everything else (the all-gather of per-rank statistics with their counts, the
all-reduce of gradient sums in backward, the running-statistics update) is the
communication logic worth testing, and it runs unchanged: ``HostSyncBatchNorm`` calls
torch's own ``torch.nn.modules._functions.SyncBatchNorm`` autograd function, and the five
kernels get CPU implementations registered with ``torch.library``, written after the CUDA
ones in aten/src/ATen/native/cuda/Normalization.cuh. ``HostSyncBatchNorm`` is not a
subclass of ``nn.SyncBatchNorm``, so DDP's GPU-only check does not apply to it.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules._functions import SyncBatchNorm as SyncBatchNormFunction
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["HostSyncBatchNorm", "convert_to_host_sync_batchnorm", "register_host_kernels"]

_LIBRARY: torch.library.Library | None = None
_LOCK = threading.Lock()


def _reduce_dims(tensor: Tensor) -> list[int]:
    return [d for d in range(tensor.dim()) if d != 1]


def _per_channel(vector: Tensor, like: Tensor) -> Tensor:
    shape = [1] * like.dim()
    shape[1] = -1
    return vector.reshape(shape)


def _stats(input: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dims = _reduce_dims(input)
    mean = input.mean(dims)
    var = (input - _per_channel(mean, input)).square().mean(dims)
    return mean, torch.rsqrt(var + eps)


def _gather_stats_with_counts(
    input: Tensor,
    mean: Tensor,
    invstd: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
    eps: float,
    counts: Tensor,
) -> tuple[Tensor, Tensor]:
    del input
    counts = counts.to(mean.dtype).reshape(-1, 1)
    total = counts.sum()
    global_mean = (counts * mean).sum(0) / total
    var_each = invstd.pow(-2) - eps
    sum_sq = (counts * (var_each + (mean - global_mean).square())).sum(0)
    global_var = sum_sq / total
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        unbiased = sum_sq / (total - 1)
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return global_mean, torch.rsqrt(global_var + eps)


def _elemt(input: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, invstd: Tensor, eps: float) -> Tensor:
    del eps
    out = (input - _per_channel(mean, input)) * _per_channel(invstd, input)
    if weight is not None:
        out = out * _per_channel(weight, input)
    if bias is not None:
        out = out + _per_channel(bias, input)
    return out


def _backward_reduce(
    grad_out: Tensor,
    input: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    input_g: bool,
    weight_g: bool,
    bias_g: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    del weight, input_g, weight_g, bias_g
    dims = _reduce_dims(input)
    sum_dy = grad_out.sum(dims)
    sum_dy_xmu = (grad_out * (input - _per_channel(mean, input))).sum(dims)
    return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd, sum_dy.clone()


def _backward_elemt(
    grad_out: Tensor,
    input: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    count: Tensor,
) -> Tensor:
    total = count.to(mean.dtype).sum()
    mean_dy = _per_channel(sum_dy / total, input)
    mean_dy_xmu = _per_channel(sum_dy_xmu / total, input)
    xmu = input - _per_channel(mean, input)
    scale = _per_channel(invstd, input)
    grad = (grad_out - mean_dy - xmu * scale.square() * mean_dy_xmu) * scale
    if weight is not None:
        grad = grad * _per_channel(weight, input)
    return grad


def register_host_kernels() -> None:
    """Registers the CPU stand-ins for SyncBatchNorm's five kernels, once per process."""
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is not None:
            return
        library = torch.library.Library("aten", "IMPL")
        library.impl("batch_norm_stats", _stats, "CPU")
        library.impl("batch_norm_gather_stats_with_counts", _gather_stats_with_counts, "CPU")
        library.impl("batch_norm_elemt", _elemt, "CPU")
        library.impl("batch_norm_backward_reduce", _backward_reduce, "CPU")
        library.impl("batch_norm_backward_elemt", _backward_elemt, "CPU")
        _LIBRARY = library  # the registrations last as long as the Library object


class HostSyncBatchNorm(_BatchNorm):
    """``nn.SyncBatchNorm`` for CPU tensors: its ``forward``, without the GPU-only check.

    The module logic (momentum, ``num_batches_tracked``, when to synchronise) follows
    ``nn.SyncBatchNorm.forward`` of torch 2.13; synchronisation is torch's own autograd
    function over the default process group.
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not (bn_training and self.training and world > 1):
            return nn.functional.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps
            )
        register_host_kernels()
        result: Tensor = SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor,
            dist.group.WORLD, world,
        )
        return result


def convert_to_host_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replaces every BatchNorm layer by a ``HostSyncBatchNorm`` sharing its parameters and
    buffers, as ``nn.SyncBatchNorm.convert_sync_batchnorm`` does."""
    converted: nn.Module = module
    if isinstance(module, _BatchNorm):
        layer = HostSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            layer.weight, layer.bias = module.weight, module.bias
        layer.running_mean = module.running_mean
        layer.running_var = module.running_var
        layer.num_batches_tracked = module.num_batches_tracked
        layer.training = module.training
        converted = layer
    for name, child in module.named_children():
        converted.add_module(name, convert_to_host_sync_batchnorm(child))
    return converted

