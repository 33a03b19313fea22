"""What a chunk's mean loss divides by: its rows, or its tokens.

A language-model loss is a mean over the labels that are not an ignore index (-100 marks
padding); when replicas, ranks or micro-batches hold different numbers of such tokens,
weighting their mean losses by rows is biased even on chunks of equal rows. Which count a
loss uses is read from the evidence (``choose_items``): the candidate counts of each chunk
(``item_candidates``) that reproduce the full-batch loss from the chunk losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.core.tree import tensor_leaves

__all__ = ["IGNORE_INDEX", "Items", "choose_items", "count_items", "ignore_indices_of", "item_candidates"]


#: ``items(args, kwargs)``: how many items (rows, tokens) one replica's chunk holds, the
#: count its mean loss divides by.
Items = Callable[[tuple[Any, ...], dict[str, Any]], int]

#: The ignore index of torch's classification losses and of Hugging Face's labels.
IGNORE_INDEX = -100


def count_items(items: Items, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    value = items(tuple(args), dict(kwargs))
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"items= returned {value!r}; it must return a count of items, an int >= 0")
    return value


def item_candidates(args: Any, kwargs: Mapping[str, Any], ignore_indices: Sequence[int] = ()) -> dict[str, int]:
    """What a chunk's mean loss may divide by besides its rows: for every integer tensor
    argument (labels, a target) the entries that are not an ignore index (-100, or
    ``ignore_indices``), over the whole tensor and shifted by one along its last dimension
    (a causal language model predicts token t+1 from token t, so its loss skips each row's
    first label). Keyed by a description: ``"tokens (labels != -100, shifted)"``."""
    found: dict[str, int] = {}
    for path, _keys, tensor in tensor_leaves((tuple(args), dict(kwargs))):
        if tensor.dim() == 0 or tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
            continue
        name = _argument_name(path)
        for ignore in dict.fromkeys((IGNORE_INDEX, *ignore_indices)):
            kept = tensor != ignore
            found.setdefault(f"tokens ({name} != {ignore})", int(kept.sum()))
            if tensor.dim() >= 2:
                found.setdefault(f"tokens ({name} != {ignore}, shifted)", int(kept[..., 1:].sum()))
    return found


def _argument_name(path: str) -> str:
    """``labels`` for the keyword argument ``[1]['labels']``, ``inputs[1]`` for the second
    positional one."""
    if path.startswith("[1]"):
        rest = path[3:]
        return rest[2:].split("'", 1)[0] if rest.startswith("['") else f"forward_kwargs{rest}"
    return "inputs" + path[3:]


def ignore_indices_of(module: nn.Module) -> tuple[int, ...]:
    """The ``ignore_index`` of every loss module inside ``module`` (torch's
    CrossEntropyLoss and NLLLoss keep one)."""
    return tuple(dict.fromkeys(
        int(value) for sub in module.modules()
        if isinstance(value := getattr(sub, "ignore_index", None), int) and not isinstance(value, bool)
    ))


def choose_items(candidates: Mapping[str, list[int]], losses: Sequence[float], full: float) -> tuple[str, list[int]]:
    """The item counts that reproduce the full-batch loss from the replica losses
    (``sum(t_i * L_i) / sum(t_i)``): the count each replica's mean loss divided by, found
    from the evidence rather than assumed. Rows unless another count, not proportional to
    the rows, does clearly better (half the error or less); a later candidate replaces an
    earlier one only on the same terms, and never when the two are proportional."""

    def error(counts: list[int]) -> float:
        total = sum(counts)
        if total <= 0 or len(counts) != len(losses):
            return math.inf
        return abs(sum(t * loss for t, loss in zip(counts, losses, strict=True)) / total - full)

    def proportional(a: list[int], b: list[int]) -> bool:
        return len(a) == len(b) and all(x * sum(b) == y * sum(a) for x, y in zip(a, b, strict=True))

    rows = list(candidates.get("rows", []))
    chosen, best = ("rows", rows), error(rows)
    for name, counts in candidates.items():
        # a count proportional to the chosen one gives the same weights: the evidence cannot
        # tell them apart, and rounding must not pick between them (the first found stays)
        if name == "rows" or proportional(counts, rows) or proportional(counts, chosen[1]):
            continue
        found = error(counts)
        if found < 0.5 * best:
            chosen, best = (name, list(counts)), found
    return chosen
