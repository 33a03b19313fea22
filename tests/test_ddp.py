"""DistributedDataParallel: the worker pool, its faults, and the checks, on gloo CPU ranks."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpverify.cli.selftest import PartlyUsed, main_selftest
from dpverify.core.comparison import StepComparison
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.checks import (
    assert_ddp_accumulation_matches,
    assert_ddp_buffers_match,
    assert_ddp_grads_match,
    assert_ddp_sync_batchnorm_matches,
    assert_ddp_training_matches,
    assert_dp_ddp_agree,
)
from dpverify.ddp.pool import DDPWorkerPool, ParallelError, RankInfo
from dpverify.ddp.rank import ShardContext, StepTask, ddp_step, run_step_task, weighted_ddp_step
from dpverify.ddp.runner import dumps
from dpverify.models.specs import KINDS, DeviceList, LossSpec, ModelSpec
from dpverify.ranked.rank import even_shards
from dpverify.strategies import Scenario, device_lists, loss_specs, model_specs, scenarios

LINUX = sys.platform.startswith("linux")
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
SUM_MSE = functools.partial(F.mse_loss, reduction="sum")

#: Per-task timeout of the pool the fault tests break on purpose.
FAULT_TIMEOUT_S = 3.0


# --------------------------------------------------------------------------- fixtures
# ddp_pool and ddp_pools come from the dpverify pytest plugin.


@pytest.fixture(scope="module")
def fault_pool() -> Iterator[DDPWorkerPool]:
    with DDPWorkerPool(2, timeout=FAULT_TIMEOUT_S) as pool:
        yield pool


def mlp(seed: int = 0, features: int = 5, hidden: int = 8, outputs: int = 2) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, outputs))


def bn_model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))


def batch(rows: int, seed: int = 1, features: int = 5, outputs: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, features, generator=generator), torch.randn(rows, outputs, generator=generator)


class WithPooler(nn.Module):
    """An HF-style encoder: returns (sequence output, pooled output), and the loss uses only
    the first, so the pooler's parameters take no part in the loss."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.encoder = nn.Linear(5, 2)
            self.pooler = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.encoder(x))
        return hidden, torch.tanh(self.pooler(hidden))


def first_output_mse(output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output[0], target)


class BatchNormWithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = bn_model()
        self.unused = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.seq(x)
        return output


def frozen_mlp() -> nn.Module:
    module = mlp()
    module[0].requires_grad_(False)
    return module


def frozen_bn_model() -> nn.Module:
    module = bn_model()
    module[0].requires_grad_(False)
    return module


LossFn = Callable[[Any, torch.Tensor], torch.Tensor]

UNUSED_MODELS: dict[str, Callable[[], tuple[nn.Module, LossFn]]] = {
    "unused-layer": lambda: (PartlyUsed(), F.mse_loss),
    "pooler": lambda: (WithPooler(), first_output_mse),
    "bn-unused-layer": lambda: (BatchNormWithUnused(), F.mse_loss),
}

ALL_CHECKS = ("grads", "grads-uneven", "accumulation", "training", "buffers", "sync-batchnorm", "dp-ddp")


def run_check(check: str, module: nn.Module, loss_fn: LossFn, pool: DDPWorkerPool, ddp_kwargs: dict[str, Any] | None) -> Any:
    """One of the DDP checks on 2 ranks, on a batch of 6 rows (5 for ``grads-uneven``)."""
    x, y = batch(6)
    common: dict[str, Any] = {"loss_fn": loss_fn, "world_size": 2, "pool": pool, "ddp_kwargs": ddp_kwargs}
    if check == "grads":
        return assert_ddp_grads_match(module, x, y, **common)
    if check == "grads-uneven":
        return assert_ddp_grads_match(module, x[:5], y[:5], **common)
    if check == "accumulation":
        return assert_ddp_accumulation_matches(module, x, y, micro_batches=3, **common)
    if check == "training":
        return assert_ddp_training_matches(module, [batch(6, seed=i) for i in range(3)], optimizer=SGD, **common)
    if check == "buffers":
        return assert_ddp_buffers_match(module, x, y, **common)
    if check == "sync-batchnorm":
        return assert_ddp_sync_batchnorm_matches(module, x, y, **common)
    assert check == "dp-ddp"
    return assert_dp_ddp_agree(module, x, y, **common)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if LINUX:  # a zombie is dead, only not yet reaped
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def wait_until_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


# --------------------------------------------------------------------------- rank tasks
# Top-level functions: the ranks unpickle them by name.


def whoami(info: RankInfo) -> tuple[int, int, int]:
    return info.rank, info.world_size, os.getpid()


def all_reduce_plus(info: RankInfo, offset: float) -> float:
    value = torch.tensor([float(info.rank + offset)])
    dist.all_reduce(value)
    return float(value)


def sleep_then_answer(info: RankInfo, seconds: float) -> int:
    time.sleep(seconds)
    return info.rank


def raise_everywhere(info: RankInfo) -> None:
    raise KeyError(f"no such thing on rank {info.rank}")


def raise_on_rank_1(ctx: ShardContext) -> Any:
    if ctx.rank == 1:
        raise ZeroDivisionError("rank 1 divided by zero")
    return ddp_step(ctx)


def lonely_collective_on_rank_1(ctx: ShardContext) -> Any:
    """Rank 0 answers without any collective; rank 1 waits in one nobody else joins."""
    if ctx.rank == 1:
        dist.all_reduce(torch.ones(1))
    output = ctx.module(*ctx.inputs)
    ctx.loss_fn(output, ctx.target).backward()
    return output


def sigkill_rank_1(ctx: ShardContext) -> Any:
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return ddp_step(ctx)


def hand_all_reduce(ctx: ShardContext) -> Any:
    """The user's own DDP: sum the gradients over ranks, divide by the world size."""
    output = ctx.module(*ctx.inputs, **ctx.kwargs)
    (ctx.loss_fn(output, ctx.target) * ctx.loss_weight).backward()
    for param in ctx.module.parameters():
        assert param.grad is not None
        dist.all_reduce(param.grad)
        param.grad /= ctx.world_size
    return output


