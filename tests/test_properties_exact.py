"""Exact mode on drawn exact scenarios (``dpverify.strategies.exact_scenarios``): every drawn
scenario is one the proof of exactness accepts, on every backend; and every backend's
gradient check, and DataParallel and DDP training with an exact optimizer, pass in exact
mode (``Case(..., exact=True)``), where torch's own code must be bit-identical to one device."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

import dpverify
from dpverify.core.scatter import chunk_sizes
from dpverify.exact.case import Evidence, ExactCase, prove
from dpverify.models.layouts import PipelineLayout, ShardedScenario, TPLayout
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
