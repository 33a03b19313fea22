"""chunk_sizes and plan_scatter follow torch's own scatter."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch

from dpverify import DroppedRowsWarning, InvalidArgument, chunk_sizes, plan_scatter

Pair = namedtuple("Pair", ["tokens", "mask"])


@pytest.mark.parametrize(
    ("batch", "n", "expected"),
    [(5, 4, [2, 2, 1]), (6, 4, [2, 2, 2]), (9, 4, [3, 3, 3]), (2, 4, [1, 1]), (1, 3, [1]), (8, 1, [8]), (0, 3, [0, 0, 0])],
)
def test_documented_examples(batch: int, n: int, expected: list[int]) -> None:
    assert chunk_sizes(batch, n) == expected


def test_matches_torch_chunk_exhaustively() -> None:
    for batch in range(0, 65):
        for n in range(1, 10):
            torch_sizes = [c.shape[0] for c in torch.empty(batch, 1).chunk(n)]
            assert chunk_sizes(batch, n) == torch_sizes, (batch, n)


@pytest.mark.parametrize(
    ("batch", "n", "match"),
    [(-1, 2, "batch_size=-1 must be at least 0"), (4, 0, "n_devices=0 must be at least 1"), (4.0, 2, "batch_size=4.0 must be an int"), (4, True, "n_devices=True must be an int")],
)
def test_bad_arguments(batch: Any, n: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        chunk_sizes(batch, n)


def test_plan_describes_idle_devices() -> None:
    plan = plan_scatter((torch.randn(5, 2),), None, [3, 1, 0, 2])
    assert plan.chunk_sizes == (2, 2, 1)
    assert plan.used_devices == (3, 1, 0)
    assert plan.idle_devices == (2,)
    assert plan.describe() == "batch of 5 rows on device_ids [3, 1, 0, 2] -> chunk sizes [2, 2, 1] (3 replicas used, device 2 idle)"


def test_plan_of_nested_arguments_and_kwargs() -> None:
    x, mask = torch.randn(6, 2), torch.ones(6, 1)
    plan = plan_scatter(((x, [x]),), {"mask": mask}, [0, 1, 2], warn=False)
    assert dict(plan.tensor_chunks) == {
        "inputs[0][0]": (2, 2, 2),
        "inputs[0][1][0]": (2, 2, 2),
        "kwargs['mask']": (2, 2, 2),
    }
    assert plan.dropped == ()


def test_plan_names_namedtuple_fields_and_dict_keys() -> None:
    """A one-row mask beside five-row tokens: torch zips one chunk of each, so one replica
    runs and the other rows are lost; the plan names them by field and key."""
    tokens, mask, ids = torch.randn(5, 2), torch.ones(1, 1), torch.arange(5)
    with pytest.warns(DroppedRowsWarning, match=r"inputs\[0\]\.tokens loses 2 rows"):
        plan = plan_scatter((Pair(tokens, mask), {"ids": ids}), None, [0, 1])
    assert plan.tensor_chunks == (("inputs[0].tokens", (3,)), ("inputs[0].mask", (1,)), ("inputs[1]['ids']", (3,)))
    assert plan.dropped == (("inputs[0].tokens", 2), ("inputs[1]['ids']", 2))
    assert plan.n_replicas == 1
