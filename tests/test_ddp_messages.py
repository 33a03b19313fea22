"""What the DDP checks say when something is wrong: the factor between DDP's and one device's
gradients and its cause, checked against torch's real DDP on gloo ranks; and what a script
that the ranks cannot import is told."""

from __future__ import annotations

import contextlib
import functools
import re
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_ddp import SUM_MSE, batch, loss_over_world_size, mlp

from dpverify.core.errors import ParallelMismatch
from dpverify.ddp.advice import main_module_advice
from dpverify.ddp.checks import (
    assert_ddp_accumulation_matches,
    assert_ddp_grads_match,
    assert_ddp_training_matches,
)
from dpverify.ddp.pool import DDPWorkerPool, RankFailure
from dpverify.ddp.rank import ShardContext
from dpverify.ranked.check import loss_reduction

SGD = functools.partial(torch.optim.SGD, lr=0.05)


# --------------------------------------------------------------------------- rank steps
# Top-level functions: the ranks unpickle them by name.


def loss_times_world_size(ctx: ShardContext) -> Any:
    """The fix for a sum loss: DDP's average of W * (sum over each shard) is the full sum."""
    model = ctx.ddp()
    output = model(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) * ctx.world_size).backward()
    return output


def accumulate_sum_loss_times_world_size(ctx: ShardContext) -> None:
    """The fix for a sum loss under accumulation: micro-batch losses unweighted, times W."""
    model = ctx.ddp()
    parts = ctx.micro_batch_split()
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            (ctx.loss_fn(model(*part.inputs), part.target) * ctx.world_size).backward()


def loss_times_rows(ctx: ShardContext) -> Any:
    """A mean loss times the shard's rows: the sum over the rank's rows."""
    model = ctx.ddp()
    output = model(*ctx.inputs)
    (ctx.loss_fn(output, ctx.target) * ctx.shard_size).backward()
    return output


def all_reduce_sum_without_division(ctx: ShardContext) -> Any:
    output = ctx.module(*ctx.inputs)
    ctx.loss_fn(output, ctx.target).backward()
    for param in ctx.module.parameters():
        assert param.grad is not None
        dist.all_reduce(param.grad)
    return output


# --------------------------------------------------------------------------- the loss's reduction


def test_loss_reduction_tells_a_sum_from_a_mean() -> None:
    x, y = batch(6)
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    weighted_ce = functools.partial(F.cross_entropy, weight=torch.tensor([1.0, 3.0]))
    assert loss_reduction(mlp(), (x,), y, SUM_MSE, (3, 3)) == "sum"
    assert loss_reduction(mlp(), (x,), y, F.mse_loss, (4, 2)) == "mean"
    assert loss_reduction(mlp(), (x,), labels, F.cross_entropy, (3, 3)) == "mean"
    assert loss_reduction(mlp(), (x,), labels, weighted_ce, (3, 3)) is None  # a weighted mean is neither
    assert loss_reduction(mlp(), (x,), y, F.mse_loss, (6,)) is None  # one shard tells nothing


# --------------------------------------------------------------------------- factors


@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)
def test_a_sum_loss_gives_one_over_the_world_size_and_is_named(ddp_pool: DDPWorkerPool) -> None:
    """DDP averages the ranks' gradients; each rank's sum loss covers its own rows, so the
    average is 1/W of the full-batch sum that one device computes."""
    world = ddp_pool.world_size
    x, y = batch(3 * world)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=SUM_MSE, world_size=world, pool=ddp_pool)
    text = str(caught.value)
    assert f"Every rank's gradient is {1 / world:.6g} times the single-device" in text
    assert f"(1/{world}, one over the world size): loss_fn is a sum-reduction loss" in text
    assert "Use a mean loss" in text
    assert "multiply each rank's loss by world_size (loss * ctx.world_size" in text
    assert "DataParallel, which sums its replicas' gradients" in text
    assert "divided by the world size twice" not in text


