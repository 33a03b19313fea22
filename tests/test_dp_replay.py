"""The replay of DataParallel's algorithm (dpverify.checks.replay): bit-identical to the
virtual DataParallel, run only where a tensor fails the tolerance, and passing a tensor
only where the parallel step is bit-identical to it and the chunking is neutral. The
models are elementwise IEEE arithmetic on fixed values, so every verdict is the same on
every machine."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_tolerance_classes import _ChunkCentred, _ChunkRounding, _fixed_linear, _rows
from torch import nn

import dpverify
import dpverify.checks.dp as assertions
from dpverify import ParallelMismatch, StepComparison
from dpverify.checks.replay import replay_step
from dpverify.core.comparison import ReplayMatch
from dpverify.core.step import StepResult
from dpverify.mutants import AveragingDataParallel, TinyErrorDataParallel

CHECKS = (dpverify.assert_dp_grads_match, dpverify.assert_grad_sum_equals_mean_loss_grad)
DEVICES = list(range(16))


class _ChunkRoundingWithDropout(_ChunkRounding):
    """``_ChunkRounding`` (chunks of one row round at 8 in float32, at 1.5e-8 in float64, the
    full batch far finer) with a train-mode Dropout in a head the loss does not use: a
    divergence source by its type, so the chunk-by-chunk sample is not taken, and the
    tolerance fails correct DataParallel today without the replay."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.classifier_dropout = nn.Dropout(0.1)


class _ChunkRoundingWithBatchNorm(_ChunkRounding):
    """``_ChunkRounding`` with a train-mode BatchNorm the forward never calls: a divergence
    source by its type that makes no difference, so the replay still runs."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.unused_norm = nn.BatchNorm1d(2).to(dtype)


class _ChunkCentredWithDropout(_ChunkCentred):
    """``x - 1e-3 * x.mean(0)`` over the rows each replica receives: chunk-dependent in exact
    arithmetic (and the same unused Dropout, so only the replay could pass it)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.classifier_dropout = nn.Dropout(0.1)


class _ChunkLoss(nn.Module):
    """Returns ``(out, mean loss of the rows it received)``: a loss computed in forward,
    which DataParallel gathers per replica (chunk-dependent)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = _ChunkRounding(dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.inner(x)
        return out, (out**2).mean()


def _head_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return output[1].mean() + F.mse_loss(output[0], target)


def _batch(dtype: torch.dtype, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows(rows, 3, 1.0, dtype), _rows(rows, 2, 1.0, dtype)


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the replays the checks run."""
    calls: list[int] = []
    replay = assertions.replay_dataparallel

    def counted(*args: Any) -> Any:
        calls.append(1)
        return replay(*args)

    monkeypatch.setattr(assertions, "replay_dataparallel", counted)
    return calls


