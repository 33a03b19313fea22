"""Comparison of a parallel step with the single-device step, and the tolerance it uses.

The default tolerance is anchored in float64 (SEMANTICS.md, Floating point). The same step
runs three times from the same weights: through the parallel wrapper, alone in the working
dtype (float32), and alone in float64. The float64 run is the answer up to about 1e-16;
the single-device float32 run's distance from it measures how much rounding this model and
batch produce in float32, whatever the gradient scale and however much cancellation the
sums involve. The parallel run passes when its distance from float64 is within
``factor`` times that, per tensor. A floor of ``floor_ulps`` units of roundoff of the
tensor's largest float64 entry keeps a lucky, nearly exact single-device run from making
the bound impossibly tight. Every quantity scales with the gradients, so the check means
the same at gradient scales from 1e-8 to 1e8, where a fixed ``atol`` either hides bugs or
fails correct code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dpverify._divergence import DivergenceSource
from dpverify._errors import InvalidArgument
from dpverify._numerics import max_abs

__all__ = [
    "StepComparison",
    "TensorComparison",
    "Tolerance",
    "compare_tensors",
    "explain_scale",
    "render",
    "uniform_scale",
]


@dataclass(frozen=True)
class Tolerance:
    """How close a parallel result must be.

    With ``rtol`` and ``atol`` (both or neither, as ``torch.testing.assert_close``), the
    parallel result is compared elementwise with the single-device result:
    ``|actual - expected| <= atol + rtol * |expected|``. Without them the float64-anchored
    rule above applies, with ``factor`` and ``floor_ulps``.
    """

    rtol: float | None = None
    atol: float | None = None
    factor: float = 8.0
    floor_ulps: float = 32.0

    def __post_init__(self) -> None:
        if (self.rtol is None) != (self.atol is None):
            missing = "atol" if self.atol is None else "rtol"
            raise InvalidArgument(
                f"rtol={self.rtol!r}, atol={self.atol!r}: pass both or neither "
                f"(add {missing}=...), or neither to use the float64-anchored tolerance"
            )
        for name in ("rtol", "atol", "factor", "floor_ulps"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0
            ):
                raise InvalidArgument(f"{name}={value!r} must be a finite number >= 0")

    @property
    def explicit(self) -> bool:
        return self.rtol is not None

    def describe(self, working_dtype: torch.dtype) -> str:
        if self.explicit:
            return (
                f"|parallel - single-device| <= atol + rtol * |single-device| with "
                f"rtol={self.rtol:.1e}, atol={self.atol:.1e}"
            )
        name = str(working_dtype).removeprefix("torch.")
        return (
            f"a tensor's greatest distance from the float64 step may be {self.factor:g}x the "
            f"single-device {name} step's, or {self.factor * self.floor_ulps:g} units of "
            f"{name} roundoff of its largest entry, whichever is larger"
        )


def _unravel(flat_index: int, shape: Sequence[int]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, rest = divmod(flat_index, size) if size else (flat_index, 0)
        index.append(rest)
    return tuple(reversed(index))


@dataclass(frozen=True)
class TensorComparison:
    """The comparison of one tensor (an output, the loss, or a parameter's gradient).

    ``ratio`` is the greatest ``|difference| / allowed`` over the elements: below 1 passes,
    and it says how close to the limit a passing tensor came. The indices and the relative
    difference are computed for failing tensors only (they stay ``()`` and 0.0 otherwise):
    a passing check reads each tensor once.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    mismatched: int = 0
    max_abs: float = 0.0
    max_abs_index: tuple[int, ...] = ()
    max_rel: float = 0.0
    max_rel_index: tuple[int, ...] = ()
    allowed: float = 0.0
    ratio: float = 0.0
    reference_error: float | None = None
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None and self.mismatched == 0

    def details(self) -> str:
        """The assert_close-style paragraph for this tensor."""
        if self.problem is not None:
            return f"{self.name}: {self.problem}"
        lines = [
            f"{self.name}: tensors are not close!" if not self.ok else f"{self.name}: close.",
            f"Mismatched elements: {self.mismatched} / {self.numel} "
            f"({100.0 * self.mismatched / max(self.numel, 1):.1f}%)",
            f"Greatest absolute difference: {self.max_abs:.3g} at index {self.max_abs_index} "
            f"(up to {self.allowed:.3g} allowed)",
            f"Greatest relative difference: {self.max_rel:.3g} at index {self.max_rel_index}",
        ]
        if self.reference_error is not None:
            lines.append(
                f"The single-device step is {self.reference_error:.3g} from float64 on this tensor."
            )
        return "\n".join(lines)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    # Embedding(sparse=True) produces sparse gradients; compare their values.
    return tensor.to_dense() if tensor.is_sparse else tensor


def _missing(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None) -> TensorComparison | None:
    """Handles None gradients: equal when both are None, or when the other is all zeros
    (DataParallel's reduce-add materialises zeros for parameters a replica did not use)."""
    if actual is not None and expected is not None:
        return None
    present = actual if actual is not None else expected
    if present is None or not bool(present.any()):
        shape = tuple(present.shape) if present is not None else ()
        return TensorComparison(name, shape, present.numel() if present is not None else 0)
    where = "parallel" if actual is None else "single-device"
    other = "single-device" if actual is None else "parallel"
    return TensorComparison(
        name,
        tuple(present.shape),
        present.numel(),
        mismatched=present.numel(),
        problem=f"is None in the {where} step but has nonzero values in the {other} step",
    )


def compare_tensors(
    name: str,
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    anchor: torch.Tensor | None,
    tolerance: Tolerance,
    probe: torch.Tensor | None = None,
    terms: float | None = None,
) -> TensorComparison:
    """Compares ``actual`` (parallel) with ``expected`` (single device) under ``tolerance``.

    ``anchor`` is the float64 single-device result; it is required by the anchored rule
    and ignored by the explicit one. When the working dtype is float64 itself, the anchor
    cannot measure its rounding; ``probe``, the float32 single-device result, does:
    rounding error scales with the unit roundoff, so the float32 error times
    ``u(float64) / u(float32)`` estimates the float64 one.

    ``terms`` is ``sum over replicas of max |g_r|``, the magnitude of what the parallel
    reduce-add summed. When replicas cancel (their contributions large, the total near
    zero), the single-device step can be exact by luck while the parallel sum carries
    rounding of the size of its terms; the floor then scales with the terms, not with the
    total (SEMANTICS.md: the scale that matters is the sum of |terms|).
    """
    missing = _missing(name, actual, expected)
    if missing is not None:
        return missing
    assert actual is not None
    assert expected is not None
    if actual.shape != expected.shape:
        return TensorComparison(
            name,
            tuple(expected.shape),
            expected.numel(),
            mismatched=expected.numel(),
            problem=(
                f"has shape {tuple(actual.shape)} in the parallel step and "
                f"{tuple(expected.shape)} in the single-device step"
            ),
        )
    if actual.numel() == 0:
        return TensorComparison(name, tuple(actual.shape), 0)
    actual, expected = _dense(actual), _dense(expected)
    anchor = None if anchor is None else _dense(anchor)
    device = expected.device
    actual = actual.detach().to(device)
    if tolerance.explicit:
        reference = expected.detach().to(torch.float64)
        allowed_each = tolerance.atol + tolerance.rtol * reference.abs()  # type: ignore[operator]
        reference_error = None
        over = (actual - reference).abs() > allowed_each
        if not bool(over.any()) and not bool(actual.isnan().any()):
            # passes: the statistics that the report needs, no indices
            distance = (actual - reference).abs()
            ratio = float((distance / allowed_each).nan_to_num(0.0).max())
            return _passed(name, actual, float(distance.max()), ratio, float(allowed_each.max()), None)
        return _detailed(name, actual, reference, allowed_each, None)
    if anchor is None:
        raise ValueError("the anchored tolerance needs the float64 result")
    reference = anchor.detach().to(device=device, dtype=torch.float64)
    roundoff = torch.finfo(expected.dtype).eps / 2 if expected.is_floating_point() else 0.0
    # Distances are taken from the float64 answer rounded to the working dtype: the best a
    # working-precision step can do. Rounding moves it by half a unit of roundoff, far
    # below the floor, and halves the memory traffic of the check.
    rounded = reference.to(expected.dtype) if expected.is_floating_point() else reference
    reference_error = max_abs(expected.detach() - rounded)
    if probe is not None and expected.dtype == torch.float64:
        probe_error = max_abs(_dense(probe).detach().to(device) - reference)
        reference_error = max(reference_error, probe_error * _ROUNDOFF_RATIO)
    scale = max_abs(rounded)
    if terms is not None:
        scale = max(scale, terms)
    allowed = tolerance.factor * max(reference_error, tolerance.floor_ulps * roundoff * scale)
    gap = max_abs(actual - rounded)
    if gap <= allowed:  # False for NaN: those take the detailed path
        ratio = 0.0 if gap == 0.0 else (gap / allowed if allowed > 0 else math.inf)
        return _passed(name, actual, gap, ratio, allowed, reference_error)
    allowed_each = torch.full((), allowed, dtype=torch.float64, device=device)
    return _detailed(name, actual, reference, allowed_each, reference_error)


_ROUNDOFF_RATIO = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps


def _passed(
    name: str, actual: torch.Tensor, gap: float, ratio: float, allowed: float, reference_error: float | None
) -> TensorComparison:
    return TensorComparison(
        name, tuple(actual.shape), actual.numel(), max_abs=gap, allowed=allowed, ratio=ratio,
        reference_error=reference_error,
    )


def _detailed(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    allowed_each: torch.Tensor,
    reference_error: float | None,
) -> TensorComparison:
    """Every statistic of a failing tensor: count, greatest differences and their indices."""
    actual64 = actual.to(torch.float64)
    both_nan = actual64.isnan() & reference.isnan()
    nan_mismatch = actual64.isnan() != reference.isnan()
    diff = torch.where(both_nan, 0.0, (actual64 - reference).abs())
    over = (diff > allowed_each) | nan_mismatch
    diff = torch.where(nan_mismatch, math.inf, diff)
    max_abs, flat_abs = diff.reshape(-1).max(0)
    rel = torch.where(diff == 0, 0.0, diff / reference.abs())
    max_rel, flat_rel = rel.reshape(-1).max(0)
    ratios = torch.where(diff == 0, 0.0, diff / allowed_each)
    allowed_at = allowed_each if allowed_each.dim() == 0 else allowed_each.reshape(-1)[flat_abs]
    shape = tuple(actual.shape)
    return TensorComparison(
        name,
        shape,
        actual.numel(),
        mismatched=int(over.sum()),
        max_abs=float(max_abs),
        max_abs_index=_unravel(int(flat_abs), shape),
        max_rel=float(max_rel),
        max_rel_index=_unravel(int(flat_rel), shape),
        allowed=float(allowed_at),
        ratio=float(ratios.max()),
        reference_error=reference_error,
    )


def _table(rows: Sequence[TensorComparison], title: str) -> list[str]:
    if not rows:
        return []
    width = max(len("tensor"), *(len(r.name) for r in rows))
    lines = [
        title,
        f"  {'tensor':<{width}}  {'shape':<14}  {'mismatched':>13}  {'max |diff|':>10}  "
        f"{'allowed':>9}  {'ratio':>9}",
    ]
    for r in rows:
        shape = "x".join(map(str, r.shape)) or "scalar"
        ratio = "-" if r.problem else f"{r.ratio:.3g}"
        lines.append(
            f"  {r.name:<{width}}  {shape:<14}  {f'{r.mismatched}/{r.numel}':>13}  "
            f"{r.max_abs:>10.3g}  {r.allowed:>9.3g}  {ratio:>9}"
        )
    return lines


def _severity(r: TensorComparison) -> tuple[bool, float]:
    return (r.problem is None, -r.ratio)


@dataclass(frozen=True)
class StepComparison:
    """The outcome of a check: every tensor compared, and the context to explain it.

    Attributes:
        check: what was checked, as a sentence.
        scenario: the batch split (chunk sizes, devices, output device).
        tolerance: the rule used, in words.
        tensors: tensors that must match, in model order.
        contrasts: tensors shown for contrast, expected to differ (e.g. the average of
            replica gradients next to their sum).
        divergence: modules that legitimately make the parallel step differ.
        notes: further facts worth printing with the verdict.
    """

    check: str
    scenario: str
    tolerance: str
    tensors: tuple[TensorComparison, ...]
    contrasts: tuple[TensorComparison, ...] = ()
    divergence: tuple[DivergenceSource, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    failures: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.failures and all(t.ok for t in self.tensors)

    @property
    def worst_ratio(self) -> float:
        return max((t.ratio for t in self.tensors if t.problem is None), default=0.0)

    def message(self) -> str:
        bad = [t for t in self.tensors if not t.ok]
        head = f"{self.check}: "
        if bad:
            head += f"{len(bad)} of {len(self.tensors)} compared tensors do not match."
        else:
            head += "failed."
        lines = [head, ""]
        for failure in self.failures:
            lines += [failure, ""]
        if bad:
            lines += [min(bad, key=_severity).details(), ""]
        lines.append(f"Scenario: {self.scenario}.")
        lines.append(f"Tolerance: {self.tolerance}.")
        lines.extend(self.notes)
        lines.append("")
        lines += _table(sorted(self.tensors, key=_severity), "Every compared tensor, worst first:")
        if self.contrasts:
            lines += _table(list(self.contrasts), "Shown for contrast (expected to differ):")
        if self.divergence and bad:
            lines += ["", "Likely cause, a module whose train-mode result depends on the batch split or on random draws:"]
            lines += [f"  - {d.describe()}" for d in self.divergence]
        return "\n".join(lines).rstrip()

    def __str__(self) -> str:
        if self.ok:
            return (
                f"{self.check}: passed ({len(self.tensors)} tensors, worst at "
                f"{self.worst_ratio:.2g} of the allowed difference). Scenario: {self.scenario}."
            )
        return self.message()


def uniform_scale(
    actual: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None]
) -> float | None:
    """The factor ``c`` when every actual gradient is ``c`` times the expected one (c != 1).

    A uniform factor is the signature of a reduction bug: ``1/k`` for averaged replica
    gradients, ``k`` or ``1/k`` for a world-size mix-up. Returns None when the gradients
    are not a clean multiple, or are equal.
    """
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
    if residual > 1e-4 or abs(c - 1.0) < 1e-3:
        return None
    return c


def explain_scale(c: float, replicas: int) -> str:
    """A sentence on a uniform gradient factor, naming the likely reduction bug."""
    text = f"Every parallel gradient is {c:.6g} times the single-device gradient"
    if replicas > 1 and abs(c * replicas - 1.0) < 1e-3:
        return text + (
            f" (1/{replicas}, one over the number of replicas used): the replica gradients "
            "were averaged. torch sums them: with a mean loss over the gathered batch, each "
            "replica already contributes (1/B) times the sum over its own rows."
        )
    if replicas > 1 and abs(c - replicas) < 1e-3 * replicas:
        return text + f" ({replicas}, the number of replicas): the loss or gradients were summed over replicas twice."
    return text + "."


Msg = str | Callable[[str], str] | None


def render(message: str, msg: Msg) -> str:
    """Applies a caller's ``msg`` the way torch.testing.assert_close does."""
    if msg is None:
        return message
    if callable(msg):
        return msg(message)
    return msg
