"""Model/criterion pairs (``parallel_loss_fn=``), per-replica outputs, ``dim=``, and the
split the wrapper really made, on every DataParallel check."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dp_lookalikes import (
    BalancedDataParallel,
    CriterionParallel,
    OutputsPerDevice,
    ReduceAddBroadcast,
    ReduceAddCommBroadcast,
)
from torch import nn

import dpverify
from dpverify.core.virtual import VirtualDataParallel
from dpverify.mutants import (
    MeanCriterionParallel,
    ReplicaOutputsDataParallel,
    WeightedCriterionParallel,
)


def _mlp(outputs: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, outputs))


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 3, generator=generator)


HELPERS = [dpverify.assert_dp_grads_match, dpverify.assert_grad_sum_equals_mean_loss_grad]


# --- model/criterion pairs -----------------------------------------------------------------


@pytest.mark.parametrize("reducer", [ReduceAddBroadcast, ReduceAddCommBroadcast], ids=["Broadcast", "comm.broadcast"])
@pytest.mark.parametrize("helper", HELPERS, ids=["grads", "grad-sum"])
def test_a_criterion_parallel_pair_is_verified_as_it_is_on_even_chunks(reducer: Any, helper: Any) -> None:
    x, y = _batch(8)  # [2, 2, 2, 2]: the mean of per-device means is the full-batch mean
    criterion = functools.partial(CriterionParallel, reducer=reducer)
    result = helper(_mlp(), x, y, loss_fn=nn.MSELoss(), device_ids=[0, 1, 2, 3], parallel=OutputsPerDevice, parallel_loss_fn=criterion)
    assert result.ok
    assert "one output per replica (4)" in "\n".join(result.notes)


@pytest.mark.parametrize("helper", HELPERS, ids=["grads", "grad-sum"])
def test_a_criterion_that_averages_uneven_chunks_is_named_as_the_loss_averaging_trap(helper: Any) -> None:
    x, y = _batch(5)  # [2, 2, 1]
    with pytest.raises(dpverify.ParallelMismatch) as caught:
        helper(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=OutputsPerDevice, parallel_loss_fn=CriterionParallel)
    text = str(caught.value)
    assert "The loss-averaging trap" in text
    assert "n_i/B = [2/5, 2/5, 1/5]" in text
    assert "weight 1/3" in text
    # the numbers it quotes are the real ones: the full-batch loss and the mean of chunk means
    model = _mlp()
    with torch.no_grad():
        out = model(x)
    full = F.mse_loss(out, y).item()
    means = [F.mse_loss(out[a:b], y[a:b]).item() for a, b in ((0, 2), (2, 4), (4, 5))]
    assert f"full-batch loss ({full:.6g})" in text
    assert f"({sum(means) / 3:.6g})" in text


@pytest.mark.parametrize(("rows", "devices"), [(5, 3), (7, 4), (9, 4), (3, 2)])
def test_a_weighted_criterion_pair_passes_on_any_split(rows: int, devices: int) -> None:
    x, y = _batch(rows)
    for helper in HELPERS:
        helper(
            _mlp(), x, y, loss_fn=F.mse_loss, device_ids=list(range(devices)),
            parallel=ReplicaOutputsDataParallel, parallel_loss_fn=WeightedCriterionParallel,
        )
    if len(set(dpverify.chunk_sizes(rows, devices))) == 1:
        return  # equal chunks: the mean of chunk means is the full-batch mean
    with pytest.raises(dpverify.ParallelMismatch, match="The loss-averaging trap"):
        dpverify.assert_dp_grads_match(
            _mlp(), x, y, loss_fn=F.mse_loss, device_ids=list(range(devices)),
            parallel=ReplicaOutputsDataParallel, parallel_loss_fn=MeanCriterionParallel,
        )


class _Pair(nn.Module):
    """Returns a dict of a tuple and a tensor, so that per-replica outputs are nested."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        out = self.body(x)
        return {"pair": (out, out.tanh()), "logits": out}


def _nested_loss(output: dict[str, Any], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output["logits"], target) + output["pair"][1].pow(2).mean()


def test_nested_per_replica_outputs_are_concatenated_leaf_by_leaf() -> None:
    x, y = _batch(7)
    result = dpverify.assert_dp_grads_match(
        _Pair(), x, y, loss_fn=_nested_loss, device_ids=[0, 1, 2],
        parallel=ReplicaOutputsDataParallel, parallel_loss_fn=WeightedCriterionParallel,
    )
    compared = {t.name for t in result.tensors}
    assert {"output['pair'][0]", "output['pair'][1]", "output['logits']"} <= compared


