"""Every catalogued data-parallel bug is caught by the property suite, with a message that
points at it, and the correct hand-written implementations pass the same properties."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import Phase, given, settings
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import dpverify
from dpverify.models.hooks import global_clip
from dpverify.mutants import (
    CLIP_NORM,
    EXACT_PROPERTIES,
    MUTANTS,
    PROPERTIES,
    Mutant,
    ReplicaOutputsDataParallel,
    ScratchDataParallel,
    WeightedCriterionParallel,
    gather_trim_eval,
    manual_allreduce_step,
    padded_loader,
    sum_count_eval,
    tp_global_clip,
    unpadded_loader,
    weighted_replica_losses,
)
from dpverify.registry import CHECKS, Target
from dpverify.sharded.fsdp import weighted_fsdp_step
from dpverify.sharded.pipeline_rank import sync_tied_grads
from dpverify.strategies import DataScenario, Scenario, ShardedScenario

# The search is bounded by the CI profile's examples; shrinking is left out to bound time.
SEARCH = settings(settings.get_profile("dpverify-ci"), database=None, print_blob=False, phases=[Phase.explicit, Phase.generate])


def _search(mutant: Mutant) -> None:
    if mutant.exact:
        _search_exact(mutant)
        return

    # (the derandomized examples follow this function's source: kept as it was)
    @SEARCH
    @given(PROPERTIES[mutant.caught_by].scenarios)
    def run(scenario: Scenario) -> None:
        mutant.check(scenario)

    run()


def _search_exact(mutant: Mutant) -> None:
    @SEARCH
    @given(mutant.caught_in.scenarios)
    def run(scenario: Scenario | ShardedScenario) -> None:
        mutant.check(scenario)

    run()


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_is_caught_with_a_message_that_points_at_the_bug(name: str) -> None:
    mutant = MUTANTS[name]
    with pytest.raises(dpverify.ParallelMismatch, match=mutant.message.replace("(", r"\(").replace(")", r"\)")):
        _search(mutant)


#: The correct implementation each property runs, by registry check: a DataParallel from
#: scratch, a reduction weighted by chunk size, a DDP step with a hand-written all-reduce,
#: torch's no_sync recipe, the FSDP2 step weighted by each rank's share of the batch, a
#: tensor-parallel clip by the norm of the full gradients; for the data checks, torch's
#: DistributedSampler construction with set_epoch (the scenario's own loader) and a
#: gather-then-trim evaluation over DistributedSampler's padded shards.
CORRECT: dict[str, Target] = {
    "dp-grads": Target(parallel=ScratchDataParallel),
    "dp-grad-sum": Target(parallel=ScratchDataParallel),
    "dp-buffers": Target(parallel=ScratchDataParallel),
    "dp-weighted-loss": Target(reduce=weighted_replica_losses),
    "dp-training": Target(parallel=ScratchDataParallel),
    "ddp-grads": Target(step=manual_allreduce_step),
    "ddp-accumulation": Target(step=dpverify.no_sync_accumulation_step),
    "fsdp-grads": Target(step=weighted_fsdp_step),
    "pp-grads": Target(schedule=ScheduleGPipe),
    "tp-grads": Target(plan=lambda layout, module: layout.plan(ColwiseParallel, RowwiseParallel)),
    "tp-training": Target(after_backward=tp_global_clip),
    "pp-training": Target(after_backward=sync_tied_grads),
    # torch's clip_grad_norm_ after backward: the global norm, under DDP and FSDP2 alike
    "ddp-training": Target(after_backward=functools.partial(global_clip, max_norm=CLIP_NORM)),
    "fsdp-training": Target(after_backward=functools.partial(global_clip, max_norm=CLIP_NORM)),
    "ddp-data": Target(),
    "ddp-metric": Target(loader=padded_loader, evaluate=gather_trim_eval),
}

#: Properties whose examples run three optimizer steps on ranks and twice on one device
#: (about 20 s a search): the end-to-end tier runs them whole.
TRAINING = {"ddp-training", "fsdp-training"}


@pytest.mark.parametrize("check", [pytest.param(name, marks=pytest.mark.deep) if name in TRAINING else name for name in sorted(PROPERTIES)])
def test_correct_implementations_pass_every_property(check: str) -> None:
    prop, correct = PROPERTIES[check], CORRECT[check]

    @SEARCH
    @given(prop.scenarios)
    def run(scenario: Scenario | DataScenario) -> None:
        prop.run(scenario, correct)

    run()


@pytest.mark.parametrize("check", sorted(EXACT_PROPERTIES))
def test_correct_implementations_pass_every_exact_property(check: str) -> None:
    # bit for bit: the hand-written DataParallel, all-reduce, FSDP2 step, plan and GPipe
    prop, correct = EXACT_PROPERTIES[check], CORRECT[check]

    @SEARCH
    @given(prop.scenarios)
    def run(scenario: Scenario | ShardedScenario) -> None:
        prop.run(scenario, correct)

    run()


ONE_ULP = sorted(name for name, mutant in MUTANTS.items() if mutant.exact)


@pytest.mark.parametrize("name", ONE_ULP)
def test_one_ulp_mutants_are_caught_in_exact_mode_within_5_examples(name: str) -> None:
    mutant = MUTANTS[name]

    @settings(SEARCH, max_examples=5)
    @given(mutant.caught_in.scenarios)
    def run(scenario: Scenario | ShardedScenario) -> None:
        mutant.check(scenario)

    with pytest.raises(dpverify.ParallelMismatch, match=mutant.message):
        run()


@pytest.mark.parametrize("name", ONE_ULP)
def test_one_ulp_mutants_pass_the_default_tolerance(name: str) -> None:
    # honest one-ulp bugs: on the same scenarios, the tolerance of the default mode lets
    # them through (which is why exact mode exists)
    mutant = MUTANTS[name]
    default = dataclasses.replace(mutant.caught_in, exact=False)

    @SEARCH
    @given(default.scenarios)
    def run(scenario: Scenario | ShardedScenario) -> None:
        default.run(scenario, mutant.target)

    run()


def test_a_sum_and_count_evaluation_over_ranks_without_padding_passes_the_metric_property() -> None:
    # the other correct evaluation: every sample on one rank, the loss sum and the count
    # all-reduced, then divided (the mutants integer-mean-eval and mean-of-rank-means-eval
    # run over the same loader)
    prop = PROPERTIES["ddp-metric"]
    correct = Target(loader=unpadded_loader, evaluate=sum_count_eval)

    @SEARCH
    @given(prop.scenarios)
    def run(scenario: DataScenario) -> None:
        prop.run(scenario, correct)

    run()


@pytest.mark.parametrize("check", ["dp-grads", "dp-grad-sum"])
def test_the_correct_model_criterion_pair_passes_the_gradient_properties(check: str) -> None:
    # the pair the criterion-mean-of-means mutant is compared with: the same model wrapper,
    # a criterion that weights each replica's loss by its rows
    prop = PROPERTIES[check]
    pair = Target(parallel=ReplicaOutputsDataParallel, parallel_loss=WeightedCriterionParallel)

    @SEARCH
    @given(prop.scenarios.filter(lambda scenario: scenario.loss.reduction == "mean"))  # its n_i/B weights are for mean losses
    def run(scenario: Scenario) -> None:
        prop.run(scenario, pair)

    run()


def test_catalogue_entries_are_documented_and_name_registry_checks() -> None:
    assert len(MUTANTS) >= 15
    # one one-ulp mutant per backend, each caught by its backend's gradient check in exact mode
    assert {MUTANTS[name].caught_by for name in ONE_ULP} == set(EXACT_PROPERTIES) == {f"{b}-grads" for b in ("dp", "ddp", "fsdp", "tp", "pp")}
    assert all(prop.exact and prop.check == name for name, prop in EXACT_PROPERTIES.items())
    sharded = [m for m in MUTANTS.values() if m.kind in ("fsdp-step", "tp-plan", "pp-schedule")]
    assert len(sharded) >= 6
    assert set(CORRECT) == set(PROPERTIES)
    data = {"ddp-data", "ddp-metric"}
    assert set(PROPERTIES) <= set(CHECKS)  # one registry: the data checks are checks like the others
    for name, prop in PROPERTIES.items():
        assert prop.check == name
    data_mutants = [m for m in MUTANTS.values() if m.kind in ("loader", "eval")]
    assert len(data_mutants) >= 6
    assert {m.caught_by for m in data_mutants} == data
    for mutant in MUTANTS.values():
        assert mutant.implementation.__doc__, mutant.name
        assert (mutant.model is not None) == (mutant.kind == "criterion"), mutant.name
        assert mutant.loader is None or mutant.kind == "eval", mutant.name
        assert mutant.caught_by in (EXACT_PROPERTIES if mutant.exact else PROPERTIES)
        assert mutant.caught_in is (EXACT_PROPERTIES if mutant.exact else PROPERTIES)[mutant.caught_by]
        assert (mutant.caught_by in data) == (mutant.kind in ("loader", "eval")), mutant.name
        assert mutant.caught_by in CHECKS
        if mutant.kind in ("loader", "eval"):
            assert mutant.target.loader is not None or mutant.target.evaluate is not None, mutant.name
            continue
        if mutant.kind == "hook":  # an after_backward hook runs in the training checks only
            assert CHECKS[mutant.caught_by].training, mutant.name
        if mutant.kind not in ("hook", "model"):  # the user's hook or model runs on any backend
            backend = {"ddp-step": "ddp", "fsdp-step": "fsdp", "tp-plan": "tp", "pp-schedule": "pp"}.get(mutant.kind, "dp")
            assert CHECKS[mutant.caught_by].backend == backend, mutant.name
        assert torch.is_tensor(torch.zeros(1))  # the catalogue imports without side effects
