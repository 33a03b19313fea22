"""Exact mode on drawn exact scenarios (``dpverify.strategies.exact_scenarios``): every drawn
scenario is one the proof of exactness accepts, on every backend; and every backend's
gradient check, and DataParallel and DDP training with an exact optimizer, pass in exact
mode (``Case(..., exact=True)``), where torch's own code must be bit-identical to one device."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dpverify
from dpverify.core.comparison import StepComparison
from dpverify.core.scatter import chunk_sizes
from dpverify.exact.case import Evidence, ExactCase, prove
from dpverify.models.layouts import PipelineLayout, ShardedScenario, TPLayout
from dpverify.models.training import OptimizerSpec, TrainingScenario
from dpverify.mutants import EXACT_PROPERTIES
from dpverify.registry import CHECKS, Case
from dpverify.strategies import EXACT_LIMITS, LossSpec, ModelSpec, Scenario, exact_scenarios

BACKENDS = ("dp", "ddp", "fsdp", "tp", "pp")
#: The widest bounds ``exact_scenarios`` accepts, on the world sizes each backend takes.
WIDEST: dict[str, Any] = {**EXACT_LIMITS}
WORLDS = {"dp": (1, 2, 3, 4), "ddp": (2, 4), "fsdp": (2, 4), "tp": (2, 4), "pp": (2, 4)}


def _pieces(backend: str, scenario: Scenario | ShardedScenario) -> tuple[list[int], bool, list[float] | None]:
    """How ``backend``'s parallel step cuts the batch: DataParallel's chunks, gathered for one
    loss; a rank's equal shard (DDP, FSDP2), a data-parallel group's rows (tensor
    parallelism) or a microbatch (pipelines), each with its mean loss, averaged."""
    plain = scenario.scenario if isinstance(scenario, ShardedScenario) else scenario
    rows, world = plain.batch_size, len(plain.devices.device_ids)
    if backend == "dp":
        return chunk_sizes(rows, world), True, None
    layout = scenario.layout if isinstance(scenario, ShardedScenario) else None
    count = (
        layout.data_parallel if isinstance(layout, TPLayout) else layout.n_microbatches if isinstance(layout, PipelineLayout) else world
    )
    return [rows // count] * count, False, [1 / count] * count


def proven(backend: str, scenario: Scenario | ShardedScenario) -> Evidence:
    """``prove`` on the scenario's grid copies, cut as ``backend`` cuts it."""
    plain = scenario.scenario if isinstance(scenario, ShardedScenario) else scenario
    built = plain.build()
    case = ExactCase.of(built.module, built.inputs, built.target, built.kwargs)
    pieces, gathered, weights = _pieces(backend, scenario)
    return prove(case, built.loss_fn, pieces=pieces, gathered=gathered, weights=weights)


def _assert_exact(backend: str, scenario: Scenario | ShardedScenario) -> None:
    evidence = proven(backend, scenario)  # raises InvalidArgument where a step would round
    assert evidence.proof.operations > 0
    assert evidence.proof.bits <= evidence.proof.precision == 53
    assert evidence.reversed_identical  # every drawn model treats its rows alike
    assert evidence.pieces_identical in (None, True)  # the split itself changes nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_drawn_scenario_is_proven_exact(backend: str) -> None:
    @given(exact_scenarios(backend))
    def run(scenario: Scenario | ShardedScenario) -> None:
        _assert_exact(backend, scenario)

    run()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_drawn_scenario_at_the_widest_bounds_is_proven_exact(backend: str) -> None:
    @given(exact_scenarios(backend, world_sizes=WORLDS[backend], **WIDEST))
    def run(scenario: Scenario | ShardedScenario) -> None:
        _assert_exact(backend, scenario)

    run()


@pytest.mark.deep
@pytest.mark.parametrize("backend", BACKENDS)
def test_many_drawn_scenarios_at_the_widest_bounds_are_proven_exact(backend: str) -> None:
    # the bounds of EXACT_LIMITS were measured; this is where they are held to it
    @settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
    @given(exact_scenarios(backend, world_sizes=WORLDS[backend], **WIDEST))
    def run(scenario: Scenario | ShardedScenario) -> None:
        _assert_exact(backend, scenario)

    run()


