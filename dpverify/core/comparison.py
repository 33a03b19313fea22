"""Comparison of a parallel step with the single-device step, and the tolerance it uses.

The default tolerance is anchored in float64: docs/tolerance.md explains it and ``Tolerance``
states its rule. Every quantity scales with the gradients, so the check means the same at
gradient scales from 1e-8 to 1e8, where a fixed ``atol`` either hides bugs or fails correct
code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from dpverify.core.divergence import DivergenceSource, divergence_sources
from dpverify.core.errors import InvalidArgument, NonFiniteReference
from dpverify.core.numerics import dense, max_abs, scale_factor, ulp_distances
from dpverify.core.text import shape_text

__all__ = [
    "NOT_KEPT",
    "PER_ELEMENT",
    "Derived",
    "ReplayMatch",
    "StepComparison",
    "TensorComparison",
    "TensorId",
    "Terms",
    "Tolerance",
    "compare_tensors",
    "explain_scale",
    "float32_hint",
    "render",
    "require_finite",
    "step_comparison",
    "steps_with_second_look",
    "uniform_scale",
    "worst_first",
]


@dataclass(frozen=True)
class Terms:
    """The magnitude of the terms a value was computed from: the scale of its rounding.

    Rounding error follows the size of what was added up, not the size of the result: a
    gradient summed from replica contributions that cancel, or a loss made of tiny residuals
    of large outputs, carries rounding of the size of its terms. ``largest`` bounds the
    terms of the largest entry (``sum over replicas of max |g_r|`` for a gradient);
    ``norm`` is the same over the whole tensor in the 2-norm (``sum over replicas of
    ||g_r||``), for the tensor-level test.
    """

    largest: float = 0.0
    norm: float = 0.0


@dataclass(frozen=True)
class Tolerance:
    """How close a parallel result must be.

    With ``rtol`` and ``atol`` (both or neither, as ``torch.testing.assert_close``), the
    parallel result is compared elementwise with the single-device result, with
    ``torch.isclose`` semantics: ``|actual - expected| <= atol + rtol * |expected|``, and
    NaN or inf never close to a finite value.

    Without them the float64-anchored rule applies, in two tests that must both pass. ``e``
    is the single-device step's distance from the float64 step, ``u`` the working dtype's
    unit roundoff and ``S`` the tensor's scale: its largest float64 entry, or the terms it
    was summed from if larger (``Terms``).

    - **elementwise**: ``max |parallel - float64| <= max(f(n) * e, factor * floor(n) * u * S)``;
    - **tensor-level**: ``||parallel - float64|| <= max(f(n) * ||e||, norm_factor *
      norm_floor(n) * u * ||S||)`` (2-norms; skipped for a single element, where it is the
      elementwise test). Rounding is incoherent and averages out over a tensor while a
      systematic error (a whole tensor 1e-5 off) adds up, so this test catches errors far
      below the elementwise one's floor.

    The floors shrink with the number of elements ``n``: ``floor(n) = max(2, floor_ulps /
    n**(1/4))`` and ``norm_floor(n) = max(1/2, norm_floor_ulps / sqrt(n))``. They guard
    against a single-device step that is exact by luck, which is likely for one element and
    vanishingly unlikely for thousands. For the same reason the factor on ``e`` is
    ``f(n) = factor * max(1, sqrt(16 / n))``: the rounding of two runs of a handful of
    elements can differ by a large ratio by chance, that of many elements cannot.
    16-bit dtypes (float16, bfloat16) use ``low_precision_floor_ulps`` for both floors,
    whatever ``n``; and no allowance is below ``subnormal_floor`` units of the dtype's
    smallest subnormal (float16 gradients of 1e-7 are spaced 6e-8 apart).
    """

    rtol: float | None = None
    atol: float | None = None
    factor: float = 8.0
    floor_ulps: float = 16.0
    norm_factor: float = 8.0
    norm_floor_ulps: float = 8.0
    low_precision_floor_ulps: float = 4.0
    subnormal_floor: float = 4.0

    def __post_init__(self) -> None:
        if (self.rtol is None) != (self.atol is None):
            missing = "atol" if self.atol is None else "rtol"
            raise InvalidArgument(
                f"rtol={self.rtol!r}, atol={self.atol!r}: pass both or neither "
                f"(add {missing}=...), or neither to use the float64-anchored tolerance"
            )
        for item in fields(self):
            name, value = item.name, getattr(self, item.name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0
            ):
                raise InvalidArgument(f"{name}={value!r} must be a finite number >= 0")

    @property
    def explicit(self) -> bool:
        return self.rtol is not None

    def floors(self, dtype: torch.dtype, numel: int = 1) -> tuple[float, float]:
        """(elementwise, tensor-level) floors for ``numel`` elements, in units of
        ``dtype``'s roundoff."""
        if dtype in _LOW_PRECISION:
            return self.low_precision_floor_ulps, self.low_precision_floor_ulps
        n = max(numel, 1)
        return (
            min(self.floor_ulps, max(2.0, self.floor_ulps / n**0.25)),
            min(self.norm_floor_ulps, max(0.5, self.norm_floor_ulps / n**0.5)),
        )

    def reference_factor(self, numel: int, conditioning: float = 0.0) -> float:
        """The factor on the single-device step's own error, for ``numel`` elements whose
        single-device error is ``conditioning`` units of roundoff of their scale.

        Rounding errors of an ill-conditioned computation (a saturated softmax, a long
        recurrence) are heavy-tailed: two runs that differ only in summation order can be
        far apart by chance. Beyond 64 units the factor grows by half for every decade.
        """
        factor = self.factor * max(1.0, math.sqrt(16.0 / max(numel, 1)))
        if conditioning > 64.0:
            factor *= 1.0 + 0.5 * math.log10(conditioning / 64.0)
        return factor

    def describe(self, working_dtype: torch.dtype) -> str:
        if self.rtol == 0 and self.atol == 0:
            return "none: every element must be equal to the single-device one (rtol=0, atol=0)"
        if self.explicit:
            return (
                f"torch.isclose: |parallel - single-device| <= atol + rtol * |single-device| "
                f"with rtol={self.rtol:.1e}, atol={self.atol:.1e}"
            )
        name = str(working_dtype).removeprefix("torch.")
        if working_dtype in _LOW_PRECISION:
            floors = f"{self.factor * self.low_precision_floor_ulps:g} units of {name} roundoff"
        else:
            low, high = self.factor * 2, self.factor * self.floor_ulps
            floors = f"{low:g} to {high:g} units of {name} roundoff (fewer for larger tensors)"
        return (
            f"per tensor, the distance from the float64 step may be {self.factor:g}x the "
            f"single-device {name} step's ({self.reference_factor(1):g}x for one element), or "
            f"{floors} of the tensor's scale (its largest entry, or the terms summed into it), "
            "in its largest element and, likewise, in its norm"
        )


