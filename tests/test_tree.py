"""core/tree.py: the one walker over tensors nested in tuples, lists, dicts and namedtuples."""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict, namedtuple
from typing import Any

import torch

from dpverify.core.step import convert_tensors, flatten_tensors
from dpverify.core.tree import map_tensors, tensor_leaves

Output = namedtuple("Output", ["hidden", "logits"])


def _nested() -> tuple[Any, list[torch.Tensor]]:
    """A structure of every container kind with non-tensor leaves among the tensors, and
    its tensors in order."""
    t = [torch.full((2,), float(i)) for i in range(5)]
    obj = {
        "logits": t[0],
        "layers": [t[1], (t[2], 3, "text"), []],
        "out": Output(hidden=t[3], logits=[None, t[4]]),
        "name": "model",
        "ids": {1, 2},
    }
    return obj, t


def test_a_tensor_is_its_own_leaf() -> None:
    x = torch.ones(3)
    assert [(path, keys) for path, keys, _ in tensor_leaves(x, "output")] == [("output", ())]
    assert next(tensor_leaves(x))[2] is x


def test_paths_keys_and_order_of_nested_containers() -> None:
    obj, tensors = _nested()
    leaves = list(tensor_leaves(obj, "output"))
    assert [path for path, _, _ in leaves] == [
        "output['logits']",
        "output['layers'][0]",
        "output['layers'][1][0]",
        "output['out'].hidden",
        "output['out'].logits[1]",
    ]
    assert [keys for _, keys, _ in leaves] == [("logits",), ("layers", 0), ("layers", 1, 0), ("out", 0), ("out", 1, 1)]
    assert all(found is wanted for (_, _, found), wanted in zip(leaves, tensors, strict=True))


def test_keys_index_the_structure_down_to_the_tensor() -> None:
    obj, _ = _nested()
    for _path, keys, tensor in tensor_leaves(obj):
        assert functools.reduce(operator.getitem, keys, obj) is tensor


def test_paths_start_empty_by_default() -> None:
    leaves = tensor_leaves((torch.ones(1), {"k": torch.ones(1)}, Output(torch.ones(1), 0)))
    assert [path for path, _, _ in leaves] == ["[0]", "[1]['k']", "[2].hidden"]


def test_non_tensor_leaves_and_other_containers_hold_no_tensors() -> None:
    # sets and arbitrary objects are not walked, as torch's scatter and gather do not walk them
    holder = type("Holder", (), {"tensor": torch.ones(1)})()
    leaves: tuple[Any, ...] = (None, 3, "text", [], (), {}, {torch.ones(1)}, holder, [None, "a", ()])
    for obj in leaves:
        assert list(tensor_leaves(obj)) == [], obj


def test_map_tensors_rebuilds_every_container_type() -> None:
    obj, tensors = _nested()
    mapped = map_tensors(obj, lambda t: t + 10)
    assert type(mapped) is dict
    assert type(mapped["layers"]) is list
    assert type(mapped["layers"][1]) is tuple
    assert type(mapped["out"]) is Output
    assert mapped["layers"][1][1:] == (3, "text")
    assert mapped["layers"][2] == []
    assert mapped["out"].logits[0] is None
    assert mapped["name"] == "model"
    assert mapped["ids"] is obj["ids"]  # not walked: kept as it is
    got = [t for _, _, t in tensor_leaves(mapped)]
    assert all(torch.equal(g, t + 10) for g, t in zip(got, tensors, strict=True))
    assert all(torch.equal(t, torch.full((2,), float(i))) for i, t in enumerate(tensors))  # inputs untouched


def test_map_tensors_keeps_dict_subclasses_and_visits_in_leaf_order() -> None:
    obj = OrderedDict(b=torch.ones(1), a=[torch.zeros(1), 7])
    seen: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    mapped = map_tensors(obj, record)
    assert type(mapped) is OrderedDict
    assert list(mapped) == ["b", "a"]
    assert [id(t) for t in seen] == [id(t) for _, _, t in tensor_leaves(obj)]
    assert map_tensors(torch.ones(2), lambda t: t * 3).tolist() == [3.0, 3.0]
    assert map_tensors("text", lambda t: t * 3) == "text"


def test_the_step_helpers_are_the_walker() -> None:
    obj, _ = _nested()
    assert [path for path, _ in flatten_tensors(obj, "output")] == [path for path, _, _ in tensor_leaves(obj, "output")]
    mixed = Output(hidden=torch.ones(2, dtype=torch.float32), logits={"ids": torch.arange(2)})
    converted = convert_tensors(mixed, torch.float64, torch.device("cpu"))
    assert type(converted) is Output
    assert converted.hidden.dtype == torch.float64
    assert converted.logits["ids"].dtype == torch.int64  # only floating tensors are cast
    assert converted.logits["ids"].data_ptr() != mixed.logits["ids"].data_ptr()  # fresh copies