def test_a_model_deeper_than_the_bounds_is_refused_by_the_proof() -> None:
    # the bounds are real: one hidden layer more than a squared error leaves bits for is
    # refused by the proof (so the strategy's rule is not merely cautious)
    model = ModelSpec("residual", features=4, hidden=4, outputs=4, depth=2, activation="leaky_relu", train=False)
    deep = Scenario(model, 8, loss=LossSpec("mse"), seed=1)
    with pytest.raises(dpverify.InvalidArgument, match="too deep or too wide"):
        proven("dp", deep)
    assert proven("dp", dataclasses.replace(deep, loss=LossSpec("l1"))).proof.bits <= 53  # L1 leaves the bits


# -- the checks in exact mode ------------------------------------------------------------------

#: An optimizer whose steps are exact: a learning rate and a momentum that are powers of two.
EXACT_SGD = OptimizerSpec("sgd", lr=2**-3, momentum=2**-1)


def assert_exact_pass(name: str, case: Case) -> StepComparison:
    """Registry check ``name`` on ``case`` in exact mode passes, and says it compared
    without tolerance (the evidence's note), every tensor bit-identical."""
    result = CHECKS[name].check(dataclasses.replace(case, exact=True))
    assert isinstance(result, StepComparison)
    assert any("Tolerance: none" in note for note in result.notes), result.notes
    assert all(t.ok for t in result.tensors)
    return result


@pytest.mark.parametrize("name", sorted(EXACT_PROPERTIES))
def test_torch_passes_every_exact_property(name: str) -> None:
    # the properties the one-ulp mutants fail: torch's own DataParallel, DDP, FSDP2,
    # tensor-parallel plan and GPipe are bit-identical to one device on every drawn scenario
    prop = EXACT_PROPERTIES[name]

    @given(prop.scenarios)
    def run(scenario: Scenario | ShardedScenario) -> None:
        assert_exact_pass(name, Case.from_scenario(scenario))

    run()


@pytest.mark.deep
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_gradient_check_passes_in_exact_mode_at_the_widest_bounds(backend: str) -> None:
    name = f"{backend}-grads"

    @settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
    @given(exact_scenarios(backend, world_sizes=WORLDS[backend][1:], **WIDEST))
    def run(scenario: Scenario | ShardedScenario) -> None:
        case = Case.from_scenario(scenario)
        assume(CHECKS[name].why_not(dataclasses.replace(case, exact=True)) is None)
        assert_exact_pass(name, case)

    run()


@st.composite
def exact_training(draw: st.DrawFn, backend: str) -> TrainingScenario:
    """Training runs exact arithmetic leaves bits for under ``EXACT_SGD``: each step's
    update adds the gradient's bits to the weights', so models stay shallow (one Linear
    layer, or an Embedding summed over its tokens with an L1 loss) and a squared error
    trains two steps, an L1 loss three."""
    worlds = (2, 3, 4) if backend == "dp" else None  # one device has nothing to reduce
    scenario = draw(st.one_of(
        exact_scenarios(backend, world_sizes=worlds, kinds=("linear",)),
        exact_scenarios(backend, world_sizes=worlds, kinds=("linear", "embedding"), losses=("l1",)),
    ))
    assert isinstance(scenario, Scenario)
    steps = draw(st.integers(1, 3 if scenario.loss.name == "l1" else 2))
    return TrainingScenario(scenario, EXACT_SGD, steps, dp=backend == "dp")


@pytest.mark.parametrize("backend", ["dp", "ddp"])
def test_training_with_an_exact_optimizer_passes_in_exact_mode(backend: str) -> None:
    name = f"{backend}-training"

    @given(exact_training(backend))
    def run(scenario: TrainingScenario) -> None:
        case = Case.from_scenario(scenario)
        assume(CHECKS[name].why_not(dataclasses.replace(case, exact=True)) is None)
        assert_exact_pass(name, case)

    run()
