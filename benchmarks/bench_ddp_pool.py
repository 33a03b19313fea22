"""Examples per second: one DDPWorkerPool for every example, or a fresh process group each.

The fresh-group baseline is what ``MultiProcessTestCase``-style tests do: for every example,
start ``world_size`` processes with the ``spawn`` start method, initialise a gloo process
group, run the check, and tear everything down. Both sides run the same public check,
``assert_ddp_grads_match``, on the same scenarios (small MLPs of varying width, even and
uneven shards), in the same run; the pool's one-time start is reported separately. A third
column shows a fresh group per example started through the fork server with torch preloaded,
which is what a pool restart after a fault costs.

    python benchmarks/bench_ddp_pool.py                  # world sizes 2 and 4
    python benchmarks/bench_ddp_pool.py --examples 400 --fresh-examples 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpverify.ddp.checks import assert_ddp_grads_match
from dpverify.ddp.pool import DDPWorkerPool


@dataclass(frozen=True)
class Scenario:
    """One example: an MLP spec, a batch, and its shards."""

    seed: int
    hidden: int
    rows: int

    def build(self) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            module = nn.Sequential(nn.Linear(6, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 3))
        generator = torch.Generator().manual_seed(self.seed)
        return module, torch.randn(self.rows, 6, generator=generator), torch.randn(self.rows, 3, generator=generator)


def scenarios(count: int, world_size: int) -> list[Scenario]:
    """``count`` scenarios; every other one splits unevenly over ``world_size`` ranks."""
    return [Scenario(seed=i, hidden=4 + i % 13, rows=2 * world_size + i % 2) for i in range(count)]


def check(scenario: Scenario, world_size: int, pool: DDPWorkerPool) -> None:
    module, x, y = scenario.build()
    assert_ddp_grads_match(module, x, y, loss_fn=F.mse_loss, world_size=world_size, pool=pool)


def through_pool(examples: Sequence[Scenario], world_size: int) -> tuple[float, float]:
    """(seconds to start the pool, examples per second through it)."""
    started = time.perf_counter()
    with DDPWorkerPool(world_size) as pool:
        pool.start()
        ready = time.perf_counter()
        check(examples[0], world_size, pool)  # warm-up: first DDP construction, imports
        begin = time.perf_counter()
        for scenario in examples:
            check(scenario, world_size, pool)
        elapsed = time.perf_counter() - begin
    return ready - started, len(examples) / elapsed


def fresh_group_each(examples: Sequence[Scenario], world_size: int, start_method: str) -> float:
    """Examples per second when every example starts and stops its own process group."""
    begin = time.perf_counter()
    for scenario in examples:
        with DDPWorkerPool(world_size, start_method=start_method) as pool:
            check(scenario, world_size, pool)
    return len(examples) / (time.perf_counter() - begin)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--examples", type=int, default=200, help="examples through the pool (default 200)")
    parser.add_argument("--fresh-examples", type=int, default=3, help="examples with a fresh group each (default 3)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, gloo on CPU\n")
    print("| world size | pool start (s) | pool (examples/s) | fresh spawn group per example (examples/s) | speed-up | fresh forkserver group per example (examples/s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for world_size in args.world_sizes:
        examples = scenarios(args.examples, world_size)
        start, pooled = through_pool(examples, world_size)
        spawned = fresh_group_each(examples[: args.fresh_examples], world_size, "spawn")
        forked = fresh_group_each(examples[: args.fresh_examples], world_size, "forkserver")
        print(
            f"| {world_size} | {start:.2f} | {pooled:.1f} | {spawned:.3f} | {pooled / spawned:.0f}x | {forked:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
