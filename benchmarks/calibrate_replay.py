"""How often DataParallel's parallel step is bit-identical to dpverify's replay of its
algorithm, and how many tensors the replay settles, on ``calibrate.py``'s scenarios.

For every scenario of ``calibrate.py``'s generator (the same specs, models and losses):

- the parallel step of ``assert_dp_grads_match`` (``dpverify.data_parallel``, on the
  scenario's devices and ``output_device``) and the replay of DataParallel's algorithm
  (``dpverify.checks.replay.replay_step``), in the working dtype: whether every output, the
  loss and every gradient are bit-identical (``torch.equal``), per scenario, per tensor and
  per class;
- ``calibrate.py``'s checks as it runs them (``run_scenario``), counting the replays run
  (only where a tensor fails every other sample of the rounding) and the tensors they
  settle; with ``--no-split``, the chunk-by-chunk sample is switched off, so that every
  tensor that fails the full-batch samples reaches the replay: how many of those false
  alarms the replay alone settles.

Usage:
    python benchmarks/calibrate_replay.py [--n 2000] [--seed 0] [--no-split] [--show 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate

import dpverify.checks.dp as assertions
from dpverify.checks.replay import replay_step
from dpverify.core.step import StepResult


@dataclass
class Counts:
    """Scenarios whose parallel step is bit-identical to the replay, and those not."""

    identical: int = 0
    different: int = 0


@dataclass
class ReplayTally:
    identity: dict[str, Counts] = field(default_factory=lambda: defaultdict(Counts))
    tensors_identical: int = 0
    tensors_different: int = 0
    different_kinds: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    #: tensors of correct code that failed every other sample and reached the replay, and
    #: those it settled; and the same for the sensitivity subsample's injected errors
    reached: int = 0
    settled: int = 0
    injected_reached: int = 0
    injected_settled: int = 0
    replays: int = 0
    settled_classes: Counter[str] = field(default_factory=Counter)
    calibration: calibrate.Tally = field(default_factory=calibrate.Tally)
    seconds: float = 0.0


def _tensors(step: StepResult) -> Iterator[tuple[str, torch.Tensor | None]]:
    yield from step.outputs
    yield "loss", step.loss
    yield from ((f"grad {name}", grad) for name, grad in step.grads.items())


def identical_tensors(spec: calibrate.Spec, sc: calibrate.Scenario) -> list[tuple[str, bool]]:
    """Each tensor of the scenario's parallel step, and whether the replay's is equal to it."""
    check = assertions.Check.create(
        sc.module, sc.inputs, device_ids=list(spec.dev), output_device=spec.out, forward_kwargs=sc.kwargs or None,
    )
    loss = assertions._loss_of(sc.loss_fn, assertions._target_on(sc.target, check, None))
    parallel = check.run(loss, parallel=True, record_replicas=True)
    replayed = dict(_tensors(replay_step(check, loss)))
    found = []
    for name, tensor in _tensors(parallel):
        found.append((name, _same(tensor, replayed.get(name))))
    return found


def _same(tensor: torch.Tensor | None, mine: torch.Tensor | None) -> bool:
    """Bit-identical; a parameter no replica used is None in the replay and zeros in
    torch's reduce-add, which are the same."""
    if tensor is None or mine is None:
        present = tensor if tensor is not None else mine
        return present is None or not bool(present.any())
    return tensor.dtype == mine.dtype and torch.equal(tensor, mine)


@contextmanager
def counting(tally: ReplayTally, classes: Callable[[], Sequence[str]], *, split: bool) -> Iterator[None]:
    """Counts the replays the checks run and the tensors they settle; without ``split``,
    the chunk-by-chunk sample is off."""
    settle, replay, split_sample = assertions.settle_by_replay, assertions.replay_dataparallel, assertions.References.split_sample
    sensitivity = calibrate._sensitivity
    injecting: list[bool] = []

    def counted_settle(result: Any, *args: Any) -> Any:
        settled = settle(result, *args)
        if injecting:
            tally.injected_reached += 1
            tally.injected_settled += settled.replay is not None
            return settled
        tally.reached += 1
        if settled.replay is not None:
            tally.settled += 1
            tally.settled_classes.update(classes())
        return settled

    def counted_sensitivity(*args: Any) -> None:
        injecting.append(True)
        try:
            sensitivity(*args)
        finally:
            injecting.pop()

    def counted_replay(*args: Any) -> Any:
        tally.replays += 1
        return replay(*args)

    assertions.settle_by_replay, assertions.replay_dataparallel = counted_settle, counted_replay
    calibrate._sensitivity = counted_sensitivity
    if not split:
        assertions.References.split_sample = lambda *_args: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        assertions.settle_by_replay, assertions.replay_dataparallel = settle, replay
        calibrate._sensitivity = sensitivity
        assertions.References.split_sample = split_sample  # type: ignore[method-assign]


