"""How the cost of a DataParallel check grows with model size and with device count.

Each point is one ``assert_dp_grads_match`` (the gradient check ``dpverify check`` runs per
split; the whole command on the ResNet-18 shape is timed by ``bench_check.py``, and is too
slow to sweep to 1e8 parameters) on an MLP of three square layers (``bench_overhead.mlp``),
batch 32, against its floor: the three bare forward/backward steps the check must run
(virtual DataParallel float32, single-device float32, single-device float64) on
ready-made copies. Floor and check are timed in the same run, interleaved; each point's
ratio is the median of the per-repeat ratios, and its spread their minimum and maximum.
The cost per parameter (check time over parameters) is what must stay flat.

The points run smallest first and each frees its model before the next, so the process's
peak is the largest point's (about 10x the float32 parameter bytes with 8 devices:
``bench_memory.py``).

Usage: python benchmarks/bench_scaling.py [--sizes 1e4 1e5 1e6 1e7 1e8] [--devices 2 4 8]
       [--repeats 5] [--figure docs/figures/scaling.png]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import mlp, timings

__all__ = ["BATCH", "DEVICES", "SIZES", "WIDTHS", "Point", "figure", "main", "measure", "mlp", "sweep", "table"]

from dpverify.figures.base import COLOURS, drawing, figure_path, new_figure, save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Widths giving about 1e4 .. 1e8 parameters with three square layers (3 * (w*w + w)).
WIDTHS = {"1e2": 5, "1e3": 18, "1e4": 57, "1e5": 182, "1e6": 577, "1e7": 1825, "1e8": 5773}
SIZES = ("1e4", "1e5", "1e6", "1e7", "1e8")
DEVICES = (2, 4, 8)
BATCH = 32


@dataclass(frozen=True)
class Point:
    """One model size on one device count: the floor's and the check's time per repeat."""

    parameters: int
    devices: int
    floors: tuple[float, ...]
    checks: tuple[float, ...]

    @property
    def floor(self) -> float:
        return statistics.median(self.floors)

    @property
    def check(self) -> float:
        return statistics.median(self.checks)

    @property
    def ratios(self) -> tuple[float, ...]:
        """Check over floor, per repeat (the two were timed back to back)."""
        return tuple(c / f for c, f in zip(self.checks, self.floors, strict=True))

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def per_parameter(self) -> float:
        """Nanoseconds of check per parameter."""
        return self.check / self.parameters * 1e9

    @property
    def floor_per_parameter(self) -> float:
        return self.floor / self.parameters * 1e9


def measure(width: int, devices: int, batch: int = BATCH, repeats: int = 5) -> Point:
    """Times the check and its floor, interleaved, ``repeats`` times after a warm-up of each."""
    parameters, floors, checks = timings(width, batch, repeats, list(range(devices)))
    return Point(parameters, devices, tuple(floors), tuple(checks))


def sweep(sizes: tuple[str, ...], devices: tuple[int, ...], repeats: int, batch: int = BATCH) -> list[Point]:
    """Every size on every device count, smallest size first; each point's models are
    freed (and the garbage collected) before the next is built."""
    points = []
    for size in sizes:
        for count in devices:
            points.append(measure(WIDTHS[size], count, batch, repeats))
            gc.collect()
    return points


def table(points: list[Point]) -> str:
    rows = [
        "| parameters | devices | floor (3 bare steps) | assert_dp_grads_match | ratio (median, min-max) | check ns/parameter |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        rows.append(
            f"| {p.parameters:,} | {p.devices} | {p.floor * 1e3:.2f} ms | {p.check * 1e3:.2f} ms | "
            f"{p.ratio:.2f}x ({min(p.ratios):.2f}-{max(p.ratios):.2f}) | {p.per_parameter:.2f} |"
        )
    return "\n".join(rows)


#: One colour per device count, from the shared palette.
DEVICE_COLOURS = {2: COLOURS["inputs"], 4: COLOURS["parameters"], 8: COLOURS["gradients"]}


def figure(points: list[Point]) -> Figure:
    """Two panels over parameters (log): time per parameter of check (solid) and floor
    (dashed) per device count, and the ratio check/floor with its min-max spread."""
    with drawing():
        fig = new_figure(4.5)
        per_parameter, ratio = fig.subplots(1, 2)
        for count in sorted({p.devices for p in points}):
            row = sorted((p for p in points if p.devices == count), key=lambda p: p.parameters)
            xs = [p.parameters for p in row]
            colour = DEVICE_COLOURS.get(count, COLOURS["muted"])
            per_parameter.plot(xs, [p.per_parameter for p in row], "o-", color=colour, label=f"check, {count} devices")
            per_parameter.plot(xs, [p.floor_per_parameter for p in row], "o--", color=colour, alpha=0.6, label=f"floor, {count} devices")
            ratios = [p.ratio for p in row]
            spread = [[r - min(p.ratios) for r, p in zip(ratios, row, strict=True)], [max(p.ratios) - r for r, p in zip(ratios, row, strict=True)]]
            ratio.errorbar(xs, ratios, yerr=spread, fmt="o-", color=colour, capsize=3, label=f"{count} devices")
        per_parameter.set(xscale="log", yscale="log", xlabel="parameters", ylabel="ns per parameter", title="Time per parameter")
        per_parameter.legend(ncols=2)
        ratio.axhline(1.0, color=COLOURS["limit"], linewidth=0.8)
        ratio.set(xscale="log", xlabel="parameters", ylabel="check / floor", title="assert_dp_grads_match over its bare steps")
        ratio.set_ylim(bottom=0)
        ratio.legend()
    return fig


def main(argv: list[str] | None = None) -> list[Point]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(WIDTHS))
    parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--figure", type=Path, default=None, help="also draw the figure into this file (.png, .svg, .pdf)")
    args = parser.parse_args(argv)
    target = None if args.figure is None else figure_path(args.figure, "--figure")  # before minutes of timing
    points = sweep(tuple(args.sizes), tuple(args.devices), args.repeats, args.batch)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, medians of {args.repeats}")
    print(table(points))
    if target is not None:
        print(f"wrote {save_figure(figure(points), target)}", file=sys.stderr)
    return points


if __name__ == "__main__":
    main()
