"""Argument validators shared by the assertion helpers, the DDP checks and the strategies.

One function per rule, so that the same mistake gets the same message wherever it is made:
each raises ``InvalidArgument`` naming the argument, the value it got and what to pass,
and returns the value (narrowed for the type checker) when it is usable. Part of the
engine: nothing here imports Hypothesis or rich.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.core.tree import first_batched

__all__ = [
    "require_arguments_fit",
    "require_bool",
    "require_callable",
    "require_instance",
    "require_int_at_least",
    "require_loss_fn",
    "require_mapping",
    "require_module_with_grads",
    "require_target_rows",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def require_instance(value: object, name: str, expected: type[T], *, alternative: str = "") -> T:
    """``value`` when it is an ``expected``; ``alternative`` names what else the caller
    accepts (the strategies take "a strategy of them" too).

    torch's own types are named with their module: "a dtype" alone reads like a string.
    """
    if not isinstance(value, expected):
        module = expected.__module__
        what = f"torch.{expected.__qualname__}" if module.split(".")[0] == "torch" else expected.__qualname__
        other = f" or {alternative}" if alternative else ""
        raise InvalidArgument(f"{name}={value!r} is {type(value).__name__}; pass a {what}{other}")
    return value


def require_int_at_least(value: object, name: str, low: int) -> int:
    """``value`` when it is an int >= ``low``. ``True`` is refused although Python counts it
    as 1: a bool where a count belongs is a misplaced flag, not a count."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgument(f"{name}={value!r} must be an int >= {low}")
    return value


def require_bool(value: object, name: str) -> bool:
    """``value`` when it is ``True`` or ``False``: 1 or "yes" would work as a flag, but is
    more likely a positional value in the wrong place."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name}={value!r} must be True or False")
    return value


def require_callable(value: F, name: str, expected: str) -> F:
    """``value`` when it can be called; ``expected`` says what to pass instead, with its
    signature (``"loss_fn(output, target) -> scalar, e.g. ..."``)."""
    if not callable(value):
        raise InvalidArgument(f"{name}={value!r} is not callable; pass {expected}")
    return value


def require_loss_fn(loss_fn: F) -> F:
    """``loss_fn`` when callable: the contract of every helper's ``loss_fn``, DDP's too."""
    return require_callable(loss_fn, "loss_fn", "loss_fn(output, target) -> scalar, e.g. torch.nn.functional.mse_loss")


def require_mapping(value: object, name: str, example: str) -> Mapping[str, Any]:
    """``value`` when it is a mapping of keyword arguments; ``example`` is one such mapping,
    as it would be written in the call (``"{'find_unused_parameters': True}"``)."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(
            f"{name}={value!r} is {type(value).__name__}; pass a mapping of keyword arguments, "
            f"e.g. {name}={example}"
        )
    return value


def require_module_with_grads(module: object, *, why: str) -> nn.Module:
    """``module`` when it is an ``nn.Module`` with a parameter that requires grad.

    ``why`` completes the sentence "module=X has no parameter that requires grad (...): ..."
    with what the caller cannot do without one (a check has no gradient to compare;
    DistributedDataParallel refuses the module). The module is named by its type: the
    repr of a model runs to pages.
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgument(f"module={type(module).__name__} is not a torch.nn.Module")
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        has = f"all its {len(params)} parameters have requires_grad=False" if params else "it has no parameters"
        raise InvalidArgument(
            f"module={type(module).__name__} has no parameter that requires grad ({has}): {why}; "
            "unfreeze at least one parameter (requires_grad_(True))"
        )
    return module


def require_target_rows(target: Any, rows: int, *, argument: str = "target") -> None:
    """A target with a batch dimension has the batch's rows there (its first tensor that is
    not a scalar: a tensor, or inside a tuple or dict): a target of other rows would reach
    the loss as a broadcasting error, or silently broadcast.

    Raises:
        InvalidArgument: the target's first batched tensor has another number of rows.
    """
    first = first_batched(target)
    if first is not None and first.size(0) != rows:
        raise InvalidArgument(
            f"{argument} has {first.size(0)} rows (shape {tuple(first.shape)}) but the batch has {rows}: "
            f"loss_fn(output, {argument}) compares row i of the output with row i of {argument}, so "
            f"pass a {argument} with one row per sample of the batch"
        )


def require_arguments_fit(module: nn.Module, inputs: Any, *, argument: str = "inputs") -> None:
    """A list given as ``inputs`` is one positional argument, as ``forward(*inputs)`` takes
    it; when the module's forward needs more positional arguments than that, the list was
    meant as a tuple of arguments.

    Raises:
        InvalidArgument: ``inputs`` is a list and the forward needs several positional
            arguments.
    """
    if not isinstance(inputs, list):
        return
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a forward without a signature tells nothing
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    if len(required) > 1:
        raise InvalidArgument(
            f"{argument} is a list of {len(inputs)}, which is one positional argument (forward(*inputs) "
            f"receives the list itself), but {type(module).__name__}.forward takes {len(required)} "
            f"({', '.join(required)}): pass a tuple, {argument}=tuple(...), to give each its own argument"
        )
