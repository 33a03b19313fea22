"""How the cost of a DataParallel and a DDP check grows with model size and with device or world size.

Each point is one ``assert_dp_grads_match`` (the gradient check ``dpverify check`` runs per
split; the whole command on the ResNet-18 shape is timed by ``bench_check.py``, and is too
slow to sweep to 1e8 parameters) on an MLP of three square layers (``bench_overhead.mlp``),
batch 32, against its floor: the three bare forward/backward steps the check must run
(virtual DataParallel float32, single-device float32, single-device float64) on
ready-made copies. Floor and check are timed in the same run, interleaved; each point's
ratio is the median of the per-repeat ratios, and its spread their minimum and maximum.
The cost per parameter (check time over parameters) is what must stay flat.

The DDP side is one ``assert_ddp_grads_match`` through a ``DDPWorkerPool`` of 2, 4 and 8
gloo ranks (started once per world size, not timed), on the same MLPs and batch, each rank
holding a contiguous shard of 32 / world size rows, against its own floor: one bare DDP
forward/backward on every rank (a ``DistributedDataParallel`` built once per point on each
rank, the task sent through the same pool) and the two bare single-device steps (float32 and
float64) the check must run in this process. The check on top of those pickles the module,
batch and loss to every rank, copies and wraps the module there, sends every rank's
gradients back and compares them.

The points run smallest first and each frees its model before the next, so the process's
peak is the largest point's (about 10x the float32 parameter bytes with 8 devices:
``bench_memory.py``).

Usage: python benchmarks/bench_scaling.py [--sizes 1e4 1e5 1e6 1e7 1e8] [--devices 2 4 8]
       [--ddp-sizes 1e4 1e5 1e6 1e7] [--world-sizes 2 4 8] [--repeats 5] [--figure docs/figures/scaling.png]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import bare_step, interleaved, mlp, timings

__all__ = [
    "BATCH", "DDP_SIZES", "DEVICES", "SIZES", "WIDTHS", "WORLD_SIZES", "Point", "ddp_measure", "ddp_sweep", "ddp_timings",
    "figure", "main", "measure", "mlp", "sweep", "table",
]

from dpverify.ddp.checks import assert_ddp_grads_match
from dpverify.ddp.pool import DDPWorkerPool, RankInfo
from dpverify.figures.base import COLOURS, drawing, figure_path, new_figure, save_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Widths giving about 1e4 .. 1e8 parameters with three square layers (3 * (w*w + w)).
WIDTHS = {"1e2": 5, "1e3": 18, "1e4": 57, "1e5": 182, "1e6": 577, "1e7": 1825, "1e8": 5773}
SIZES = ("1e4", "1e5", "1e6", "1e7", "1e8")
DEVICES = (2, 4, 8)
#: The DDP side stops at 1e7: at 1e8 every rank holds the module, its copy, DDP's buckets
#: and the gradients (about 2 GB each, 16 GB for 8 ranks, beside this process's own copies)
#: and every check pickles 400 MB to each rank and back.
DDP_SIZES = ("1e4", "1e5", "1e6", "1e7")
WORLD_SIZES = (2, 4, 8)
BATCH = 32


@dataclass(frozen=True)
class Point:
    """One model size on one device count (``"dp"``: virtual devices) or world size
    (``"ddp"``: pooled ranks): the floor's and the check's time per repeat."""

    parameters: int
    devices: int
    floors: tuple[float, ...]
    checks: tuple[float, ...]
    backend: str = "dp"

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


#: Rank-side state of the DDP floor: this rank's DistributedDataParallel model and shard,
#: built by ``_ready_floor`` once per point (on the ranks, never in this process).
_FLOOR: dict[str, Any] = {}


def _ready_floor(info: RankInfo, module: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> None:
    """On every rank: wraps a copy of ``module`` in DistributedDataParallel and keeps it
    with the rank's contiguous shard of the batch, for ``_floor_step`` (a pool task)."""
    shards = zip(inputs.chunk(info.world_size), target.chunk(info.world_size), strict=True)
    x, y = list(shards)[info.rank]
    _FLOOR["step"] = (DistributedDataParallel(copy.deepcopy(module)), x, y)


def _floor_step(info: RankInfo) -> None:
    """On every rank: one bare DDP forward/backward of the model ``_ready_floor`` built (a pool task)."""
    del info
    model, x, y = _FLOOR["step"]
    bare_step(model, model, x, y)


def _forget_floor(info: RankInfo) -> None:
    del info
    _FLOOR.clear()


def ddp_timings(width: int, pool: DDPWorkerPool, batch: int, repeats: int) -> tuple[int, list[float], list[float]]:
    """The parameters of ``mlp(width)``, and ``repeats`` timings of its DDP floor (a bare DDP
    step on every rank of ``pool``, then the float32 and float64 single-device steps here) and
    of ``assert_ddp_grads_match`` through ``pool``, interleaved, after a warm-up of each."""
    torch.manual_seed(0)
    module = mlp(width)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    single, double = copy.deepcopy(module), copy.deepcopy(module).double()
    x64, y64 = x.double(), y.double()
    pool.run(_ready_floor, module, x, y)

    def floor() -> None:
        pool.run(_floor_step)
        bare_step(single, single, x, y)
        bare_step(double, double, x64, y64)

    def check() -> None:
        assert_ddp_grads_match(module, x, y, loss_fn=F.mse_loss, world_size=pool.world_size, pool=pool)

    try:
        floors, checks = interleaved(floor, check, repeats)
    finally:
        pool.run(_forget_floor)
    return sum(p.numel() for p in module.parameters()), floors, checks


