"""Small numeric kernels shared by the comparison and the step recorder."""

from __future__ import annotations

import math

import torch

__all__ = ["max_abs"]


def max_abs(tensor: torch.Tensor) -> float:
    """max |x| in one pass (aminmax is several times faster than an infinity norm); NaN if any."""
    low, high = torch.aminmax(tensor)
    low_value, high_value = float(low), float(high)
    if math.isnan(low_value) or math.isnan(high_value):
        return math.nan
    return max(high_value, -low_value)  # +0.0, not -0.0, for an all-zero tensor