def hand_all_reduce_without_division(ctx: ShardContext) -> Any:
    output = ctx.module(*ctx.inputs, **ctx.kwargs)
    (ctx.loss_fn(output, ctx.target) * ctx.loss_weight).backward()
    for param in ctx.module.parameters():
        assert param.grad is not None
        dist.all_reduce(param.grad)
    return output


def loss_over_world_size(ctx: ShardContext) -> Any:
    model = ctx.ddp()
    output = model(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) / ctx.world_size).backward()
    return output


def doubled_loss(ctx: ShardContext) -> Any:
    model = ctx.ddp()
    output = model(*ctx.inputs)
    (2 * ctx.loss_fn(output, ctx.target)).backward()
    return output


def no_local_model(ctx: ShardContext) -> Any:
    output = ctx.module(*ctx.inputs)  # forgot the wrapper: nothing is all-reduced
    ctx.loss_fn(output, ctx.target).backward()
    return output


def accumulate_forward_outside_no_sync(ctx: ShardContext) -> None:
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        output = model(*part.inputs)  # the classic mistake: forward before entering no_sync
        loss = ctx.loss_fn(output, part.target) / len(parts)
        if index < len(parts) - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()


def accumulate_without_dividing(ctx: ShardContext) -> None:
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        with model.no_sync() if not last else contextlib.nullcontext():
            ctx.loss_fn(model(*part.inputs), part.target).backward()  # not divided by k


def accumulate_dividing_twice(ctx: ShardContext) -> None:
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        with model.no_sync() if not last else contextlib.nullcontext():
            loss = ctx.loss_fn(model(*part.inputs), part.target) / len(parts)
            (loss / len(parts)).backward()  # divided by k again, as a second scaler would


def one_grad_slightly_off(ctx: ShardContext) -> Any:
    """torch's DDP step, then the first parameter's gradient 1e-6 too large (relative): below
    float32's resolution of a sum of a few terms, far above float64's."""
    output = ddp_step(ctx)
    grad = next(ctx.module.parameters()).grad
    assert grad is not None
    grad.mul_(1 + 1e-6)
    return output


def accumulate_all_inside_no_sync(ctx: ShardContext) -> None:
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    with model.no_sync():
        for part in parts:
            (ctx.loss_fn(model(*part.inputs), part.target) / len(parts)).backward()


def unused_grads_after_ddp(info: RankInfo, module: nn.Module, x: torch.Tensor) -> dict[str, bool]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(module, find_unused_parameters=True)
    model(x[info.rank :: info.world_size]).sum().backward()
    return {name: p.grad is None for name, p in module.named_parameters()}


def buffers_after_no_grad_forward(info: RankInfo, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(module)
    shard = x[info.rank :: info.world_size] + 3.0 * info.rank
    with torch.no_grad():
        model(shard)  # train mode: updates this rank's running statistics
    after_first = module[1].running_mean.clone()
    with torch.no_grad():
        model(shard)
    return after_first, module[1].running_mean.clone()


def broadcast_buffers_warning(info: RankInfo, module: nn.Module) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedDataParallel(module, broadcast_buffers=True)
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def sync_batchnorm_on_cpu(info: RankInfo, module: nn.Module) -> str:
    from torch.nn.parallel import DistributedDataParallel

    try:
        DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(module))
    except ValueError as error:
        return str(error)
    return "accepted"


# --------------------------------------------------------------------------- the pool


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def test_pool_reuses_its_ranks_across_tasks(ddp_pool: DDPWorkerPool) -> None:
    first = ddp_pool.run(whoami)
    for _ in range(5):
        again = ddp_pool.run(whoami)
        assert again == first
    world = ddp_pool.world_size
    assert [(rank, size) for rank, size, _pid in first] == [(r, world) for r in range(world)]
    assert sorted(pid for _r, _s, pid in first) == sorted(ddp_pool.pids)
    assert ddp_pool.run(all_reduce_plus, 0.0) == (sum(range(world)),) * world
    assert ddp_pool.backend == "gloo"


@pytest.mark.timeout(60)
def test_two_pools_on_one_machine_do_not_collide(ddp_pool: DDPWorkerPool) -> None:
    with DDPWorkerPool(2) as other:
        results: dict[str, tuple[float, ...]] = {}
        threads = [
            threading.Thread(target=lambda: results.__setitem__("a", ddp_pool.run(all_reduce_plus, 10.0))),
            threading.Thread(target=lambda: results.__setitem__("b", other.run(all_reduce_plus, 20.0))),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert set(other.pids).isdisjoint(ddp_pool.pids)
    assert results == {"a": (21.0, 21.0), "b": (41.0, 41.0)}


def test_pool_rejects_what_cannot_be_pickled(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(InvalidArgument, match=r"fn=.*cannot be pickled.*lambda"):
        ddp_pool.run(lambda info: info.rank)
    with pytest.raises(InvalidArgument, match=r"args\[0\]=.*cannot be pickled"):
        ddp_pool.run(sleep_then_answer, lambda: 1)


def echo(info: RankInfo, value: Any) -> Any:
    return value


def tagged_parameter() -> nn.Parameter:
    param = nn.Parameter(torch.randn(3))
    param.tag = "kept"  # type: ignore[attr-defined]
    return param


TENSORS: dict[str, Callable[[], torch.Tensor]] = {
    "plain": lambda: torch.randn(3, 4),
    "scalar": lambda: torch.tensor(2.5, dtype=torch.float64),
    "empty": lambda: torch.zeros(0, 3),
    "bool": lambda: torch.tensor([True, False]),
    "bfloat16": lambda: torch.randn(5).to(torch.bfloat16),
    "conjugate": lambda: torch.randn(2, dtype=torch.complex64).conj(),
    "transposed": lambda: torch.randn(3, 4).t(),
    "slice": lambda: torch.arange(6.0)[2:],
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "leaf requiring grad": lambda: torch.randn(3, requires_grad=True),
    "parameter": lambda: nn.Parameter(torch.randn(2, 2)),
    "frozen parameter": lambda: nn.Parameter(torch.randn(2), requires_grad=False),
    "parameter with an attribute": tagged_parameter,
}


@pytest.mark.parametrize("kind", sorted(TENSORS))
def test_tensors_travel_to_the_ranks_as_torch_pickles_them(kind: str) -> None:
    """``dumps`` sends a plain CPU tensor as its bytes and any other as torch does; either
    way it loads as torch's own pickling loads it."""
    tensor = TENSORS[kind]()
    ours, torchs = pickle.loads(dumps(tensor)), pickle.loads(pickle.dumps(tensor))
    assert type(ours) is type(torchs)
    assert (ours.dtype, ours.shape, ours.stride(), ours.requires_grad, ours.is_conj()) == (
        torchs.dtype, torchs.shape, torchs.stride(), torchs.requires_grad, torchs.is_conj()
    )
    assert torch.equal(ours.detach().resolve_conj(), tensor.detach().resolve_conj())
    assert ours.__dict__ == torchs.__dict__
    if kind in ("plain", "scalar", "empty", "bool", "bfloat16", "leaf requiring grad", "parameter", "frozen parameter"):
        assert b"dpverify.ddp.runner" in dumps(tensor)  # as its bytes
    elif kind != "parameter with an attribute":  # (its data goes as bytes, inside torch's reduction)
        assert b"dpverify.ddp.runner" not in dumps(tensor)


def test_a_module_round_trip_through_the_ranks_keeps_tied_weights(ddp_pool: DDPWorkerPool) -> None:
    module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    module[1].weight = module[0].weight
    back = ddp_pool.run(echo, module)[0]
    assert back[0].weight is back[1].weight
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), module.state_dict().values(), strict=True))


