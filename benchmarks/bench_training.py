"""What a 3-step training check costs against a one-step check, on the same pooled ranks.

For every backend the registry's training check (``dp-training``, ``ddp-training``, ...:
three optimizer steps of SGD with momentum, parameters, buffers and optimizer state
compared with single-device training after every step, float64-anchored) and its one-step
gradient check (``dp-grads``, ``ddp-grads``, ...) run on the same small Sequential MLPs,
the ranked ones through one ``DDPWorkerPool`` (DataParallel on virtual devices in this
process), interleaved example by example so that a loaded machine slows both alike. The
goal: a 3-step training check costs at most 3x a one-step check.

    python benchmarks/bench_training.py                       # every backend on 2 ranks
    python benchmarks/bench_training.py --backends fsdp --examples 40
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from dpverify.ddp.pool import DDPWorkerPool
from dpverify.registry import CHECKS, TRAINING_STEPS, Case, Target

#: The one-step check and the training check of each backend.
CHECK = {
    "dp": ("dp-grads", "dp-training"), "ddp": ("ddp-grads", "ddp-training"), "fsdp": ("fsdp-grads", "fsdp-training"),
    "tp": ("tp-grads", "tp-training"), "pp": ("pp-grads", "pp-training"),
}


@dataclass(frozen=True)
class Example:
    """One scenario: a Sequential MLP's width, a seed and the rows of each batch."""

    seed: int
    hidden: int
    rows: int

    def case(self, world_size: int) -> Case:
        """The one-step check's case; its ``batches`` are the training check's, one
        distinct batch per optimizer step."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            module = nn.Sequential(nn.Linear(6, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 8), nn.Tanh(), nn.Linear(8, 3))
        generator = torch.Generator().manual_seed(self.seed)
        pairs = tuple((torch.randn(self.rows, 6, generator=generator), torch.randn(self.rows, 3, generator=generator)) for _ in range(TRAINING_STEPS))
        x, y = pairs[0]
        return Case(module, (x,), y, F.mse_loss, tuple(range(world_size)), batches=pairs)


def examples(count: int, world_size: int) -> list[Example]:
    """``count`` examples of widths 8 to 32, batches of 2 rows per rank."""
    return [Example(seed=i, hidden=8 * (1 + i % 4), rows=2 * world_size) for i in range(count)]


def timed(name: str, case: Case, pool: DDPWorkerPool) -> float:
    begin = time.perf_counter()
    CHECKS[name].check(case, Target(pool=pool))
    return time.perf_counter() - begin


@dataclass(frozen=True)
class Row:
    """One backend's times: the median seconds of a one-step and of a training check, and
    the ratio of their totals."""

    backend: str
    one_step: float
    training: float
    ratio: float


def measure(backend: str, batch: Sequence[Example], world_size: int, pool: DDPWorkerPool) -> Row:
    """Both checks on every example, interleaved, after one warm-up of each."""
    one, trained = CHECK[backend]
    cases = [example.case(world_size) for example in batch]
    timed(one, cases[0], pool)
    timed(trained, cases[0], pool)
    one_times, training_times = [], []
    for case in cases:
        one_times.append(timed(one, replace(case), pool))
        training_times.append(timed(trained, replace(case), pool))
    return Row(backend, statistics.median(one_times), statistics.median(training_times), sum(training_times) / sum(one_times))


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", choices=sorted(CHECK), default=list(CHECK))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--examples", type=int, default=30, help="examples per backend (default 30)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, gloo on CPU, {args.world_size} ranks\n")
    print(f"| backend | one-step check (ms, median) | {TRAINING_STEPS}-step training check (ms, median) | ratio (totals) |")
    print("|---|---:|---:|---:|")
    rows = []
    with DDPWorkerPool(args.world_size) as pool:
        for backend in args.backends:
            row = measure(backend, examples(args.examples, args.world_size), args.world_size, pool)
            rows.append(row)
            print(f"| {backend} | {row.one_step * 1e3:.1f} | {row.training * 1e3:.1f} | {row.ratio:.2f}x |", flush=True)
    return rows


if __name__ == "__main__":
    main()
