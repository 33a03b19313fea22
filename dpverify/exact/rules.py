"""What each operation of the exact set needs for its result to be exact.

A rule looks at one call's actual operands (the values the step really computed with) and
returns the ``Need``s of its results: the grid the exact result lies on (``lowest``, the
exponent of its lowest possible bit) and a bound on every partial result an
implementation may form on the way (``bound``), in any order of summation. The result is
exact when that bound fits the output's significand above the grid. Multilinear
operations (matrix products, convolutions, sums, pooling and their backwards) get their
bound by running the same operation on the operands' absolute values: that is the sum of
the absolute values of every term, which bounds every partial sum.

An operation that cannot be made exact raises ``Refused`` with the reason; one outside
``RULES`` and ``MOVES`` (data movement, selection, sign) is refused by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpverify.exact.grid import is_power_of_two, lowest_bit, precision

__all__ = ["IGNORED_NAMESPACES", "MARGIN", "MOVES", "RULES", "Need", "Refused", "bits", "fits", "rule_of"]


@dataclass(frozen=True)
class Need:
    """One result's requirement: every partial result is a multiple of ``2**lowest`` (None:
    all operands zero) no larger than ``bound`` in magnitude."""

    lowest: int | None
    bound: float
    dtype: torch.dtype


class Refused(Exception):
    """The operation, on these operands, cannot be shown exact; the message says why and
    what to change."""


Rule = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], list[Need]]


# --------------------------------------------------------------------------- operands


def _low(value: Any) -> int | None:
    """The grid of a tensor or Python number (``lowest_bit``)."""
    if isinstance(value, torch.Tensor):
        return lowest_bit(value)
    if isinstance(value, bool) or value is None:
        return 0
    number = float(value)
    if number == 0 or not math.isfinite(number):
        return None
    mantissa, exponent = math.frexp(abs(number))
    significand = int(mantissa * 2**53)
    return exponent - 53 + ((significand & -significand).bit_length() - 1)


def _big(value: Any) -> float:
    """The largest magnitude of a tensor or number."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return 0.0
        return float(value.detach().abs().max()) if value.is_floating_point() else float(value.detach().abs().max().to(torch.float64))
    return abs(float(value)) if value is not None else 0.0