def test_pool_arguments_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="world_size=0"):
        DDPWorkerPool(0)
    with pytest.raises(InvalidArgument, match="backend='mpi'"):
        DDPWorkerPool(2, backend="mpi")
    with pytest.raises(InvalidArgument, match=r"nccl.*one CUDA device per rank: world_size=4096"):
        DDPWorkerPool(4096, backend="nccl")
    with pytest.raises(InvalidArgument, match="timeout"):
        DDPWorkerPool(2, timeout=0)


@pytest.mark.timeout(60)
def test_exception_on_rank_1_is_reported_with_its_traceback_and_the_pool_recovers(fault_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    old = fault_pool.run(whoami)
    started = time.monotonic()
    with pytest.raises(ParallelError) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=raise_on_rank_1, pool=fault_pool)
    elapsed = time.monotonic() - started
    error = caught.value
    assert error.rank == 1
    assert "ZeroDivisionError: rank 1 divided by zero" in error.traceback
    assert "raise_on_rank_1" in error.traceback
    assert [f.kind for f in error.failures] == ["raised", "blocked"]  # rank 0 waits in DDP's broadcast
    assert "rank 1 raised ZeroDivisionError" in str(error)
    assert elapsed < FAULT_TIMEOUT_S + 3
    assert wait_until_gone([pid for *_, pid in old], within=5) == []
    assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, pool=fault_pool)


@pytest.mark.timeout(60)
def test_exception_on_every_rank_names_every_rank(fault_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelError, match=r"failed on 2 of 2 ranks") as caught:
        fault_pool.run(raise_everywhere)
    assert [(f.rank, f.kind) for f in caught.value.failures] == [(0, "raised"), (1, "raised")]
    assert "KeyError: 'no such thing on rank 1'" in caught.value.failures[1].traceback
    assert fault_pool.run(whoami)[1][0] == 1


@pytest.mark.timeout(60)
def test_hang_on_rank_1_is_detected_after_the_timeout_and_the_pool_restarts(fault_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    old = [pid for *_, pid in fault_pool.run(whoami)]
    restarts = fault_pool.restarts
    started = time.monotonic()
    with pytest.raises(ParallelError) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=lonely_collective_on_rank_1, pool=fault_pool)
    elapsed = time.monotonic() - started
    error = caught.value
    assert error.rank == 1
    assert [(f.rank, f.kind) for f in error.failures] == [(1, "hung")]
    assert f"did not answer within the {FAULT_TIMEOUT_S:g} s timeout" in str(error)
    if LINUX:  # faulthandler shows where the rank was stuck
        assert "all_reduce" in error.traceback
        assert "lonely_collective_on_rank_1" in error.traceback
    assert FAULT_TIMEOUT_S <= elapsed < FAULT_TIMEOUT_S + 3
    assert wait_until_gone(old, within=5) == []
    assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, pool=fault_pool)
    assert fault_pool.restarts == restarts + 1


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_rank_killed_by_sigkill_is_reported_within_a_second(fault_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    started = time.monotonic()
    with pytest.raises(ParallelError) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=sigkill_rank_1, pool=fault_pool)
    elapsed = time.monotonic() - started
    error = caught.value
    assert error.rank == 1
    assert error.failures[0].kind == "signal"
    assert "rank 1 was killed by SIGKILL (exit code -9)" in str(error)
    assert elapsed < 1.0 + 2.5  # death is seen at once; rank 0 then gets the failure grace
    assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, pool=fault_pool)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_rank_killed_from_outside_mid_task(fault_pool: DDPWorkerPool) -> None:
    fault_pool.start()
    victim = fault_pool.pids[1]
    timer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
    timer.start()
    started = time.monotonic()
    with pytest.raises(ParallelError, match="rank 1 was killed by SIGKILL"):
        fault_pool.run(sleep_then_answer, 30.0, timeout=60)
    assert time.monotonic() - started < 0.3 + FAULT_TIMEOUT_S
    assert fault_pool.run(sleep_then_answer, 0.0) == (0, 1)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_rank_that_died_between_tasks_is_replaced_silently(fault_pool: DDPWorkerPool) -> None:
    fault_pool.start()
    victim = fault_pool.pids[0]
    os.kill(victim, signal.SIGKILL)
    assert wait_until_gone([victim], within=5) == []
    # A killed process shows as a zombie while its other threads (gloo's) still exit and
    # still hold its files; the pool sees the death once its pipe closes.
    time.sleep(0.5)
    assert fault_pool.run(all_reduce_plus, 0.0) == (1.0, 1.0)
    assert victim not in fault_pool.pids


@pytest.mark.timeout(60)
def test_close_leaves_no_rank_behind() -> None:
    pool = DDPWorkerPool(2)
    pool.start()
    pids = list(pool.pids)
    assert len(pids) == 2
    assert all(alive(pid) for pid in pids)
    pool.close()
    assert pool.closed
    assert pool.pids == ()
    assert wait_until_gone(pids, within=5) == []
    with pytest.raises(InvalidArgument, match="is closed"):
        pool.run(whoami)