class _SecondReplicaNegated(ReplicaOutputsDataParallel):
    def gather(self, outputs: Any, output_device: Any) -> Any:
        outputs = list(outputs)
        outputs[1] = -outputs[1]
        return outputs


def test_a_wrong_per_replica_output_fails_on_the_concatenated_output() -> None:
    x, y = _batch(6)
    with pytest.raises(dpverify.ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(
            _mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2],
            parallel=_SecondReplicaNegated, parallel_loss_fn=WeightedCriterionParallel,
        )
    failing = {t.name for t in caught.value.report.tensors if not t.ok}
    assert "output" in failing


def test_the_criterion_wrapper_is_built_on_the_virtual_devices() -> None:
    built: list[list[int]] = []

    class Recording(WeightedCriterionParallel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(list(self.device_ids))

    x, y = _batch(6)
    before = nn.DataParallel(nn.Linear(2, 2)).device_ids  # [] without CUDA, the visible GPUs with it
    dpverify.assert_dp_grads_match(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=ReplicaOutputsDataParallel, parallel_loss_fn=Recording)
    assert built == [[0, 1, 2]]  # the virtual devices, whatever this machine has
    assert nn.DataParallel(nn.Linear(2, 2)).device_ids == before


def test_a_criterion_wrapper_with_torchs_gathering_data_parallel() -> None:
    x, y = _batch(5)
    # torch's DataParallel gathers: the criterion gets one tensor and runs its module on it
    dpverify.assert_dp_grads_match(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel_loss_fn=WeightedCriterionParallel)


def test_parallel_loss_fn_must_be_callable() -> None:
    x, y = _batch(4)
    with pytest.raises(dpverify.InvalidArgument, match="parallel_loss_fn"):
        dpverify.assert_dp_grads_match(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1], parallel_loss_fn="criterion")  # type: ignore[arg-type]


def test_a_criterion_wrapper_that_returns_no_scalar_is_named() -> None:
    x, y = _batch(4)

    def per_replica(criterion: nn.Module, device_ids: Any, output_device: Any) -> Any:
        return lambda outputs, target: torch.stack([criterion(o, t) for o, t in zip(outputs, target.chunk(len(outputs)), strict=True)])

    with pytest.raises(dpverify.InvalidArgument, match="parallel_loss_fn returned"):
        dpverify.assert_dp_grads_match(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1], parallel=ReplicaOutputsDataParallel, parallel_loss_fn=per_replica)


# --- the split the wrapper made ----------------------------------------------------------


def test_the_grad_sum_average_divides_by_the_replicas_that_ran() -> None:
    x, y = _batch(9)  # torch's scatter: [3, 3, 3] on 4 devices; the balanced wrapper [1, 3, 3, 2]
    result = dpverify.assert_grad_sum_equals_mean_loss_grad(
        _mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], parallel=functools.partial(BalancedDataParallel, 1),
    )
    assert result.notes[0] == "4 replicas contributed (chunks [1, 3, 3, 2])."
    assert "the wrapper ran 4 replica forwards on chunks of [1, 3, 3, 2] rows (9 of 9; torch's scatter would give [3, 3, 3])" in result.scenario
    averages = [t.name for t in result.tensors if t.name.startswith("average of replica grads")]
    assert averages
    assert all(name.endswith("= full / 4") for name in averages)


def test_replicas_are_reported_in_device_ids_order() -> None:
    x, y = _batch(5)
    result = dpverify.assert_grad_sum_equals_mean_loss_grad(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[2, 0, 1])
    assert result.notes[0] == "3 replicas contributed (chunks [2, 2, 1])."


def test_a_wrapper_that_loses_rows_before_the_loss_fails_naming_them() -> None:
    from dpverify.mutants import BalancedDropsChunkDataParallel

    x, y = _batch(9)  # balanced [1, 3, 3, 2]; the last chunk never runs
    with pytest.raises(dpverify.ParallelMismatch, match=r"chunks of \[1, 3, 3\] rows, 7 of 9 \(2 reached no replica\)"):
        dpverify.assert_dp_grads_match(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], parallel=BalancedDropsChunkDataParallel)


# --- dim ---------------------------------------------------------------------------------


