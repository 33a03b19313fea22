"""Small numeric kernels shared by the comparison and the step recorder."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = [
    "FLOAT64_JITTER", "JITTER_ROUNDOFFS", "dense", "jitter_for", "largest_abs", "magnitudes", "max_abs", "scale_factor", "ulp_distances", "ulps",
]

# Relative size of the parameter perturbation of a jittered run, in units of roundoff of
# the dtype whose rounding it measures: a few, the rounding a step makes in each parameter use.
JITTER_ROUNDOFFS = 8.0
FLOAT64_JITTER = JITTER_ROUNDOFFS * torch.finfo(torch.float64).eps


def jitter_for(dtype: torch.dtype) -> tuple[torch.dtype | None, float]:
    """The dtype (None: the module's own) and relative parameter perturbation of a
    jittered training run that samples the rounding of a module in ``dtype``: float64 from
    parameters ``FLOAT64_JITTER`` off for a float64 module, else the module's dtype from
    parameters one unit of its roundoff off (as a one-step check's second sample)."""
    if dtype == torch.float64:
        return torch.float64, FLOAT64_JITTER
    return None, torch.finfo(dtype).eps


def max_abs(tensor: torch.Tensor) -> float:
    """max |x| in one pass (aminmax is several times faster than an infinity norm); NaN if any."""
    low, high = torch.aminmax(tensor)
    low_value, high_value = float(low), float(high)
    if math.isnan(low_value) or math.isnan(high_value):
        return math.nan
    return max(high_value, -low_value)  # +0.0, not -0.0, for an all-zero tensor


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a dense tensor (``Embedding(sparse=True)`` gives sparse gradients)."""
    return tensor.to_dense() if tensor.is_sparse else tensor


def largest_abs(tensor: torch.Tensor) -> float:
    """The largest absolute entry of ``tensor``, sparse or dense (0 when it is empty)."""
    values = dense(tensor.detach())
    return max_abs(values) if values.numel() else 0.0


def magnitudes(tensor: torch.Tensor) -> tuple[float, float]:
    """``tensor``'s largest absolute entry and its 2-norm, sparse or dense (0 and 0 when it is empty)."""
    values = dense(tensor.detach())
    if not values.numel():
        return 0.0, 0.0
    return max_abs(values), float(torch.linalg.vector_norm(values))


def scale_factor(actual: Mapping[str, torch.Tensor | None], expected: Mapping[str, torch.Tensor | None], rounding: float) -> float | None:
    """``c`` when ``actual`` is ``c`` times ``expected`` on every tensor both hold with the
    same shape (1.0 included), to ``rounding`` of its norm (the least-squares ``c`` over all
    of them, in float64); None when they are not a clean multiple or either is all zero."""
    dot = norm_e = norm_a = 0.0
    for name, e in expected.items():
        a = actual.get(name)
        if a is None or e is None or a.shape != e.shape:
            continue
        a64, e64 = a.detach().double().cpu(), e.detach().double().cpu()
        dot += float((a64 * e64).sum())
        norm_e += float((e64 * e64).sum())
        norm_a += float((a64 * a64).sum())
    if norm_e == 0.0 or norm_a == 0.0:
        return None
    c = dot / norm_e
    residual = max(norm_a - c * dot, 0.0) ** 0.5 / norm_a**0.5
    return c if residual <= rounding else None


def ulp_distances(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``|actual - expected|`` per element in units in the last place of ``expected``'s
    elements (the spacing of ``expected``'s dtype above each element's magnitude), in
    float64; NaN or inf where either is not finite."""
    magnitude = expected.detach().abs()
    spacing = torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude
    return (actual.detach().to(torch.float64) - expected.detach().to(torch.float64)).abs() / spacing.to(torch.float64)


def ulps(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest distance between ``actual`` and ``expected``, in units in the last place
    of ``expected``'s elements (``ulp_distances``; 0 when they are empty)."""
    return float(ulp_distances(actual, expected).max()) if expected.numel() else 0.0
