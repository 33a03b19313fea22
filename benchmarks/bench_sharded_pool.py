"""Checks per second of the FSDP2, tensor-parallel and pipeline checks: pooled ranks against
a fresh process group per check, in the same run.

Each check is the registry's (``fsdp-grads``, ``tp-grads``, ``pp-grads``) with its default
layout, on small Sequential MLPs of varying width (FSDP2 also on uneven shards): what the
property suite and ``dpverify fuzz --backend fsdp|tp|pp`` run. The pooled side sends every
check to one ``DDPWorkerPool`` (its device meshes made once per rank); the baseline starts
``world_size`` processes with ``spawn``, initialises a gloo group, runs one check and tears
everything down, as a test that makes its own group per example does.

    python benchmarks/bench_sharded_pool.py                      # fsdp, tp, pp on 2 and 4 ranks
    python benchmarks/bench_sharded_pool.py --backends tp --examples 100 --fresh-examples 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpverify.ddp.pool import DDPWorkerPool
from dpverify.registry import CHECKS, Case, Target

CHECK = {"fsdp": "fsdp-grads", "tp": "tp-grads", "pp": "pp-grads"}


@dataclass(frozen=True)
class Example:
    """One check: a Sequential MLP's width, a seed and the batch's rows."""

    seed: int
    hidden: int
    rows: int

    def case(self, world_size: int) -> Case:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            module = nn.Sequential(
                nn.Linear(6, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 8), nn.Tanh(), nn.Linear(8, 3),
            )
        generator = torch.Generator().manual_seed(self.seed)
        x, y = torch.randn(self.rows, 6, generator=generator), torch.randn(self.rows, 3, generator=generator)
        return Case(module, (x,), y, F.mse_loss, tuple(range(world_size)))


def examples(count: int, world_size: int, backend: str) -> list[Example]:
    """``count`` examples: widths the world size divides (a tensor-parallel plan shards
    them), batches of 2 rows per rank; FSDP2's every other one a row more (uneven shards),
    the pipeline's cut into equal microbatches."""
    extra = backend == "fsdp"
    return [Example(seed=i, hidden=world_size * (1 + i % 4), rows=2 * world_size + (i % 2 if extra else 0)) for i in range(count)]


def run(example: Example, backend: str, world_size: int, pool: DDPWorkerPool) -> None:
    CHECKS[CHECK[backend]].check(example.case(world_size), Target(pool=pool))


def through_pool(batch: Sequence[Example], backend: str, world_size: int) -> tuple[float, float]:
    """(seconds to start the pool, checks per second through it)."""
    started = time.perf_counter()
    with DDPWorkerPool(world_size) as pool:
        pool.start()
        ready = time.perf_counter()
        run(batch[0], backend, world_size, pool)  # warm-up: imports, the device mesh
        begin = time.perf_counter()
        for example in batch:
            run(example, backend, world_size, pool)
        elapsed = time.perf_counter() - begin
    return ready - started, len(batch) / elapsed


def fresh_group_each(batch: Sequence[Example], backend: str, world_size: int) -> float:
    """Checks per second when every check starts and stops its own spawned process group."""
    begin = time.perf_counter()
    for example in batch:
        with DDPWorkerPool(world_size, start_method="spawn") as pool:
            run(example, backend, world_size, pool)
    return len(batch) / (time.perf_counter() - begin)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", choices=sorted(CHECK), default=["fsdp", "tp", "pp"])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--examples", type=int, default=60, help="checks through the pool (default 60)")
    parser.add_argument("--fresh-examples", type=int, default=2, help="checks with a fresh group each (default 2)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, gloo on CPU\n")
    print("| backend | world size | pool start (s) | pool (checks/s) | pool (ms a check) | fresh spawn group per check (checks/s) | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for backend in args.backends:
        for world_size in args.world_sizes:
            batch = examples(args.examples, world_size, backend)
            start, pooled = through_pool(batch, backend, world_size)
            fresh = fresh_group_each(batch[: args.fresh_examples], backend, world_size)
            print(f"| {backend} | {world_size} | {start:.2f} | {pooled:.1f} | {1000 / pooled:.1f} | {fresh:.3f} | {pooled / fresh:.0f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