def ddp_measure(width: int, pool: DDPWorkerPool, batch: int = BATCH, repeats: int = 5) -> Point:
    """``measure``'s DDP counterpart, on ``pool``'s ranks."""
    parameters, floors, checks = ddp_timings(width, pool, batch, repeats)
    return Point(parameters, pool.world_size, tuple(floors), tuple(checks), backend="ddp")


def ddp_sweep(sizes: tuple[str, ...], world_sizes: tuple[int, ...], repeats: int, batch: int = BATCH) -> list[Point]:
    """Every size on every world size, one pool per world size (its start not timed),
    smallest size first."""
    points = []
    for world_size in world_sizes:
        with DDPWorkerPool(world_size) as pool:
            pool.start()
            for size in sizes:
                points.append(ddp_measure(WIDTHS[size], pool, batch, repeats))
                gc.collect()
    return sorted(points, key=lambda p: (p.parameters, p.devices))


def table(points: list[Point]) -> str:
    """The points' table, in the docs' format: DataParallel's, then DDP's."""
    return "\n\n".join(_table([p for p in points if p.backend == b], b) for b in ("dp", "ddp") if any(p.backend == b for p in points))


def _table(points: list[Point], backend: str) -> str:
    rows = [
        "| parameters | devices | floor (3 bare steps) | assert_dp_grads_match | ratio (median, min-max) | check ns/parameter |"
        if backend == "dp" else
        "| parameters | world size | floor (rank steps + 2 bare steps) | assert_ddp_grads_match | ratio (median, min-max) | check ns/parameter |",
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


#: What each backend's row of panels is titled by, and what its counts are called.
_BACKENDS = {"dp": ("assert_dp_grads_match", "devices"), "ddp": ("assert_ddp_grads_match, pooled ranks", "ranks")}


def figure(points: list[Point]) -> Figure:
    """A row of two panels per backend measured (DataParallel, then DDP), over parameters
    (log): time per parameter of check (solid) and floor (dashed) per device count or world
    size, and the ratio check/floor (log) with its min-max spread."""
    backends = [b for b in _BACKENDS if any(p.backend == b for p in points)]
    with drawing():
        fig = new_figure(4.5 * len(backends))
        axes = fig.subplots(len(backends), 2, squeeze=False)
        for (per_parameter, ratio), backend in zip(axes, backends, strict=True):
            _panels(per_parameter, ratio, [p for p in points if p.backend == backend], *_BACKENDS[backend])
    return fig


def _panels(per_parameter: Axes, ratio: Axes, points: list[Point], title: str, unit: str) -> None:
    from matplotlib.ticker import LogLocator, NullFormatter

    for count in sorted({p.devices for p in points}):
        row = sorted((p for p in points if p.devices == count), key=lambda p: p.parameters)
        xs = [p.parameters for p in row]
        colour = DEVICE_COLOURS.get(count, COLOURS["muted"])
        per_parameter.plot(xs, [p.per_parameter for p in row], "o-", color=colour, label=f"check, {count} {unit}")
        per_parameter.plot(xs, [p.floor_per_parameter for p in row], "o--", color=colour, alpha=0.6, label=f"floor, {count} {unit}")
        ratios = [p.ratio for p in row]
        spread = [[r - min(p.ratios) for r, p in zip(ratios, row, strict=True)], [max(p.ratios) - r for r, p in zip(ratios, row, strict=True)]]
        ratio.errorbar(xs, ratios, yerr=spread, fmt="o-", color=colour, capsize=3, label=f"{count} {unit}")
    per_parameter.set(xscale="log", yscale="log", xlabel="parameters", ylabel="ns per parameter", title=f"{title}: time per parameter")
    per_parameter.legend(ncols=2)
    ratio.axhline(1.0, color=COLOURS["limit"], linewidth=0.8)
    # log: under load single repeats range over orders of magnitude, and 1.25x and 2x read alike anywhere
    ratio.set(xscale="log", yscale="log", xlabel="parameters", ylabel="check / floor", title=f"{title}: over its bare steps")
    ratio.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ratio.yaxis.set_major_formatter(_times)
    ratio.yaxis.set_minor_formatter(NullFormatter())
    ratio.legend()


def _times(value: float, _position: float) -> str:
    """A ratio's tick label: 0.5x, 1x, 2x (matplotlib's own on a log axis read 5 x 10^-1)."""
    return f"{value:g}x"


def main(argv: list[str] | None = None) -> list[Point]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(WIDTHS), help="none: no DataParallel points")
    parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
    parser.add_argument("--ddp-sizes", nargs="*", default=list(DDP_SIZES), choices=list(WIDTHS), help="none: no DDP points")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=list(WORLD_SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--figure", type=Path, default=None, help="also draw the figure into this file (.png, .svg, .pdf)")
    args = parser.parse_args(argv)
    target = None if args.figure is None else figure_path(args.figure, "--figure")  # before minutes of timing
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = _load_average()
    points = sweep(tuple(args.sizes), tuple(args.devices), args.repeats, args.batch)
    if args.ddp_sizes:
        points += ddp_sweep(tuple(args.ddp_sizes), tuple(args.world_sizes), args.repeats, args.batch)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, medians of {args.repeats}; "
        f"began {began}, load average {load} before and {_load_average()} after"
    )
    print(table(points))
    if target is not None:
        print(f"wrote {save_figure(figure(points), target)}", file=sys.stderr)
    return points


def _load_average() -> str:
    """The 1-minute load average, or "unknown" where the platform has none."""
    try:
        with open("/proc/loadavg") as handle:
            return handle.read().split()[0]
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
