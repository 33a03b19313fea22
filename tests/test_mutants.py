"""Every catalogued DataParallel bug is caught by the property suite, with a message that
points at it, and the correct from-scratch implementation passes the same properties."""

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


@pytest.mark.parametrize("check", sorted(PROPERTIES))
def test_scratch_data_parallel_passes_every_property(check: str) -> None:
    prop = PROPERTIES[check]

    @SEARCH
    @given(prop.scenarios)
    def run(scenario: Scenario) -> None:
        if check == "assert_loss_reduction_matches_full_batch":
            s = scenario.build()
            dpverify.assert_loss_reduction_matches_full_batch(
                s.module, s.inputs, device_ids=s.device_ids, reduce=weighted_replica_losses, parallel=ScratchDataParallel
            )
        else:
            prop.run(scenario, ScratchDataParallel)

    run()


def test_catalogue_entries_are_documented() -> None:
    assert len(MUTANTS) >= 9
    for mutant in MUTANTS.values():
        assert mutant.implementation.__doc__, mutant.name
        assert mutant.caught_by in PROPERTIES
        assert torch.is_tensor(torch.zeros(1))  # the catalogue imports without side effects
