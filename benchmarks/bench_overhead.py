"""Cost of one ``assert_dp_grads_match`` against the bare steps it must run.

The floor is the three forward/backward steps every anchored check needs, timed on
ready-made copies: the virtual DataParallel step in float32, the single-device step in
float32 and the single-device step in float64. The ratio (check / floor) is the harness's
overhead: copies of the module, the scatter plan, the comparison and the report. Both are
timed in the same run, interleaved, and the medians are compared, so machine noise hits
both alike.

Usage: python benchmarks/bench_overhead.py [--repeats 7] [--batch 32]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import dpverify

DEVICE_IDS = [0, 1, 2, 3]


def mlp(width: int, depth: int = 3) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


# Widths giving about 1e3 .. 1e7 parameters with three square layers.
WIDTHS = {"1e3": 18, "1e4": 57, "1e5": 182, "1e6": 577, "1e7": 1825}


def bare_step(model: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One bare forward/backward of ``model`` (``module``, or a wrapper of it) on ``x``, ``y``."""
    module.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(floor: Callable[[], object], check: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """``repeats`` timings of ``floor`` and of ``check``, one of each in turn (a loaded moment
    slows both), after a warm-up of each."""
    floor()
    check()
    floors, checks = [], []
    for _ in range(repeats):
        floors.append(timed(floor))
        checks.append(timed(check))
    return floors, checks


def timings(width: int, batch: int, repeats: int, device_ids: Sequence[int] = DEVICE_IDS) -> tuple[int, list[float], list[float]]:
    """The parameters of ``mlp(width)``, and ``repeats`` timings of its floor (the three
    bare steps the check must run) and of ``assert_dp_grads_match``, interleaved, after a
    warm-up of each."""
    torch.manual_seed(0)
    module = mlp(width)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    single = copy.deepcopy(module)
    parallel = dpverify.VirtualDataParallel(copy.deepcopy(module), list(device_ids))
    double = copy.deepcopy(module).double()
    x64, y64 = x.double(), y.double()

    def floor() -> None:
        bare_step(parallel, parallel.module, x, y)
        bare_step(single, single, x, y)
        bare_step(double, double, x64, y64)

    def check() -> None:
        dpverify.assert_dp_grads_match(module, x, y, loss_fn=F.mse_loss, device_ids=list(device_ids))

    floors, checks = interleaved(floor, check, repeats)
    return sum(p.numel() for p in module.parameters()), floors, checks


def measure(width: int, batch: int, repeats: int) -> tuple[int, float, float]:
    params, floors, checks = timings(width, batch, repeats)
    return params, statistics.median(floors), statistics.median(checks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, device_ids {DEVICE_IDS}")
    print("| parameters | floor (3 bare steps) | assert_dp_grads_match | ratio |")
    print("|---:|---:|---:|---:|")
    for width in WIDTHS.values():
        params, floor, check = measure(width, args.batch, args.repeats)
        print(f"| {params:,} | {floor * 1e3:.2f} ms | {check * 1e3:.2f} ms | {check / floor:.2f}x |")


if __name__ == "__main__":
    main()