def _abs(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().abs()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return abs(value)
    return value


def _plus(*lows: int | None) -> int | None:
    """The grid of a product: the operands' grids add (None: a zero operand)."""
    if any(low is None for low in lows):
        return None
    return sum(low for low in lows if low is not None)


def _least(*lows: int | None) -> int | None:
    """The grid of a sum: the finest of the terms' (None terms are zero)."""
    present = [low for low in lows if low is not None]
    return min(present) if present else None


def _dtype(out: Any) -> torch.dtype:
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.dtype if isinstance(first, torch.Tensor) else torch.float64


def _largest(result: Any) -> float:
    return _big(result) if isinstance(result, torch.Tensor) else 0.0


def _power_count(count: int, what: str) -> int:
    if count < 1 or count & (count - 1):
        raise Refused(
            f"{what} divides by {count}, not a power of two, so the quotient rounds; make the count a power "
            "of two (the batch size, the width or the window), or use a sum"
        )
    return count.bit_length() - 1


# --------------------------------------------------------------------------- rules


#: The most significant bits a Python number may carry into exact arithmetic (a learning
#: rate, a momentum, a slope): 0.125 has 1, 0.1 has 53.
SHORT = 12


def _short(value: Any, what: str) -> None:
    """Refuses a Python number with more than ``SHORT`` significant bits."""
    if isinstance(value, (torch.Tensor, bool)) or value is None:
        return
    number = float(value)
    low = _low(number)
    if low is None:
        return
    digits = math.frexp(abs(number))[1] - low
    if digits > SHORT:
        raise Refused(
            f"{what}{number!r}, a number with {digits} significant bits, and every product with it adds them; use a "
            "short dyadic number (a learning rate, momentum, weight decay or slope such as 0.5, 0.125 or 3 * 2**-5)"
        )


def _add(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    a, b = args[0], args[1]
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    _short(alpha, "it scales by alpha=")
    _short(b, "it adds ")
    return [Need(_least(_low(a), _plus(_low(b), _low(alpha))), _big(a) + abs(float(alpha)) * _big(b), _dtype(out))]


def _mul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    a, b = args[0], args[1]
    _short(b, "it multiplies by ")
    return [Need(_plus(_low(a), _low(b)), _big(a) * _big(b), _dtype(out))]


def _div(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    divisor = args[1]
    values = divisor.detach().flatten().tolist() if isinstance(divisor, torch.Tensor) else [divisor]
    for value in values[:1 << 16]:
        if not is_power_of_two(float(value)):
            raise Refused(f"it divides by {float(value)!r}, not a power of two, so the quotient rounds")
    return []


def _pow(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    base, exponent = args[0], args[1]
    if isinstance(exponent, torch.Tensor) or float(exponent) != int(exponent) or int(exponent) < 0:
        raise Refused(f"it raises to the power {exponent!r}; only whole powers (x**2) stay exact")
    n = int(exponent)
    low = _low(base)
    return [Need(None if low is None else low * n, _big(base) ** n, _dtype(out))]


def _leaky(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    # leaky_relu(x, slope) and leaky_relu_backward(grad, x, slope, self_is_result)
    value = args[0]
    slope = args[2] if func.overloadpacket is torch.ops.aten.leaky_relu_backward else (args[1] if len(args) > 1 else 0.01)
    _short(slope, "its negative slope is ")
    return [Need(_least(_low(value), _plus(_low(value), _low(slope))), _big(value) * max(1.0, abs(float(slope))), _dtype(out))]


def _absolute(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` on the absolute values of its floating operands (scalars too)."""
    return func(*(_abs(a) for a in args), **{k: _abs(v) for k, v in kwargs.items()})


def _multilinear(
    grids: Callable[[tuple[Any, ...], dict[str, Any]], Sequence[int | None]],
    cheap: Callable[[tuple[Any, ...], dict[str, Any]], float] | None = None,
) -> Rule:
    """A rule for an operation linear in each operand: ``grids`` gives each result's grid
    from the operands, the bound comes from the operation on absolute values. ``cheap``, a
    looser bound from the operands' largest magnitudes alone (for one result), is taken
    where it already fits: the operation then does not run a second time."""

    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        lows = list(grids(args, kwargs))
        if cheap is not None and len(lows) == 1 and isinstance(outs[0], torch.Tensor):
            loose = Need(lows[0], cheap(args, kwargs), outs[0].dtype)
            if fits(loose):
                return [loose]
        bounds = _absolute(func, args, kwargs)
        results = bounds if isinstance(bounds, (tuple, list)) else (bounds,)
        return [
            Need(low, _largest(bound), result.dtype)
            for low, bound, result in zip(lows, results, outs, strict=False)
            if isinstance(result, torch.Tensor) and result.is_floating_point()
        ]

    return rule


#: Bounds are computed in float64 themselves; this margin covers their own rounding.
MARGIN = 1.0 + 2.0**-30


def bits(need: Need) -> int:
    """The significand bits ``need``'s partial results take: from its bound's highest bit
    down to its grid (0 when nothing constrains it)."""
    if need.lowest is None or need.bound == 0:
        return 0
    return math.frexp(need.bound * MARGIN)[1] - need.lowest


def fits(need: Need) -> bool:
    """Whether every partial result ``need`` describes is exact in its dtype."""
    return math.isfinite(need.bound) and bits(need) <= precision(need.dtype)


def _mm_cheap(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    # mm, bmm, mv, dot: |a| |b| times the length of the contraction
    return _big(args[0]) * _big(args[1]) * int(args[0].shape[-1])


def _addmm_cheap(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    beta, alpha = abs(float(_scale(args, kwargs, "beta", 3))), abs(float(_scale(args, kwargs, "alpha", 4)))
    return beta * _big(args[0]) + alpha * _big(args[1]) * _big(args[2]) * int(args[1].shape[-1])


def _scale(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int, default: Any = 1) -> Any:
    return kwargs.get(name, args[position] if len(args) > position else default)


def _mm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
    return [_plus(_low(args[0]), _low(args[1]))]


def _addmm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
    beta, alpha = _scale(args, kwargs, "beta", 3), _scale(args, kwargs, "alpha", 4)
    return [_least(_plus(_low(args[0]), _low(beta)), _plus(_low(args[1]), _low(args[2]), _low(alpha)))]


def _convolution(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
    return [_least(_plus(_low(args[0]), _low(args[1])), _low(args[2]) if args[2] is not None else None)]


def _convolution_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
    grad, value, weight = _low(args[0]), _low(args[1]), _low(args[2])
    return [_plus(grad, weight), _plus(grad, value), grad]


def _first(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
    return [_low(args[0])]


def _first_two(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
    return [_least(_low(args[0]), _low(args[2]) if len(args) > 2 else None)]


def _counted(count: Callable[[tuple[Any, ...], dict[str, Any], Any], int], what: str) -> Rule:
    """A rule for a mean: a sum (its bound and grid from the absolute values) divided by
    ``count``, which must be a power of two."""

    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
        n = count(args, kwargs, out)
        shift = _power_count(n, what)
        bound = _absolute(func, args, kwargs)
        bound = bound[0] if isinstance(bound, (tuple, list)) else bound
        # the sum before the division: on the operand's grid, ``count`` times the result's bound
        return [Need(_low(args[0]), _largest(bound) * 2**shift, _dtype(out))]

    return rule


def _mean_count(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    return max(1, int(args[0].numel()) // max(1, int(out.numel())))


def _window(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    # avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    kernel = args[1] if len(args) > 1 else kwargs["kernel_size"]
    padding = args[3] if len(args) > 3 else kwargs.get("padding", 0)
    ceil_mode = args[4] if len(args) > 4 else kwargs.get("ceil_mode", False)
    include_pad = args[5] if len(args) > 5 else kwargs.get("count_include_pad", True)
    override = args[6] if len(args) > 6 else kwargs.get("divisor_override")
    if override:
        return int(override)
    if ceil_mode or (any(int(p) for p in _pair(padding)) and not include_pad):
        raise Refused("its windows at the border divide by fewer elements than the others; use padding=0 and ceil_mode=False")
    return math.prod(int(k) for k in _pair(kernel))


def _window_backward(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    # avg_pool2d_backward(grad, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return _window(args[1:], kwargs, out)


def _pair(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value, value]


def _adaptive(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    # _adaptive_avg_pool2d(x, output_size) and _adaptive_avg_pool2d_backward(grad, x)
    if isinstance(args[1], torch.Tensor):
        sizes, target = list(args[1].shape[-2:]), list(args[0].shape[-2:])
    else:
        sizes, target = list(args[0].shape[-2:]), [int(t) for t in args[1]]
    if any(s % t for s, t in zip(sizes, target, strict=True)):
        raise Refused(f"its windows differ in size ({sizes} pooled to {target}); make the input a multiple of the output size")
    return math.prod(s // t for s, t in zip(sizes, target, strict=True))


def _mse(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    # mse_loss(a, b, reduction): reduction 0 none, 1 mean, 2 sum
    a, b = args[0], args[1]
    reduction = _scale(args, kwargs, "reduction", 2, 1)
    difference = _least(_low(a), _low(b))
    terms = (a.detach().abs() + b.detach().abs()) ** 2
    needs = [Need(difference, _big(a) + _big(b), _dtype(out)), Need(_plus(difference, difference), float(terms.sum()), _dtype(out))]
    if reduction == 1:
        _power_count(a.numel(), "its mean")
    return needs


def _mse_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    # mse_loss_backward(grad, a, b, reduction): 2 * (a - b) * grad (/ numel)
    grad, a, b = args[0], args[1], args[2]
    reduction = _scale(args, kwargs, "reduction", 3, 1)
    if reduction == 1:
        _power_count(a.numel(), "its mean")
    difference = _least(_low(a), _low(b))
    return [
        Need(difference, _big(a) + _big(b), _dtype(out)),
        Need(_plus(difference, _low(grad), 1), 2 * (_big(a) + _big(b)) * _big(grad), _dtype(out)),
    ]


def _index_put(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    # index_put(self, indices, values, accumulate): a copy, or with accumulate a sum
    if not _scale(args, kwargs, "accumulate", 3, False):
        return []
    return _multilinear(_first_two)(func, args, kwargs, out)


def _embedding_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    # embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    if _scale(args, kwargs, "scale_grad_by_freq", 4, False):
        raise Refused("scale_grad_by_freq=True divides by how often each token occurs; use scale_grad_by_freq=False")
    return _multilinear(_first)(func, args, kwargs, out)


def _narrowing(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    """A copy into another dtype: exact when the values fit the narrower significand."""
    source = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
    if not isinstance(source, torch.Tensor):
        return []
    return [Need(_low(source), _big(source), _dtype(out))]


def _foreach(rule: Rule) -> Rule:
    """A ``_foreach_`` operation: ``rule`` on each element of its lists."""

    def each(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
        lists = [a for a in args if isinstance(a, (list, tuple))]
        count = len(lists[0]) if lists else 0
        needs: list[Need] = []
        outs = out if isinstance(out, (list, tuple)) and out else lists[0]
        for i in range(count):
            picked = tuple(a[i] if isinstance(a, (list, tuple)) else a for a in args)
            needs += rule(func, picked, kwargs, outs[i])
        return needs

    return each


def _refuse(reason: str) -> Rule:
    def rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
        raise Refused(reason)

    return rule


_ATEN = torch.ops.aten


def _packets(*names: str) -> list[Any]:
    return [getattr(_ATEN, name) for name in names if hasattr(_ATEN, name)]


#: Operations that move, select, copy or flip signs of values: they round nothing.
MOVES: frozenset[Any] = frozenset(_packets(
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "expand_as",
    "slice", "select", "narrow", "cat", "stack", "split", "split_with_sizes", "chunk", "unbind", "clone",
    "detach", "alias", "lift_fresh", "unsqueeze", "squeeze", "flatten", "unflatten", "contiguous", "as_strided",
    "index_select", "gather", "index", "embedding", "zeros", "zeros_like", "ones", "ones_like", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
    "full", "full_like", "scalar_tensor", "fill", "fill_", "zero_", "arange", "relu", "relu_", "threshold_backward",
    "neg", "neg_", "abs", "sgn", "sign", "maximum", "minimum", "max", "min", "amax", "amin", "argmax", "argmin",
    "where", "masked_fill", "masked_fill_", "clamp", "clamp_min", "clamp_max", "max_pool2d_with_indices",
    "max_pool3d_with_indices", "max_pool2d", "constant_pad_nd", "flip", "roll", "repeat", "tile", "sort", "topk",
    "select_backward", "slice_backward", "set_", "resize_", "split_copy",
    "squeeze_copy", "unsqueeze_copy", "view_copy", "transpose_copy", "permute_copy", "t_copy", "expand_copy",
    "slice_copy", "select_copy", "masked_select", "diagonal", "unfold", "im2col", "pixel_shuffle",
    "channel_shuffle", "_to_dense", "clone", "copy",
))

#: Namespaces whose operations do no arithmetic on the step's floats (profiling marks).
IGNORED_NAMESPACES = frozenset({"profiler", "prim", "prims_common"})

_SUM = _multilinear(_first)

RULES: dict[Any, Rule] = {
    **dict.fromkeys(_packets("add", "add_", "sub", "sub_", "rsub"), _add),
    **dict.fromkeys(_packets("mul", "mul_"), _mul),
    **dict.fromkeys(_packets("div", "div_"), _div),
    **dict.fromkeys(_packets("pow", "pow_"), _pow),
    **dict.fromkeys(_packets("leaky_relu", "leaky_relu_", "leaky_relu_backward"), _leaky),
    **dict.fromkeys(_packets("mm", "bmm", "mv", "dot"), _multilinear(_mm, _mm_cheap)),
    **dict.fromkeys(_packets("addmm", "addmm_", "baddbmm", "addmv"), _multilinear(_addmm, _addmm_cheap)),
    **dict.fromkeys(_packets("addbmm"), _multilinear(_addmm)),
    **dict.fromkeys(_packets("convolution"), _multilinear(_convolution)),
    **dict.fromkeys(_packets("convolution_backward"), _multilinear(_convolution_backward)),
    **dict.fromkeys(_packets("sum", "cumsum", "col2im"), _SUM),
    **dict.fromkeys(_packets("index_put", "index_put_", "_index_put_impl_"), _index_put),
    **dict.fromkeys(_packets("max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward"), _SUM),
    **dict.fromkeys(_packets("index_add", "index_add_", "scatter_add", "scatter_add_"), _multilinear(_first_two)),
    **dict.fromkeys(_packets("mean"), _counted(_mean_count, "its mean")),
    **dict.fromkeys(_packets("avg_pool2d", "avg_pool3d"), _counted(_window, "its average pooling")),
    **dict.fromkeys(_packets("avg_pool2d_backward", "avg_pool3d_backward"), _counted(_window_backward, "its average pooling")),
    **dict.fromkeys(_packets("_adaptive_avg_pool2d"), _counted(_adaptive, "its adaptive average pooling")),
    **dict.fromkeys(_packets("_adaptive_avg_pool2d_backward"), _counted(_adaptive, "its adaptive average pooling")),
    **dict.fromkeys(_packets("mse_loss"), _mse),
    **dict.fromkeys(_packets("mse_loss_backward"), _mse_backward),
    **dict.fromkeys(_packets("embedding_dense_backward"), _embedding_backward),
    **dict.fromkeys(_packets("_to_copy", "copy_", "to"), _narrowing),
    **dict.fromkeys(_packets("_foreach_add", "_foreach_add_", "_foreach_sub", "_foreach_sub_"), _foreach(_add)),
    **dict.fromkeys(_packets("_foreach_mul", "_foreach_mul_"), _foreach(_mul)),
    **dict.fromkeys(_packets("_foreach_div", "_foreach_div_"), _foreach(_div)),
    **dict.fromkeys(_packets("_foreach_neg", "_foreach_neg_", "_foreach_zero_", "_foreach_copy_"), lambda f, a, k, o: []),
    **dict.fromkeys(_packets("native_dropout", "bernoulli", "bernoulli_", "rand", "randn", "rand_like", "randn_like"), _refuse(
        "it draws random numbers, which one device and the ranks draw differently; put dropout in eval mode (or p=0)"
    )),
}


def rule_of(func: Any) -> Rule | None:
    """The rule of ``func`` (an aten overload), ``_moves`` for data movement, None when it
    is outside the exact set."""
    packet = func.overloadpacket
    if packet in RULES:
        return RULES[packet]
    if packet in MOVES:
        return _moves
    return None


def _moves(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Need]:
    return []
