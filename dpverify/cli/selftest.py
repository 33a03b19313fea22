"""``dpverify ddp-selftest``: the DDP checks on built-in models, under torchrun or a pool.

Under ``torchrun`` (one node or many, gloo or nccl) the checks run inside the process
group torchrun started: every rank runs every check, results are all-gathered, and rank 0
prints the verdict. Without torchrun, the same checks run through a ``DDPWorkerPool`` of
``--world-size`` ranks on this machine. The exit code is 0 when every check passed, 1 when
one failed, 2 for bad usage, on every rank.

    torchrun --standalone --nproc-per-node 2 -m dpverify.cli.selftest
    python -m dpverify.cli.selftest --world-size 4
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpverify.cli.exits import EXIT_FAILED, EXIT_NOTHING_CHECKED, EXIT_OK, usage_error
from dpverify.core.errors import InvalidArgument
from dpverify.core.text import plural
from dpverify.ddp.pool import DDPWorkerPool, RankRunner
from dpverify.ddp.torchrun import join_torchrun_group, torchrun_backend, under_torchrun
from dpverify.models.builtin import BuiltinCase, builtin_case
from dpverify.registry import CHECKS, Case, Target, Verdict

__all__ = ["PartlyUsed", "main_selftest", "selftest_command", "torchrun_backend"]

class PartlyUsed(nn.Module):
    """A Linear head plus a branch that forward never uses (for find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(5, 2)
        self.unused = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.used(x)
        return output


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=generator), torch.randn(rows, 2, generator=generator)


@dataclass(frozen=True)
class SelfCheck:
    """One registry check of the self-test, on a built-in case.

    Attributes:
        label: the row's name.
        check: the registry name (a key of ``CHECKS``).
        case: the model and batch; its device count is replaced by the world size.
        target: DDP options (the ranks are the runner's).
        expect_scale: the check must fail with exactly this uniform factor between DDP and
            the reference (a sum loss under DDP is 1/world_size of DataParallel's: the
            diagnosis is the point, not a bug); None when it must pass.
    """

    label: str
    check: str
    case: Case
    target: Target = field(default_factory=Target)
    expect_scale: float | None = None


def _case(case: BuiltinCase | tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]], world: int, loss_fn: Any = F.mse_loss, **fields: Any) -> Case:
    if isinstance(case, BuiltinCase):
        return Case(case.module, case.inputs, case.target, case.loss_fn, tuple(range(world)), **fields)
    module, (x, y) = case
    return Case(module, (x,), y, loss_fn, tuple(range(world)), **fields)


def _checks(world: int, seed: int) -> list[SelfCheck]:
    even, uneven = 2 * world, 2 * world + 1
    x_y = _data(even, seed)
    batches = tuple(((x,), y) for x, y in (_data(even, seed + i) for i in range(3)))
    linear = _seeded(lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)), seed)
    bn = _seeded(lambda: nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)), seed)
    summed = functools.partial(F.mse_loss, reduction="sum")

    def builtin(name: str, rows: int) -> Case:
        return _case(builtin_case(name, batch=rows, seed=seed), world)

    def training(optimizer: Any) -> Case:
        return _case((linear, x_y), world, batches=batches, optimizer=optimizer)

    return [
        SelfCheck("grads: mlp, even shards", "ddp-grads", builtin("mlp", even)),
        SelfCheck("grads: mlp, uneven shards", "ddp-grads", builtin("mlp", uneven)),
        SelfCheck("grads: conv, even shards", "ddp-grads", builtin("conv", even)),
        SelfCheck("grads: embedding, uneven", "ddp-grads", builtin("embedding", uneven)),
        SelfCheck("train: SGD momentum, 3 steps", "ddp-training", training(functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))),
        SelfCheck("train: Adam, 3 steps", "ddp-training", training(functools.partial(torch.optim.Adam, lr=0.01))),
        SelfCheck("no_sync accumulation, k=2", "ddp-accumulation", _case((linear, x_y), world)),
        SelfCheck("find_unused_parameters", "ddp-grads", _case((_seeded(PartlyUsed, seed), x_y), world), Target(ddp_kwargs={"find_unused_parameters": True})),
        SelfCheck("buffers come from rank 0", "ddp-buffers", _case((bn, x_y), world)),
        SelfCheck("SyncBatchNorm = full-batch BN", "ddp-sync-batchnorm", _case((bn, x_y), world)),
        SelfCheck("DP = DDP for a mean loss", "dp-ddp-agree", _case((linear, x_y), world)),
        SelfCheck("DP = W x DDP for a sum loss", "dp-ddp-agree", _case((linear, x_y), world, summed), expect_scale=1 / world if world > 1 else None),
    ]