class _SeqFirst(nn.Module):
    """A GRU over (time, batch, features): the batch is dim 1, and time mixes rows of dim 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gru = nn.GRU(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _hidden = self.gru(x)
        result: torch.Tensor = self.head(out)
        return result


def _seq_batch(batch: int = 5, steps: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(steps, batch, 4, generator=generator), torch.randn(steps, batch, 3, generator=generator)


@pytest.mark.parametrize("helper", HELPERS, ids=["grads", "grad-sum"])
def test_a_batch_along_dim_1_is_split_along_dim_1(helper: Any) -> None:
    x, y = _seq_batch()
    result = helper(_SeqFirst(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], dim=1)
    assert "chunk sizes [2, 2, 1]" in result.scenario
    assert "along dim 1" in result.scenario
    if helper is dpverify.assert_grad_sum_equals_mean_loss_grad:
        assert result.notes[0] == "3 replicas contributed (chunks [2, 2, 1])."


def _ignores_dim(module: nn.Module, device_ids: list[int], output_device: int, dim: int = 0) -> nn.Module:
    return VirtualDataParallel(module, device_ids, output_device)  # splits along dim 0 whatever dim says


def test_a_wrapper_that_ignores_dim_fails() -> None:
    x, y = _seq_batch()
    with pytest.raises(dpverify.ParallelMismatch):
        dpverify.assert_dp_grads_match(_SeqFirst(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], dim=1, parallel=_ignores_dim)


def test_a_balanced_wrapper_along_dim_1() -> None:
    x, y = _seq_batch(batch=9)
    result = dpverify.assert_grad_sum_equals_mean_loss_grad(
        _SeqFirst(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], dim=1, parallel=functools.partial(BalancedDataParallel, 1),
    )
    assert "chunks of [1, 3, 3, 2] rows" in result.scenario


def test_a_pair_along_dim_1() -> None:
    x, y = _seq_batch(batch=5)
    with pytest.raises(dpverify.ParallelMismatch, match=r"The loss-averaging trap.*\[2, 2, 1\] rows"):
        dpverify.assert_dp_grads_match(
            _SeqFirst(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], dim=1,
            parallel=ReplicaOutputsDataParallel, parallel_loss_fn=MeanCriterionParallel,
        )
    dpverify.assert_dp_grads_match(
        _SeqFirst(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], dim=1,
        parallel=ReplicaOutputsDataParallel, parallel_loss_fn=WeightedCriterionParallel,
    )


@pytest.mark.parametrize(("dim", "match"), [(3, r"dim=3 is not a dimension of inputs"), ("1", r"dim='1' must be an int"), (True, r"dim=True must be an int")])
def test_a_bad_dim_is_named(dim: Any, match: str) -> None:
    x, y = _seq_batch()
    with pytest.raises(dpverify.InvalidArgument, match=match):
        dpverify.assert_dp_grads_match(_SeqFirst(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1], dim=dim)


class _SeqLoss(nn.Module):
    """Returns its chunk's mean loss over (time, batch): the loss-in-forward case along dim
    1. torch's gather concatenates along dim 1 and stacks scalars only for dim 0, so the
    loss keeps a dimension 1 (``shape``), or the gather fails."""

    def __init__(self, shape: tuple[int, ...] = (1, 1)) -> None:
        super().__init__()
        self.inner = _SeqFirst()
        self.shape = shape

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.inner(x), y).reshape(self.shape)


def test_torch_cannot_gather_scalar_losses_along_dim_1_and_the_error_says_why() -> None:
    x, y = _seq_batch(batch=5)
    with pytest.raises(IndexError) as caught:
        dpverify.check_forward_loss_average(_SeqLoss(shape=()), (x, y), device_ids=[0, 1, 2], dim=1)
    assert "return the loss as loss.reshape(1, 1)" in "\n".join(caught.value.__notes__)


def test_the_loss_average_checks_split_along_dim() -> None:
    x, y = _seq_batch(batch=5)
    report = dpverify.check_forward_loss_average(_SeqLoss(), (x, y), device_ids=[0, 1, 2], dim=1)
    assert report.chunk_sizes == (2, 2, 1)
    assert report.is_biased
    assert report.weighted_is_exact
    dpverify.assert_loss_reduction_matches_full_batch(_SeqLoss(), (x, y), device_ids=[0, 1, 2], reduce=dpverify.chunk_weighted_loss, dim=1)


class _CountsColumns(nn.Module):
    """Counts the rows along dim 1 it has seen, in a buffer updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.shape[1])
        out: torch.Tensor = self.linear(x)
        return out