_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TensorId:
    """Which tensor a comparison is of, as fields that code reads (never parses back).

    ``kind`` is what the tensor is ("grad", "output", "loss", "buffer", ...), ``name`` the
    parameter's or buffer's name (quoted in messages) or an output's path (``output``,
    ``output['logits']``, shown as it is), ``rank`` the rank or replica that
    produced it (None for the whole step), ``variant`` which run of the step ("plain
    ddp_step", "step 2", "microbatch 0") and ``detail`` what follows the name in a
    message (an output's rows "[0:3]", "after its step"). ``str()`` is the text messages
    and tables show, e.g. ``rank 1 plain ddp_step grad 'fc.weight'``.
    """

    kind: str
    name: str = ""
    rank: int | None = None
    variant: str = ""
    detail: str = ""

    def __str__(self) -> str:
        if self.kind == "output":  # an output is named by its path: output['logits'][0:3]
            glued = self.detail.startswith("[")
            core, detail = self.name + (self.detail if glued else ""), "" if glued else self.detail
        else:
            core, detail = f"{self.kind} {self.name!r}" if self.name else self.kind, self.detail
        parts = [f"rank {self.rank}" if self.rank is not None else "", self.variant, core, detail]
        return " ".join(part for part in parts if part)


@dataclass(frozen=True)
class ReplayMatch:
    """Why a tensor that failed the tolerance passes: the parallel step's tensor is
    bit-identical to a replay of DataParallel's algorithm on one device (the same chunks,
    a replica per chunk, gradients summed in replica order), and the chunking is neutral in
    exact arithmetic (the replay moves with the precision, as rounding does:
    ``dpverify.checks.replay``).

    Attributes:
        shift: the greatest absolute difference between the replay and the single-device
            step on this tensor, in the working dtype: what chunking itself moves it by.
        failed_ratio: the ``TensorComparison.ratio`` it failed the tolerance by.
    """

    shift: float
    failed_ratio: float

    def describe(self, name: str) -> str:
        return (
            f"{name}: bit-identical to a replay of DataParallel's algorithm; chunking moves this tensor by "
            f"{self.shift:.3g} from the full batch (the tolerance alone would fail it, at {self.failed_ratio:.3g} "
            "times the allowed difference)."
        )


#: The fields of a finite failing tensor's comparison under the anchored rule that are
#: computed when first read (``_ElementStatistics``): what its failure report alone shows.
PER_ELEMENT = ("mismatched", "max_abs_index", "max_rel", "max_rel_index")


@dataclass(frozen=True)
class TensorComparison:
    """The comparison of one tensor (an output, the loss, or a parameter's gradient).

    ``ratio`` is the greatest ``|difference| / allowed`` over the elements (or of the
    tensor-level test, whichever is larger): below 1 passes, and it says how close to the
    limit a passing tensor came. The indices and the relative difference are computed for
    failing tensors only (they stay ``()`` and 0.0 otherwise): a passing check reads each
    tensor a few times, never element by element in Python.

    ``norm_gap``/``norm_allowed`` are the tensor-level test's numbers (0 with explicit
    tolerances).

    Of a finite tensor failing the anchored rule, the fields only its failure report shows
    (``PER_ELEMENT``: the count of mismatched elements, the indices, the relative
    difference) are computed when first read, each the value it would have been; until
    then the comparison holds the tensor and its reference. ``ok``, ``ratio``, ``max_abs``
    and ``allowed`` are computed at once. ``nonfinite`` counts NaN and inf entries of the parallel result where the
    single-device result is finite. ``noise`` is True when the tensor is below the working
    dtype's resolution (zero in exact arithmetic up to rounding): it was checked only for
    the size of its values.
    """

    id: TensorId
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
    norm_gap: float = 0.0
    norm_allowed: float = 0.0
    nonfinite: int = 0
    noise: bool = False
    #: the reference's largest |entry| (measured for failing tensors; 0 otherwise)
    size: float = 0.0
    #: neither step has a gradient here (None in both, or None in one and all zeros in the
    #: other, as DataParallel's reduce-add gives a parameter no replica used): nothing to
    #: compare, and no error to show
    absent: bool = False
    #: without tolerance (rtol = atol = 0), a failing tensor's greatest finite difference
    #: in units in the last place of the single-device element (``ulp_distances``), and
    #: where (None otherwise)
    max_ulps: float | None = None
    max_ulps_index: tuple[int, ...] = ()
    #: set where the tensor failed the tolerance but is bit-identical to a replay of
    #: DataParallel's algorithm whose chunking is neutral (compared then with the replay
    #: as a further rounding sample, so it passes): what the replay showed
    replay: ReplayMatch | None = None

    @property
    def name(self) -> str:
        """The text messages and tables show for this tensor."""
        return str(self.id)

    @property
    def ok(self) -> bool:
        pending = self.__dict__.get("_statistics")
        over = pending.over if pending is not None else self.mismatched > 0
        return self.problem is None and not over and self.norm_gap <= self.norm_allowed

    if not TYPE_CHECKING:  # to mypy the fields are plain attributes, as they read

        def __getattr__(self, name: str) -> object:
            # Called only for an attribute the instance lacks: a per-element statistic of
            # a failing tensor not read yet (``_ElementStatistics``), computed now, once.
            pending = self.__dict__.get("_statistics")
            if pending is None or name not in PER_ELEMENT:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            for key, value in pending.figures().items():
                object.__setattr__(self, key, value)
            object.__delattr__(self, "_statistics")
            return self.__dict__[name]

    def _values(self) -> tuple[object, ...]:
        # every field, per-element statistics computed, ``NOT_KEPT`` for those a summary dropped
        return tuple(getattr(self, item.name, NOT_KEPT) for item in fields(self))

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, TensorComparison)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        pairs = (f"{item.name}={value!r}" for item, value in zip(fields(self), self._values(), strict=True))
        return f"{type(self).__name__}({', '.join(pairs)})"

    def __getstate__(self) -> dict[str, object]:
        """Every field, per-element statistics computed (a pickled comparison holds no tensors)."""
        state = {item.name: value for item, value in zip(fields(self), self._values(), strict=True) if value is not NOT_KEPT}
        if isinstance(self.__dict__.get("_statistics"), _NotKept):
            state["_statistics"] = self.__dict__["_statistics"]
        return state

    def summary(self) -> TensorComparison:
        """This comparison as a summary: its per-element statistics (``PER_ELEMENT``) where
        they are still to be computed are dropped with the tensors they need (reading one
        raises ``AttributeError``); what the verdict reads stays. ``dpverify check`` keeps
        the rows of a check it explains so: it reports their verdict only, and a row still
        to be computed holds a gradient and its reference."""
        pending = self.__dict__.get("_statistics")
        if not isinstance(pending, _ElementStatistics) or pending.computed:  # nothing held
            return self
        summary = self.renamed(self.id)
        object.__setattr__(summary, "_statistics", _NotKept(pending.over))
        return summary

    def renamed(self, id: TensorId) -> TensorComparison:
        """The same comparison of another tensor id (the gradient check's row of a
        gradient, reused by the replica-sum check), its per-element statistics still to be
        computed where they were (``dataclasses.replace`` would compute them)."""
        copy = object.__new__(TensorComparison)
        copy.__dict__.update(self.__dict__)
        object.__setattr__(copy, "id", id)
        return copy

    def details(self) -> str:
        """The assert_close-style paragraph for this tensor."""
        if self.problem is not None:
            return f"{self.name}: {self.problem}"
        lines = [
            f"{self.name}: tensors are not close!" if not self.ok else f"{self.name}: close.",
            f"Mismatched elements: {self.mismatched} / {self.numel} "
            f"({100.0 * self.mismatched / max(self.numel, 1):.1f}%)",
        ]
        if self.nonfinite:
            lines.append(
                f"Non-finite values: {self.nonfinite} NaN or inf entries in the parallel step "
                "where the single-device step is finite"
            )
        lines += [
            f"Greatest absolute difference: {self.max_abs:.3g} at index {self.max_abs_index} "
            f"(up to {self.allowed:.3g} allowed)",
            f"Greatest relative difference: {self.max_rel:.3g} at index {self.max_rel_index}",
        ]
        if self.max_ulps is not None:
            differ = "differs" if self.mismatched == 1 else "differ"
            lines.append(
                f"Bit for bit: {self.mismatched} of the {self.numel} elements {differ}; the greatest differs by "
                f"{_ulps_text(self.max_ulps)} at index {self.max_ulps_index} (units in the last place of the "
                "single-device value)"
            )
        if self.norm_allowed and self.norm_gap > self.norm_allowed:
            lines.append(
                f"Norm of the difference: {self.norm_gap:.3g} (up to {self.norm_allowed:.3g} "
                "allowed): a systematic error spread over the tensor, beyond what rounding "
                "gives"
            )
        if self.reference_error is not None:
            lines.append(
                f"The single-device step is {self.reference_error:.3g} from float64 on this tensor."
            )
        return "\n".join(lines)


