"""The one walker over nested arguments and outputs: tensors inside tuples, lists, dicts
and namedtuples, at any depth, as torch's scatter and gather see them.

Everything in dpverify that looks for the tensors of an input or an output (the step's
recorded outputs, the scatter plan, a rank's shard, the compute dtype of a loss, explain's
byte counts) goes through ``tensor_leaves`` or ``map_tensors``, so that they agree on what
a nested structure holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["first_batched", "map_tensors", "tensor_leaves"]


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
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(item, fn) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(item, fn)) for key, item in obj.items())
    return obj


def first_batched(obj: Any) -> torch.Tensor | None:
    """The first tensor of ``obj`` with a batch dimension (not a scalar), in
    ``tensor_leaves``' order: the one whose rows say how a call's batch was split."""
    return next((tensor for _path, _keys, tensor in tensor_leaves(obj) if tensor.dim() > 0), None)
