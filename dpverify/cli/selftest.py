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
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.core.text import plural
from dpverify.ddp.checks import (
    assert_ddp_accumulation_matches,
    assert_ddp_buffers_match,
    assert_ddp_grads_match,
    assert_ddp_sync_batchnorm_matches,
    assert_ddp_training_matches,
    assert_dp_ddp_agree,
)
from dpverify.ddp.pool import DDPWorkerPool, ParallelError, ProcessGroupRunner, RankRunner
from dpverify.models.builtin import builtin_case

__all__ = ["PartlyUsed", "main_selftest"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class PartlyUsed(nn.Module):
    """A Linear head plus a branch that forward never uses (for find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(5, 2)
        self.unused = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.used(x)
        return output


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=generator), torch.randn(rows, 2, generator=generator)


@dataclass(frozen=True)
class SelfCheck:
    """One named check of the self-test; ``run`` returns a one-line detail or raises."""

    name: str
    run: Callable[[RankRunner], str]


def _passed(result: object) -> str:
    return str(result).split(": passed", 1)[-1].split(". Scenario", 1)[0].strip(" ()") or "passed"


def _checks(world: int, seed: int) -> list[SelfCheck]:
    even, uneven = 2 * world, 2 * world + 1
    mlp = builtin_case("mlp", batch=even, seed=seed)
    mlp_odd = builtin_case("mlp", batch=uneven, seed=seed)
    conv = builtin_case("conv", batch=even, seed=seed)
    embedding = builtin_case("embedding", batch=uneven, seed=seed)
    x, y = _data(even, seed)
    batches = [_data(even, seed + i) for i in range(3)]
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    linear = _seeded(lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)), seed)
    bn = _seeded(_bn_model, seed)
    unused = _seeded(PartlyUsed, seed)

    def grads(case_name: str) -> Callable[[RankRunner], str]:
        case = {"mlp": mlp, "mlp-uneven": mlp_odd, "conv": conv, "embedding": embedding}[case_name]
        assert case.loss_fn is not None
        loss_fn = case.loss_fn

        def run(pool: RankRunner) -> str:
            return _passed(assert_ddp_grads_match(case.module, case.inputs, case.target, loss_fn=loss_fn, world_size=world, pool=pool))

        return run

    def sum_loss_differs(pool: RankRunner) -> str:
        summed = functools.partial(F.mse_loss, reduction="sum")
        try:
            assert_dp_ddp_agree(linear, x, y, loss_fn=summed, world_size=world, pool=pool)
        except ParallelMismatch as failure:
            if world > 1 and f"differ by the world size, {world}" not in str(failure):
                raise
            return f"DDP grads are 1/{world} of DP's for a sum loss, as reported"
        if world > 1:
            raise ParallelMismatch("a sum loss gave the same gradients under DP and DDP")
        return "world size 1: DP and DDP agree"

    return [
        SelfCheck("grads: mlp, even shards", grads("mlp")),
        SelfCheck("grads: mlp, uneven shards", grads("mlp-uneven")),
        SelfCheck("grads: conv, even shards", grads("conv")),
        SelfCheck("grads: embedding, uneven", grads("embedding")),
        SelfCheck("train: SGD momentum, 3 steps", lambda p: _passed(assert_ddp_training_matches(linear, batches, loss_fn=F.mse_loss, optimizer=sgd, world_size=world, pool=p))),
        SelfCheck("train: Adam, 3 steps", lambda p: _passed(assert_ddp_training_matches(linear, batches, loss_fn=F.mse_loss, optimizer=adam, world_size=world, pool=p))),
        SelfCheck("no_sync accumulation, k=2", lambda p: _passed(assert_ddp_accumulation_matches(linear, x, y, loss_fn=F.mse_loss, world_size=world, micro_batches=2, pool=p))),
        SelfCheck("find_unused_parameters", lambda p: _passed(assert_ddp_grads_match(unused, x, y, loss_fn=F.mse_loss, world_size=world, pool=p, ddp_kwargs={"find_unused_parameters": True}))),
        SelfCheck("buffers come from rank 0", lambda p: _passed(assert_ddp_buffers_match(bn, x, y, loss_fn=F.mse_loss, world_size=world, pool=p))),
        SelfCheck("SyncBatchNorm = full-batch BN", lambda p: _passed(assert_ddp_sync_batchnorm_matches(bn, x, y, loss_fn=F.mse_loss, world_size=world, pool=p))),
        SelfCheck("DP = DDP for a mean loss", lambda p: _passed(assert_dp_ddp_agree(linear, x, y, loss_fn=F.mse_loss, world_size=world, pool=p))),
        SelfCheck("DP = W x DDP for a sum loss", sum_loss_differs),
    ]


def _under_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def _join_torchrun_group(backend: str | None) -> ProcessGroupRunner:
    import torch.distributed as dist

    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        chosen = backend or ("nccl" if gpus > local_rank and dist.is_nccl_available() else "gloo")
        if chosen == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(chosen)
    return ProcessGroupRunner()


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
    checks = _checks(runner.world_size, seed)
    for check in checks:
        try:
            detail, ok = check.run(runner), True
        except (ParallelMismatch, ParallelError, InvalidArgument) as failure:
            detail, ok = str(failure), False
            failed.append((check.name, detail))
        show(f"  {'PASS' if ok else 'FAIL'}  {check.name:<32} {detail.splitlines()[0]}")
    for name, detail in failed:
        show(f"\n--- {name}\n{detail}")
    elapsed = time.perf_counter() - started
    status = "OK" if not failed else "FAILED"
    show(
        f"\ndpverify ddp-selftest: {status}, {len(checks) - len(failed)} of {plural(len(checks), 'check')} "
        f"passed on {plural(runner.world_size, 'rank')} ({runner.backend}) in {elapsed:.1f}s"
    )
    return 1 if failed else 0


def main_selftest(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dpverify ddp-selftest``; returns the exit code (same on every rank)."""
    args = _parser().parse_args(argv)
    if _under_torchrun():
        runner = _join_torchrun_group(args.backend)
        rank = runner.rank

        def show(line: str) -> None:
            if rank == 0:
                print(line, flush=True)

        show(f"dpverify ddp-selftest: torchrun process group, {plural(runner.world_size, 'rank')} ({runner.backend}), torch {torch.__version__}")
        try:
            return _run_all(runner, args.seed, show)
        finally:
            import torch.distributed as dist

            dist.destroy_process_group()
    if args.world_size < 1:
        print(f"dpverify ddp-selftest: --world-size={args.world_size} must be at least 1", file=sys.stderr)
        return 2
    try:
        pool = DDPWorkerPool(args.world_size, args.backend, timeout=args.timeout)
    except InvalidArgument as error:
        print(f"dpverify ddp-selftest: {error}", file=sys.stderr)
        return 2
    with pool:
        print(f"dpverify ddp-selftest: local pool, {plural(pool.world_size, 'rank')} ({pool.backend}), torch {torch.__version__}", flush=True)
        return _run_all(pool, args.seed, lambda line: print(line, flush=True))


if __name__ == "__main__":
    raise SystemExit(main_selftest(sys.argv[1:]))
