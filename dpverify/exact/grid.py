"""Dyadic grids: the numbers exact mode computes with, and how far a tensor's digits reach.

A dyadic number is an integer times a power of two. A float holds one exactly when the
integer fits its significand (53 bits for float64), so a sum or product of dyadic numbers
rounds nothing as long as the exact result's digits, from its highest set bit down to its
lowest, fit in those bits. ``lowest_bit`` reads where a tensor's digits end; ``dyadic``
puts a tensor on a coarse grid (``bits`` significant bits per element, one power of two
per tensor), which leaves the products and sums of a small network room to stay exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

__all__ = ["BITS", "dyadic", "dyadic_module", "dyadic_tree", "is_power_of_two", "lowest_bit", "precision"]

#: Significant bits of each element of a converted tensor (integers up to 2**BITS times the
#: tensor's power of two). Fewer bits leave more of float64's 53 for depth and width.
BITS = 4


def precision(dtype: torch.dtype) -> int:
    """Significand bits of a floating ``dtype``, the hidden bit included (53 for float64)."""
    # eps is 2**(1 - precision)
    return 1 - math.frexp(torch.finfo(dtype).eps)[1] + 1


def lowest_bit(tensor: torch.Tensor) -> int | None:
    """The exponent of the lowest set bit over the finite nonzero elements of a floating
    ``tensor``: every element is an integer multiple of ``2**lowest_bit`` (None: no such
    element, nothing constrains the grid)."""
    values = tensor.detach()
    if values.is_complex() or not values.is_floating_point():
        return 0 if values.numel() else None
    if values.numel() == 0:
        return None
    values = values.to(torch.float64)
    mantissa, exponent = torch.frexp(torch.where(torch.isfinite(values), values, 0.0))
    # mantissa in [0.5, 1): times 2**53 it is the significand, an integer below 2**53; its
    # lowest set bit (s & -s) is a power of two whose own exponent frexp reads exactly
    significand = (mantissa.abs() * 2.0**53).to(torch.int64)
    lowest = torch.frexp((significand & -significand).to(torch.float64))[1]
    grid = exponent.to(torch.int64) - 54 + lowest.to(torch.int64)
    found = torch.where(significand != 0, grid, torch.iinfo(torch.int64).max).min()
    return None if int(found) == torch.iinfo(torch.int64).max else int(found)


def is_power_of_two(value: float) -> bool:
    """Whether ``abs(value)`` is a power of two (0.25, 1, 8): multiplying or dividing by it
    rounds nothing."""
    if value == 0 or not math.isfinite(value):
        return False
    return math.frexp(abs(value))[0] == 0.5


def dyadic(tensor: torch.Tensor, bits: int = BITS) -> torch.Tensor:
    """A float64 copy of ``tensor`` with every element rounded to ``bits`` significant bits
    of one power of two, the tensor's own: its largest element keeps its leading bits,
    smaller ones fewer (and the smallest become 0). Integer tensors are returned as they are."""
    if not tensor.is_floating_point():
        return tensor.detach().clone()
    values = tensor.detach().to(torch.float64)
    finite = values[torch.isfinite(values)]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    if largest == 0.0:
        return torch.zeros_like(values)
    mantissa, exponent = math.frexp(largest)
    # a largest element that is a power of two keeps its exponent, so that a tensor on its
    # grid is its own grid copy
    step = 2.0 ** (exponent - (mantissa == 0.5) - bits)
    return torch.round(values / step) * step


def dyadic_module(module: nn.Module, bits: int = BITS) -> nn.Module:
    """``module`` (itself, changed in place) in float64 with every floating parameter and
    buffer put on its grid (``dyadic``); the caller passes a copy it owns."""
    module.to(torch.float64)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(dyadic(tensor, bits))
    return module


def dyadic_tree(value: Any, bits: int = BITS) -> Any:
    """``value`` with every floating tensor in it (nested in tuples, lists and dicts)
    replaced by its float64 grid copy (``dyadic``); integer tensors and other leaves stay."""
    return _pytree.tree_map(lambda leaf: dyadic(leaf, bits) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf, value)
