"""Cost of ``dpverify check`` on a ResNet-18-shaped model against the bare steps it must run.

The model is built here from plain torch layers (torchvision's ResNet-18 layout: a 7x7
stem, max-pool, four stages of two basic blocks, average pool, a 10-way classifier; 11.2M
parameters) and fed 3x32x32 images with class labels, so ``dpverify check`` runs it with
cross-entropy. It is timed through the command's own code path: ``user_model`` loads
``bench_check:resnet18`` with ``--inputs bench_check:batches`` as the command line does,
and ``check_model`` runs every planned one-step check of the defaults (the training checks
among them are timed against the one-step ones by ``bench_training.py``) with the default
batch sizes and device counts.

The floor is the bare forward/backward steps a correct check must run, timed on copies
made beforehand (as in ``bench_overhead.py``), in the same run, interleaved, medians
compared:

* per split, ONE parallel step (virtual DataParallel): the split's two checks (gradients
  and replica sum) are the same step of the same module through the same wrapper, and
  the one recording every replica's gradient gives both what they compare. A step that
  raises, as BatchNorm in train mode does on one-row chunks, is timed up to its error;
* per batch size whose parallel steps ran, ONE single-device float32 step and ONE in
  float64 (the references and the tolerance's anchor): they depend on the batch, not on
  the split, so the batch on 2 and on 4 devices needs them once;
* per batch size where a tensor fails on a module without divergence sources, ONE more
  single-device float32 step from jittered parameters (the second rounding sample
  dpverify takes before calling a tensor a mismatch). Passing checks need none, and
  neither do the train-mode BatchNorm mismatches, which are explained whatever the
  rounding.

BatchNorm makes ``check`` run every split twice, as the model is (mismatches explained)
and on an eval-mode copy (mismatches fail): the floor counts both modes' steps.

Everything else is the check's own cost, against the floor: the deep copies of the model
each step runs on (one in float64), recording each replica's gradient (a copy, a max and
a norm pass per replica), the comparisons, and a parallel step that raises, which the
second check of its split runs again.

Usage: python benchmarks/bench_check.py [--repeats 3] [--quick] [--profile 20] [--cpu-time]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# ``user_model`` imports the factory by name, as ``dpverify check bench_check:resnet18`` does.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dpverify
from dpverify.cli.user_model import user_model
from dpverify.core.divergence import ONE_ROW_BATCHNORM, divergence_sources
from dpverify.core.step import copy_module
from dpverify.models.user import Batch, UserModel
from dpverify.planner import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CHECKS,
    DEFAULT_DEVICE_COUNTS,
    ModelCheckReport,
    Split,
    Verdict,
    check_model,
)
from dpverify.registry import CHECKS

CLASSES = 10
IMAGE = (3, 32, 32)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, and a projected shortcut when the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def resnet(width: int = 64, blocks: tuple[int, ...] = (2, 2, 2, 2), classes: int = CLASSES) -> nn.Module:
    """torchvision's ResNet layout from plain layers: ``width`` channels in the first stage,
    doubling per stage, ``blocks`` basic blocks per stage."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
    ]
    channels = width
    for stage, count in enumerate(blocks):
        outputs = width * 2**stage
        for index in range(count):
            layers.append(BasicBlock(channels, outputs, 2 if stage and not index else 1))
            channels = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


def resnet18() -> nn.Module:
    """The ResNet-18 shape (11.2M parameters with 10 classes)."""
    return resnet()


def resnet_tiny() -> nn.Module:
    """The same layout, 4 channels wide and one block per stage: a smoke of the benchmark."""
    return resnet(width=4, blocks=(1, 1, 1, 1))


