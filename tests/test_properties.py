"""The property suite: DataParallel semantics over random scenarios (VirtualDataParallel on CPU,
the real one where the CUDA devices exist), each run as a registry check by name, the way
every front end runs it; torch's own code passes the scenarios the mutants are searched on,
and a mutant is a failing verdict of its check."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import dpverify
from dpverify.checks.loss_average import LossAverageReport
from dpverify.models.specs import DeviceList, LossSpec, ModelSpec
from dpverify.mutants import MUTANTS, PROPERTIES
from dpverify.registry import CHECKS, Case, Target, Verdict
from dpverify.strategies import Scenario, batch_sizes, device_lists, dtypes, model_specs, scenarios

# Every dtype a model trains in, 16-bit ones included: the tolerance follows each dtype's
# roundoff, so correct DataParallel must pass in all of them.
EXACT = scenarios(models=model_specs(exact=True), dtype=dtypes(bfloat16=True, float16=True))


def _raised(run: Callable[[], object]) -> Exception | None:
    """The ParallelMismatch or ValueError ``run`` raises, or None."""
    try:
        run()
    except (dpverify.ParallelMismatch, ValueError) as error:
        return error
    return None


def _placed(case: Case, scenario: Scenario) -> Case:
    """``case`` on ``device_ids[0]`` when the scenario's devices are real CUDA devices (torch's
    DataParallel wants the module there); unchanged on virtual devices."""
    if not scenario.devices.real:
        return case
    device = torch.device("cuda", scenario.devices.device_ids[0])
    case.module.to(device)
    return dataclasses.replace(case, inputs=tuple(x.to(device) for x in case.inputs))


@given(EXACT)
def test_batch_independent_deterministic_models_match_one_device(scenario: Scenario) -> None:
    CHECKS["dp-grads"].check(Case.from_scenario(scenario))


@given(EXACT)
def test_replica_grads_sum_to_the_full_grad_and_average_to_it_over_replicas_used(scenario: Scenario) -> None:
    result = CHECKS["dp-grad-sum"].check(Case.from_scenario(scenario))
    assert isinstance(result, dpverify.StepComparison)
    replicas = len(scenario.chunk_sizes)  # can be fewer than the devices
    assert result.notes[0] == f"{replicas} replica{'s' if replicas != 1 else ''} contributed (chunks {scenario.chunk_sizes})."
    averages = [t for t in result.tensors if t.name.startswith("average of replica grads")]
    assert averages
    assert all(t.name.endswith(f"= full / {replicas}") and t.ok for t in averages)


@given(scenarios(models=model_specs(kinds=["loss-head"])))
def test_forward_loss_averaging_is_biased_exactly_by_the_chunk_weights(scenario: Scenario) -> None:
    case = Case.from_scenario(scenario)
    report = CHECKS["dp-loss-average"].check(case)
    assert isinstance(report, LossAverageReport)
    uneven = len(set(scenario.chunk_sizes)) > 1
    assert report.is_biased == uneven, str(report)
    assert report.loss_bias == pytest.approx(report.predicted_bias, rel=1e-8, abs=1e-12)
    assert report.weighted_mean == pytest.approx(report.full_batch_loss, rel=1e-10, abs=1e-12)
    assert report.weighted_grad_error < 1e-9
    # biased on uneven chunks is a warning about the training loop, never a failure; one
    # chunk ran one replica: nothing parallel, a skip
    serial = len(scenario.chunk_sizes) == 1
    expected = Verdict.SKIP if serial else Verdict.WARN if uneven else Verdict.PASS
    assert CHECKS["dp-loss-average"].run(case).verdict is expected

    CHECKS["dp-weighted-loss"].check(case, Target(reduce=dpverify.chunk_weighted_loss))


@given(scenarios(models=model_specs(kinds=["batchnorm", "dropout"])))
def test_batch_dependent_and_random_models_are_classified_not_false_alarms(scenario: Scenario) -> None:
    assume(not scenario.model.exact)
    case = Case.from_scenario(scenario)
    responsible = "norm" if scenario.model.kind == "batchnorm" else "drop"
    outcome = _raised(lambda: CHECKS["dp-grads"].check(case))
    if isinstance(outcome, dpverify.ParallelMismatch):
        assert isinstance(outcome.report, dpverify.StepComparison)
        assert [d.module for d in outcome.report.divergence] == [responsible]
        assert f"'{responsible}' (" in str(outcome)
    elif outcome is not None:  # BatchNorm given one row: in a replica, or on one device
        assert "Expected more than 1 value per channel" in str(outcome)
        assert "batch statistics" in "\n".join(outcome.__notes__)
    else:
        # Dropout masks on tiny layers can coincide by chance; batch statistics of a split
        # batch never equal the whole batch's.
        assert scenario.model.kind == "dropout" or len(scenario.chunk_sizes) == 1
    # the registry's verdict: explained by the responsible module, not a failure
    result = CHECKS["dp-grads"].run(Case.from_scenario(scenario))
    matched = Verdict.SKIP if len(scenario.chunk_sizes) == 1 else Verdict.PASS  # one replica: nothing parallel
    assert result.verdict is (matched if outcome is None else Verdict.EXPLAINED), result.summary
    # the same model in eval mode is exact
    CHECKS["dp-grads"].check(case.in_eval_mode())


@given(scenarios(models=model_specs(kinds=["buffer-counter", "attribute-counter"])))
def test_state_survives_from_replica_zero_only(scenario: Scenario) -> None:
    # rows_seen keeps replica 0's chunk (the whole batch on one device); calls is lost on
    # every replica (1 on one device, where DataParallel runs the module itself)
    CHECKS["dp-state"].check(_placed(Case.from_scenario(scenario), scenario))


#: The properties whose examples run three optimizer steps on ranks and twice on one device
#: (about 20 s a search): the end-to-end tier runs them.
TRAINING = {"ddp-training", "fsdp-training"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.deep) if name in TRAINING else name for name in sorted(PROPERTIES)])
def test_torch_passes_every_property_the_mutants_fail(name: str) -> None:
    """torch's own DataParallel, reduction and DDP step pass the scenarios each mutant is
    searched on, in float32 and float64: a caught mutant is the mutant's fault."""

    @given(PROPERTIES[name].scenarios)
    def run(scenario: Scenario) -> None:
        PROPERTIES[name].run(scenario)

    run()