def _descendants_code() -> str:
    return textwrap.dedent(
        """
        import os

        def descendants(root):
            children = {}
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        with open(f"/proc/{entry}/stat") as handle:
                            ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
                    except (OSError, ValueError):
                        continue
                    children.setdefault(ppid, []).append(int(entry))
            found, todo = [], [root]
            while todo:
                for child in children.get(todo.pop(), []):
                    found.append(child)
                    todo.append(child)
            return found
        """
    )


@pytest.mark.timeout(120)
@pytest.mark.skipif(not LINUX, reason="reads /proc to find every descendant process")
@pytest.mark.deep
def test_no_process_outlives_a_pytest_session(tmp_path: Path) -> None:
    record = tmp_path / "pids.json"
    (tmp_path / "test_inner.py").write_text(
        _descendants_code()
        + textwrap.dedent(
            f"""
            import json
            from dpverify.ddp.pool import shared_pool

            def rank_of(info):
                return info.rank

            def test_pools_are_left_open():
                # Never closed here: the pool's finalizer must stop the ranks at exit.
                assert shared_pool(2).run(rank_of) == (0, 1)
                assert shared_pool(3).run(rank_of) == (0, 1, 2)
                with open({str(record)!r}, "w") as handle:
                    json.dump(descendants(os.getpid()), handle)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=100,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    pids = json.loads(record.read_text())
    assert len(pids) >= 5  # 2 + 3 ranks, plus the fork server
    assert wait_until_gone(pids, within=10) == []


@pytest.mark.timeout(120)
@pytest.mark.skipif(not LINUX, reason="reads /proc to find every descendant process")
@pytest.mark.deep
def test_ranks_exit_when_their_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "killed_parent.py"
    script.write_text(
        _descendants_code()
        + textwrap.dedent(
            """
            import json, signal
            from dpverify.ddp.pool import DDPWorkerPool

            if __name__ == "__main__":
                pool = DDPWorkerPool(2)
                pool.start()
                print(json.dumps(descendants(os.getpid())), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(pids) >= 3  # 2 ranks and the fork server
    assert wait_until_gone(pids, within=10) == []


# --------------------------------------------------------------------------- gradients


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def test_every_rank_gets_the_full_batch_gradient(ddp_pool: DDPWorkerPool) -> None:
    world = ddp_pool.world_size
    x, y = batch(2 * world)
    result = assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=world, pool=ddp_pool)
    assert result.ok
    assert result.worst_ratio < 1
    names = [t.name for t in result.tensors]
    assert len(names) == world * (1 + 4)  # each rank: its output rows and 4 gradients
    assert f"rank {world - 1} grad '2.weight'" in names
    assert f"rank {world - 1} output[{2 * world - 2}:{2 * world}]" in names
    assert "step ddp_step" in result.scenario


def test_uneven_shards_report_the_trap_and_verify_the_weighted_recipe(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(5)
    result = assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, shards=[4, 1], pool=ddp_pool)
    assert result.ok
    assert "weighted_ddp_step" in result.scenario
    trap = next(note for note in result.notes if "loss-averaging trap" in note)
    assert "[1/8, 1/2] instead of 1/B = 1/5" in trap
    # the bias reported is the plain step's: mean of the two shard losses minus the full loss
    model = mlp().double()
    with torch.no_grad():
        shard_losses = [F.mse_loss(model(x[a:b].double()), y[a:b].double()) for a, b in ((0, 4), (4, 5))]
        expected_bias = float(sum(shard_losses) / 2 - F.mse_loss(model(x.double()), y.double()))
    reported = float(re.search(r"bias ([-+][0-9.e+-]+)\)", trap).group(1))  # type: ignore[union-attr]
    assert reported == pytest.approx(expected_bias, rel=1e-3)
    assert result.contrasts
    assert any(c.mismatched for c in result.contrasts)


def test_a_plain_mean_loss_step_on_uneven_shards_fails_as_the_trap(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(5)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=ddp_step, pool=ddp_pool)
    text = str(caught.value)
    assert "falls into the loss-averaging trap" in text
    assert "ctx.loss_weight" in text
    assert "shards [3, 2]" in text


@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def perturb_then_ddp_step(ctx: ShardContext) -> Any:
    """A custom step that changes the weights of every rank but rank 0 before it wraps the
    module: DDP's start-up broadcast of rank 0's weights makes them agree again."""
    with torch.no_grad():
        for param in ctx.module.parameters():
            param.add_(ctx.rank)
    return ddp_step(ctx)


def start_up_broadcasts(info: RankInfo, task: StepTask) -> int:
    """How many times DistributedDataParallel broadcast rank 0's weights at construction
    while this rank ran ``task``."""
    import torch.nn.parallel.distributed as ddp_module

    seen = []
    original = ddp_module._sync_module_states

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return original(*args, **kwargs)

    ddp_module._sync_module_states = counting
    try:
        run_step_task(info, task)
    finally:
        ddp_module._sync_module_states = original
    return len(seen)


def test_own_steps_skip_ddps_start_up_sync_which_custom_steps_keep(ddp_pool: DDPWorkerPool) -> None:
    """dpverify's own steps wrap a module equal on every rank, so DDP's start-up
    collectives would change nothing and are skipped; a custom step may change the module
    before wrapping it, so it keeps them, as does init_sync named in ddp_kwargs."""
    world = ddp_pool.world_size
    x, y = batch(2 * world)

    def broadcasts(steps: list[Any], ddp_kwargs: tuple[tuple[str, Any], ...] = ()) -> set[int]:
        task = StepTask(mlp(), (x,), y, F.mse_loss, even_shards(2 * world, world), tuple(steps), ddp_kwargs=ddp_kwargs)
        return set(ddp_pool.run(start_up_broadcasts, task))

    skipped = "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters  # torch 2.3 on
    assert broadcasts([ddp_step, weighted_ddp_step]) == ({0} if skipped else {1})
    assert broadcasts([perturb_then_ddp_step]) == {1}
    assert broadcasts([ddp_step], (("init_sync", True),)) == {1}
    assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=world, step=perturb_then_ddp_step, pool=ddp_pool)


def test_a_hand_written_all_reduce_step_is_verified(ddp_pool: DDPWorkerPool) -> None:
    world = ddp_pool.world_size
    x, y = batch(2 * world + 1)
    assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=world, step=hand_all_reduce, pool=ddp_pool)
    with pytest.raises(ParallelMismatch, match=rf"is {world} times .*\({world}, the world size\)"):
        assert_ddp_grads_match(mlp(), x[: 2 * world], y[: 2 * world], loss_fn=F.mse_loss, world_size=world, step=hand_all_reduce_without_division, pool=ddp_pool)


