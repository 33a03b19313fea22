"""The ``dpverify`` command line."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpverify._assertions import assert_dp_grads_match, assert_grad_sum_equals_mean_loss_grad
from dpverify._builtin import BUILTIN_MODELS, BuiltinCase, builtin_case
from dpverify._devices import cuda_device_count
from dpverify._errors import ParallelMismatch
from dpverify._loss_average import (
    assert_loss_reduction_matches_full_batch,
    check_forward_loss_average,
)

__all__ = ["main"]

#: (batch size, device count): even chunks, uneven chunks, fewer rows than devices.
SPLITS: tuple[tuple[int, int], ...] = ((8, 2), (5, 4), (2, 4))


@dataclass(frozen=True)
class Verdict:
    model: str
    split: str
    check: str
    passed: bool
    detail: str


def _weighted(losses: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return (losses * torch.tensor(sizes, dtype=losses.dtype, device=losses.device)).sum() / sum(sizes)


def load_object(spec: str, option: str) -> Any:
    """Imports ``package.module:attribute`` (the current directory is importable)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"dpverify: {option} {spec!r} must look like 'module:attribute'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SystemExit(f"dpverify: {option} {spec!r}: cannot import {module_name!r} ({error})") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise SystemExit(f"dpverify: {option} {spec!r}: {module_name!r} has no attribute {attribute!r}") from None


def _checks(case: BuiltinCase, ids: list[int], parallel: Any = None) -> list[tuple[str, Callable[[], str]]]:
    if case.loss_fn is None:
        def averaging() -> str:
            report = check_forward_loss_average(case.module, case.inputs, device_ids=ids, parallel=parallel)
            uneven = len(set(report.chunk_sizes)) > 1
            if report.is_biased != uneven:
                raise ParallelMismatch(
                    f"loss.mean() of replica losses should be biased exactly when chunks are "
                    f"uneven; chunks {list(report.chunk_sizes)}, is_biased={report.is_biased}\n{report}"
                )
            return f"loss.mean() bias {report.loss_bias:+.3g} (chunks {list(report.chunk_sizes)})"

        def weighted() -> str:
            result = assert_loss_reduction_matches_full_batch(
                case.module, case.inputs, device_ids=ids, reduce=_weighted, parallel=parallel
            )
            return f"worst error at {result.worst_ratio:.2g} of tolerance"

        return [("loss.mean() bias is as predicted", averaging), ("n_i/B-weighted loss is exact", weighted)]

    loss_fn = case.loss_fn

    def grads() -> str:
        result = assert_dp_grads_match(
            case.module, case.inputs, case.target, loss_fn=loss_fn, device_ids=ids, parallel=parallel
        )
        return f"worst error at {result.worst_ratio:.2g} of tolerance"

    def grad_sum() -> str:
        result = assert_grad_sum_equals_mean_loss_grad(
            case.module, case.inputs, case.target, loss_fn=loss_fn, device_ids=ids, parallel=parallel
        )
        return f"worst error at {result.worst_ratio:.2g} of tolerance"

    return [("gradients match one device", grads), ("replica grads sum to full batch", grad_sum)]


def _verify(args: argparse.Namespace) -> int:
    models = args.models or list(BUILTIN_MODELS)
    unknown = sorted(set(models) - set(BUILTIN_MODELS))
    if unknown:
        print(f"dpverify verify: unknown --models {unknown}; choose from {sorted(BUILTIN_MODELS)}", file=sys.stderr)
        return 2
    parallel = load_object(args.parallel, "--parallel") if args.parallel else None
    gpus = cuda_device_count()
    where = f"{gpus} CUDA devices" if gpus else "virtual devices (no CUDA here)"
    wrapper = args.parallel or "DataParallel"
    print(f"dpverify verify: {wrapper} on {where}, torch {torch.__version__}")
    verdicts: list[Verdict] = []
    started = time.perf_counter()
    for name in models:
        for batch, n_devices in SPLITS:
            case = builtin_case(name, batch=batch, seed=args.seed)
            ids = list(range(n_devices))
            split = f"B={batch} on {n_devices} devices"
            for label, run in _checks(case, ids, parallel):
                try:
                    verdicts.append(Verdict(name, split, label, True, run()))
                except ParallelMismatch as failure:
                    verdicts.append(Verdict(name, split, label, False, str(failure)))
                mark = "PASS" if verdicts[-1].passed else "FAIL"
                print(f"  {mark}  {name:<16} {split:<18} {label:<34} {verdicts[-1].detail.splitlines()[0]}")
    failed = [v for v in verdicts if not v.passed]
    for verdict in failed:
        print(f"\n--- {verdict.model}, {verdict.split}: {verdict.check}\n{verdict.detail}")
    elapsed = time.perf_counter() - started
    status = "OK" if not failed else "FAILED"
    print(f"\n{status}: {len(verdicts) - len(failed)} passed, {len(failed)} failed in {elapsed:.1f}s")
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpverify",
        description="Checks PyTorch data parallelism against the single-device step, by execution.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    verify = commands.add_parser(
        "verify",
        help="verify DataParallel on the built-in models and print the verdict",
        description="Runs every check on the built-in models for even chunks, uneven chunks "
        "and a batch smaller than the device count.",
    )
    verify.add_argument("--models", nargs="+", metavar="NAME", help=f"subset of {', '.join(BUILTIN_MODELS)}")
    verify.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")
    verify.add_argument(
        "--parallel",
        metavar="MODULE:CALLABLE",
        help="verify your own DataParallel implementation, called as "
        "CALLABLE(module, device_ids=..., output_device=...)",
    )
    verify.set_defaults(run=_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dpverify`` and ``python -m dpverify``; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    code: int = args.run(args)
    return code