def test_the_fixes_named_for_a_sum_loss_pass(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(7)
    for rows, shards in ((6, None), (7, [5, 2])):  # even, and uneven without ctx.loss_weight
        assert_ddp_grads_match(mlp(), x[:rows], y[:rows], loss_fn=SUM_MSE, world_size=2, shards=shards, step=loss_times_world_size, pool=ddp_pool)
    assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=SUM_MSE, world_size=2, micro_batches=3, step=accumulate_sum_loss_times_world_size, pool=ddp_pool)
    # A hand-written SUM all-reduce without division is right for a sum loss.
    assert_ddp_grads_match(mlp(), x, y, loss_fn=SUM_MSE, world_size=2, step=all_reduce_sum_without_division, pool=ddp_pool)


def _factor(text: str) -> float:
    """The measured factor of 'Every rank's gradient is <c> times the single-device ...'."""
    found = re.search(r"Every rank's gradient is (\S+) times the single-device", text)
    assert found is not None, text
    return float(found.group(1))


def test_a_sum_loss_under_accumulation_gives_one_over_k_times_the_world_size(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=SUM_MSE, world_size=2, micro_batches=3, pool=ddp_pool)
    text = str(caught.value)
    assert _factor(text) == pytest.approx(1 / 6, rel=1e-4)  # measured: rounding may move its 6th digit
    assert "(1/6 = 1/(micro-batches * world size)): a sum-reduction loss" in text
    assert "(3, the number of micro-batches)" not in text


def test_a_sum_loss_without_a_single_factor_is_named(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(5)
    with pytest.raises(ParallelMismatch) as caught:  # uneven shards: no uniform factor
        assert_ddp_grads_match(mlp(), x, y, loss_fn=SUM_MSE, world_size=2, pool=ddp_pool)
    text = str(caught.value)
    assert "loss_fn sums over the rows" in text
    assert "(the loss-averaging trap)" not in text  # a mean-loss diagnosis
    batches = [batch(6, seed=i) for i in range(2)]
    with pytest.raises(ParallelMismatch, match="loss_fn sums over the rows"):
        assert_ddp_training_matches(mlp(), batches, loss_fn=SUM_MSE, optimizer=SGD, world_size=2, pool=ddp_pool)


def test_a_mean_loss_divided_by_the_world_size_is_not_blamed_on_the_loss(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=loss_over_world_size, pool=ddp_pool)
    text = str(caught.value)
    assert _factor(text) == pytest.approx(0.5, rel=1e-4)
    assert "(1/2, one over the world size): the gradients were divided by the world size twice" in text
    assert "sum-reduction" not in text


def test_a_step_that_sums_its_rows_is_named(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=loss_times_rows, pool=ddp_pool)
    text = str(caught.value)
    assert "is 3 times" in text
    assert "(3, the rows per rank): the step's loss is the sum over the rank's rows" in text
    assert "the world size)" not in text


def test_summed_but_not_averaged_gradients_are_named(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(6)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, step=all_reduce_sum_without_division, pool=ddp_pool)
    text = str(caught.value)
    assert "is 2 times" in text
    assert "(2, the world size): the ranks' gradients were summed but not divided" in text
    assert "rows per rank" not in text


# --------------------------------------------------------------------------- the main module
# Every DDP rank is a new process (forkserver, or spawn) that imports the main module again.

SCRIPT_BODY = """
import torch
import torch.nn.functional as F
from torch import nn

import dpverify


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 2)

    def forward(self, x):
        return self.linear(x)


def check():
    torch.manual_seed(0)
    x, y = torch.randn(6, 5), torch.randn(6, 2)
    print(dpverify.assert_ddp_grads_match(Net(), x, y, loss_fn=F.mse_loss, world_size=2), flush=True)

"""

#: Seconds a script may take: starting torch and the ranks takes a few; a hang takes forever.
SCRIPT_TIMEOUT_S = 90


def run_python(tmp_path: Path, args: list[str], stdin: str | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, *args], input=stdin, cwd=tmp_path, capture_output=True, text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    return done, time.monotonic() - started


def parallel_error(stderr: str) -> str:
    """The ParallelError that ended the script, as Python printed it (the ranks' tracebacks,
    indented, are part of its message)."""
    return stderr[stderr.index("\ndpverify.ddp.pool.ParallelError: DDP task") + 1 :]


@pytest.mark.timeout(2 * SCRIPT_TIMEOUT_S)
@pytest.mark.deep
def test_a_script_with_the_main_guard_passes(tmp_path: Path) -> None:
    (tmp_path / "guarded.py").write_text(SCRIPT_BODY + 'if __name__ == "__main__":\n    check()\n')
    done, _ = run_python(tmp_path, ["guarded.py"])
    assert done.returncode == 0, done.stderr
    assert "passed" in done.stdout


@pytest.mark.timeout(2 * SCRIPT_TIMEOUT_S)
@pytest.mark.deep
def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path: Path) -> None:
    (tmp_path / "unguarded.py").write_text(SCRIPT_BODY + "check()\n")
    done, elapsed = run_python(tmp_path, ["unguarded.py"])
    assert done.returncode == 1
    error = parallel_error(done.stderr)
    head = error.split("\n\n", 1)[0]
    assert "failed on 2 of 2 ranks" in head
    assert "rank 0 raised ParallelError" in head  # the ranks' own failure, not a silent exit
    assert "exited with code 1 without answering" not in error
    assert "unguarded.py has no `if __name__ == '__main__':` guard" in error
    assert "put the code that calls dpverify under `if __name__ == '__main__':`" in error
    assert "unguarded.py" in error.split("rank 0 traceback", 1)[1]  # the rank's own story
    assert elapsed < SCRIPT_TIMEOUT_S