def test_a_loss_divided_by_the_world_size_is_named(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch, match=r"1/2, one over the world size.*divided by the world size twice"):
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=loss_over_world_size, pool=ddp_pool)


def test_a_step_without_the_wrapper_leaves_ranks_disagreeing(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch, match=r"Rank 0 and rank 1 hold different gradients") as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=no_local_model, pool=ddp_pool)
    report = caught.value.report
    assert any(t.name.startswith("rank 0 grad") and not t.ok for t in report.tensors)  # type: ignore[attr-defined]


def test_mismatch_message_reads_like_assert_close(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=doubled_loss, pool=ddp_pool)
    text = str(caught.value)
    assert re.search(r"rank [01] grad '[0-9.a-z]+': tensors are not close!", text)
    assert re.search(r"Greatest absolute difference: \S+ at index \(\d+(, \d+)?\) \(up to \S+ allowed\)", text)
    assert "shards [3, 3] on 2 ranks (gloo)" in text
    assert "Every rank's gradient is 2 times" in text


def test_arguments_are_checked_before_anything_is_sent(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    model = mlp()
    with pytest.raises(InvalidArgument, match=r"loss_fn=.*cannot be pickled"):
        assert_ddp_grads_match(model, x, y, loss_fn=lambda out, t: F.mse_loss(out, t), world_size=2, pool=ddp_pool)
    with pytest.raises(InvalidArgument, match=r"step=.*cannot be pickled"):
        assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2, step=lambda ctx: None, pool=ddp_pool)
    with pytest.raises(InvalidArgument, match=r"shards=\[4, 1\] sums to 5 but the batch has 6 rows"):
        assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2, shards=[4, 1], pool=ddp_pool)
    with pytest.raises(InvalidArgument, match=r"has 3 entries for world_size=2"):
        assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2, shards=[2, 2, 2], pool=ddp_pool)
    with pytest.raises(InvalidArgument, match=r"contains 0"):
        assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2, shards=[6, 0], pool=ddp_pool)
    with pytest.raises(InvalidArgument, match=r"pool has world_size 2 but world_size=4"):
        assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=4, pool=ddp_pool)
    with pytest.raises(InvalidArgument, match=r"cannot give each of 4 ranks a row"):
        assert_ddp_grads_match(model, x[:3], y[:3], loss_fn=F.mse_loss, world_size=4)
    with pytest.raises(InvalidArgument, match=r"ddp_kwargs\['device_ids'\] is set by each rank"):
        assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, ddp_kwargs={"device_ids": [0]})


def test_even_shards() -> None:
    assert even_shards(6, 2) == (3, 3)
    assert even_shards(5, 2) == (3, 2)
    assert even_shards(9, 4) == (3, 2, 2, 2)
    with pytest.raises(InvalidArgument):
        even_shards(3, 4)


# --------------------------------------------------------------------------- training


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_training_over_several_steps_matches_one_device(ddp_pool: DDPWorkerPool, optimizer: Any) -> None:
    world = ddp_pool.world_size
    batches = [batch(2 * world + (i % 2), seed=i) for i in range(4)]  # even and uneven splits
    result = assert_ddp_training_matches(mlp(), batches, loss_fn=F.mse_loss, optimizer=optimizer, world_size=world, pool=ddp_pool)
    assert result.ok
    assert all(t.name.startswith(f"rank {t.id.rank} step 4 ") for t in result.tensors)
    kinds = {t.id.kind for t in result.tensors}
    assert kinds == {"param", "optimizer state"}  # SGD's momentum_buffer, Adam's exp_avg and exp_avg_sq
    assert any("weighted" in note for note in result.notes)


def test_training_reports_the_first_step_that_diverges(ddp_pool: DDPWorkerPool) -> None:
    batches = [batch(6, seed=i) for i in range(3)]
    with pytest.raises(ParallelMismatch, match=r"rank [01] step 1 param") as caught:
        assert_ddp_training_matches(mlp(), batches, loss_fn=F.mse_loss, optimizer=SGD, world_size=2, step=doubled_loss, pool=ddp_pool)
    assert "the table shows step 1" in str(caught.value)


# --------------------------------------------------------------------------- no_sync accumulation


@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def test_no_sync_accumulation_matches_one_big_step(ddp_pool: DDPWorkerPool) -> None:
    world = ddp_pool.world_size
    x, y = batch(3 * world + 1)
    result = assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=world, micro_batches=3, pool=ddp_pool)
    assert result.ok
    assert f"Gradient synchronisations per rank: {[1] * world} (one expected)." in result.notes


def test_forward_outside_no_sync_is_caught(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=3, step=accumulate_forward_outside_no_sync, pool=ddp_pool)
    report = caught.value.report
    assert all(t.ok for t in report.tensors)  # type: ignore[attr-defined]  # right gradients, wasted all-reduces
    assert "synchronised 3 times over 3 micro-batches" in str(caught.value)
    assert "forward ran outside no_sync()" in str(caught.value)


def test_micro_batch_loss_not_divided_is_caught(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch, match=r"is 3 times .*\(3, the number of micro-batches\)"):
        assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=3, step=accumulate_without_dividing, pool=ddp_pool)


@pytest.mark.parametrize("micro_batches", [3, 2], ids=["k=3", "k=world_size"])
def test_micro_batch_loss_divided_twice_names_the_micro_batches(ddp_pool: DDPWorkerPool, micro_batches: int) -> None:
    # 1/k; where k equals the world size the factor is also 1/world_size, and both are named
    x, y = batch(12)  # equal micro-batches: dividing by k once is exact
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=micro_batches, step=accumulate_dividing_twice, pool=ddp_pool)
    message = str(caught.value)
    assert f"(1/{micro_batches}, one over the number of micro-batches): each micro-batch's loss was divided by {micro_batches} twice" in message
    assert ("(1/2, one over the world size)" in message) == (micro_batches == 2)