# Their defaults stay in ``__init__``; as class attributes they would hide a statistic still
# to be computed from ``TensorComparison.__getattr__``.
for _name in PER_ELEMENT:
    delattr(TensorComparison, _name)


def _missing(name: TensorId, actual: torch.Tensor | None, expected: torch.Tensor | None) -> TensorComparison | None:
    """Handles None gradients: equal when both are None, or when the other is all zeros
    (DataParallel's reduce-add materialises zeros for parameters a replica did not use)."""
    if actual is not None and expected is not None:
        return None
    present = actual if actual is not None else expected
    if present is None or not bool(present.any()):
        shape = tuple(present.shape) if present is not None else ()
        return TensorComparison(name, shape, present.numel() if present is not None else 0, absent=True)
    where = "parallel" if actual is None else "single-device"
    other = "single-device" if actual is None else "parallel"
    return TensorComparison(
        name,
        tuple(present.shape),
        present.numel(),
        mismatched=present.numel(),
        problem=f"is None in the {where} step but has nonzero values in the {other} step",
    )


def require_finite(name: TensorId, tensor: torch.Tensor | None, step: str) -> None:
    """Raises ``NonFiniteReference`` when a reference result holds NaN or inf.

    A reference that is not finite cannot anchor a comparison: every parallel value would
    be judged against NaN. The message names the tensor, the step and how many entries.
    """
    if tensor is None or not tensor.is_floating_point():
        return
    values = dense(tensor)
    if values.numel() == 0 or math.isfinite(max_abs(values)):  # one pass, no allocation
        return
    nan = int(values.isnan().sum())
    inf = int(values.isinf().sum())
    raise NonFiniteReference(
        f"{name} is not finite in the {step} step ({nan} NaN, {inf} inf of {values.numel()} "
        f"entries), so there is nothing to compare the parallel step with. Check the inputs "
        f"and target for NaN/inf, the loss for log(0) or division by zero, and the dtype "
        f"for overflow ({str(tensor.dtype).removeprefix('torch.')} reaches "
        f"{torch.finfo(tensor.dtype).max:.3g})."
    )


@dataclass(frozen=True)
class _Anchored:
    """What the anchored rule derives from the references alone, whatever the parallel
    result: ``rounded``, the float64 answer in the working ``dtype`` (on the single-device
    result's device); ``wide``, the dtype differences are taken in; the single-device
    step's greatest distance from the answer (with the further rounding samples) and its
    2-norm; and the answer's largest entry and 2-norm.
    """

    rounded: torch.Tensor
    dtype: torch.dtype
    wide: torch.dtype
    reference_error: float
    reference_norm: float
    size: float
    size_norm: float


#: What ``compare_tensors`` derived from sets of reference tensors, by their ids (the
#: tensors are held with it, so that their ids stay theirs): see ``compare_tensors``'s
#: ``derived``.
Derived = dict[tuple[int, ...], tuple[object, ...]]


def _prepared(
    name: TensorId, expected: torch.Tensor, anchor: torch.Tensor, probe: torch.Tensor | None, jitter: torch.Tensor | None,
    memo: Derived | None,
) -> _Anchored:
    tensors = (expected, anchor, probe, jitter)
    slot = tuple(id(t) for t in tensors)
    hit = memo.get(slot) if memo is not None else None
    if hit is not None and all(a is b for a, b in zip(hit[:4], tensors, strict=True)):
        assert isinstance(hit[4], _Anchored)
        return hit[4]
    prepared = _anchored_reference(name, expected, anchor, probe, jitter)
    if memo is not None:
        memo[slot] = (*tensors, prepared)
    return prepared