def batches(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``--inputs``: images and class labels (dpverify seeds the generator)."""
    return torch.randn(batch_size, *IMAGE), torch.randint(0, CLASSES, (batch_size,))


def load(quick: bool) -> UserModel:
    """The model as ``dpverify check bench_check:FACTORY --inputs bench_check:batches`` loads it."""
    return user_model(f"bench_check:{'resnet_tiny' if quick else 'resnet18'}", inputs_spec="bench_check:batches")


#: The default checks but the training ones: the steps the floor counts.
ONE_STEP_CHECKS = tuple(name for name in DEFAULT_CHECKS if not CHECKS[name].training)


def run_check(model: UserModel) -> ModelCheckReport:
    return check_model(model, batch_sizes=DEFAULT_BATCH_SIZES, device_counts=DEFAULT_DEVICE_COUNTS, checks=ONE_STEP_CHECKS)


@dataclass
class Floor:
    """The bare steps, on ready-made copies, and what each stands for."""

    steps: list[Callable[[], None]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, step: Callable[[], None]) -> None:
        self.steps.append(step)
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def __call__(self) -> None:
        for step in self.steps:
            step()


def _bare(runner: Callable[..., Any], module: nn.Module, batch: Batch, dtype: torch.dtype | None) -> Callable[[], None]:
    inputs = tuple(t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in batch.inputs)
    loss_fn, target = batch.loss_fn, batch.target
    assert loss_fn is not None

    def step() -> None:
        module.zero_grad(set_to_none=True)
        try:
            loss_fn(runner(*inputs), target).backward()
        except ValueError as error:
            # BatchNorm in train mode on a one-row chunk: the check pays this much too
            if ONE_ROW_BATCHNORM not in str(error):
                raise

    return step


EVAL = " (eval mode)"


def build_floor(model: UserModel, report: ModelCheckReport) -> Floor:
    """The steps ``report``'s checks needed (see the module's docstring): per split and mode
    one parallel step; per batch size and mode whose parallel steps ran the float32 and
    float64 references; and the jittered float32 step where a tensor failed on a module
    without divergence sources (contrasts, meant to differ, ask for none)."""
    floor = Floor()
    modes = [("", model.module)]
    if any(r.title.endswith(EVAL) for r in report.results):
        modes.append((EVAL, copy.deepcopy(model.module).eval()))
    for suffix, module in modes:
        settles = not divergence_sources(module)
        for batch_size in DEFAULT_BATCH_SIZES:
            batch = model.make_batch(batch_size)
            needs_references = needs_second_sample = False
            for devices in DEFAULT_DEVICE_COUNTS:
                results = [
                    r for r in report.results
                    if r.split == Split(batch_size, devices) and r.title.endswith(EVAL) == bool(suffix) and r.verdict is not Verdict.SKIP
                ]
                if not results:
                    continue
                wrapped = dpverify.VirtualDataParallel(copy_module(module, None), list(range(devices)))
                floor.add("parallel", _bare(wrapped, wrapped.module, batch, None))
                # a check without compared tensors stopped at its parallel step
                needs_references |= any(r.tensors for r in results)
                needs_second_sample |= settles and any(r.verdict is Verdict.FAIL and r.tensors for r in results)
            if needs_references:
                single, double = copy_module(module, None), copy_module(module, torch.float64)
                floor.add("single-device float32", _bare(single, single, batch, None))
                floor.add("single-device float64", _bare(double, double, batch, torch.float64))
            if needs_second_sample:
                jittered = copy_module(module, None)
                floor.add("jittered single-device float32", _bare(jittered, jittered, batch, None))
    return floor


#: What the timings read: the wall clock, or with ``--cpu-time`` the process's CPU time
#: (every thread's), which a machine loaded by other work slows far less.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


@dataclass(frozen=True)
class Measurement:
    """Medians of the repeats; each repeat times the floor and then the check."""

    parameters: int
    checks: int
    verdicts: dict[str, int]
    steps: dict[str, int]
    floor: float
    check: float
    #: each repeat's check over its floor, in order
    ratios: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        """``dpverify check`` over the bare steps it must run: the median of the repeats'
        ratios (a loaded machine slows a whole repeat, floor and check alike)."""
        return statistics.median(self.ratios) if self.ratios else self.check / self.floor


def measure(quick: bool, repeats: int, clock: str = "wall") -> Measurement:
    model = load(quick)
    report = run_check(model)  # warm-up, and which steps the verdicts needed
    floor = build_floor(model, report)
    floor()
    floors, checks = [], []
    for _ in range(repeats):
        floors.append(_timed(floor, CLOCKS[clock]))
        checks.append(_timed(lambda: run_check(model), CLOCKS[clock]))
    verdicts = {v: report.count(v) for v in (Verdict.PASS, Verdict.EXPLAINED, Verdict.FAIL, Verdict.WARN, Verdict.SKIP) if report.count(v)}
    return Measurement(
        model.parameter_count, len(report.results), verdicts, floor.counts, statistics.median(floors), statistics.median(checks),
        tuple(c / f for f, c in zip(floors, checks, strict=True)),
    )


def profile(quick: bool, top: int) -> str:
    """cProfile's top entries (by own time) of one ``check_model`` after a warm-up."""
    model = load(quick)
    run_check(model)
    profiler = cProfile.Profile()
    profiler.runcall(run_check, model)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> Measurement:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model of the same layout (a smoke)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="also print cProfile's top N entries")
    parser.add_argument("--cpu-time", action="store_true", help="time by the process's CPU time, not the wall clock (a loaded machine)")
    args = parser.parse_args(argv)
    result = measure(args.quick, args.repeats, "cpu" if args.cpu_time else "wall")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {'tiny ResNet' if args.quick else 'ResNet-18'} "
        f"shape, {result.parameters:,} parameters, inputs 3x{IMAGE[1]}x{IMAGE[2]}, cross-entropy; batch sizes "
        f"{list(DEFAULT_BATCH_SIZES)} on {list(DEFAULT_DEVICE_COUNTS)} virtual devices; medians of {args.repeats}"
        + ("; CPU time" if args.cpu_time else "")
    )
    print(f"checks: {result.checks} ({', '.join(f'{n} {v}' for v, n in result.verdicts.items())})")
    print("floor: " + ", ".join(f"{n} {kind}" for kind, n in result.steps.items()))
    print("| parameters | floor (bare steps) | dpverify check | ratio (median, min-max) |")
    print("|---:|---:|---:|---:|")
    spread = f"{min(result.ratios):.2f}-{max(result.ratios):.2f}"
    print(f"| {result.parameters:,} | {result.floor:.2f} s | {result.check:.2f} s | {result.ratio:.2f}x ({spread}) |")
    if args.profile:
        print(profile(args.quick, args.profile))
    return result


if __name__ == "__main__":
    main()
