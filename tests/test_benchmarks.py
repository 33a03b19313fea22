"""Small smokes of the benchmark scripts: each runs, and its figures mean what they say."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_ddp_pool
import bench_overhead
import calibrate
import mutants as mutants_benchmark

from dpverify.mutants import MUTANTS


def test_calibration_smoke_has_no_false_positive_and_no_miss(capsys: pytest.CaptureFixture[str]) -> None:
    tally = calibrate.main(["--n", "25", "--show", "0"])
    assert tally.runs == 25
    assert tally.ours_false == 0
    assert tally.ours_missed_1e4 == 0
    assert "| false positives | 0 |" in capsys.readouterr().out


def test_overhead_smoke_measures_both_sides() -> None:
    params, floor, check = bench_overhead.measure(width=18, batch=8, repeats=1)
    assert params == 1026
    assert 0 < floor < check * 50
    assert check > 0


def test_mutant_benchmark_finds_a_mutant() -> None:
    found, seconds = mutants_benchmark.examples_until_found(MUTANTS["averaging"], 0, 200)
    assert found is not None
    assert found >= 1
    assert seconds > 0


@pytest.mark.timeout(180)
def test_ddp_pool_benchmark_smoke() -> None:
    examples = bench_ddp_pool.scenarios(4, 2)
    seconds, rate = bench_ddp_pool.through_pool(examples, 2)
    assert seconds > 0
    assert rate > 0
