"""The shared argument validators: what each accepts, and that a refusal names the argument,
the value and what to pass."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from dpverify.core.errors import InvalidArgument
from dpverify.core.validation import (
    require_bool,
    require_callable,
    require_instance,
    require_int_at_least,
    require_mapping,
    require_module_with_grads,
)
from dpverify.models.specs import ModelSpec


@pytest.mark.parametrize(("value", "low"), [(0, 0), (3, 1), (5, 5), (-2, -3)])
def test_int_at_least_returns_the_value(value: int, low: int) -> None:
    assert require_int_at_least(value, "n", low) == value


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0, "world_size=0 must be an int >= 1"),
        (True, "world_size=True must be an int >= 1"),  # bool is an int to Python, not here
        (False, "world_size=False must be an int >= 1"),
        (2.0, r"world_size=2\.0 must be an int >= 1"),
        ("2", "world_size='2' must be an int >= 1"),
        (None, "world_size=None must be an int >= 1"),
    ],
)
def test_int_at_least_refuses_bools_floats_and_small_ints(value: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        require_int_at_least(value, "world_size", 1)


def test_bool_accepts_only_true_and_false() -> None:
    assert require_bool(True, "exact") is True
    assert require_bool(False, "exact") is False
    for value, shown in ((1, "1"), (0, "0"), ("yes", "'yes'"), (None, "None")):
        with pytest.raises(InvalidArgument, match=re.escape(f"exact={shown} must be True or False")):
            require_bool(value, "exact")


def test_callable_names_the_argument_and_what_to_pass() -> None:
    assert require_callable(len, "loss_fn", "a loss") is len
    with pytest.raises(InvalidArgument, match=r"^loss_fn='mse' is not callable; pass loss_fn\(output, target\) -> scalar$"):
        require_callable("mse", "loss_fn", "loss_fn(output, target) -> scalar")


def test_mapping_accepts_any_mapping_and_shows_an_example() -> None:
    kwargs = OrderedDict(static_graph=True)
    assert require_mapping(kwargs, "ddp_kwargs", "{}") is kwargs
    expected = "ddp_kwargs=[('static_graph', True)] is list; pass a mapping of keyword arguments, e.g. ddp_kwargs={'static_graph': True}"
    with pytest.raises(InvalidArgument, match=f"^{re.escape(expected)}$"):
        require_mapping([("static_graph", True)], "ddp_kwargs", "{'static_graph': True}")


def test_instance_names_the_type_got_and_the_type_wanted() -> None:
    spec = ModelSpec("linear")
    assert require_instance(spec, "models", ModelSpec) is spec
    with pytest.raises(InvalidArgument, match=r"^models='linear' is str; pass a ModelSpec$"):
        require_instance("linear", "models", ModelSpec)
    # torch's types read with their module: "a dtype" alone would read like a string
    with pytest.raises(InvalidArgument, match=r"^dtype='float32' is str; pass a torch\.dtype or a strategy of them$"):
        require_instance("float32", "dtype", torch.dtype, alternative="a strategy of them")


def test_module_with_grads_returns_a_trainable_module() -> None:
    module = nn.Sequential(nn.Linear(2, 2).requires_grad_(False), nn.Linear(2, 1))
    assert require_module_with_grads(module, why="there is no gradient to compare") is module


@pytest.mark.parametrize(
    ("module", "match"),
    [
        ("net", r"^module=str is not a torch\.nn\.Module$"),
        (nn.Linear(3, 2).requires_grad_(False), r"^module=Linear has no parameter that requires grad \(all its 2 parameters have requires_grad=False\): there is no gradient to compare; unfreeze at least one parameter \(requires_grad_\(True\)\)$"),
        (nn.ReLU(), r"^module=ReLU has no parameter that requires grad \(it has no parameters\): there is no gradient to compare;"),
    ],
)
def test_module_with_grads_names_the_module_type_and_the_fix(module: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        require_module_with_grads(module, why="there is no gradient to compare")


def test_refusals_are_value_errors_too() -> None:
    # callers that catch ValueError for bad arguments keep working
    with pytest.raises(ValueError, match="n=-1"):
        require_int_at_least(-1, "n", 0)
