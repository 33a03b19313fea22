"""Every catalogued DataParallel bug is caught by the property suite, with a message that
points at it, and the correct from-scratch implementation passes the same properties."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import Phase, assume, given, settings
from hypothesis.strategies import SearchStrategy

import dpverify
from dpverify.mutants import MUTANTS, Mutant, ScratchDataParallel, weighted_replica_losses
from dpverify.strategies import Scenario, device_lists, model_specs, scenarios

# A data-parallel bug can only show with two devices or more.
DEVICES = device_lists(min_devices=2)
EXACT = scenarios(models=model_specs(exact=True), devices=DEVICES)
LOSS_HEADS = scenarios(models=model_specs(kinds=["loss-head"]), devices=DEVICES)
STATEFUL = scenarios(models=model_specs(kinds=["buffer-counter", "batchnorm"]), devices=DEVICES)
# The search is bounded by the CI profile's examples; shrinking is left out to bound time.
SEARCH = settings(settings.get_profile("dpverify-ci"), database=None, print_blob=False, phases=[Phase.explicit, Phase.generate])


def grads_match(scenario: Scenario, parallel: Any) -> None:
    s = scenario.build()
    dpverify.assert_dp_grads_match(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids,
        output_device=s.output_device, forward_kwargs=s.kwargs, parallel=parallel,
    )


def grad_sum(scenario: Scenario, parallel: Any) -> None:
    s = scenario.build()
    dpverify.assert_grad_sum_equals_mean_loss_grad(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids,
        forward_kwargs=s.kwargs, parallel=parallel,
    )


def buffers_match(scenario: Scenario, parallel: Any) -> None:
    assume(not (scenario.model.kind == "batchnorm" and scenario.model.train and min(scenario.chunk_sizes) < 2))
    s = scenario.build()
    dpverify.assert_dp_buffers_match(s.module, s.inputs, device_ids=s.device_ids, forward_kwargs=s.kwargs, parallel=parallel)


def loss_reduction(scenario: Scenario, reduce: Any, parallel: Any = None) -> None:
    s = scenario.build()
    dpverify.assert_loss_reduction_matches_full_batch(s.module, s.inputs, device_ids=s.device_ids, reduce=reduce, parallel=parallel)


PROPERTIES: dict[str, tuple[SearchStrategy[Scenario], Callable[[Scenario, Any], None]]] = {
    "assert_dp_grads_match": (EXACT, grads_match),
    "assert_grad_sum_equals_mean_loss_grad": (EXACT, grad_sum),
    "assert_dp_buffers_match": (STATEFUL, buffers_match),
    "assert_loss_reduction_matches_full_batch": (LOSS_HEADS, loss_reduction),
}


def _search(mutant: Mutant) -> None:
    strategy, prop = PROPERTIES[mutant.caught_by]

    @SEARCH
    @given(strategy)
    def run(scenario: Scenario) -> None:
        prop(scenario, mutant.implementation)

    run()


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_is_caught_with_a_message_that_points_at_the_bug(name: str) -> None:
    mutant = MUTANTS[name]
    with pytest.raises(dpverify.ParallelMismatch, match=mutant.message.replace("(", r"\(").replace(")", r"\)")):
        _search(mutant)


@pytest.mark.parametrize("check", sorted(PROPERTIES))
def test_scratch_data_parallel_passes_every_property(check: str) -> None:
    strategy, prop = PROPERTIES[check]

    @SEARCH
    @given(strategy)
    def run(scenario: Scenario) -> None:
        if check == "assert_loss_reduction_matches_full_batch":
            loss_reduction(scenario, weighted_replica_losses, ScratchDataParallel)
        else:
            prop(scenario, ScratchDataParallel)

    run()


def test_catalogue_entries_are_documented() -> None:
    assert len(MUTANTS) >= 9
    for mutant in MUTANTS.values():
        assert mutant.implementation.__doc__, mutant.name
        assert mutant.caught_by in PROPERTIES
        assert torch.is_tensor(torch.zeros(1))  # the catalogue imports without side effects
