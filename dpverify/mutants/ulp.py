"""The one-unit-in-the-last-place error the one-ulp mutants inject: the smallest error a
float can carry, below every tolerance, which only exact mode (``exact=True``) sees."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

__all__ = ["one_ulp_up"]


@torch.no_grad()
def one_ulp_up(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself with its first element moved up by one unit in the last place
    (``torch.nextafter`` toward +inf), in place; a DTensor's local shard's first element
    (where this rank holds one)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel():
        flat = local.view(-1)
        flat[0] = torch.nextafter(flat[0], flat.new_tensor(math.inf))
    return tensor
