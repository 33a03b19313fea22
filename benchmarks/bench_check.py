"""Cost of ``dpverify check`` on a ResNet-18-shaped model against the bare steps it must run.

The model is built here from plain torch layers (torchvision's ResNet-18 layout: a 7x7
stem, max-pool, four stages of two basic blocks, average pool, a 10-way classifier; 11.2M
parameters) and fed 3x32x32 images with class labels, so ``dpverify check`` runs it with
cross-entropy. It is timed through the command's own code path: ``user_model`` loads
``bench_check:resnet18`` with ``--inputs bench_check:batches`` as the command line does,
and ``check_model`` runs every planned check with the default batch sizes and device
counts.

The floor is the distinct forward/backward steps those checks need, timed on copies made
beforehand (as in ``bench_overhead.py``), in the same run, interleaved, medians compared:

* per split, the parallel step of each of its two checks (virtual DataParallel; a step
  that raises, as BatchNorm in train mode does on one-row chunks, is timed up to its
  error, as the check pays it);
* per split whose parallel step ran, ONE single-device step in float32 and ONE in float64
  (the references and the tolerance's anchor);
* per split where a tensor differs (BatchNorm in train mode: the divergence dpverify
  explains), ONE more single-device float32 step from jittered parameters (the second
  rounding sample dpverify takes before calling a tensor a mismatch; passing splits, the
  eval-mode ones, need none).

BatchNorm makes ``check`` run every split twice, as the model is (mismatches explained)
and on an eval-mode copy (mismatches fail): the floor counts both modes' steps.

Usage: python benchmarks/bench_check.py [--repeats 3] [--quick] [--profile 20]
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
from dpverify.checks.model import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_DEVICE_COUNTS,
    ModelCheckReport,
    Split,
    Verdict,
    check_model,
)
from dpverify.cli.user_model import user_model
from dpverify.core.divergence import ONE_ROW_BATCHNORM
from dpverify.core.step import copy_module
from dpverify.models.user import Batch, UserModel

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


def run_check(model: UserModel) -> ModelCheckReport:
    return check_model(model, batch_sizes=DEFAULT_BATCH_SIZES, device_counts=DEFAULT_DEVICE_COUNTS)


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


def build_floors(model: UserModel, report: ModelCheckReport) -> tuple[Floor, Floor]:
    """The steps ``report``'s checks needed, counted two ways.

    Both have the two parallel steps of every split. Where a parallel step ran, the
    references: a float32 and a float64 single-device step, and, where a tensor differs
    (a failed or explained verdict), the jittered float32 step (the second rounding
    sample; contrasts, meant to differ, ask for none). The first
    floor counts the references once per split, as the issue does; the second, strict one
    once per batch and mode, as they do not depend on the device count (the minimum).
    """
    per_split, per_batch = Floor(), Floor()
    modes = [("", model.module)]
    if any(r.check.endswith(" (eval mode)") for r in report.results):
        modes.append((" (eval mode)", copy.deepcopy(model.module).eval()))
    for suffix, module in modes:
        for batch_size in DEFAULT_BATCH_SIZES:
            batch = model.make_batch(batch_size)
            single, double, jittered = (copy_module(module, dtype) for dtype in (None, torch.float64, None))
            references = [
                ("single-device float32", _bare(single, single, batch, None)),
                ("single-device float64", _bare(double, double, batch, torch.float64)),
            ]
            second_sample = ("jittered single-device float32", _bare(jittered, jittered, batch, None))
            batch_needs = batch_differs = False
            for devices in DEFAULT_DEVICE_COUNTS:
                results = [r for r in report.results if r.split == Split(batch_size, devices) and r.check.endswith(" (eval mode)") == bool(suffix)]
                for _ in results:
                    wrapped = dpverify.VirtualDataParallel(copy_module(module, None), list(range(devices)))
                    step = _bare(wrapped, wrapped.module, batch, None)
                    per_split.add("parallel", step)
                    per_batch.add("parallel", step)
                # a check without compared tensors stopped at its parallel step
                if any(r.tensors for r in results):
                    batch_needs = True
                    # only a tensor that differs asks for the second rounding sample
                    differs = any(r.verdict in (Verdict.FAIL, Verdict.EXPLAINED) for r in results if r.tensors)
                    batch_differs |= differs
                    for kind, step in references + ([second_sample] if differs else []):
                        per_split.add(kind, step)
            if batch_needs:
                for kind, step in references + ([second_sample] if batch_differs else []):
                    per_batch.add(kind, step)
    return per_split, per_batch


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Measurement:
    parameters: int
    checks: int
    verdicts: dict[str, int]
    split_steps: dict[str, int]
    strict_steps: dict[str, int]
    split_floor: float
    strict_floor: float
    check: float

    @property
    def ratio(self) -> float:
        """Against the strict floor: the fewest steps the checks can run."""
        return self.check / self.strict_floor

    @property
    def split_ratio(self) -> float:
        """Against the issue's floor: references counted once per split."""
        return self.check / self.split_floor


def measure(quick: bool, repeats: int) -> Measurement:
    model = load(quick)
    report = run_check(model)  # warm-up, and which steps the verdicts needed
    per_split, per_batch = build_floors(model, report)
    per_split()
    per_batch()
    splits, stricts, checks = [], [], []
    for _ in range(repeats):
        splits.append(_timed(per_split))
        stricts.append(_timed(per_batch))
        checks.append(_timed(lambda: run_check(model)))
    verdicts = {v: report.count(v) for v in (Verdict.PASS, Verdict.EXPLAINED, Verdict.FAIL, Verdict.WARN, Verdict.SKIP) if report.count(v)}
    return Measurement(
        model.parameter_count, len(report.results), verdicts, per_split.counts, per_batch.counts,
        statistics.median(splits), statistics.median(stricts), statistics.median(checks),
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
    args = parser.parse_args(argv)
    result = measure(args.quick, args.repeats)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {'tiny ResNet' if args.quick else 'ResNet-18'} "
        f"shape, {result.parameters:,} parameters, inputs 3x{IMAGE[1]}x{IMAGE[2]}, cross-entropy; batch sizes "
        f"{list(DEFAULT_BATCH_SIZES)} on {list(DEFAULT_DEVICE_COUNTS)} virtual devices; medians of {args.repeats}"
    )
    print(f"checks: {result.checks} ({', '.join(f'{n} {v}' for v, n in result.verdicts.items())})")
    print("floor per split: " + ", ".join(f"{n} {kind}" for kind, n in result.split_steps.items()))
    print("strict floor (references once per batch and mode): " + ", ".join(f"{n} {kind}" for kind, n in result.strict_steps.items()))
    print("| parameters | floor per split | strict floor | dpverify check | ratio (per split) | ratio (strict) |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {result.parameters:,} | {result.split_floor:.2f} s | {result.strict_floor:.2f} s | {result.check:.2f} s "
        f"| {result.split_ratio:.2f}x | {result.ratio:.2f}x |"
    )
    if args.profile:
        print(profile(args.quick, args.profile))
    return result


if __name__ == "__main__":
    main()
