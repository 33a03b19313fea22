"""Training-step mutants for DDP and FSDP2: the user's code after backward
(``after_backward(ctx)`` hooks: gradient clipping) and the user's module (``model(module)``:
a running statistic in forward), written with the bug; the correct clip they are compared
with is ``dpverify.models.hooks.global_clip`` (torch's ``clip_grad_norm_``) to
``CLIP_NORM``. Module-level, so that they pickle to the ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dpverify.core.tree import map_tensors, tensor_leaves

__all__ = [
    "CLIP_NORM",
    "LocalBatchOffset",
    "clip_reduced_twice",
    "local_batch_offset",
    "local_shard_clip",
]

#: The clipping threshold of the hooks: small enough that the drawn scenarios' gradients
#: are clipped, so that a wrong norm changes the step.
CLIP_NORM = 0.01


def _scale(params: list[nn.Parameter], norm: torch.Tensor) -> None:
    scale = (CLIP_NORM / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        assert p.grad is not None
        p.grad.mul_(scale)


def local_shard_clip(ctx: Any) -> None:
    """Clips by a norm computed from the rank's local FSDP2 shard of every gradient
    (``p.grad.to_local()``): each rank scales its shard by its own factor, as if its shard
    were the whole gradient."""
    params = [p for p in ctx.module.parameters() if p.grad is not None]
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    _scale(params, torch.norm(torch.stack([g.norm() for g in local])))


def clip_reduced_twice(ctx: Any) -> None:
    """Clips by a norm whose square is all-reduced over the data-parallel group: DDP has
    already averaged the gradients, so the sum adds the world size's identical copies and
    the norm is ``sqrt(world_size)`` times too large."""
    params = [p for p in ctx.module.parameters() if p.grad is not None]
    squared = torch.stack([p.grad.pow(2).sum() for p in params]).sum()
    dist.all_reduce(squared, group=ctx.group)
    _scale(params, squared.sqrt())


class LocalBatchOffset(nn.Module):
    """The scenario's module behind a running statistic of its output, used as an offset:
    every forward updates an exponential moving average of the output's mean from the batch
    it sees and adds it to the output (``dp.LocalBatchStatistic`` keeps it aside). Under DDP each rank sees only its shard, so the average is of the
    local batch, never all-reduced over the ranks."""

    ema: torch.Tensor

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        dtype = next((p.dtype for p in inner.parameters() if p.is_floating_point()), torch.get_default_dtype())
        self.register_buffer("ema", torch.zeros((), dtype=dtype))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        first = next((t for _path, _keys, t in tensor_leaves(out) if t.is_floating_point()), None)
        if first is not None:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * first.detach().mean().to(self.ema.dtype))
        return map_tensors(out, lambda t: t + self.ema.to(t.dtype) if t.is_floating_point() else t)


def local_batch_offset(module: nn.Module) -> nn.Module:
    """The user's module with a running statistic updated from the local batch in forward
    and added to the output (``LocalBatchOffset``)."""
    return LocalBatchOffset(module)
