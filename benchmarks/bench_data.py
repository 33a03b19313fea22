"""What the data checks cost against iterating the same loaders without dpverify.

Both checks run on the shared pool's ranks (warmed by a first call) over a TensorDataset of
``--samples`` rows (8 features, 3 classes), each rank's loader
``DataLoader(batch_size=64, sampler=DistributedSampler(shuffle=True))`` with ``set_epoch``:

- data check: ``assert_ddp_data_matches`` over ``--epochs`` epochs. Floor: the same
  ``world_size x epochs`` loaders built and iterated one after another in this process.
- metric check: ``assert_ddp_metric_matches`` with a sum-and-count evaluation (a linear
  classifier's cross-entropy, all_reduced) on epoch 0's loaders. Floor: the same loop
  without the all_reduce over the ranks' loaders and over one loader of the whole dataset,
  one after another in this process: the ``world_size + 1`` evaluations the check makes.

Check and floor alternate, ``--repeats`` times; the medians are printed.

    python benchmarks/bench_data.py
    python benchmarks/bench_data.py --samples 100000 --world-size 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpverify.data.loaders import distributed_loader
from dpverify.data.metrics import assert_ddp_metric_matches
from dpverify.data.path import assert_ddp_data_matches

BATCH_SIZE = 64

#: Each rank's loader: shuffled DistributedSampler, set_epoch, batches of 64.
LOADER = distributed_loader(batch_size=BATCH_SIZE, shuffle=True)


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 8, generator=generator), torch.randint(0, 3, (samples,), generator=generator))


def model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Linear(8, 3)


def local_sums(module: nn.Module, loader: Any) -> torch.Tensor:
    """[loss sum, count] over ``loader``, in float64."""
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            total[0] += F.cross_entropy(module(x), y, reduction="sum").double()
            total[1] += len(y)
    return total


def mean_loss(module: nn.Module, loader: Any) -> float:
    """The evaluation under test: sums and counts all_reduced over the ranks, then divided."""
    total = local_sums(module, loader)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def data_floor(data: TensorDataset, world_size: int, epochs: int) -> None:
    for epoch in range(epochs):
        for rank in range(world_size):
            for _batch in LOADER(data, rank, world_size, epoch):
                pass


def metric_floor(data: TensorDataset, world_size: int, module: nn.Module) -> None:
    for rank in range(world_size):
        local_sums(module, LOADER(data, rank, world_size, 0))
    local_sums(module, DataLoader(data, batch_size=BATCH_SIZE))


@dataclass(frozen=True)
class Row:
    """One line of the table: the check's and its floor's median seconds."""

    name: str
    check: float
    floor: float

    @property
    def ratio(self) -> float:
        return self.check / self.floor


def _timed(fn: Callable[[], object], into: list[float]) -> None:
    started = time.perf_counter()
    fn()
    into.append(time.perf_counter() - started)


def measure(samples: int, world_size: int, epochs: int, repeats: int) -> list[Row]:
    """The data check and the metric check against their floors, on the shared pool."""
    data, module = dataset(samples), model()
    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        (
            f"data check, {samples} samples, {world_size} ranks, {epochs} epochs",
            lambda: assert_ddp_data_matches(data, LOADER, world_size=world_size, epochs=epochs),
            lambda: data_floor(data, world_size, epochs),
        ),
        (
            f"metric check, {samples} samples, {world_size} ranks",
            lambda: assert_ddp_metric_matches(module, data, mean_loss, world_size=world_size, loader_factory=LOADER),
            lambda: metric_floor(data, world_size, module),
        ),
    ]
    rows = []
    for name, check, floor in cases:
        check()  # the pool's ranks started, imports done
        checks: list[float] = []
        floors: list[float] = []
        for _ in range(repeats):
            _timed(check, checks)
            _timed(floor, floors)
        rows.append(Row(name, statistics.median(checks), statistics.median(floors)))
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, gloo on CPU, batch size {BATCH_SIZE}\n")
    print("| check | check (s, median) | floor: the same loaders in one process (s, median) | ratio |")
    print("|---|---:|---:|---:|")
    rows = measure(args.samples, args.world_size, args.epochs, args.repeats)
    for row in rows:
        print(f"| {row.name} | {row.check:.3f} | {row.floor:.3f} | {row.ratio:.1f}x |", flush=True)
    return rows


if __name__ == "__main__":
    import bench_data  # the evaluation is pickled to the ranks by this module's name, not __main__'s

    bench_data.main()
