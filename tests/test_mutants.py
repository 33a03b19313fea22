"""Every catalogued data-parallel bug is caught by the property suite, with a message that
points at it, and the correct hand-written implementations pass the same properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings

import dpverify
from dpverify.mutants import (
    MUTANTS,
    PROPERTIES,
    Mutant,
    ScratchDataParallel,
    manual_allreduce_step,
    weighted_replica_losses,
)
from dpverify.strategies import Scenario

# The search is bounded by the CI profile's examples; shrinking is left out to bound time.
SEARCH = settings(settings.get_profile("dpverify-ci"), database=None, print_blob=False, phases=[Phase.explicit, Phase.generate])


def _search(mutant: Mutant) -> None:
    @SEARCH
    @given(PROPERTIES[mutant.caught_by].scenarios)
    def run(scenario: Scenario) -> None:
        mutant.check(scenario)

    run()


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_is_caught_with_a_message_that_points_at_the_bug(name: str) -> None:
    mutant = MUTANTS[name]
    with pytest.raises(dpverify.ParallelMismatch, match=mutant.message.replace("(", r"\(").replace(")", r"\)")):
        _search(mutant)


#: The correct implementation each property runs: a DataParallel from scratch, a reduction
#: weighted by chunk size, a DDP step with a hand-written all-reduce, torch's no_sync recipe.
CORRECT = {
    "assert_dp_grads_match": ScratchDataParallel,
    "assert_grad_sum_equals_mean_loss_grad": ScratchDataParallel,
    "assert_dp_buffers_match": ScratchDataParallel,
    "assert_loss_reduction_matches_full_batch": weighted_replica_losses,
    "assert_ddp_grads_match": manual_allreduce_step,
    "assert_ddp_accumulation_matches": dpverify.no_sync_accumulation_step,
}


@pytest.mark.parametrize("check", sorted(PROPERTIES))
def test_correct_implementations_pass_every_property(check: str) -> None:
    prop, correct = PROPERTIES[check], CORRECT[check]

    @SEARCH
    @given(prop.scenarios)
    def run(scenario: Scenario) -> None:
        prop.run(scenario, correct)

    run()


def test_catalogue_entries_are_documented() -> None:
    assert len(MUTANTS) >= 15
    assert set(CORRECT) == set(PROPERTIES)
    for mutant in MUTANTS.values():
        assert mutant.implementation.__doc__, mutant.name
        assert mutant.caught_by in PROPERTIES
        assert torch.is_tensor(torch.zeros(1))  # the catalogue imports without side effects