def _anchored_reference(
    name: TensorId,
    expected: torch.Tensor,
    anchor: torch.Tensor,
    probe: torch.Tensor | None = None,
    jitter: torch.Tensor | None = None,
) -> _Anchored:
    """The anchored rule's view of the references of one tensor (see ``compare_tensors``
    for ``probe`` and ``jitter``); ``name`` names the tensor if a reference is not finite.

    Raises:
        NonFiniteReference: ``expected`` or ``anchor`` holds NaN or inf.
    """
    expected = dense(expected)
    device = expected.device
    reference = dense(anchor).detach().to(device=device, dtype=torch.float64)
    dtype = expected.dtype if expected.is_floating_point() else torch.float64
    # Distances are taken from the float64 answer rounded to the working dtype: the best a
    # working-precision step can do. Rounding moves it by half a unit of roundoff, far
    # below the floors, and halves the memory traffic of the check.
    rounded = reference.to(dtype)
    # 16-bit differences are taken in float64: a float16 subtraction would round them.
    wide = torch.float64 if dtype in _LOW_PRECISION else dtype
    error = expected.detach().to(wide) - rounded.to(wide)
    reference_error, reference_norm = max_abs(error), _norm(error)
    del error
    if not math.isfinite(reference_error):
        # NaN or inf in a reference shows here first; name which one before comparing.
        require_finite(name, expected, "single-device")
        require_finite(name, anchor, "float64 single-device")
    if dtype == torch.float64 and probe is not None:
        # float64's own anchor cannot show its rounding; float32's, scaled by the ratio of
        # the unit roundoffs, does, unless float32 saturates (see compare_tensors)
        probe_error = dense(probe).detach().to(device=device, dtype=torch.float64) - reference
        largest = max_abs(probe_error)
        if largest <= _SATURATED * max_abs(reference):
            reference_error = max(reference_error, largest * _ROUNDOFF_RATIO)
            reference_norm = max(reference_norm, _norm(probe_error) * _ROUNDOFF_RATIO)
    if jitter is not None:  # a further sample of the working dtype's rounding
        jittered = dense(jitter).detach().to(device=device, dtype=wide) - rounded.to(wide)
        reference_error = max(reference_error, max_abs(jittered))
        reference_norm = max(reference_norm, _norm(jittered))
    return _Anchored(rounded, dtype, wide, reference_error, reference_norm, max_abs(rounded), _norm(rounded))


def compare_tensors(
    name: TensorId,
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    anchor: torch.Tensor | None,
    tolerance: Tolerance,
    probe: torch.Tensor | None = None,
    terms: float | Terms | None = None,
    jitter: torch.Tensor | None = None,
    *,
    derived: Derived | None = None,
) -> TensorComparison:
    """Compares ``actual`` (parallel) with ``expected`` (single device) under ``tolerance``.

    ``anchor`` is the float64 single-device result; it is required by the anchored rule
    and ignored by the explicit one. ``probe`` (the float32 single-device result: its
    error, scaled by ``u(float64) / u(float32)``, estimates a float64 step's rounding unless
    float32 saturates) and ``jitter`` (the step rerun from parameters perturbed by a few
    units of roundoff) are further samples of the rounding (docs/tolerance.md).

    ``terms`` is the magnitude of what the parallel step summed into the value (a
    ``Terms``, or a float: its ``largest``); the floors scale with it where it exceeds the
    value.

    ``derived``: a memo the caller keeps across comparisons with the same reference tensors
    (the same objects, unchanged meanwhile), so that what the anchored rule needs from them
    is derived once; every figure is the same as without it.

    Raises:
        NonFiniteReference: ``expected`` or ``anchor`` holds NaN or inf.
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
    given = expected  # the object ``derived`` knows (a sparse one is densified anew)
    actual, expected = dense(actual), dense(expected)
    device = expected.device
    actual = actual.detach().to(device)
    if tolerance.explicit:
        require_finite(name, expected, "single-device")
        return _explicit(name, actual, expected.detach(), tolerance)
    if anchor is None:
        raise ValueError("the anchored tolerance needs the float64 result")
    return _anchored(name, actual, _prepared(name, given, anchor, probe, jitter, derived), tolerance, terms)


def _anchored(
    name: TensorId, actual: torch.Tensor, prepared: _Anchored, tolerance: Tolerance, terms: float | Terms | None,
) -> TensorComparison:
    """The anchored rule (``Tolerance``) on one tensor, ``actual`` dense and on the
    reference's device."""
    rounded, dtype, wide = prepared.rounded, prepared.dtype, prepared.wide
    reference_error, reference_norm = prepared.reference_error, prepared.reference_norm
    roundoff = torch.finfo(dtype).eps / 2
    if not isinstance(terms, Terms):
        terms = Terms(terms or 0.0, 0.0)
    numel = actual.numel()
    scale = max(prepared.size, terms.largest)
    scale_norm = max(prepared.size_norm, terms.norm)
    floor, norm_floor = tolerance.floors(dtype, numel)
    # A tensor whose single-device rounding is a sizeable part of its own size is zero in
    # exact arithmetic up to rounding (a LayerNorm over two features, an attention key
    # bias): its values are noise in every step, and only their size can be checked.
    noise = reference_error >= 0.25 * prepared.size
    if noise:
        scale = max(scale, reference_error)
        scale_norm = max(scale_norm, reference_norm)
        floor = norm_floor = 1.0 / roundoff
    spacing = tolerance.subnormal_floor * torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    def conditioning(error: float, size: float) -> float:
        # divided in two steps: roundoff * size underflows to 0 for subnormal gradients
        return error / size / roundoff if size > 0 else 0.0

    allowed = max(
        tolerance.reference_factor(numel, conditioning(reference_error, scale)) * reference_error,
        tolerance.factor * floor * roundoff * scale,
        tolerance.factor * spacing,
    )
    norm_allowed = max(
        tolerance.reference_factor(numel, conditioning(reference_norm, scale_norm)) * reference_norm,
        tolerance.norm_factor * norm_floor * roundoff * scale_norm,
        tolerance.norm_factor * spacing * math.sqrt(numel),
    )
    difference = actual.to(wide) - rounded.to(wide)
    gap, norm_gap = max_abs(difference), _norm(difference)
    if numel == 1:  # one element: the norm is the elementwise test
        norm_allowed = max(norm_allowed, allowed)
    if gap <= allowed and norm_gap <= norm_allowed:  # False for NaN: those take the detailed path
        ratio = max(_ratio(gap, allowed), _ratio(norm_gap, norm_allowed))
        return TensorComparison(
            name, tuple(actual.shape), actual.numel(), max_abs=gap, allowed=allowed, ratio=ratio,
            reference_error=reference_error, norm_gap=norm_gap, norm_allowed=norm_allowed, noise=noise,
        )
    if math.isfinite(gap):  # the reference is finite, so NaN/inf can only be the parallel step's
        largest = _largest_difference(difference, gap, actual, rounded)
        del difference
        return _failing(
            TensorComparison(
                name, tuple(actual.shape), numel, max_abs=largest, allowed=allowed,
                ratio=max(_ratio(largest, allowed), _ratio(norm_gap, norm_allowed)), reference_error=reference_error,
                norm_gap=norm_gap, norm_allowed=norm_allowed, noise=noise, size=prepared.size,
            ),
            _ElementStatistics(actual, rounded, allowed, largest > allowed),
        )
    del difference
    # The isclose rule of the explicit path with the anchored allowance as atol.
    allowed_each = torch.full((), allowed, dtype=torch.float64, device=actual.device)
    target = rounded.to(torch.float64)
    outside = ~torch.isclose(actual.to(torch.float64), target, rtol=0.0, atol=allowed)
    detailed = _detailed(name, actual, target, allowed_each, reference_error, mismatched=outside)
    norm_gap = math.inf if math.isnan(norm_gap) else norm_gap
    return replace(
        detailed,
        norm_gap=norm_gap,
        norm_allowed=norm_allowed,
        ratio=max(detailed.ratio, _ratio(norm_gap, norm_allowed)),
        noise=noise,
    )