#: torch's own DDP in float64, where the DDP checks called rounding a mismatch before a
#: failing tensor got a second look (dpverify.ranked.check.References): l1's sign
#: gradients of the bias cancel to 0 over the batch but not on each rank (one device rounds
#: their mean to 2.8e-17, the all-reduce of the ranks' thirds to 0: rounding of the size of
#: the terms it sums), and a GRU's micro-batch accumulation reorders sums (float64 rounding
#: of the model, which the float64 anchor cannot show and a float32 probe does).
FLOAT64_DDP = {
    "ddp-grads": Scenario(
        ModelSpec("linear", features=3, outputs=1, train=False), 12, DeviceList((0, 1, 2)),
        LossSpec("l1"), torch.float64, seed=1,
    ),
    "ddp-accumulation": Scenario(
        ModelSpec("gru", features=1, hidden=3, outputs=1, depth=2, train=False), 6,
        DeviceList((0, 1, 2)), LossSpec("mse"), torch.float64, seed=2,
    ),
}


@pytest.mark.parametrize("name", sorted(FLOAT64_DDP))
def test_torch_ddp_in_float64_is_no_false_alarm(name: str) -> None:
    CHECKS[name].check(Case.from_scenario(FLOAT64_DDP[name]))


#: One mutant per registry check, on a scenario that shows its bug (the shrunk
#: counterexamples of benchmarks/mutants.py).
CAUGHT = {
    "dp-grads": ("averaging", Scenario(batch_size=2, devices=DeviceList((0, 1, 2)))),
    "dp-grad-sum": ("detached-replicas", Scenario(batch_size=2, devices=DeviceList((0, 1, 2)))),
    "dp-buffers": ("last-replica-buffers", Scenario(ModelSpec("batchnorm"), 4)),
    "dp-weighted-loss": ("mean-of-means", Scenario(ModelSpec("loss-head"), 3)),
    "dp-training": ("lost-forward-state", Scenario(batch_size=2)),
    "ddp-grads": ("ddp-summed-allreduce", Scenario(batch_size=4)),
    "ddp-accumulation": ("ddp-undivided-accumulation", Scenario(batch_size=4)),
}


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_a_mutant_is_a_failing_verdict_of_its_registry_check(name: str) -> None:
    mutant, scenario = MUTANTS[CAUGHT[name][0]], CAUGHT[name][1]
    assert mutant.caught_by == name
    result = CHECKS[name].run(Case.from_scenario(scenario), mutant.target)
    assert result.verdict is Verdict.FAIL, result.summary
    assert isinstance(result.error, dpverify.ParallelMismatch)
    assert mutant.message in result.detail
    assert CHECKS[name].run(Case.from_scenario(scenario)).verdict is Verdict.PASS


@given(device_lists(min_devices=2), st.data())
def test_positional_inputs_of_different_lengths_drop_rows(devices: dpverify.strategies.DeviceList, data: st.DataObject) -> None:
    n = len(devices.device_ids)
    rows_x = data.draw(batch_sizes(n), label="rows_x")
    rows_y = data.draw(batch_sizes(n), label="rows_y")
    chunks_x, chunks_y = dpverify.chunk_sizes(rows_x, n), dpverify.chunk_sizes(rows_y, n)
    replicas = min(len(chunks_x), len(chunks_y))
    kept_x = sum(chunks_x[:replicas])
    x, y = torch.arange(float(rows_x)).unsqueeze(1), torch.ones(rows_y, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dpverify.plan_scatter((x, y), None, list(devices.device_ids))
    dropped = [w for w in caught if issubclass(w.category, dpverify.DroppedRowsWarning)]
    assert plan.n_replicas == replicas
    assert bool(dropped) == (kept_x < rows_x or sum(chunks_y[:replicas]) < rows_y)

    class Add(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b.sum()

    out = dpverify.VirtualDataParallel(Add(), list(devices.device_ids))(x, y)
    assert out.shape[0] == (rows_x if n == 1 else kept_x)
