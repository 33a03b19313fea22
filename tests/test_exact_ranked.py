"""Exact mode (``exact=True``) of the ranked helpers, DDP, FSDP2, tensor and pipeline
parallel, on gloo CPU ranks: exact passes on models of the exact set, a one-ulp error in one
element of one reduced gradient caught only in exact mode, and the refusals, each naming
what rounds and the fix."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dpverify.core.comparison import StepComparison
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.checks import (
    DDPCheck,
    assert_ddp_accumulation_matches,
    assert_ddp_grads_match,
    assert_ddp_sync_batchnorm_matches,
    assert_ddp_training_matches,
    assert_dp_ddp_agree,
)
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.ddp.rank import ShardContext
from dpverify.registry import CHECKS, Case, Target, Verdict
from dpverify.sharded.fsdp import FSDPContext, assert_fsdp_grads_match, assert_fsdp_training_matches
from dpverify.sharded.pipeline import assert_pipeline_grads_match, assert_pipeline_training_matches
from dpverify.sharded.tensor_parallel import (
    assert_tensor_parallel_grads_match,
    assert_tensor_parallel_training_matches,
)

#: An optimizer of the exact set: a dyadic learning rate and momentum.
DYADIC_SGD = functools.partial(torch.optim.SGD, lr=2**-3, momentum=0.5)
MLP_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def mlp(seed: int = 0, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(3, 4), act(), nn.Linear(4, 2))


def linear(seed: int = 0) -> nn.Sequential:
    """One layer: enough bits left over for two optimizer steps (an MLP's second step needs
    more than float64's 53)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(3, 2))


def batch(rows: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, generator=generator), torch.randn(rows, 2, generator=generator)


def _nudge_first(grad: torch.Tensor) -> None:
    """Moves the first nonzero element of ``grad`` by one unit in the last place."""
    flat = grad.view(-1)
    index = int(flat.nonzero()[0])
    flat[index] = torch.nextafter(flat[index], torch.tensor(math.inf, dtype=flat.dtype))


def one_ulp_ddp_step(ctx: ShardContext) -> Any:
    """DDP's step, then one element of the first parameter's all-reduced gradient one ulp
    up, on every rank: a reduction that is off in its last bit."""
    output = ctx.backward(ctx.ddp())
    with torch.no_grad():
        _nudge_first(next(ctx.module.parameters()).grad)
    return output


def one_ulp_fsdp_step(ctx: FSDPContext) -> Any:
    """FSDP2's step, then one element of rank 0's shard of the first reduce-scattered
    gradient one ulp up."""
    output = ctx.backward(ctx.fsdp())
    if ctx.rank == 0:
        with torch.no_grad():
            _nudge_first(next(ctx.module.parameters()).grad.to_local())
    return output


def _exact_note(result: StepComparison) -> str:
    found = [note for note in result.notes if note.startswith("Exact:") and note.endswith("Tolerance: none.")]
    assert len(found) == 1, result.notes
    return found[0]


# --------------------------------------------------------------------------- passes


def test_ddp_exact_pass_compares_grid_copies_bit_for_bit(ddp_pool: DDPWorkerPool) -> None:
    model = mlp()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    x, y = batch()
    result = assert_ddp_grads_match(model, x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, exact=True)
    assert result.ok
    note = _exact_note(result)
    assert "the parallel algorithm's pieces [2, 2] give the full batch's gradients bit for bit" in note
    assert note.endswith("Tolerance: none.")
    assert result.tolerance.startswith("none: every element must be equal")
    # the user's objects stay as they were: float32, the same weights
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert x.dtype == torch.float32


def test_ddp_exact_skips_the_second_look(ddp_pool: DDPWorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact mode compares with the single-device step only: no float64 anchor, no probe,
    no jittered run, even on a failure (the References' second look would cost steps for a
    tolerance that is not used)."""
    dtypes: list[torch.dtype | None] = []
    original = DDPCheck.reference

    def counted(self: DDPCheck, dtype: torch.dtype | None, *, jitter: float = 0.0) -> Any:
        dtypes.append(dtype)
        return original(self, dtype, jitter=jitter)

    monkeypatch.setattr(DDPCheck, "reference", counted)
    x, y = batch()
    with pytest.raises(ParallelMismatch):
        assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, step=one_ulp_ddp_step, exact=True)
    assert dtypes == [None]


def test_ddp_exact_training_pass_proves_every_optimizer_step(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()
    result = assert_ddp_training_matches(
        linear(), [(x, y), (x.flip(0), y)], loss_fn=F.mse_loss, optimizer=DYADIC_SGD, world_size=2, pool=ddp_pool, exact=True,
    )
    assert result.ok
    assert _exact_note(result)
    assert any("Exact: single-device training ran under the proof, every operation of its 2 steps exact" in note for note in result.notes)


def test_ddp_exact_accumulation_pass(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch(8)
    result = assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=2, pool=ddp_pool, exact=True)
    assert result.ok
    assert "pieces [2, 2, 2, 2]" in _exact_note(result)


def test_dp_ddp_agree_exact_pass(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()
    result = assert_dp_ddp_agree(mlp(act=functools.partial(nn.LeakyReLU, 0.25)), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, exact=True)
    assert result.ok
    assert _exact_note(result)


def test_fsdp_exact_pass(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()
    result = assert_fsdp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, exact=True)
    assert result.ok
    assert "pieces [2, 2]" in _exact_note(result)


def test_tensor_parallel_exact_pass_slices_of_the_proven_products(ddp_pool: DDPWorkerPool) -> None:
    """The proof covers the full-batch step only; the ranks compute column blocks and
    partial sums of its products (Colwise, then Rowwise's all-reduce): bit-identical here,
    as the proof's bounds on every partial sum say they must be."""
    x, y = batch()
    result = assert_tensor_parallel_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, plan=MLP_PLAN, pool=ddp_pool, exact=True)
    assert result.ok
    assert all(row.ok for row in result.tensors)
    assert _exact_note(result)


def test_pipeline_exact_pass(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()
    result = assert_pipeline_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=2, pool=ddp_pool, exact=True)
    assert result.ok
    assert "pieces [2, 2]" in _exact_note(result)


@pytest.mark.deep
@pytest.mark.parametrize("ddp_pool", [4], indirect=True)
@pytest.mark.parametrize("data_parallel", [1, 2])
def test_tensor_parallel_exact_pass_on_four_ranks(ddp_pool: DDPWorkerPool, data_parallel: int) -> None:
    """Four tensor-parallel ranks, or two groups of two (FSDP2 averaging over the groups):
    the slices and the group average, bit-identical to the proven full-batch step."""
    x, y = batch(8)
    result = assert_tensor_parallel_grads_match(
        mlp(), x, y, loss_fn=F.mse_loss, world_size=4, plan=MLP_PLAN, data_parallel=data_parallel, pool=ddp_pool, exact=True,
    )
    assert result.ok


@pytest.mark.deep
@pytest.mark.parametrize("helper", [assert_fsdp_training_matches, assert_tensor_parallel_training_matches, assert_pipeline_training_matches])
def test_sharded_exact_training_passes(ddp_pool: DDPWorkerPool, helper: Any) -> None:
    x, y = batch()
    if helper is assert_fsdp_training_matches:
        model, batches, extra = linear(), [(x, y), (x.flip(0), y)], {}
    else:
        # tensor parallel shards the MLP, a pipeline needs two stages: its two layers leave
        # float64 bits for one optimizer step
        model, batches = mlp(), [(x, y)]
        extra = {"plan": MLP_PLAN} if helper is assert_tensor_parallel_training_matches else {"n_microbatches": 2}
    result = helper(model, batches, loss_fn=F.mse_loss, optimizer=DYADIC_SGD, world_size=2, pool=ddp_pool, exact=True, **extra)
    assert result.ok
    assert _exact_note(result)
    assert any(note.startswith("Exact: single-device training ran under the proof") for note in result.notes)


# --------------------------------------------------------------------------- one ulp


def test_one_ulp_in_one_ddp_gradient_element_is_caught_only_in_exact_mode(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()
    run = functools.partial(assert_ddp_grads_match, mlp(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, step=one_ulp_ddp_step)
    assert run().ok  # the default tolerance cannot see one ulp
    with pytest.raises(ParallelMismatch) as caught:
        run(exact=True)
    failing = [row for row in caught.value.report.tensors if not row.ok]
    assert {(row.id.kind, row.id.name) for row in failing} == {("grad", "0.weight")}
    assert {row.id.rank for row in failing} == {0, 1}


def test_one_ulp_in_one_fsdp_gradient_shard_is_caught_only_in_exact_mode(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()
    run = functools.partial(assert_fsdp_grads_match, mlp(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool, step=one_ulp_fsdp_step)
    assert run().ok
    with pytest.raises(ParallelMismatch) as caught:
        run(exact=True)
    failing = [row for row in caught.value.report.tensors if not row.ok]
    # the error sits in rank 0's shard of the weight; every rank reports the whole gradient
    assert {(row.id.kind, row.id.name) for row in failing} == {("grad", "0.weight")}


# --------------------------------------------------------------------------- refusals


def _refusal(run: Any) -> str:
    with pytest.raises(InvalidArgument) as caught:
        run()
    return str(caught.value)


def test_world_size_three_is_refused_naming_the_division() -> None:
    x, y = batch(6)
    text = _refusal(lambda: assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=3, exact=True))
    assert "world_size=3: DistributedDataParallel divides every gradient by 3" in text
    assert "power of two" in text


def test_a_non_power_of_two_shard_with_a_mean_loss_is_refused() -> None:
    x, y = batch()
    text = _refusal(lambda: assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, shards=[3, 1], exact=True))
    assert text.startswith("exact=True: aten.mse_loss in the loss of piece 0 of 2 (rows 0:3 of the batch)")


def test_tanh_is_refused_naming_the_module() -> None:
    x, y = batch()
    text = _refusal(lambda: assert_fsdp_grads_match(mlp(act=nn.Tanh), x, y, loss_fn=F.mse_loss, world_size=2, exact=True))
    assert "aten.tanh in the forward of module '1' (Tanh) is outside the exact set" in text


def test_a_learning_rate_of_a_tenth_is_refused_naming_the_optimizer_step(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    text = _refusal(lambda: assert_ddp_training_matches(linear(), [(x, y)], loss_fn=F.mse_loss, optimizer=sgd, world_size=2, pool=ddp_pool, exact=True))
    assert "in the optimizer step of step 1 (SGD(lr=0.1))" in text


def test_exact_with_a_tolerance_or_not_a_bool_is_refused() -> None:
    x, y = batch()
    text = _refusal(lambda: assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, rtol=1e-5, atol=0.0, exact=True))
    assert "exact=True with rtol=1e-05, atol=0.0" in text
    text = _refusal(lambda: assert_ddp_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, exact="yes"))  # type: ignore[typeddict-item]
    assert "exact" in text


def test_counts_that_divide_by_three_are_refused() -> None:
    x, y = batch(12)
    text = _refusal(lambda: assert_ddp_accumulation_matches(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, micro_batches=3, exact=True))
    assert "micro_batches=3: gradient accumulation divides every gradient by 3" in text
    text = _refusal(lambda: assert_pipeline_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=2, n_microbatches=3, exact=True))
    assert "n_microbatches=3: the schedule (scale_grads=True) divides every gradient by 3" in text
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    text = _refusal(lambda: assert_tensor_parallel_grads_match(mlp(), x, y, loss_fn=F.mse_loss, world_size=6, plan=plan, data_parallel=3, exact=True))
    assert "data_parallel=3: FSDP2's reduce-scatter over the data-parallel groups divides every gradient by 3" in text


def test_sync_batchnorm_has_no_exact_mode() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x, y = batch()
    text = _refusal(lambda: assert_ddp_sync_batchnorm_matches(model, x, y, loss_fn=F.mse_loss, world_size=2, exact=True))
    assert "assert_ddp_sync_batchnorm_matches has no exact mode" in text


# --------------------------------------------------------------------------- the registry


def test_the_registry_runs_the_ranked_checks_exactly_on_an_exact_case(ddp_pool: DDPWorkerPool) -> None:
    x, y = batch()
    case = Case(mlp(), (x,), y, F.mse_loss, exact=True)
    broken = Target(step=one_ulp_ddp_step, pool=ddp_pool)
    assert CHECKS["ddp-grads"].run(case, Target(pool=ddp_pool)).verdict is Verdict.PASS
    assert CHECKS["ddp-grads"].run(case, broken).verdict is Verdict.FAIL
    assert CHECKS["ddp-grads"].run(replace(case, exact=False), broken).verdict is Verdict.PASS
    batchnorm = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    skipped = CHECKS["ddp-sync-batchnorm"].run(replace(case, module=batchnorm), Target(pool=ddp_pool))
    assert skipped.verdict is Verdict.SKIP
    assert "no exact mode" in skipped.summary