@pytest.mark.timeout(2 * SCRIPT_TIMEOUT_S)
@pytest.mark.parametrize("how", ["stdin", "-c"])
@pytest.mark.deep
def test_code_without_a_file_is_told_to_use_an_importable_module(tmp_path: Path, how: str) -> None:
    code = SCRIPT_BODY + 'if __name__ == "__main__":\n    check()\n'
    done, elapsed = run_python(tmp_path, ["-"] if how == "stdin" else ["-c", code], stdin=code if how == "stdin" else None)
    assert done.returncode == 1
    error = parallel_error(done.stderr)
    assert "exited with code 1 without answering" not in error
    assert "define models, loss functions and steps in an importable module" in error
    if how == "stdin":
        assert "code fed on standard input" in error
        assert "No such file or directory" in error  # the ranks' failure, shown
    else:
        assert "Can't get attribute 'Net'" in error
    assert elapsed < SCRIPT_TIMEOUT_S


def test_advice_for_ranks_that_exit_silently_or_cannot_unpickle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without the fork server's report (the spawn start method), the ranks exit at start-up
    without a word; and from python -c or a notebook, they cannot import what __main__ defines."""
    script = tmp_path / "train.py"
    script.write_text("")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    silent = [RankFailure(r, "exited", "exited with code 1 without answering") for r in range(2)]
    advice = main_module_advice(silent, starting=True)
    assert "their error is on this process's standard error" in advice
    assert "train.py" in advice
    assert "under `if __name__ == '__main__':`" in advice
    assert main_module_advice(silent, starting=False) == ""  # a death during a task is not this
    unpickle = [RankFailure(0, "raised", "raised AttributeError", "AttributeError: Can't get attribute 'Net' on <module '__main__' from 'x'>")]
    assert "defined under `if __name__ == '__main__':` or inside a function" in main_module_advice(unpickle, starting=False)
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # python -c: no file
    assert "define models, loss functions and steps in an importable module" in main_module_advice(unpickle, starting=False)


def count_kept_in_float32(ctx: ShardContext) -> Any:
    """A float64 step whose mean divides by a count kept in float32: 1/3 rounded to
    float32 scales every gradient by 1 + 3e-8."""
    model = ctx.ddp()
    output = model(*ctx.inputs)
    weight = 1 / torch.tensor(float(output.numel()), dtype=torch.float32)
    (F.mse_loss(output, ctx.target, reduction="sum") * weight).backward()
    return output


def test_a_count_kept_in_float32_in_a_float64_step_is_hinted(ddp_pool: DDPWorkerPool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 1, dtype=torch.float64)
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2, step=count_kept_in_float32, pool=ddp_pool)
    assert "This float64 step is off by float32's rounding" in str(caught.value)
    assert "A float32 intermediate in the parallel step is the likely cause" in str(caught.value)
