"""The keywords the ranked assertion helpers share, each defined once.

A helper takes its scenario positionally and by its own required keywords (``loss_fn``,
``world_size``, ...), and every optional keyword through ``**options``, typed by a
``TypedDict`` group: ``RankedKeywords`` (every ranked helper), ``ShardedKeywords`` (the
ones that cut a batch into shards), and a backend's own on top. ``accepted`` checks one
call's keywords against its group (an unknown name is the ``TypeError`` Python raises for
one), and ``documented`` writes each shared keyword's Args text, from ``ARGS``, into the
helper's docstring.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypedDict, TypeVar

from dpverify.core.comparison import Msg
from dpverify.ddp.pool import RankRunner

__all__ = ["ARGS", "RankedKeywords", "ShardedKeywords", "TrainingKeywords", "accepted", "check_keywords", "documented"]

_F = TypeVar("_F", bound=Callable[..., Any])
_D = TypeVar("_D", bound=Mapping[str, Any])


class RankedKeywords(TypedDict, total=False):
    """The optional keywords of every ranked helper."""

    pool: RankRunner | None
    rtol: float | None
    atol: float | None
    msg: Msg
    exact: bool


class ShardedKeywords(RankedKeywords, total=False):
    """The optional keywords of a helper that cuts the batch into contiguous shards and runs
    a per-rank step on each."""

    shards: Sequence[int] | None
    step: Any
    forward_kwargs: Mapping[str, Any] | None


class TrainingKeywords(TypedDict, total=False):
    """The optional keywords of a training helper, on top of its backend's."""

    after_backward: Any


#: The Args text of each shared keyword, as the helpers' docstrings show it.
ARGS: dict[str, str] = {
    "pool": "the ranks to use (default: the shared pool of ``world_size`` ranks).",
    "rtol": "explicit relative tolerance (with ``atol``) instead of the anchored rule.",
    "atol": "explicit absolute tolerance (with ``rtol``).",
    "msg": "replaces the failure message, or a callable that rewrites it.",
    "exact": (
        "compare bit for bit, without tolerance: dpverify runs float64 copies of the module, "
        "inputs and target on a dyadic grid, shows every operation of the single-device step, "
        "and of its cut into the ranks' pieces, exact, and requires the ranks' tensors to equal "
        "it to the last bit (a one-ulp error in one element fails). Refused, naming the "
        "operation or count and the fix, where the arithmetic cannot be exact (tanh, softmax; "
        "a world size, shard or micro-batch count that is not a power of two; explicit rtol "
        "or atol). A training helper proves every optimizer step of the single-device run too: "
        "the learning rate and momentum must be short dyadic numbers such as 2**-3, and "
        "float64's 53 bits bound the depth, the width and the number of steps. Default False."
    ),
    "forward_kwargs": (
        "keyword arguments of the forward, ``model(*inputs, **forward_kwargs)``; tensors with "
        "the batch's rows are sharded along dim 0 like ``inputs``, others reach every rank "
        "whole. Picklable."
    ),
    "ddp_kwargs": "keyword arguments for DistributedDataParallel.",
    "after_backward": (
        "your code between backward and the optimizer step, ``hook(ctx)``: gradient clipping, "
        "unscaling, a custom all-reduce. It runs on every rank after each step's backward "
        "(``ctx``: the rank's context, ``ctx.module`` its module, ``ctx.step_index`` the "
        "step) and in the single-device reference (``ctx.reference`` True, ``ctx.world_size`` "
        "1, ``ctx.module`` the reference module); pass ``group=ctx.group`` to its collectives. "
        "Picklable."
    ),
}


def accepted(helper: Callable[..., Any], given: _D, group: type, without: Collection[str] = ()) -> _D:
    """``given``, the keywords of one call of ``helper``, once every name is one of
    ``group``'s (a ``TypedDict``) and none is in ``without``.

    Raises:
        TypeError: an unexpected keyword, as Python words it.
    """
    allowed = set(getattr(group, "__required_keys__", ())) | set(getattr(group, "__optional_keys__", ()))
    allowed -= set(without)
    for name in given:
        if name not in allowed:
            raise TypeError(f"{helper.__name__}() got an unexpected keyword argument {name!r}")
    return given


def check_keywords(options: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of ``RankedCheck.create`` among ``options``."""
    return {name: options[name] for name in ("shards", "pool", "rtol", "atol", "forward_kwargs", "exact") if name in options}


_MARK = re.compile(r"^(?P<indent>[ ]*)<shared: (?P<names>[^>]*)>$", re.MULTILINE)


def documented(helper: _F) -> _F:
    """``helper`` with each ``<shared: name, ...>`` line of its docstring replaced by those
    keywords' Args lines (``ARGS``), wrapped at the docstring's width."""
    doc = helper.__doc__ or ""

    def lines(found: re.Match[str]) -> str:
        indent = found.group("indent")
        return "\n".join(
            textwrap.fill(
                ARGS[name], 92, initial_indent=f"{indent}{name}: ", subsequent_indent=f"{indent}    ",
                break_long_words=False, break_on_hyphens=False,
            )
            for name in (part.strip() for part in found.group("names").split(","))
        )

    helper.__doc__ = _MARK.sub(lines, doc)
    return helper