def _norm(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor)) if tensor.numel() else 0.0


def _ratio(gap: float, allowed: float) -> float:
    if gap == 0.0:
        return 0.0
    return gap / allowed if allowed > 0 else math.inf


_ROUNDOFF_RATIO = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
# float32 relative error beyond which the probe is saturated: it has lost so many of its
# 24 bits that its error no longer scales with the unit roundoff.
_SATURATED = 2.0**-10


def _explicit(name: TensorId, actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance) -> TensorComparison:
    """The explicit rule, with torch.isclose's semantics (NaN and inf included)."""
    assert tolerance.rtol is not None
    assert tolerance.atol is not None
    if actual.dtype != expected.dtype:
        actual = actual.to(expected.dtype)
    close = torch.isclose(actual, expected, rtol=tolerance.rtol, atol=tolerance.atol)
    reference = expected.to(torch.float64)
    allowed_each = tolerance.atol + tolerance.rtol * reference.abs()
    if bool(close.all()):
        distance = (actual.to(torch.float64) - reference).abs()
        ratio = float(torch.where(distance == 0, 0.0, distance / allowed_each).max())
        return TensorComparison(
            name, tuple(actual.shape), actual.numel(), max_abs=float(distance.max()), ratio=ratio,
            allowed=float(allowed_each.max()),
        )
    detailed = _detailed(name, actual, reference, allowed_each, None, mismatched=~close)
    if tolerance.rtol == 0 and tolerance.atol == 0 and expected.is_floating_point():
        # without tolerance the absolute difference says little: one unit in the last place says it all
        distances = ulp_distances(actual, expected)
        distances = torch.where(torch.isfinite(distances), distances, 0.0).reshape(-1)
        largest, flat = distances.max(0)
        if float(largest) > 0:
            return replace(detailed, max_ulps=float(largest), max_ulps_index=_unravel(int(flat), tuple(actual.shape)))
    return detailed


def _ulps_text(count: float) -> str:
    """``1 ulp``, ``3 ulps``, ``2.5 ulps``, ``1.2e+300 ulps``."""
    if count.is_integer() and count < 1e15:
        return f"{int(count)} ulp{'s' if count != 1 else ''}"
    return f"{count:.3g} ulps"


def _detailed(
    name: TensorId,
    actual: torch.Tensor,
    reference: torch.Tensor,
    allowed_each: torch.Tensor,
    reference_error: float | None,
    mismatched: torch.Tensor | None = None,
) -> TensorComparison:
    """Every statistic of a failing tensor: count, greatest differences and their indices.

    ``mismatched`` marks the failing elements when the caller decided them (torch.isclose);
    otherwise an element fails when it is farther than allowed, or non-finite where the
    reference is finite. A finite tensor of the anchored rule takes ``_detailed_finite``,
    which skips the passes that look for NaN and inf.
    """
    actual64 = actual.to(torch.float64)
    diff = (actual64 - reference).abs()
    nonfinite = ~torch.isfinite(actual64) & torch.isfinite(reference)
    diff = torch.where(nonfinite, math.inf, diff.nan_to_num(nan=0.0))
    over = (diff > allowed_each) | nonfinite if mismatched is None else mismatched
    nonfinite_count = int(nonfinite.sum())
    shape = tuple(actual.shape)
    max_abs, flat_abs = diff.reshape(-1).max(0)
    rel = torch.where(diff == 0, 0.0, diff / reference.abs())
    max_rel, flat_rel = rel.reshape(-1).max(0)
    ratios = torch.where(diff == 0, 0.0, diff / allowed_each)
    allowed_at = allowed_each if allowed_each.dim() == 0 else allowed_each.reshape(-1)[flat_abs]
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
        nonfinite=nonfinite_count,
        size=float(reference.abs().amax()),
    )


def _detailed_finite(
    name: TensorId, actual: torch.Tensor, rounded: torch.Tensor, allowed: float, reference_error: float,
) -> TensorComparison:
    """``_detailed`` of a finite failing tensor against ``rounded`` (the float64 answer in
    the working dtype) with one allowance: the same float64 figures, a chunk of elements
    at a time, so that the float64 temporaries stay small (a whole large model fails in
    train mode with BatchNorm, every tensor of it tens of megabytes).

    Each figure equals ``_detailed``'s: the in-place subtraction promotes ``rounded``
    exactly; the greatest values keep the first index among equals, as ``max`` does; and
    the greatest ``difference / allowed`` is the greatest difference over ``allowed``.
    """
    flat_actual, flat_rounded = actual.reshape(-1), rounded.reshape(-1)
    mismatched, largest, at_largest, max_rel, at_rel, size = 0, -1.0, 0, -1.0, 0, 0.0
    for start in range(0, flat_actual.numel(), _DETAIL_CHUNK):
        part = flat_rounded[start : start + _DETAIL_CHUNK]
        size = max(size, float(part.abs().amax()))
        diff = flat_actual[start : start + _DETAIL_CHUNK].to(torch.float64, copy=True)
        diff.sub_(part)
        diff.abs_()
        mismatched += int(torch.count_nonzero(diff > allowed))
        # the greatest value is cheap; its index is looked for only where it is the greatest yet
        value = float(torch.amax(diff))
        if value > largest:
            largest, at_largest = value, start + int(diff.argmax())
        # |diff / part| is diff / |part|; 0 / 0 (an element both steps give as zero) is NaN
        # here and 0 in _detailed, which takes 0 wherever the difference is 0
        rel = diff / part
        rel.abs_()
        rel.nan_to_num_(nan=0.0, posinf=math.inf)
        value = float(torch.amax(rel))
        if value > max_rel:
            max_rel, at_rel = value, start + int(rel.argmax())
    shape = tuple(actual.shape)
    return TensorComparison(
        name,
        shape,
        actual.numel(),
        mismatched=mismatched,
        max_abs=largest,
        max_abs_index=_unravel(at_largest, shape),
        max_rel=max_rel,
        max_rel_index=_unravel(at_rel, shape),
        allowed=allowed,
        ratio=_ratio(largest, allowed),
        reference_error=reference_error,
        size=size,
    )