def _verdict(check: SelfCheck, runner: RankRunner) -> tuple[bool | None, str, str]:
    """``(ok, one line, report)`` of one self-check on ``runner``'s ranks; ok is None when
    the check was skipped (one rank: nothing runs in parallel)."""
    result = CHECKS[check.check].run(check.case, replace(check.target, pool=runner))
    if result.verdict is Verdict.SKIP:
        return None, result.summary, ""
    if check.expect_scale is None:
        return result.verdict is Verdict.PASS, result.summary, result.detail
    if result.verdict is Verdict.FAIL and result.scale is not None and abs(result.scale / check.expect_scale - 1) < 1e-3:
        return True, f"DDP grads are {result.scale:.3g} x DP's for a sum loss, as diagnosed", ""
    return False, f"expected DDP grads at {check.expect_scale:.3g} x DP's, got {result.verdict}: {result.summary}", result.detail


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpverify ddp-selftest",
        description="Runs the DistributedDataParallel checks on built-in models: inside the "
        "process group of torchrun when started by it, else through a local pool of ranks.",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the local pool without torchrun (default 2)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per check before a local rank counts as hung")
    return parser


def _run_all(runner: RankRunner, seed: int, show: Callable[[str], None]) -> int:
    started = time.perf_counter()
    failed: list[tuple[str, str]] = []
    skipped = 0
    checks = _checks(runner.world_size, seed)
    for check in checks:
        ok: bool | None
        try:
            ok, line, report = _verdict(check, runner)
        except InvalidArgument as error:  # a self-check that cannot run here is a failure too
            ok, line, report = False, str(error).splitlines()[0], str(error)
        if ok is False:
            failed.append((check.label, report or line))
        skipped += ok is None
        show(f"  {'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  {check.label:<32} {line}")
    for name, detail in failed:
        show(f"\n--- {name}\n{detail}")
    elapsed = time.perf_counter() - started
    nothing = skipped == len(checks)  # one rank: nothing ran in parallel, which is no pass
    status = "FAILED" if failed else "NOTHING CHECKED" if nothing else "OK"
    show(
        f"\ndpverify ddp-selftest: {status}, {len(checks) - len(failed) - skipped} of {plural(len(checks), 'check')} "
        f"passed on {plural(runner.world_size, 'rank')} ({runner.backend}) in {elapsed:.1f}s"
        + (f", {skipped} skipped" if skipped else "")
    )
    return EXIT_FAILED if failed else EXIT_NOTHING_CHECKED if nothing else EXIT_OK


def main_selftest(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dpverify ddp-selftest``; returns the exit code, or under torchrun
    ends the rank with it once its group is destroyed (``leave_rank``; the same code on
    every rank).

    Raises:
        InvalidArgument: an unusable option (``selftest_command`` makes it exit 2).
    """
    args = _parser().parse_args(argv)
    if under_torchrun():
        runner = join_torchrun_group(args.backend)
        rank = runner.rank

        def show(line: str) -> None:
            if rank == 0:
                print(line, flush=True)

        show(f"dpverify ddp-selftest: torchrun process group, {plural(runner.world_size, 'rank')} ({runner.backend}), torch {torch.__version__}")
        import torch.distributed as dist

        from dpverify.cli.torchrun import leave_rank

        code = _run_all(runner, args.seed, show)
        dist.destroy_process_group()
        leave_rank(code)  # not the interpreter's teardown, which can abort a rank (see leave_rank)
    if args.world_size < 1:
        raise InvalidArgument(f"--world-size={args.world_size} must be at least 1")
    with DDPWorkerPool(args.world_size, args.backend, timeout=args.timeout) as pool:
        print(f"dpverify ddp-selftest: local pool, {plural(pool.world_size, 'rank')} ({pool.backend}), torch {torch.__version__}", flush=True)
        return _run_all(pool, args.seed, lambda line: print(line, flush=True))


def selftest_command(argv: Sequence[str] | None = None) -> int:
    """``dpverify ddp-selftest`` with the command line's error policy: an unusable option
    prints its message and gives ``EXIT_USAGE``."""
    try:
        return main_selftest(argv)
    except InvalidArgument as error:
        return usage_error("ddp-selftest", error)


if __name__ == "__main__":  # torchrun -m dpverify.cli.selftest
    raise SystemExit(selftest_command(sys.argv[1:]))