def _without_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks as they were before the replay: a tensor that fails every sample fails."""
    monkeypatch.setattr(assertions, "settle_by_replay", lambda result, *_args: result)


def _steps(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any = F.mse_loss, **options: Any,
) -> tuple[StepResult, StepResult]:
    """The parallel step (``dpverify.data_parallel``) and the replay, in the working dtype."""
    check = assertions.Check.create(model, x, **{"device_ids": [0, 1, 2], **options})
    loss = assertions._loss_of(loss_fn, assertions._target_on(y, check, None))
    return check.run(loss, parallel=True, record_replicas=True), replay_step(check, loss)


@pytest.mark.parametrize("options", [{}, {"device_ids": [3, 1], "output_device": -1}, {"device_ids": [0]}, {"device_ids": [0, 1, 2, 5, 6], "output_device": 5}])
def test_the_replay_is_bit_identical_to_the_virtual_dataparallel(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    # train-mode Dropout too: the replicas draw from their devices' generators as DataParallel's do
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Dropout(0.3), nn.Linear(7, 3))
    x, y = torch.randn(11, 5), torch.randn(11, 3)
    parallel, replayed = _steps(model, x, y, **options)
    assert replayed.replica_rows == parallel.replica_rows
    assert torch.equal(replayed.loss, parallel.loss)
    assert [p for p, _ in replayed.outputs] == [p for p, _ in parallel.outputs]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(replayed.outputs, parallel.outputs, strict=True))
    for name, grad in parallel.grads.items():
        mine = replayed.grads[name]
        assert grad is not None
        assert mine is not None
        assert torch.equal(mine, grad), name


def test_the_replay_sums_the_replicas_gradients_in_replica_order() -> None:
    x, y = _batch(torch.float32, 5)
    parallel, replayed = _steps(_fixed_linear(3, 2, torch.float32), x, y)
    assert len(replayed.contributions) == 3
    for name, grad in replayed.grads.items():
        parts = [grads[name] for _device, grads in replayed.contributions]
        total = parts[0] + parts[1]
        total += parts[2]
        assert grad is not None
        assert torch.equal(grad, total)
        assert torch.equal(grad, parallel.grads[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("model_type", [_ChunkRoundingWithDropout, _ChunkRoundingWithBatchNorm])
def test_a_correct_step_that_fails_the_tolerance_today_passes_by_the_replay(
    dtype: torch.dtype, model_type: type[nn.Module], monkeypatch: pytest.MonkeyPatch, replays: list[int],
) -> None:
    x, y = _batch(dtype)
    for check in CHECKS:
        result = check(model_type(dtype), x, y, loss_fn=F.mse_loss, device_ids=DEVICES)
        assert result.ok
        settled = [row for row in result.tensors if row.replay is not None]
        assert settled, "nothing needed the replay: the scenario no longer tests it"
        for row in settled:
            assert isinstance(row.replay, ReplayMatch)
            assert row.replay.failed_ratio > 1
            assert row.replay.describe(row.name) in str(result)
    assert len(replays) == len(CHECKS)  # once per check, whatever the number of tensors it settles
    _without_replay(monkeypatch)
    for check in CHECKS:
        with pytest.raises(ParallelMismatch):
            check(model_type(dtype), x, y, loss_fn=F.mse_loss, device_ids=DEVICES)


def test_the_reported_shift_is_what_chunking_moves_the_tensor_by() -> None:
    x, y = _batch(torch.float64)
    model = _ChunkRoundingWithDropout(torch.float64)
    result = dpverify.assert_dp_grads_match(model, x, y, loss_fn=F.mse_loss, device_ids=DEVICES)
    check = assertions.Check.create(model, x, device_ids=DEVICES)
    loss = assertions._loss_of(F.mse_loss, y)
    replayed, single = replay_step(check, loss), check.run(loss, parallel=False)
    rows = {row.id: row for row in result.tensors}
    weight = rows[assertions.TensorId("grad", "head.weight")]
    replayed_grad, single_grad = replayed.grads["head.weight"], single.grads["head.weight"]
    assert weight.replay is not None
    assert replayed_grad is not None
    assert single_grad is not None
    assert weight.replay.shift == float((replayed_grad - single_grad).abs().max())
    assert math.isclose(weight.replay.shift, 3.3e-9, rel_tol=0.2)  # rounding at the spacing of 1e8, not a chunk dependence
    message = result.message()
    assert "grad 'head.weight': bit-identical to a replay of DataParallel's algorithm; chunking moves this tensor by" in message


@pytest.mark.filterwarnings("ignore:Was asked to gather along dimension 0")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("build", "replayed"),
    [
        # chunk-dependent in its own code: the replay runs and refuses to settle it
        pytest.param(lambda dtype: (_ChunkCentredWithDropout(dtype), F.mse_loss), True, id="chunk-centred"),
        # a divergence source that ran: nothing it feeds could settle, so no replay runs
        pytest.param(
            lambda dtype: (nn.Sequential(_fixed_linear(3, 4, dtype), nn.BatchNorm1d(4).to(dtype), _fixed_linear(4, 2, dtype)), F.mse_loss),
            False, id="train-mode-batchnorm",
        ),
        pytest.param(lambda dtype: (_ChunkLoss(dtype), _head_loss), True, id="loss-in-forward"),
    ],
)
def test_a_step_that_depends_on_the_chunk_still_fails(
    dtype: torch.dtype, build: Callable[[torch.dtype], tuple[nn.Module, Any]], replayed: bool, replays: list[int],
) -> None:
    x, y = _batch(dtype, 11)  # chunks [3, 3, 3, 2]: the mean of the chunks' means is not the batch's
    x = x + 1.0
    model, loss_fn = build(dtype)
    for check in CHECKS:
        with pytest.raises(ParallelMismatch) as caught:
            check(model, x, y, loss_fn=loss_fn, device_ids=[0, 1, 2, 3])
        report = caught.value.report
        assert isinstance(report, StepComparison)
        assert not any(row.replay is not None for row in report.tensors)
    assert bool(replays) == replayed
    # the parallel step is bit-identical to the replay: the chunking's dependence is what fails
    parallel, replayed = _steps(model, x, y, loss_fn, device_ids=[0, 1, 2, 3])
    assert all(torch.equal(replayed.grads[name], grad) for name, grad in parallel.grads.items() if grad is not None)


# TinyErrorDataParallel's 1e-4 in float64 only: in float32 the chunks round this model's
# inputs to 0, and the weight's gradient it scales is 0
@pytest.mark.parametrize(
    ("wrapper", "dtype"),
    [(TinyErrorDataParallel, torch.float64), (AveragingDataParallel, torch.float64), (AveragingDataParallel, torch.float32)],
)
def test_a_broken_wrapper_still_fails_where_the_replay_settles_the_correct_one(
    dtype: torch.dtype, wrapper: Any, replays: list[int],
) -> None:
    x, y = _batch(dtype)
    for check in CHECKS:
        with pytest.raises(ParallelMismatch) as caught:
            check(_ChunkRoundingWithDropout(dtype), x, y, loss_fn=F.mse_loss, device_ids=DEVICES, parallel=wrapper)
        report = caught.value.report
        assert isinstance(report, StepComparison)
        assert any(not row.ok and row.replay is None for row in report.tensors)
    assert replays


def test_passing_checks_never_pay_for_the_replay(replays: list[int]) -> None:
    # well conditioned, and ill-conditioned where the chunk-by-chunk sample settles it
    x, y = _batch(torch.float32)
    for model in (_fixed_linear(3, 2, torch.float32), _ChunkRounding(torch.float32)):
        for check in CHECKS:
            assert check(model, x, y, loss_fn=F.mse_loss, device_ids=DEVICES).ok
    assert replays == []


def test_explicit_tolerances_take_no_replay(replays: list[int]) -> None:
    x, y = _batch(torch.float64)
    with pytest.raises(ParallelMismatch):
        dpverify.assert_dp_grads_match(
            _ChunkRoundingWithDropout(torch.float64), x, y, loss_fn=F.mse_loss, device_ids=DEVICES, rtol=1e-12, atol=1e-12,
        )
    assert replays == []
