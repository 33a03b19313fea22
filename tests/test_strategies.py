"""The strategies: validation, shrinking, determinism, and specs a person can paste."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument as HypothesisInvalidArgument

import dpverify
from dpverify import strategies
from dpverify.strategies import (
    DeviceList,
    LossSpec,
    ModelSpec,
    Scenario,
    batch_sizes,
    device_lists,
    dtypes,
    loss_specs,
    model_specs,
    scenarios,
)

NAMESPACE = {"ModelSpec": ModelSpec, "LossSpec": LossSpec, "DeviceList": DeviceList, "Scenario": Scenario, "torch": torch}


def test_every_public_strategy_is_exported_and_documented() -> None:
    readme = (__import__("pathlib").Path(__file__).parent.parent / "README.md").read_text()
    for name in strategies.__all__:
        obj = getattr(strategies, name)
        assert obj.__doc__ or isinstance(obj, tuple), name
        if callable(obj) and name[0].islower():
            assert f"`{name}(" in readme, f"{name} is not documented in the README"
            assert "Shrinks" in (obj.__doc__ or ""), f"{name}'s docstring does not say how it shrinks"


@given(scenarios())
def test_scenarios_print_as_pasteable_specs(scenario: Scenario) -> None:
    assert eval(repr(scenario), NAMESPACE) == scenario
    assert pickle.loads(pickle.dumps(scenario)) == scenario


@given(scenarios())
def test_build_is_deterministic(scenario: Scenario) -> None:
    first, second = scenario.build(), scenario.build()
    for a, b in zip(first.module.state_dict().values(), second.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(first.inputs, second.inputs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(first.target, second.target)
    assert first.inputs[0].shape[0] == scenario.batch_size
    assert next(first.module.parameters()).dtype == scenario.dtype


def test_build_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    Scenario(ModelSpec("mlp")).build()
    assert torch.equal(torch.get_rng_state(), before)


def test_shrinks_to_the_simplest_scenario() -> None:
    simplest = find(scenarios(), lambda s: True, settings=settings(database=None))
    assert simplest == Scenario(ModelSpec("linear", features=1, hidden=1, outputs=1), 1, DeviceList((0,)), LossSpec(), torch.float32, 0)


def test_shrinks_a_failure_to_one_linear_layer_and_the_fewest_devices() -> None:
    # the condition stands for "any uneven split fails": the minimal example is one Linear
    # layer, the smallest uneven batch and two devices
    found = find(
        scenarios(),
        lambda s: len(set(s.chunk_sizes)) > 1,
        settings=settings(database=None, max_examples=2000),
    )
    assert found.model.kind == "linear"
    assert len(found.devices.device_ids) == 2
    assert found.batch_size == 3


@given(st.integers(1, 6), st.data())
def test_batch_sizes_cover_the_interesting_splits(n: int, data: st.DataObject) -> None:
    size = data.draw(batch_sizes(n, max_size=16))
    assert 1 <= size <= 16


@pytest.mark.parametrize(
    ("predicate", "label"),
    [
        (lambda b: b < 4, "fewer rows than devices"),
        (lambda b: b % 4 == 0, "equal chunks"),
        (lambda b: b > 4 and b % 4 != 0, "uneven chunks"),
        (lambda b: len(dpverify.chunk_sizes(b, 4)) < 4 and b > 4, "fewer chunks than devices"),
    ],
)
def test_batch_sizes_reach_each_case(predicate: Any, label: str) -> None:
    assert predicate(find(batch_sizes(4), predicate, settings=settings(database=None))), label


@given(device_lists(min_devices=2, max_devices=4))
def test_device_lists_are_distinct_with_output_device_from_the_list(devices: DeviceList) -> None:
    assert 2 <= len(devices.device_ids) <= 4
    assert len(set(devices.device_ids)) == len(devices.device_ids)
    assert devices.output_device is None or devices.output_device in devices.device_ids
    assert devices.real == (torch.cuda.device_count() > max(devices.device_ids))


def test_device_lists_reach_reversed_orders() -> None:
    found = find(device_lists(min_devices=2), lambda d: list(d.device_ids) == sorted(d.device_ids, reverse=True) and d.output_device is not None)
    assert found.device_ids == (1, 0)


@given(loss_specs(), st.integers(1, 5), st.integers(2, 4))
def test_every_loss_gives_a_scalar_with_its_target(loss: LossSpec, batch: int, outputs: int) -> None:
    logits = torch.randn(batch, outputs, requires_grad=True)
    value = loss(logits, loss.target(batch, outputs))
    assert value.dim() == 0
    value.backward()


@given(model_specs())
def test_specs_declare_whether_they_are_exact(spec: ModelSpec) -> None:
    expected = not ((spec.kind == "batchnorm" and spec.train) or (spec.kind == "dropout" and spec.train) or spec.kind == "loss-head")
    assert spec.exact == expected
    found = dpverify.divergence_sources(spec.build())
    assert bool(found) == (not spec.batch_independent or not spec.deterministic)


def test_dtypes() -> None:
    assert find(dtypes(), lambda d: True) == torch.float32
    assert find(dtypes(bfloat16=True), lambda d: d == torch.bfloat16) == torch.bfloat16
    assert find(dtypes(float16=True), lambda d: d == torch.float16) == torch.float16


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: model_specs(kinds=["transformer"]), "kinds=\\['transformer'\\]"),
        (lambda: model_specs(kinds=[]), "kinds=\\[\\]"),
        (lambda: model_specs(kinds=["loss-head"], exact=True), "leaves nothing to draw"),
        (lambda: model_specs(max_hidden=0), "max_hidden=0 must be an int >= 1"),
        (lambda: batch_sizes(0), "n_devices=0 must be an int >= 1"),
        (lambda: batch_sizes(2, max_size=0), "max_size=0"),
        (lambda: device_lists(min_devices=3, max_devices=2), "max_devices=2 must be an int >= 3"),
        (lambda: loss_specs(names=["hinge"]), "names=\\['hinge'\\]"),
        (lambda: loss_specs(reductions=["none"]), "reductions=\\['none'\\]"),
        (lambda: scenarios(max_batch=0), "max_batch=0"),
    ],
)
def test_bad_arguments_fail_eagerly_naming_the_argument(make: Any, match: str) -> None:
    with pytest.raises(dpverify.InvalidArgument, match=match):
        make()


def test_one_invalid_argument_for_dpverify_and_hypothesis() -> None:
    # one class: what dpverify's helpers raise, what Hypothesis expects of a strategy, a ValueError
    assert issubclass(dpverify.InvalidArgument, HypothesisInvalidArgument)
    assert issubclass(dpverify.InvalidArgument, ValueError)
    # pytest.raises matches as ``except dpverify.InvalidArgument`` does (by isinstance)
    with pytest.raises(dpverify.InvalidArgument, match="max_batch=0 must be an int >= 1"):
        find(scenarios(max_batch=0), lambda scenario: True)


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        (batch_sizes(st.just(0)), "n_devices=0 must be an int >= 1"),
        (scenarios(models=st.just("linear")), "models='linear' is str; pass a ModelSpec"),
        (scenarios(dtype=st.just("float32")), "dtype='float32' is str; pass a torch.dtype"),
    ],
)
def test_bad_drawn_values_raise_dpverify_invalid_argument_under_given(strategy: st.SearchStrategy[Any], match: str) -> None:
    @given(strategy)
    @settings(max_examples=5, database=None)
    def test(value: Any) -> None:
        pass

    with pytest.raises(dpverify.InvalidArgument, match=match):
        test()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: model_specs(kinds=5), "kinds=5: choose a non-empty subset of"),
        (lambda: model_specs(kinds="linear"), "kinds='linear': choose a non-empty subset of"),
        (lambda: loss_specs(names="mse"), "names='mse': choose a non-empty subset of"),
        (lambda: loss_specs(reductions="mean"), "reductions='mean': choose from 'mean' and 'sum'"),
        (lambda: dtypes(bfloat16=1), "bfloat16=1 must be True or False"),
        (lambda: model_specs(exact="yes"), "exact='yes' must be True or False"),
        (lambda: scenarios(devices=(0, 1)), "devices=\\(0, 1\\) is tuple; pass a DeviceList"),
    ],
)
def test_wrongly_typed_arguments_are_invalid_arguments(make: Any, match: str) -> None:
    with pytest.raises(dpverify.InvalidArgument, match=match):
        make()


def test_spec_validation() -> None:
    with pytest.raises(dpverify.InvalidArgument, match="kind='resnet'"):
        ModelSpec("resnet")
    with pytest.raises(dpverify.InvalidArgument, match="reduction='none'"):
        LossSpec("mse", "none")
    with pytest.raises(dpverify.InvalidArgument, match="name='hinge'"):
        LossSpec("hinge")