def test_the_buffer_check_takes_replica_zeros_chunk_along_dim() -> None:
    x, _y = _seq_batch(batch=5)
    result = dpverify.assert_dp_buffers_match(_CountsColumns(), x, device_ids=[0, 1, 2], dim=1)
    assert "Replica 0 ran on 2 rows;" in "\n".join(result.notes)


def test_virtual_and_torch_data_parallel_take_dim() -> None:
    x, _y = _seq_batch(batch=5)
    model = _SeqFirst()
    with torch.no_grad():
        expected = model(x)
        got = dpverify.data_parallel(model, [0, 1, 2], dim=1)(x)
    torch.testing.assert_close(got, expected)


def _sum_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target, reduction="sum")


def test_the_trap_is_named_only_when_the_loss_is_the_mean_of_chunk_losses() -> None:
    x, y = _batch(5)
    # n_i/B weights on sum losses: wrong, but not the mean of the chunk losses
    with pytest.raises(dpverify.ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(
            _mlp(), x, y, loss_fn=_sum_mse, device_ids=[0, 1, 2],
            parallel=ReplicaOutputsDataParallel, parallel_loss_fn=WeightedCriterionParallel,
        )
    assert "loss-averaging trap" not in str(caught.value)
    # averaging sum losses over equal chunks: the mean of the chunk losses, a sum loss's trap
    x, y = _batch(6)
    with pytest.raises(dpverify.ParallelMismatch, match=r"The chunks are equal \(\[2, 2, 2\] rows\), so the chunk losses are not per-row means"):
        dpverify.assert_dp_grads_match(
            _mlp(), x, y, loss_fn=_sum_mse, device_ids=[0, 1, 2],
            parallel=ReplicaOutputsDataParallel, parallel_loss_fn=MeanCriterionParallel,
        )


# --- where the outputs were gathered --------------------------------------------------------


class _GathersOnZero(nn.DataParallel[Any]):
    """Gathers on device 0 whatever output_device says."""

    def gather(self, outputs: Any, output_device: Any) -> Any:
        return super().gather(outputs, 0)


@pytest.mark.parametrize("output_device", [1, -1])
def test_a_wrapper_that_gathers_elsewhere_than_output_device_fails(output_device: int) -> None:
    x, y = _batch(6)
    where = "the host" if output_device == -1 else f"device {output_device}"
    with pytest.raises(dpverify.ParallelMismatch, match=rf"gathered its outputs on device 0; output_device={output_device} asks for {where}"):
        dpverify.assert_dp_grads_match(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], output_device=output_device, parallel=_GathersOnZero)
    # torch's own gathers where it is asked to, virtual or subclassed
    for parallel in (None, nn.DataParallel):
        dpverify.assert_dp_grads_match(_mlp(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], output_device=output_device, parallel=parallel)


def test_the_step_records_where_it_gathered() -> None:
    from dpverify.checks.dp import Check

    x, y = _batch(6)
    for output_device in (2, -1):
        check = Check.create(_mlp(), x, device_ids=[0, 1, 2], output_device=output_device)
        step = check.run(lambda out: F.mse_loss(out, y), parallel=True, record_replicas=True)
        assert step.gathered_on == (output_device,)
        assert step.replica_rows == (2, 2, 2)


# --- loss-in-forward models through wrappers of one's own ----------------------------------


def test_the_loss_checks_take_one_loss_per_replica_and_the_replicas_that_ran() -> None:
    from dpverify.models.builtin import builtin_case

    built = builtin_case("loss-in-forward", batch=9)  # torch's scatter: [3, 3, 3] on 4 devices
    # a wrapper that returns one output per replica: its losses are those outputs
    report = dpverify.check_forward_loss_average(built.module, built.inputs, device_ids=[0, 1, 2, 3], parallel=ReplicaOutputsDataParallel)
    assert report.chunk_sizes == (3, 3, 3)
    assert not report.is_biased
    # a balanced wrapper runs 4 replicas, [1, 3, 3, 2]: four losses, weighted by that split
    balanced = functools.partial(BalancedDataParallel, 1)
    report = dpverify.check_forward_loss_average(built.module, built.inputs, device_ids=[0, 1, 2, 3], parallel=balanced)
    assert report.chunk_sizes == (1, 3, 3, 2)
    assert len(report.replica_losses) == 4
    assert report.is_biased
    assert report.weighted_is_exact
    dpverify.assert_loss_reduction_matches_full_batch(built.module, built.inputs, device_ids=[0, 1, 2, 3], reduce=dpverify.chunk_weighted_loss, parallel=balanced)