# Elements per chunk of _detailed_finite: float64 temporaries of half a megabyte.
_DETAIL_CHUNK = 1 << 16

class _ElementStatistics:
    """The per-element statistics (``PER_ELEMENT``) of a finite failing tensor, computed
    by ``_detailed_finite`` when a field of them is first read, then forgotten with the
    tensors it needs.

    They are a tensor's float64 report: several passes over it, and the check whose
    failure a model's train-mode BatchNorm explains fails on every gradient, while
    ``dpverify check`` only summarises an explained check. What the verdict reads (whether
    the tensor passes, its ratio, its greatest difference) is computed at once
    (``_largest_difference``); the comparison holds ``actual`` and ``rounded`` until the
    rest is read or the comparison is dropped.

    Attributes:
        over: some element is farther than ``allowed`` (``mismatched > 0``).
    """

    __slots__ = ("_figures", "actual", "allowed", "over", "rounded")

    def __init__(self, actual: torch.Tensor, rounded: torch.Tensor, allowed: float, over: bool) -> None:
        self.actual: torch.Tensor | None = actual
        self.rounded: torch.Tensor | None = rounded
        self.allowed = allowed
        self.over = over
        self._figures: dict[str, object] | None = None

    @property
    def computed(self) -> bool:
        return self._figures is not None

    def figures(self) -> dict[str, object]:
        """The statistics by field name (computed once: comparisons renamed from one share them)."""
        if self._figures is None:
            assert self.actual is not None
            assert self.rounded is not None
            detailed = _detailed_finite(TensorId(""), self.actual, self.rounded, self.allowed, 0.0)
            self._figures = {name: getattr(detailed, name) for name in PER_ELEMENT}
            self.actual = self.rounded = None
        return self._figures


class _NotKept:
    """What a summary (``TensorComparison.summary``) keeps of statistics not computed:
    whether some element is over the allowance, the verdict's part of them."""

    __slots__ = ("over",)

    def __init__(self, over: bool) -> None:
        self.over = over

    def figures(self) -> dict[str, object]:
        raise AttributeError(
            "the per-element statistics (" + ", ".join(PER_ELEMENT) + ") of this comparison were not kept: "
            "it is a summary (TensorComparison.summary), as dpverify check keeps the rows of a check it "
            "explains; run the check with its assertion helper (assert_dp_grads_match, ...) for its full report"
        )

    def __getstate__(self) -> bool:
        return self.over

    def __setstate__(self, over: bool) -> None:
        self.over = over


class _NotKeptValue:
    """The value ``repr`` and ``==`` see for a statistic a summary did not keep."""

    def __repr__(self) -> str:
        return "<not kept>"

    def __reduce__(self) -> str:
        return "NOT_KEPT"


#: Stands for a per-element statistic a summary did not keep (``TensorComparison.summary``).
NOT_KEPT = _NotKeptValue()


def _failing(row: TensorComparison, statistics: _ElementStatistics) -> TensorComparison:
    """``row`` with its ``PER_ELEMENT`` fields left to ``statistics``."""
    object.__setattr__(row, "_statistics", statistics)
    for name in PER_ELEMENT:
        object.__delattr__(row, name)
    return row


