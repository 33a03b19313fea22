"""Calibration of the float64-anchored tolerance against torch.testing.assert_close defaults.

Runs N random correct float32 DataParallel scenarios (exact models from
``dpverify.strategies``, virtual devices) with the loss scaled so that gradients range over
1e-8 .. 1e8, and reports, for dpverify's tolerance and for ``assert_close``'s float32
defaults (rtol 1.3e-6, atol 1e-5), side by side:

- false positives: correct DataParallel reported as a mismatch (target: 0);
- how close to the limit correct results come (error / allowed, percentiles);
- sensitivity: the smallest relative error in one parameter's gradient that is caught,
  per gradient scale, and how often a 1e-4 error is missed.

The perturbation is applied to the parallel step's gradients after the fact, so each
scenario runs its three steps once.

Usage: python benchmarks/calibrate.py [--n 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings

from dpverify._assertions import Check, References, _loss_of, _target_on
from dpverify._comparison import Tolerance, compare_tensors
from dpverify._step import StepResult
from dpverify.strategies import LossSpec, Scenario, dtypes, model_specs, scenarios

SCALES = (1e-8, 1e-4, 1.0, 1e4, 1e8)
DELTAS = tuple(10.0**-k for k in range(1, 10))  # 1e-1 .. 1e-9


@dataclass(frozen=True)
class ScaledLoss:
    """``scale * loss(output, target)``: moves every gradient by the same factor."""

    base: LossSpec
    scale: float

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.scale * self.base(output, target)


@dataclass
class Tally:
    runs: int = 0
    ours_false: int = 0
    close_false: int = 0
    ratios: list[float] | None = None
    ours_caught: dict[float, list[float]] | None = None
    close_caught: dict[float, list[float]] | None = None
    ours_missed_1e4: int = 0
    close_missed_1e4: int = 0
    suspects: list[str] | None = None
    ill_conditioned: int = 0

    def __post_init__(self) -> None:
        self.ratios, self.ours_caught, self.close_caught = [], defaultdict(list), defaultdict(list)
        self.suspects = []


def _assert_close_fails(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError:
        return True
    return False


def _ours_fails(name: str, actual: torch.Tensor, refs: References, tolerance: Tolerance) -> bool:
    expected = refs.expected.grads[name]
    anchor = refs.anchor.grads[name] if refs.anchor else None
    return not compare_tensors(name, actual, expected, anchor, tolerance).ok


#: A gradient whose float32 rounding error, relative to its size, is below this is "well
#: conditioned": an error of 1e-4 in it is far above what rounding can explain. (A gradient
#: that is analytically zero, or that cancels to a few ulps of its terms, carries no
#: relative information: no tolerance can tell a 1e-4 error in it from rounding.)
WELL_CONDITIONED = 1e-6


def _well_conditioned(name: str, refs: References) -> bool:
    expected, anchor = refs.expected.grads.get(name), refs.anchor.grads.get(name) if refs.anchor else None
    if expected is None or anchor is None:
        return False
    scale = float(anchor.abs().max())
    noise = float((expected.double() - anchor).abs().max())
    return scale > 0 and noise <= WELL_CONDITIONED * scale


def _smallest_caught(fails: Callable[[float], bool]) -> float:
    """The smallest relative perturbation on the DELTAS grid that is caught (inf: none)."""
    caught = math.inf
    for delta in DELTAS:
        if not fails(delta):
            break
        caught = delta
    return caught


def _measure(scenario: Scenario, scale: float, tally: Tally) -> None:
    s = scenario.build()
    loss = ScaledLoss(s.loss_fn, scale)
    check = Check.create(s.module, s.inputs, device_ids=s.device_ids, forward_kwargs=s.kwargs)
    parallel: StepResult = check.run(_loss_of(loss, _target_on(s.target, check, None)), parallel=True, record_replicas="magnitudes")
    refs = check.references(lambda dtype: _loss_of(loss, _target_on(s.target, check, dtype)))
    rows = check.compare(parallel, refs, outputs=False)
    tally.runs += 1
    if not all(r.ok for r in rows):
        tally.ours_false += 1
        worst = max(rows, key=lambda r: r.ratio)
        tally.suspects.append(f"false positive at scale {scale:g}: {worst.name} ratio {worst.ratio:.3g}: {scenario!r}")  # type: ignore[union-attr]
    tally.ratios.append(max((r.ratio for r in rows), default=0.0))  # type: ignore[union-attr]
    names = [n for n in refs.expected.grads if _well_conditioned(n, refs)]
    tally.close_false += any(_assert_close_fails(parallel.grads[n], refs.expected.grads[n]) for n in names)  # type: ignore[arg-type]
    if not names:
        tally.ill_conditioned += 1
        return
    name = names[scenario.seed % len(names)]
    grad = parallel.grads[name]
    assert grad is not None
    ours = _smallest_caught(lambda d: _ours_fails(name, grad * (1 + d), refs, check.tolerance))
    close = _smallest_caught(lambda d: _assert_close_fails(grad * (1 + d), refs.expected.grads[name]))  # type: ignore[arg-type]
    tally.ours_caught[scale].append(ours)  # type: ignore[index]
    tally.close_caught[scale].append(close)  # type: ignore[index]
    if ours > 1e-4:
        tally.ours_missed_1e4 += 1
        tally.suspects.append(f"1e-4 missed at scale {scale:g} in {name!r} (smallest caught {ours:g}): {scenario!r}")  # type: ignore[union-attr]
    tally.close_missed_1e4 += close > 1e-4


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _fmt(delta: float) -> str:
    return "never" if math.isinf(delta) else f"{delta:.0e}"


def report(tally: Tally, seconds: float, show: int = 0) -> None:
    assert tally.ratios is not None
    assert tally.ours_caught is not None
    assert tally.close_caught is not None
    print(f"{tally.runs} correct float32 scenarios in {seconds:.0f} s\n")
    print("| | dpverify (float64-anchored) | assert_close defaults |")
    print("|---|---:|---:|")
    print(f"| false positives | {tally.ours_false} | {tally.close_false} |")
    print(f"| 1e-4 error in one parameter missed | {tally.ours_missed_1e4} | {tally.close_missed_1e4} |")
    print(
        f"\nThe perturbed parameter is drawn among those whose gradient is well conditioned (float32 "
        f"rounding below {WELL_CONDITIONED:g} of its size); {tally.ill_conditioned} scenarios had none "
        "and are left out of the sensitivity figures."
    )
    r = tally.ratios
    print(
        f"\nError / allowed on correct runs: median {statistics.median(r):.3g}, p90 {_percentile(r, 0.9):.3g}, "
        f"p99 {_percentile(r, 0.99):.3g}, max {max(r):.3g}\n"
    )
    print("| gradient scale | dpverify: median / worst smallest error caught | assert_close: median / worst |")
    print("|---:|---:|---:|")
    for scale in SCALES:
        ours, close = tally.ours_caught[scale], tally.close_caught[scale]
        if not ours:
            continue
        print(
            f"| {scale:.0e} | {_fmt(statistics.median(ours))} / {_fmt(max(ours))} | "
            f"{_fmt(statistics.median(close))} / {_fmt(max(close))} |"
        )
    for line in (tally.suspects or [])[:show]:
        print(line)


def main(argv: Sequence[str] | None = None) -> Tally:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000, help="scenarios (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=20, help="print up to this many false positives and misses")
    args = parser.parse_args(argv)
    tally = Tally()
    counter = iter(range(10**9))

    @seed(args.seed)
    @settings(
        max_examples=args.n, database=None, deadline=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(scenarios(models=model_specs(exact=True), dtype=dtypes().filter(lambda d: d == torch.float32)))
    def run(scenario: Scenario) -> None:
        _measure(scenario, SCALES[next(counter) % len(SCALES)], tally)

    started = time.perf_counter()
    run()
    report(tally, time.perf_counter() - started, args.show)
    return tally


if __name__ == "__main__":
    main()