def test_last_micro_batch_inside_no_sync_is_caught(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch, match=r"never averaged across ranks"):
        assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=3, step=accumulate_all_inside_no_sync, pool=ddp_pool)


def test_too_many_micro_batches_is_an_argument_error(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(InvalidArgument, match=r"every shard needs at least 4 rows"):
        assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=4, pool=ddp_pool)


# --------------------------------------------------------------------------- unused parameters


def test_unused_parameters_without_find_unused_are_caught(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(PartlyUsed(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool)
    text = str(caught.value)
    assert "Parameters ['unused.weight', 'unused.bias'] get no gradient" in text
    assert "find_unused_parameters" in text
    assert "Rank 0 and rank 1 hold different gradients" in text  # the bucket was never reduced


def test_find_unused_parameters_matches_one_device(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    result = assert_ddp_grads_match(PartlyUsed(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, ddp_kwargs={"find_unused_parameters": True})
    assert result.ok


def test_torch_leaves_globally_unused_grads_none_not_zero(ddp_pool: DDPWorkerPool) -> None:
    """find_unused_parameters is often said to give unused parameters zero grads; torch 2.13
    leaves a parameter that no rank used with grad None, so momentum and weight decay skip it
    (docs/semantics.md, DistributedDataParallel)."""
    x, _ = batch(6)
    for rank_result in ddp_pool.run(unused_grads_after_ddp, PartlyUsed(), x):
        assert rank_result == {"used.weight": False, "used.bias": False, "unused.weight": True, "unused.bias": True}
    sgd_decay = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.5)
    module = PartlyUsed()
    batches = [batch(6, seed=i) for i in range(3)]
    result = assert_ddp_training_matches(module, batches, loss_fn=F.mse_loss, optimizer=sgd_decay, world_size=2, pool=ddp_pool, ddp_kwargs={"find_unused_parameters": True})
    assert "'unused.weight'" in next(n for n in result.notes if "stayed None" in n)
    unused_rows = [t for t in result.tensors if "unused" in t.name]
    assert unused_rows
    assert all(t.ok for t in unused_rows)


def test_training_without_find_unused_names_the_parameters_and_the_fix(ddp_pool: DDPWorkerPool) -> None:
    """torch raises 'Expected to have finished reduction' at the second forward; the check says
    which parameters got no gradient and what to pass, ahead of the ranks' tracebacks."""
    batches = [batch(6, seed=i) for i in range(3)]
    for module, loss_fn, names in ((PartlyUsed(), F.mse_loss, "['unused.weight', 'unused.bias']"), (WithPooler(), first_output_mse, "['pooler.weight', 'pooler.bias']")):
        with pytest.raises(ParallelError) as caught:
            assert_ddp_training_matches(module, batches, loss_fn=loss_fn, optimizer=SGD, world_size=2, pool=ddp_pool)
        head = str(caught.value).split("\n\n", 1)[0]
        assert f"parameters {names} get no gradient" in head
        assert "ddp_kwargs={'find_unused_parameters': True}" in head
        assert "at the forward of step 2" in head
        assert "Expected to have finished reduction" in head  # torch's own words, to search for
        assert "TORCH_DISTRIBUTED_DEBUG" not in head
        assert [f.kind for f in caught.value.failures] == ["raised", "raised"]


@pytest.mark.parametrize(("check", "model"), [
    ("grads", "unused-layer"), ("grads", "pooler"), ("grads-uneven", "pooler"), ("accumulation", "pooler"),
    ("training", "pooler"), ("buffers", "bn-unused-layer"), ("sync-batchnorm", "bn-unused-layer"),
    ("dp-ddp", "unused-layer"), ("dp-ddp", "pooler"),
])
def test_unused_parameters_with_find_unused_pass_every_check(ddp_pool: DDPWorkerPool, check: str, model: str) -> None:
    module, loss_fn = UNUSED_MODELS[model]()
    result = run_check(check, module, loss_fn, ddp_pool, {"find_unused_parameters": True})
    assert result.ok
    grad_rows = [t for t in result.tensors if "unused" in t.name or "pooler" in t.name]
    assert grad_rows or check == "buffers"
    assert all(t.ok for t in grad_rows)


@pytest.mark.parametrize(("check", "model"), [
    ("grads", "pooler"), ("accumulation", "pooler"), ("sync-batchnorm", "bn-unused-layer"), ("dp-ddp", "unused-layer"),
])
def test_unused_parameters_without_find_unused_fail_naming_them_and_the_fix(ddp_pool: DDPWorkerPool, check: str, model: str) -> None:
    module, loss_fn = UNUSED_MODELS[model]()
    with pytest.raises(ParallelMismatch) as caught:
        run_check(check, module, loss_fn, ddp_pool, None)
    text = str(caught.value)
    names = [name for name, p in module.named_parameters() if "unused" in name or "pooler" in name]
    assert f"parameters {names} get no gradient" in text.lower()
    assert "ddp_kwargs={'find_unused_parameters': True}" in text
    assert "last micro-batch also ran inside no_sync()" not in text  # not the accumulation mistake


def test_buffers_check_with_unused_parameters_passes_without_find_unused(ddp_pool: DDPWorkerPool) -> None:
    """Only buffers are compared; an eval forward under no_grad does not hit torch's error."""
    module, loss_fn = UNUSED_MODELS["bn-unused-layer"]()
    assert run_check("buffers", module, loss_fn, ddp_pool, None).ok


@pytest.mark.parametrize("check", ALL_CHECKS)
def test_frozen_parameters_pass_every_check(ddp_pool: DDPWorkerPool, check: str) -> None:
    module = frozen_bn_model() if check in ("buffers", "sync-batchnorm") else frozen_mlp()
    result = run_check(check, module, F.mse_loss, ddp_pool, None)
    assert result.ok
    frozen_rows = [t for t in result.tensors if "'0." in t.name or "'seq.0." in t.name]
    assert all(t.ok for t in frozen_rows)


def test_frozen_parameters_are_not_mistaken_for_unused_ones(ddp_pool: DDPWorkerPool) -> None:
    """A frozen parameter has grad None on one device too, but DDP ignores it: no advice about
    find_unused_parameters when something else fails."""
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(frozen_mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=doubled_loss, pool=ddp_pool)
    text = str(caught.value)
    assert "Every rank's gradient is 2 times" in text
    assert "find_unused_parameters" not in text
    assert "get no gradient" not in text
    batches = [batch(6, seed=i) for i in range(2)]
    result = assert_ddp_training_matches(frozen_mlp(), batches, loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=ddp_pool)
    assert not any("'0.weight'" in note for note in result.notes)


@pytest.mark.parametrize("check", ALL_CHECKS)
def test_a_module_without_trainable_parameters_is_an_argument_error(ddp_pool: DDPWorkerPool, check: str) -> None:
    module = bn_model().requires_grad_(False)
    with pytest.raises(InvalidArgument, match=r"module=\w+ has no parameter that requires grad \(.*\): DistributedDataParallel refuses") as caught:
        run_check(check, module, F.mse_loss, ddp_pool, None)
    assert "loss_fn" not in str(caught.value)


# --------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def test_buffers_come_from_rank_0(ddp_pool: DDPWorkerPool) -> None:
    world = ddp_pool.world_size
    x, y = batch(3 * world)
    result = assert_ddp_buffers_match(bn_model(), x, y, loss_fn=F.mse_loss, world_size=world, pool=ddp_pool)
    assert result.ok
    assert sum("at the next forward" in t.name for t in result.tensors) == 3 * world


#: torch 2.13 has DDP's ``forward_sync_buffers`` beside ``broadcast_buffers`` (the old name
#: warns); older torch (2.11) has only ``broadcast_buffers``.
HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
NO_BUFFER_SYNC = {"forward_sync_buffers" if HAS_FORWARD_SYNC_BUFFERS else "broadcast_buffers": False}


def test_buffers_not_synchronised_are_caught(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch, match=r"Ranks \[1\] kept their own running statistics") as caught:
        assert_ddp_buffers_match(bn_model(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, ddp_kwargs=NO_BUFFER_SYNC)
    bad = [t.name for t in caught.value.report.tensors if not t.ok]  # type: ignore[attr-defined]
    assert "rank 1 buffer '1.running_mean' at the next forward" in bad
    assert not any(name.startswith("rank 0") for name in bad)


@pytest.mark.skipif(not HAS_FORWARD_SYNC_BUFFERS, reason=f"the DDP of torch {torch.__version__} has no forward_sync_buffers")
def test_torch_deprecates_broadcast_buffers(ddp_pool: DDPWorkerPool) -> None:
    """The issue names broadcast_buffers; torch 2.13 warns it is deprecated for
    forward_sync_buffers (whose False still syncs at construction)."""
    messages = ddp_pool.run(broadcast_buffers_warning, bn_model())
    assert all(any("`broadcast_buffers` is deprecated" in m for m in ranks) for ranks in messages)


def test_torch_skips_the_buffer_broadcast_after_a_no_grad_forward(ddp_pool: DDPWorkerPool) -> None:
    x, _ = batch(6)
    (first0, second0), (first1, second1) = ddp_pool.run(buffers_after_no_grad_forward, bn_model(), x)
    assert not torch.equal(first0, first1)  # each rank updated its own statistics
    assert not torch.equal(second1, second0)  # and the second forward did not broadcast rank 0's


# --------------------------------------------------------------------------- SyncBatchNorm


@pytest.mark.parametrize(("world", "rows"), [(2, 6), (2, 5), (4, 9)])
def test_sync_batchnorm_matches_full_batch_batchnorm(ddp_pools: Callable[[int], DDPWorkerPool], world: int, rows: int) -> None:
    x, y = batch(rows)
    result = assert_ddp_sync_batchnorm_matches(bn_model(), x, y, loss_fn=F.mse_loss, world_size=world, pool=ddp_pools(world))
    assert result.ok
    assert sum("running_var" in t.name for t in result.tensors) == world
    assert any(c.mismatched for c in result.contrasts)  # plain BatchNorm under DDP differs


def test_torch_refuses_sync_batchnorm_on_cpu(ddp_pool: DDPWorkerPool) -> None:
    messages = ddp_pool.run(sync_batchnorm_on_cpu, bn_model())
    assert messages == ("SyncBatchNorm layers only work with GPU modules",) * 2


def test_sync_batchnorm_needs_a_batchnorm(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(InvalidArgument, match="no BatchNorm layer"):
        assert_ddp_sync_batchnorm_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool)


# --------------------------------------------------------------------------- DP and DDP


@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def test_dp_and_ddp_agree_for_a_mean_loss_and_differ_by_world_size_for_a_sum(ddp_pool: DDPWorkerPool) -> None:
    world = ddp_pool.world_size
    x, y = batch(2 * world)
    assert assert_dp_ddp_agree(mlp(), x, y, loss_fn=F.mse_loss, world_size=world, pool=ddp_pool).ok
    with pytest.raises(ParallelMismatch) as caught:
        assert_dp_ddp_agree(mlp(), x, y, loss_fn=SUM_MSE, world_size=world, pool=ddp_pool)
    text = str(caught.value)
    assert f"DDP's gradients are {1 / world:.6g} = 1/{world}" in text
    assert f"differ by the world size, {world}" in text


# --------------------------------------------------------------------------- property


DDP_MODELS = model_specs(kinds=list(KINDS), exact=True)  # "kwargs": a keyword argument sharded with the batch


@st.composite
def ddp_scenarios(draw: st.DrawFn) -> tuple[Scenario, tuple[int, ...]]:
    """A scenario from ``dpverify.strategies`` (mean losses: the DDP checks' contract), its
    device list's length as the world size (2 to 4), and random contiguous shards."""
    scenario = draw(
        scenarios(
            models=DDP_MODELS, devices=device_lists(min_devices=2, max_devices=4),
            losses=loss_specs(reductions=("mean",)),
        ).filter(lambda s: s.batch_size >= len(s.devices.device_ids))
    )
    world, rows = len(scenario.devices.device_ids), scenario.batch_size
    cuts = sorted(draw(st.lists(st.integers(1, rows - 1), min_size=world - 1, max_size=world - 1, unique=True)))
    return scenario, tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True))


@pytest.mark.timeout(240)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples: the dpverify-ci profile
@given(drawn=ddp_scenarios())
def test_property_ddp_matches_one_device_for_any_shards(ddp_pools: Callable[[int], DDPWorkerPool], drawn: tuple[Scenario, tuple[int, ...]]) -> None:
    scenario, shards = drawn
    s, world = scenario.build(), len(shards)
    pool = ddp_pools(world)
    kwargs = s.kwargs or None
    result = assert_ddp_grads_match(s.module, s.inputs, s.target, loss_fn=s.loss_fn, world_size=world, shards=shards, pool=pool, forward_kwargs=kwargs)
    assert result.ok
    with pytest.raises(ParallelMismatch, match=rf"\({world}, the world size\)"):
        assert_ddp_grads_match(s.module, s.inputs, s.target, loss_fn=s.loss_fn, world_size=world, shards=shards, step=hand_all_reduce_without_division, pool=pool, forward_kwargs=kwargs)


# --------------------------------------------------------------------------- float64

#: torch's own DDP on 3 ranks, in float64. L1's sign gradients of the bias cancel to 0 over
#: the 12 rows, not over each rank's 4: one device rounds the sum to 2.8e-17, the all-reduce's
#: sum of the ranks' thirds to 0, rounding of the size of the terms summed (1/3), which the
#: near-zero full-batch gradient cannot scale.
L1_LINEAR_F64 = Scenario(
    ModelSpec("linear", features=3, outputs=1, train=False), 12, DeviceList((0, 1, 2)), LossSpec("l1"), torch.float64, seed=1,
)
#: A 2-layer GRU, 2 micro-batches of one row per rank: accumulation reorders the sums, by
#: float64 rounding of the model that the float64 anchor (the single-device step itself) cannot show.
GRU_F64 = Scenario(
    ModelSpec("gru", features=1, hidden=3, outputs=1, depth=2, train=False), 6, DeviceList((0, 1, 2)), LossSpec("mse"), torch.float64, seed=2,
)


def test_cancelling_rank_gradients_in_float64_are_no_false_alarm(ddp_pools: Callable[[int], DDPWorkerPool]) -> None:
    s = L1_LINEAR_F64.build()
    result = assert_ddp_grads_match(s.module, s.inputs, s.target, loss_fn=s.loss_fn, world_size=3, pool=ddp_pools(3))
    assert result.ok
    # the scenario still shows the cancellation: the bias gradient, the mean of the rows'
    # signs, is 0 in exact arithmetic; one device and the ranks may round it differently
    # (2.8e-17 against 0 on one CPU), or both to 0 where a CPU sums in another order: only
    # rounding either way
    with torch.no_grad():
        signs = torch.sign(s.module(*s.inputs) - s.target)
    assert float(signs.sum()) == 0.0
    bias = [t for t in result.tensors if t.name.endswith("grad 'bias'")]
    assert len(bias) == 3
    assert all(t.max_abs < 1e-15 for t in bias)


def test_accumulation_rounding_in_float64_is_no_false_alarm(ddp_pools: Callable[[int], DDPWorkerPool]) -> None:
    s = GRU_F64.build()
    result = assert_ddp_accumulation_matches(s.module, s.inputs, s.target, loss_fn=s.loss_fn, world_size=3, micro_batches=2, pool=ddp_pools(3))
    assert result.ok
    # every rank's gradients were compared; whether accumulation rounded them differently
    # from one device depends on the CPU's summation order, so it is not assumed
    assert {t.name.split(" ")[1] for t in result.tensors if " grad " in t.name} == {"0", "1", "2"}


def test_a_gradient_off_by_one_in_a_million_still_fails_in_float64(ddp_pools: Callable[[int], DDPWorkerPool]) -> None:
    s = L1_LINEAR_F64.build()
    with pytest.raises(ParallelMismatch, match=r"rank [012] grad 'weight': tensors are not close!") as caught:
        assert_ddp_grads_match(s.module, s.inputs, s.target, loss_fn=s.loss_fn, world_size=3, step=one_grad_slightly_off, pool=ddp_pools(3))
    report = caught.value.report
    assert isinstance(report, StepComparison)
    failing = {t.name for t in report.tensors if not t.ok}
    assert failing == {f"rank {r} grad 'weight'" for r in range(3)}  # the bias's rounding still passes
    assert all(t.max_abs > 1e3 * t.allowed for t in report.tensors if not t.ok)


# --------------------------------------------------------------------------- torchrun


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(), reason="needs torchrun")
@pytest.mark.deep
def test_selftest_under_torchrun_prints_one_verdict() -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dpverify.cli.selftest"],
        capture_output=True, text=True, timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("dpverify ddp-selftest: OK, 12 of 12 checks passed on 2 ranks (gloo)") == 1
    assert "torchrun process group" in done.stdout


@pytest.mark.timeout(120)
def test_selftest_with_a_local_pool(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_selftest(["--world-size", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 12
    assert "FAIL" not in out
    assert "OK, 12 of 12 checks passed on 3 ranks (gloo)" in out


def test_selftest_reads_the_sum_loss_factor_from_the_result_not_its_text(ddp_pool: DDPWorkerPool) -> None:
    """The sum-loss self-check passes on the diagnosed factor (a structured field), and
    fails when the factor is not the one expected."""
    import dataclasses

    from dpverify.cli import selftest

    sum_loss = selftest._checks(2, 0)[-1]
    assert sum_loss.expect_scale == 0.5
    ok, line, _ = selftest._verdict(sum_loss, ddp_pool)
    assert ok, line
    assert "0.5 x DP's" in line
    wrong = dataclasses.replace(sum_loss, expect_scale=0.25)
    ok, line, _ = selftest._verdict(wrong, ddp_pool)
    assert not ok
    assert line.startswith("expected DDP grads at 0.25 x DP's, got FAIL")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_models_pass_the_ddp_checks(dtype: torch.dtype) -> None:
    model = mlp().to(dtype)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 5, generator=g).to(dtype), torch.randn(8, 2, generator=g).to(dtype)
    assert assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2).ok
    assert assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2, shards=[5, 3]).ok
    assert assert_ddp_accumulation_matches(model, x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=2).ok
    assert assert_ddp_buffers_match(bn_model().to(dtype), x, y, loss_fn=F.mse_loss, world_size=2).ok
