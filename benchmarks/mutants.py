"""How fast the property suite finds each catalogued bug (``dpverify.mutants``).

For every mutant: the registry check that catches it (``dpverify.registry.CHECKS``,
or the data check, run on ``PROPERTIES``' scenarios; a one-ulp mutant's in exact mode,
on ``EXACT_PROPERTIES``'), the examples and seconds until the first failing scenario
(random generation, several seeds, medians), then the counterexample Hypothesis shrinks it
to and that counterexample's size (model kind, rows, devices; for a data mutant the
``DataScenario`` in words).

Usage: python benchmarks/mutants.py [--seeds 5] [--max-examples 500] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from hypothesis import HealthCheck, Phase, find, given, seed, settings

import dpverify
from dpverify.models.layouts import ShardedScenario
from dpverify.mutants import MUTANTS, Mutant
from dpverify.strategies import DataScenario, Scenario

AnyScenario = Scenario | ShardedScenario | DataScenario


class Found(Exception):
    """Raised by the search at the first failing example."""


def examples_until_found(mutant: Mutant, seed_value: int, max_examples: int) -> tuple[int | None, float]:
    count = 0

    @seed(seed_value)
    @settings(max_examples=max_examples, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(mutant.caught_in.scenarios)
    def search(scenario: AnyScenario) -> None:
        nonlocal count
        count += 1
        try:
            mutant.check(scenario)
        except dpverify.ParallelMismatch as caught:
            raise Found from caught

    started = time.perf_counter()
    try:
        search()
    except Found:
        return count, time.perf_counter() - started
    return None, time.perf_counter() - started


def _fails(mutant: Mutant, scenario: AnyScenario) -> bool:
    try:
        mutant.check(scenario)
    except dpverify.ParallelMismatch:
        return True
    return False


def shrunk(mutant: Mutant) -> AnyScenario:
    found = find(
        mutant.caught_in.scenarios,
        lambda s: _fails(mutant, s),
        settings=settings(database=None, max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck)),
    )
    assert isinstance(found, (Scenario, ShardedScenario, DataScenario))
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--max-examples", type=int, default=500)
    parser.add_argument("--only", nargs="+", choices=list(MUTANTS), metavar="NAME", help="these mutants only (default all)")
    args = parser.parse_args(argv)
    print("| mutant | bug | caught by | examples until found (median, max) | seconds (median) | shrunk counterexample |")
    print("|---|---|---|---:|---:|---|")
    for mutant in (MUTANTS[name] for name in args.only) if args.only else MUTANTS.values():
        caught_by = f"`{mutant.caught_by}`" + (" (exact)" if mutant.exact else "")
        runs = [examples_until_found(mutant, s, args.max_examples) for s in range(args.seeds)]
        found = [n for n, _ in runs if n is not None]
        seconds = statistics.median(t for _, t in runs)
        missed = len(runs) - len(found)
        counts = f"{statistics.median(found):g}, {max(found)}" if found else "not found"
        if missed:
            counts += f" ({missed} of {len(runs)} seeds missed)"
        shrunk_example = shrunk(mutant)
        if isinstance(shrunk_example, DataScenario):
            print(f"| {mutant.name} | {mutant.bug} | {caught_by} | {counts} | {seconds:.2f} | {shrunk_example} |")
            continue
        # a sharded scenario is a plain one on its ranks, with a layout
        example = shrunk_example.scenario if isinstance(shrunk_example, ShardedScenario) else shrunk_example
        size = f"{example.model.kind}, {example.batch_size} rows, devices {list(example.devices.device_ids)}"
        if example.devices.output_device is not None:
            size += f", output_device {example.devices.output_device}"
        if isinstance(shrunk_example, ShardedScenario):
            size += f", {shrunk_example.layout!r}"
        print(f"| {mutant.name} | {mutant.bug} | {caught_by} | {counts} | {seconds:.2f} | {size} |")


if __name__ == "__main__":
    main()
