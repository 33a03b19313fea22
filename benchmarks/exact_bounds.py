"""How deep and how wide an exact model may be: the deepest Linear/ReLU stack exact mode
proves exact, per width, for 1, 2 and 3 optimizer steps.

Exact mode (docs/exact.md) computes in float64 on a dyadic grid, and its proof refuses an
operation whose exact result needs more than float64's 53 significand bits. Each Linear
layer multiplies by weights of ``BITS`` significant bits and sums ``width`` products, so
the bits a value needs grow with depth and width; an optimizer step writes ``lr * grad``,
whose digits reach far below the weights' own grid, into the weights, so that every later
step starts from longer numbers. This script measures where that ends: for each width, the
model ``Linear(width, width)`` followed by ``depth`` blocks of ``ReLU, Linear(width, width)``
(``depth + 1`` Linear layers), a batch of ``--batch`` rows, MSE (mean) and SGD (lr 2**-3,
momentum 2**-1), trained for ``steps`` steps under ``proving``: the deepest ``depth`` whose
every operation is shown exact, and the significand bits its tightest operation needs
(steps 0: one forward and backward, what the gradient checks run).

Usage:
    python benchmarks/exact_bounds.py [--widths 2 8 32 128 512] [--steps 0 1 2 3] [--batch 8] [--max-depth 40]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dpverify import InvalidArgument
from dpverify.exact.case import ExactCase
from dpverify.exact.grid import BITS
from dpverify.exact.proof import proving

#: The optimizer of the measurement: SGD with one-bit numbers, as ``check --exact`` defaults to.
LR, MOMENTUM = 2.0**-3, 2.0**-1


def stack(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    """``Linear(width, width)`` and ``depth`` blocks of ``ReLU, Linear(width, width)``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(width, width)]
    for _ in range(depth):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers)


def exact_bits(width: int, depth: int, steps: int, batch: int, seed: int = 0) -> int | None:
    """The significand bits the tightest operation of ``steps`` training steps (0: one
    forward and backward, no step) needs when every operation is exact; None when the proof
    refuses one (it needs more than 53)."""
    generator = torch.Generator().manual_seed(seed + 1)
    inputs, target = torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator)
    case = ExactCase.of(stack(width, depth, seed), (inputs,), target)
    optimizer = torch.optim.SGD(case.module.parameters(), lr=LR, momentum=MOMENTUM)
    try:
        with proving(case.module) as prover:
            # steps 0: one forward and backward, what the gradient checks run
            for step in range(1, max(steps, 1) + 1):
                prover.stage = f"the loss of step {step}"
                optimizer.zero_grad()
                F.mse_loss(case.module(*case.args), case.target).backward()
                if steps:
                    prover.stage = f"the optimizer step of step {step}"
                    optimizer.step()
    except InvalidArgument:
        return None
    return prover.proof().bits


def deepest(width: int, steps: int, batch: int, max_depth: int) -> tuple[int | None, int | None]:
    """The deepest exact ``depth`` (None: not even ``depth`` 0, a single Linear layer) up
    to ``max_depth``, and its bits. Depths are tried upward: a deeper stack contains a
    shallower one's arithmetic and more, so the first refusal ends the search."""
    best: tuple[int | None, int | None] = (None, None)
    for depth in range(max_depth + 1):
        bits = exact_bits(width, depth, steps, batch)
        if bits is None:
            break
        best = (depth, bits)
    return best


def main(argv: Sequence[str] | None = None) -> dict[tuple[int, int], tuple[int | None, int | None]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 8, 32, 128, 512])
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 1, 2, 3], help="optimizer steps; 0: gradients only")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-depth", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    found = {(w, s): deepest(w, s, args.batch, args.max_depth) for w in args.widths for s in args.steps}
    print(f"Deepest exact stack Linear(w, w) + depth x [ReLU, Linear(w, w)]: batch {args.batch}, MSE (mean), "
          f"SGD lr={LR:g} momentum={MOMENTUM:g}, {BITS} significant bits per element of the grid copies; "
          f"depth (bits of 53 its tightest operation needs), depth searched up to {args.max_depth}\n")
    print("| width | " + " | ".join("gradients" if s == 0 else f"{s} step{'s' if s > 1 else ''}" for s in args.steps) + " |")
    print("|---:|" + "---:|" * len(args.steps))
    for w in args.widths:
        cells = []
        for s in args.steps:
            depth, bits = found[(w, s)]
            cells.append("refused" if depth is None else f"{depth}{'+' if depth == args.max_depth else ''} ({bits})")
        print(f"| {w} | " + " | ".join(cells) + " |")
    print(f"\n{time.perf_counter() - started:.0f} s")
    return found


if __name__ == "__main__":
    main()