def run(n: int, seed: int, *, split: bool) -> ReplayTally:
    tally = ReplayTally()
    current: list[str] = []
    started = time.perf_counter()
    with counting(tally, lambda: current, split=split):
        for index in range(n):
            spec = calibrate.generate(index, seed)
            current[:] = spec.classes
            if calibrate.run_scenario(spec, tally.calibration) == "skipped":
                continue
            try:
                found = identical_tensors(spec, calibrate.build(spec))
            except Exception as error:  # counted, not hidden: the scenario is left out of the identity counts
                tally.errors[f"{type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"] += 1
                continue
            same = all(ok for _name, ok in found)
            for name in ["all", *spec.classes]:
                counts = tally.identity[name]
                counts.identical += same
                counts.different += not same
            tally.tensors_identical += sum(ok for _name, ok in found)
            tally.tensors_different += sum(not ok for _name, ok in found)
            tally.different_kinds.update(calibrate._tensor_kind(name) for name, ok in found if not ok)
            if not same:
                tally.examples.append(f"{spec}  ({', '.join(name for name, ok in found if not ok)[:120]})")
    tally.seconds = time.perf_counter() - started
    return tally


def report(tally: ReplayTally, seed: int, split: bool, show: int) -> None:
    cal = tally.calibration
    total = tally.identity["all"]
    print(f"\n{cal.scenarios + cal.skipped} scenarios (seed {seed}, chunk-by-chunk sample {'on' if split else 'off'}) "
          f"in {tally.seconds:.0f} s; {cal.skipped} skipped (not finite in the working dtype)\n")
    print("| | count |")
    print("|---|---:|")
    print(f"| parallel step bit-identical to the replay | {total.identical} scenarios |")
    print(f"| not bit-identical | {total.different} scenarios |")
    print(f"| tensors bit-identical / not | {tally.tensors_identical} / {tally.tensors_different} |")
    print(f"| scenarios the identity test could not run | {sum(tally.errors.values())} |")
    print(f"| false alarms (calibrate.py's checks) | {cal.false_alarms} |")
    print(f"| crashes | {cal.crashes} |")
    print(f"| tensors that reached the replay (failed every other sample) | {tally.reached} |")
    print(f"| of them settled by the replay | {tally.settled} |")
    print(f"| replays run (correct code and injections) | {tally.replays} |")
    print(f"| injected errors' tensors that reached the replay / settled by it | {tally.injected_reached} / {tally.injected_settled} |")
    print("\nPer class (scenarios bit-identical / not):\n")
    print("| class | identical | not |")
    print("|---|---:|---:|")
    for name in sorted(tally.identity, key=lambda k: (k != "all", k)):
        counts = tally.identity[name]
        print(f"| {name} | {counts.identical} | {counts.different} |")
    if tally.settled_classes:
        print("\nSettled tensors per class: " + ", ".join(f"{c} {k}" for c, k in tally.settled_classes.most_common(12)))
    if tally.different_kinds:
        print("\nTensors not bit-identical, by kind: " + ", ".join(f"{k} {c}" for k, c in tally.different_kinds.most_common()))
    for line in tally.examples[:show]:
        print(f"    {line}")
    for text, count in tally.errors.most_common(show):
        print(f"    identity test raised {count} x {text}")
    for failure in cal.failures[:show]:
        print(f"    {failure.outcome}, {failure.check}: {failure.spec}\n      {failure.message}")


def main(argv: Sequence[str] | None = None) -> ReplayTally:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="scenarios (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-split", action="store_true", help="switch the chunk-by-chunk sample off")
    parser.add_argument("--show", type=int, default=10, help="examples listed (default 10)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibrate.py runs
    try:
        tally = run(args.n, args.seed, split=not args.no_split)
    finally:
        torch.set_num_threads(threads)
    report(tally, args.seed, not args.no_split, args.show)
    return tally


if __name__ == "__main__":
    main()
