"""Small smokes of exact mode's benchmark scripts: each runs, and its figures mean what they say."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import calibrate_exact
import exact_bounds


@pytest.mark.timeout(240)
def test_exact_calibration_smoke_counts_every_scenario_and_catches_every_one_ulp_injection(capsys: pytest.CaptureFixture[str]) -> None:
    tally = calibrate_exact.main(["--n", "11", "--show", "50"])
    out = capsys.readouterr().out
    assert tally.scenarios == 11
    assert tally.passes + tally.refused + tally.false_alarms + tally.crashes == tally.scenarios
    overall = tally.by_class["all"]
    assert (overall.scenarios, overall.passes, overall.refused, overall.false_alarms, overall.crashes) == (
        tally.scenarios, tally.passes, tally.refused, tally.false_alarms, tally.crashes,
    )
    # correct code of the exact set: no false alarm, no crash
    assert [f"{f.outcome}: {f.message}: {f.spec}" for f in tally.failures] == []
    # scenarios 0 and 10 carry the injections: whole tensor and one element, exact and default mode
    injected = sorted({calibrate_exact.Spec.parse(i.spec).i for i in tally.injections})
    assert injected == [i for i in (0, 10) if calibrate_exact.generate(i, 0).sens]
    assert {(i.where, i.exact) for i in tally.injections} == {(w, e) for w in calibrate_exact.WHERE for e in (True, False)}
    assert [i for i in tally.injections if i.exact and i.outcome != "caught"] == []
    # scenario 5 is timed in both modes
    assert len(tally.costs) == 1
    assert all(exact > 0 and default > 0 for _, exact, default, _ in tally.costs)
    assert "| false alarms (ParallelMismatch on correct code) |" in out
    assert "| backend | injected | exact mode: caught | default mode: caught |" in out


def test_exact_calibration_spec_round_trips_and_rebuilds_the_same_scenario() -> None:
    for index in range(40):
        spec = calibrate_exact.generate(index, 3)
        assert calibrate_exact.Spec.parse(str(spec)) == spec
        a, b = calibrate_exact.build(spec), calibrate_exact.build(str(spec))
        assert torch.equal(a.inputs, b.inputs)
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            assert torch.equal(p, q)
        assert spec.sens == (index % calibrate_exact.SENSITIVITY_EVERY == 0)


def test_exact_calibration_draws_what_exact_arithmetic_divides_by_as_powers_of_two() -> None:
    for index in range(300):
        spec = calibrate_exact.generate(index, 1)
        if spec.red == "mean":
            # a mean loss divides by the rows of the whole batch, a rank's shard or a microbatch, times the outputs
            rows = spec.B if spec.backend in ("dp", "tp") else spec.B // (spec.mb if spec.backend == "pp" else spec.W)
            count = rows * spec.O
            assert count & (count - 1) == 0, spec
        if spec.backend != "dp":
            assert spec.W & (spec.W - 1) == 0, spec


def test_a_nudge_is_one_unit_in_the_last_place() -> None:
    gradient = torch.tensor([[0.5, -3.0], [1e-3, 0.0]], dtype=torch.float64)
    up = torch.full_like(gradient, math.inf)
    whole = calibrate_exact.nudge(gradient, "whole")
    assert torch.equal(whole, torch.nextafter(gradient, up))
    one = calibrate_exact.nudge(gradient, "one")
    changed = (one != gradient).nonzero().tolist()
    assert changed == [[0, 1]]  # the largest element, -3.0, and nothing else
    assert one[0, 1] == torch.nextafter(torch.tensor(-3.0, dtype=torch.float64), torch.tensor(math.inf, dtype=torch.float64))


def test_exact_bounds_shrink_with_steps_and_three_steps_fit_nothing_at_width_8() -> None:
    one = exact_bounds.deepest(8, 1, 8, 6)
    two = exact_bounds.deepest(8, 2, 8, 6)
    assert one[0] is not None
    assert two[0] is not None
    assert one[0] >= two[0]
    assert exact_bounds.exact_bits(8, 0, 3, 8) is None
    # the bits of the deepest stack fit float64, one more layer does not
    assert one[1] is not None
    assert one[1] <= 53
    assert exact_bounds.exact_bits(8, one[0] + 1, 1, 8) is None