def _largest_difference(difference: torch.Tensor, gap: float, actual: torch.Tensor, rounded: torch.Tensor) -> float:
    """The greatest ``|actual - rounded|`` taken in float64, as ``_detailed_finite`` takes
    it, from ``difference`` (``actual - rounded`` in the dtype differences are taken in;
    consumed) whose greatest ``|entry|`` is ``gap``.

    A float32 difference of float32 tensors is the float64 one rounded to float32, and
    rounding is monotonic: an element with the greatest float64 difference has a float32
    difference within one float32 step of ``gap`` (the step below too: two float64 values
    can round to neighbouring float32 ones). Those few elements are taken again in float64.
    """
    if difference.dtype == torch.float64:
        return gap
    flat = difference.reshape(-1)
    if not actual.dtype == rounded.dtype == difference.dtype:  # rounded before subtracting: no such bound
        return max(
            float((actual.reshape(-1)[start : start + _DETAIL_CHUNK].to(torch.float64) - rounded.reshape(-1)[start : start + _DETAIL_CHUNK]).abs().amax())
            for start in range(0, flat.numel(), _DETAIL_CHUNK)
        )
    below = torch.nextafter(torch.tensor(gap, dtype=flat.dtype), torch.tensor(-math.inf, dtype=flat.dtype))
    near = (flat.abs_() >= below).nonzero().squeeze(1)
    exact = actual.reshape(-1)[near].to(torch.float64) - rounded.reshape(-1)[near].to(torch.float64)
    return float(exact.abs_().amax())


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``torch.unravel_index`` of one flat index, in Python."""
    index = []
    for size in reversed(shape):
        flat, at = divmod(flat, size)
        index.append(at)
    return tuple(reversed(index))


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
        shape = shape_text(r.shape)
        if r.absent:
            lines.append(f"  {r.name:<{width}}  {shape:<14}  {'no gradient in either step':>45}")
            continue
        ratio = "-" if r.problem else f"{r.ratio:.3g}"
        lines.append(
            f"  {r.name:<{width}}  {shape:<14}  {f'{r.mismatched}/{r.numel}':>13}  "
            f"{r.max_abs:>10.3g}  {r.allowed:>9.3g}  {ratio:>9}"
        )
    return lines


_Sample = TypeVar("_Sample")


def steps_with_second_look(
    steps: int, rows_of: Callable[[int, _Sample | None], list[TensorComparison]], second: Callable[[], _Sample] | None,
) -> Iterator[list[TensorComparison]]:
    """The rows of each step of a training check, in order: ``rows_of(index, None)``, and
    for a step whose rows fail, ``rows_of(index, sample)`` instead, compared again with a
    second sample of rounding (``second()``: single-device training from jittered
    parameters, run once, at the first such step; None: no second look, as with explicit
    tolerances). A caller that stops at the first failing step stops the runs too.

    Training needs the second look where one float64 run cannot show the rounding: Adam's
    ``m / (sqrt(v) + eps)`` turns a gradient entry that cancels to rounding noise into an
    update ``lr / eps`` times that noise, and a moment may cancel from terms far larger than
    itself and keep their rounding."""
    sample: _Sample | None = None
    for index in range(steps):
        rows = rows_of(index, None)
        if second is not None and not all(row.ok for row in rows):
            if sample is None:
                sample = second()
            rows = rows_of(index, sample)
        yield rows


def worst_first(r: TensorComparison) -> tuple[bool, float]:
    """The sort key of every "worst first" list (the report's table, its figure): a tensor
    that could not be compared (no ratio) first, then by ratio, largest first."""
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
        failures: findings that fail the check whatever the tensors say.
        scale: the uniform factor between the parallel gradients and the expected ones,
            when one factor explains them all (0.5: halved; ``1 / world_size``: a sum loss
            under DDP); None when none does or the check passed.
        replicas: the replica forwards the parallel step was seen to run (forward hooks on
            the module's copies); None where they are not counted (the DDP and sharded
            checks run one rank per process). Fewer than two ran nothing in parallel, so a
            match says nothing about the parallel code.
        replayed: train-mode Dropout layers whose masks the reference replayed from the
            parallel run (so they are not among ``divergence``).
        exact: compared without tolerance (rtol = atol = 0, as exact mode compares): a
            pass means every element equal to the single-device one.
    """

    check: str
    scenario: str
    tolerance: str
    tensors: tuple[TensorComparison, ...]
    contrasts: tuple[TensorComparison, ...] = ()
    divergence: tuple[DivergenceSource, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    failures: tuple[str, ...] = field(default_factory=tuple)
    scale: float | None = None
    replicas: int | None = None
    replayed: tuple[str, ...] = ()
    exact: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures and all(t.ok for t in self.tensors)

    @property
    def worst_ratio(self) -> float:
        return max((t.ratio for t in self.tensors if t.problem is None), default=0.0)

    def replay_notes(self) -> list[str]:
        """A sentence per tensor that passed by the replay of DataParallel's algorithm."""
        return [t.replay.describe(t.name) for t in self.tensors if t.replay is not None]

    def message(self) -> str:
        bad = [t for t in self.tensors if not t.ok]
        verdict = f"{len(bad)} of {len(self.tensors)} compared tensors do not match." if bad else "failed."
        lines = [f"{self.check}: {verdict}", ""]
        for failure in self.failures:
            lines += [failure, ""]
        if bad:
            lines += [min(bad, key=worst_first).details(), ""]
        lines.append(f"Scenario: {self.scenario}.")
        lines.append(f"Tolerance: {self.tolerance}.")
        lines.extend(self.replay_notes())
        lines.extend(self.notes)
        lines.append("")
        lines += _table(sorted(self.tensors, key=worst_first), "Every compared tensor, worst first:")
        if self.contrasts:
            lines += _table(list(self.contrasts), "Shown for contrast (expected to differ):")
        if self.divergence and bad:
            lines += ["", "Likely cause, a module whose train-mode result depends on the batch split or on random draws:"]
            lines += [f"  - {d.describe()}" for d in self.divergence]
        return "\n".join(lines).rstrip()

    def __str__(self) -> str:
        if self.ok:
            how = (
                "every element equal to the single-device one: no tolerance" if self.exact
                else f"worst at {self.worst_ratio:.2g} of the allowed difference"
            )
            return " ".join([
                f"{self.check}: passed ({len(self.tensors)} tensors, {how}). Scenario: {self.scenario}.",
                *self.replay_notes(),
            ])
        return self.message()


def step_comparison(
    check: str,
    scenario: str,
    tolerance: Tolerance,
    dtype: torch.dtype,
    module: nn.Module,
    rows: Sequence[TensorComparison],
    *,
    contrasts: Sequence[TensorComparison] = (),
    notes: Sequence[str] = (),
    failures: Sequence[str] = (),
    scale: float | None = None,
    divergence: bool = True,
    replicas: int | None = None,
    replayed: Collection[str] = (),
) -> StepComparison:
    """The outcome of a check, built the same way by the DataParallel and the DDP helpers so
    that their messages read alike: the tolerance in words for the working ``dtype``, and
    ``module``'s divergence sources, the likely cause of a mismatch (unless ``divergence``
    is False: a check whose reference already splits the batch as the parallel step does,
    such as DDP's buffer and SyncBatchNorm checks). A float64 step whose every mismatch is
    of float32's rounding in size gets a note that names a float32 intermediate as the
    likely cause (``float32_hint``). ``replayed``: Dropout layers whose masks the reference
    replayed from the parallel run, no longer a source of divergence."""
    hint = float32_hint(rows) if dtype == torch.float64 else None
    return StepComparison(
        check=check,
        scenario=scenario,
        tolerance=tolerance.describe(dtype),
        tensors=tuple(rows),
        contrasts=tuple(contrasts),
        divergence=divergence_sources(module, replayed=replayed) if divergence else (),
        notes=(*notes, *([hint] if hint else [])),
        failures=tuple(failures),
        scale=scale,
        replicas=replicas,
        replayed=tuple(replayed),
        exact=tolerance.rtol == 0 and tolerance.atol == 0,
    )


# The relative error of float64 results that passed through float32 once or a few times:
# from a lucky sixteenth of float32's unit roundoff to 32 units of it.
_FLOAT32_ROUNDOFF = torch.finfo(torch.float32).eps / 2
_FLOAT32_BAND = (_FLOAT32_ROUNDOFF / 16, _FLOAT32_ROUNDOFF * 32)


def float32_hint(rows: Sequence[TensorComparison]) -> str | None:
    """A sentence when the worst mismatched tensor of a float64 step is off by float32's
    rounding relative to its largest entry (within ``_FLOAT32_BAND``: far beyond float64's
    rounding, far below what a wrong reduction or a lost row gives), as a float32
    intermediate in the step makes it; None when a tensor fails otherwise."""
    bad = [row for row in rows if not row.ok]
    if not bad or any(row.problem is not None or row.nonfinite or row.size <= 0 for row in bad):
        return None
    relative = [row.max_abs / row.size for row in bad]
    low, high = _FLOAT32_BAND
    if not low <= max(relative) <= high:
        return None
    return (
        f"This float64 step is off by float32's rounding: the mismatched tensors' greatest differences are "
        f"at most {max(relative):.1e} of their largest entries, where float32 rounds at "
        f"{_FLOAT32_ROUNDOFF:.1e} and float64 at {torch.finfo(torch.float64).eps / 2:.1e}. A float32 "
        "intermediate in the parallel step is the likely cause: a count, a weight or a mask made as float32 "
        "(torch.tensor(n) or .float() where the default dtype is float32), or a float32 buffer; make it with "
        "dtype=the inputs' dtype."
    )


def uniform_scale(
    actual: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None], rounding: float = 1e-4
) -> float | None:
    """The factor ``c`` when every actual gradient is ``c`` times the expected one (c != 1).

    A uniform factor is the signature of a reduction bug: ``1/k`` for averaged replica
    gradients, ``k`` or ``1/k`` for a world-size mix-up. Returns None when the gradients
    are not a clean multiple, or are equal.
    """
    c = scale_factor(actual, expected, rounding)
    return None if c is None or abs(c - 1.0) < 10 * rounding else c


def explain_scale(
    c: float,
    replicas: int,
    rounding: float = 1e-4,
    *,
    averager: str | None = None,
    micro_batches: int = 1,
    shard_size: float | None = None,
    reduction: str | None = None,
    size: str = "world size",
    untracked_all_reduce: bool = False,
) -> str:
    """A sentence on a uniform gradient factor between the parallel step and one device,
    naming every classic mistake that produces that factor (2 can be the world size and the
    rows per rank).

    ``averager`` None is DataParallel, which sums its ``replicas``' gradients. Otherwise
    ``averager`` names what averages the ranks' gradients (``"DDP"``, ``"FSDP2's
    reduce-scatter"``), ``replicas`` is the world size (``size`` names what it counts in the
    text, e.g. the data-parallel groups of tensor parallelism), and ``reduction``
    (``"sum"``, ``"mean"`` or None: how ``loss_fn`` reduces) tells a sum loss from a mean
    one. A factor within ``10 * rounding`` (relative) of a cause's factor (the micro-batch
    count, the world size, the rows per rank ``shard_size`` (on uneven shards their
    average, the batch over the world size), their inverses) names it.
    ``untracked_all_reduce``: the ranks were seen passing a tensor that requires grad to
    ``torch.distributed.all_reduce``; a factor of ``1/world_size`` is then named as that,
    not guessed.
    """

    def near(value: float) -> bool:
        return abs(c - value) < 10 * rounding * value

    if averager is None:  # DataParallel sums its replicas' gradients
        head = f"Every parallel gradient is {c:.6g} times the single-device gradient"
        causes = []
        if replicas > 1 and near(1.0 / replicas):
            causes.append(
                f"(1/{replicas}, one over the number of replicas used): the replica gradients "
                "were averaged. torch sums them: with a mean loss over the gathered batch, each "
                "replica already contributes (1/B) times the sum over its own rows"
            )
        elif replicas > 1 and near(replicas):
            causes.append(f"({replicas}, the number of replicas): the loss or gradients were summed over replicas twice")
    else:
        head = f"Every rank's gradient is {c:.6g} times the single-device full-batch gradient"
        causes = _averaged_rank_causes(replicas, near, averager, micro_batches, shard_size, reduction, size)
        if untracked_all_reduce and replicas > 1 and near(1.0 / replicas):
            causes = [
                f"(1/{replicas}, one over the {size}): the loss went through "
                "torch.distributed.all_reduce, which autograd does not differentiate (it has no "
                "gradient formula, so the gradient passes through it as if it were not there), "
                f"so the division by the {size} that follows reaches the gradient and the "
                f"all-reduce does not, while {averager} averages the ranks' gradients as well. "
                "Backpropagate the rank's own loss and all-reduce a detached copy for logging "
                "(reported = loss.detach().clone(); dist.all_reduce(reported)), or use the "
                "differentiable torch.distributed.nn.functional.all_reduce"
            ]
    return head + (" " + "; or ".join(causes) if causes else "") + "."


def _averaged_rank_causes(
    world_size: int, near: Callable[[float], bool], averager: str, micro_batches: int, shard_size: float | None, reduction: str | None, size: str,
) -> list[str]:
    """The causes of a factor under a ranked wrapper that averages its ranks' gradients."""
    summed = reduction == "sum"
    causes = []
    if micro_batches > 1 and near(micro_batches) and not summed:
        causes.append(
            f"({micro_batches}, the number of micro-batches): each micro-batch's loss must be "
            f"divided by {micro_batches} (weighted by its rows * world_size / B), or the "
            "accumulated gradient is the sum of the micro-batch means"
        )
    if micro_batches > 1 and near(1.0 / micro_batches) and not summed:
        causes.append(
            f"(1/{micro_batches}, one over the number of micro-batches): each micro-batch's "
            f"loss was divided by {micro_batches} twice, e.g. by gradient_accumulation_steps in "
            "the step and again where the loss is scaled or the gradients averaged"
        )
    if world_size > 1 and near(world_size) and not summed:
        causes.append(
            f"({world_size}, the {size}): the ranks' gradients were summed but not divided "
            f"by the {size}. {averager} averages for you; a hand-written all_reduce with "
            "ReduceOp.SUM must be followed by grad /= world_size, and a loss must not be "
            f"multiplied by the {size} on top of the average {averager} takes"
        )
    if shard_size and shard_size > 1 and near(shard_size) and not summed:
        causes.append(
            (f"({shard_size:g}, the rows per rank)" if float(shard_size).is_integer() else f"({shard_size:g}, the batch's rows over the {size})")
            + ": the step's loss is the sum over the rank's "
            "rows (or its mean times the rows) while loss_fn, which the single-device step "
            "uses, averages: divide the step's loss by its rows (ctx.shard_size), or use "
            f"loss_fn as it is; {averager} then averages the ranks"
        )
    if world_size > 1 and near(1.0 / world_size):
        if reduction != "mean":
            unweighted = " and the micro-batch losses were added up unweighted" if micro_batches > 1 else ""
            causes.append(
                f"(1/{world_size}, one over the {size}): "
                + ("loss_fn is a sum-reduction loss (the full batch's loss is the sum of the shards' losses)" if summed else "a sum-reduction loss (e.g. reduction='sum')")
                + f"{unweighted}. Each rank's loss sums its own rows, and "
                f"{averager} divides the sum of the ranks' gradients by the {size}, {world_size}, "
                "so every rank gets 1/world_size of the full-batch sum that one device computes. "
                "Use a mean loss (reduction='mean'); or keep the sum and multiply each rank's "
                "loss by world_size (loss * ctx.world_size in a step); DataParallel, which sums "
                "its replicas' gradients, gives the single-device gradient for the same sum loss"
            )
        if not summed:
            causes.append(
                f"(1/{world_size}, one over the {size}): the gradients were divided by the "
                f"{size} twice, e.g. a mean loss divided by world_size (or a hand-written "
                f"average) on top of {averager}, which already averages over ranks"
            )
    if world_size > 1 and micro_batches > 1 and near(1.0 / (world_size * micro_batches)) and reduction != "mean":
        causes.append(
            f"(1/{world_size * micro_batches} = 1/(micro-batches * {size})): "
            f"a sum-reduction loss with each micro-batch's loss weighted by its share "
            f"(1/{micro_batches}, the recipe for a mean loss): each rank's gradient is "
            f"1/{micro_batches} of the sum over its rows, and {averager} divides by the {size}, "
            f"{world_size}. Use a mean loss; or keep the sum, add the micro-batch losses up "
            "unweighted and multiply them by world_size"
        )
    return causes


Msg = str | Callable[[str], str] | None


def render(message: str, msg: Msg) -> str:
    """Applies a caller's ``msg`` the way torch.testing.assert_close does."""
    if msg is None:
        return message
    if callable(msg):
        return msg(message)
    return msg
