"""The property suite: DataParallel semantics over random scenarios (VirtualDataParallel on CPU,
the real one where the CUDA devices exist)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import dpverify
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


def _place(module: torch.nn.Module, scenario: Scenario) -> torch.device:
    device = torch.device("cuda", scenario.devices.device_ids[0]) if scenario.devices.real else torch.device("cpu")
    module.to(device)
    return device


@given(EXACT)
def test_batch_independent_deterministic_models_match_one_device(scenario: Scenario) -> None:
    s = scenario.build()
    dpverify.assert_dp_grads_match(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids,
        output_device=s.output_device, forward_kwargs=s.kwargs,
    )


@given(EXACT)
def test_replica_grads_sum_to_the_full_grad_and_average_to_it_over_replicas_used(scenario: Scenario) -> None:
    s = scenario.build()
    result = dpverify.assert_grad_sum_equals_mean_loss_grad(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids, forward_kwargs=s.kwargs
    )
    replicas = len(scenario.chunk_sizes)  # can be fewer than the devices
    assert result.notes[0].startswith(f"{replicas} replicas contributed")
    averages = [t for t in result.tensors if t.name.startswith("average of replica grads")]
    assert averages
    assert all(t.name.endswith(f"= full / {replicas}") and t.ok for t in averages)


@given(scenarios(models=model_specs(kinds=["loss-head"])))
def test_forward_loss_averaging_is_biased_exactly_by_the_chunk_weights(scenario: Scenario) -> None:
    s = scenario.build()
    report = dpverify.check_forward_loss_average(s.module, s.inputs, device_ids=s.device_ids)
    uneven = len(set(scenario.chunk_sizes)) > 1
    assert report.is_biased == uneven, str(report)
    assert report.loss_bias == pytest.approx(report.predicted_bias, rel=1e-8, abs=1e-12)
    assert report.weighted_mean == pytest.approx(report.full_batch_loss, rel=1e-10, abs=1e-12)
    assert report.weighted_grad_error < 1e-9

    def weighted(losses: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return (losses * torch.tensor(sizes, dtype=losses.dtype, device=losses.device)).sum() / sum(sizes)

    dpverify.assert_loss_reduction_matches_full_batch(s.module, s.inputs, device_ids=s.device_ids, reduce=weighted)


@given(scenarios(models=model_specs(kinds=["batchnorm", "dropout"])))
def test_batch_dependent_and_random_models_are_classified_not_false_alarms(scenario: Scenario) -> None:
    assume(not scenario.model.exact)
    s = scenario.build()
    kwargs = {"loss_fn": s.loss_fn, "device_ids": s.device_ids, "forward_kwargs": s.kwargs}
    responsible = "norm" if scenario.model.kind == "batchnorm" else "drop"
    outcome = _raised(lambda: dpverify.assert_dp_grads_match(s.module, s.inputs, s.target, **kwargs))
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
    # the same model in eval mode is exact
    exact = dataclasses.replace(scenario, model=dataclasses.replace(scenario.model, train=False)).build()
    dpverify.assert_dp_grads_match(exact.module, exact.inputs, exact.target, **kwargs)


@given(scenarios(models=model_specs(kinds=["buffer-counter", "attribute-counter"])))
def test_state_survives_from_replica_zero_only(scenario: Scenario) -> None:
    s = scenario.build()
    device = _place(s.module, scenario)
    wrapper = dpverify.data_parallel(s.module, s.device_ids, output_device=s.output_device)
    wrapper(*[x.to(device) for x in s.inputs])
    single_device = len(s.device_ids) == 1  # DataParallel then runs the module itself
    if scenario.model.kind == "buffer-counter":
        expected = scenario.batch_size if single_device else scenario.chunk_sizes[0]
        assert int(s.module.rows_seen) == expected
    else:
        assert s.module.calls == (1 if single_device else 0)


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
