"""The one walker over nested arguments and outputs: tensors inside tuples, lists, dicts
and namedtuples, at any depth, as torch's scatter and gather see them.

Everything in dpverify that looks for the tensors of an input or an output (the step's
recorded outputs, the scatter plan, a rank's shard, the compute dtype of a loss, explain's
byte counts) goes through ``tensor_leaves`` or ``map_tensors``, so that they agree on what
a nested structure holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["concatenate", "first_batched", "map_tensors", "tensor_leaves"]


def _children(obj: Any) -> Iterator[tuple[Any, str, Any]] | None:
    """``(key, printable step, item)`` for each item of a container, or None for a leaf."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ((i, f".{name}", item) for i, (name, item) in enumerate(zip(obj._fields, obj, strict=True)))
    if isinstance(obj, (tuple, list)):
        return ((i, f"[{i}]", item) for i, item in enumerate(obj))
    if isinstance(obj, dict):
        return ((key, f"[{key!r}]", item) for key, item in obj.items())
    return None


def tensor_leaves(obj: Any, path: str = "") -> Iterator[tuple[str, tuple[Any, ...], torch.Tensor]]:
    """Every tensor in ``obj``, in order: its printable path (``output['logits'][0]``,
    ``output.hidden``), the keys that reach it (``obj[k0][k1]...``) and the tensor.

    Args:
        obj: a tensor, or tuples, lists, dicts and namedtuples of them (other objects are
            leaves without tensors).
        path: the printable name of ``obj`` itself.
    """
    if isinstance(obj, torch.Tensor):
        yield path, (), obj
        return
    children = _children(obj)
    if children is None:
        return
    for key, step, item in children:
        for sub, keys, tensor in tensor_leaves(item, path + step):
            yield sub, (key, *keys), tensor


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` rebuilt with every tensor replaced by ``fn(tensor)``; containers keep their
    type (namedtuples included) and other objects are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    children = _children(obj)
    if children is None:
        return obj
    return _rebuild(obj, [(key, map_tensors(item, fn)) for key, _step, item in children])


def _rebuild(like: Any, pairs: list[tuple[Any, Any]]) -> Any:
    """A container of ``like``'s type holding the ``(key, item)`` pairs' items (keyed for a dict)."""
    if isinstance(like, dict):
        return type(like)(pairs)
    items = [item for _key, item in pairs]
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items)


def first_batched(obj: Any) -> torch.Tensor | None:
    """The first tensor of ``obj`` with a batch dimension (not a scalar), in
    ``tensor_leaves``' order: the one whose rows say how a call's batch was split."""
    return next((tensor for _path, _keys, tensor in tensor_leaves(obj) if tensor.dim() > 0), None)


def concatenate(parts: Sequence[Any], dim: int = 0) -> Any:
    """One structure from per-replica ones, as torch's gather builds it: tensors
    concatenated along ``dim`` (scalars stacked into a vector) on the first part's device,
    containers item by item, other objects taken from the first part.

    Raises:
        ValueError: the parts do not have the same structure, or their tensors cannot be
            concatenated (shapes differ off ``dim``).
    """
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(part, torch.Tensor) for part in parts):
            raise ValueError("the parts mix tensors and other objects")
        if first.dim() == 0:
            return torch.stack([part.to(first.device) for part in parts])
        return torch.cat([part.to(first.device) for part in parts], dim)
    children = _children(first)
    if children is None:
        return first
    keys = [key for key, _step, _item in children]
    if not all(type(part) is type(first) and len(part) == len(first) for part in parts):
        raise ValueError("the parts have different containers")
    return _rebuild(first, [(key, concatenate([part[key] for part in parts], dim)) for key in keys])
