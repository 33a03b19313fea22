"""What the DataParallel checks say when something is wrong: the rows and replicas that
differ, the chunk a wrapper dropped, and a float32 intermediate in a float64 step, each
read from what the parallel step did, never from which wrapper ran."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dp_lookalikes import WholeBatch, ZeroedReplicaBuffers
from torch import nn

import dpverify
from dpverify.core.comparison import TensorComparison, TensorId, float32_hint


class _ReadsABuffer(nn.Module):
    """A Linear layer plus a buffer its forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("shift", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) + self.shift
        return out




class _DropsAChunk(nn.DataParallel[Any]):
    """Scatters as torch does, then runs every chunk but one (``skip``: its index)."""

    skip = -1

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        chunks, keywords = self.scatter(inputs, kwargs, self.device_ids)
        keep = [i for i in range(len(chunks)) if i != self.skip % len(chunks)]
        replicas = self.replicate(self.module, [self.device_ids[i] for i in keep])
        outputs = self.parallel_apply(replicas, [chunks[i] for i in keep], [keywords[i] for i in keep])
        return self.gather(outputs, self.output_device)


class _DropsTheFirstChunk(_DropsAChunk):
    skip = 0




class _GathersThroughFloat32(nn.DataParallel[Any]):
    """Rounds the gathered output to float32 and back: a float32 intermediate."""

    def gather(self, outputs: Any, output_device: Any) -> Any:
        return super().gather(outputs, output_device).float().to(torch.float64)


class _HalvesGather(nn.DataParallel[Any]):
    def gather(self, outputs: Any, output_device: Any) -> Any:
        return super().gather(outputs, output_device) / 2


def _batch(rows: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, 4, generator=generator, dtype=dtype), torch.randn(rows, 3, generator=generator, dtype=dtype)


def _sums(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that takes any number of rows (no broadcast warning): the step of a wrapper
    that loses rows runs to the end."""
    return (output.sum(0) - target.sum(0)).pow(2).mean()


def _message(module: nn.Module, rows: int, devices: int, parallel: Any, **options: Any) -> str:
    x, y = _batch(rows, next(module.parameters()).dtype)
    with pytest.raises(dpverify.ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(module, x, y, loss_fn=_sums, device_ids=list(range(devices)), parallel=parallel, **options)
    return str(caught.value)


# --------------------------------------------------------------------------- rows and replicas


@pytest.mark.parametrize("explicit", [False, True], ids=["anchored", "rtol-atol"])
def test_a_buffer_lost_on_the_copies_names_their_rows_and_replicas(explicit: bool) -> None:
    torch.manual_seed(0)
    options = {"rtol": 1e-5, "atol": 1e-6} if explicit else {}
    message = _message(_ReadsABuffer(), 5, 3, ZeroedReplicaBuffers, **options)
    # chunks [2, 2, 1]: replicas 1 and 2 hold rows 2-4, replica 0 rows 0-1
    assert "output: rows 2-4 of 5 differ: the chunks of replicas 1-2 (rows 2-4), while replica 0's rows 0-1 match" in message
    assert "chunks of [2, 2, 1] rows" in message
    assert "Only the copies differ" in message


def test_rows_are_named_along_the_split_dimension() -> None:
    torch.manual_seed(0)
    module = _ReadsABuffer()
    x, y = _batch(6)

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.inner(x.t()).t()
            return out

    with pytest.raises(dpverify.ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(
            Transposed(), x.t().contiguous(), y.t().contiguous(), loss_fn=F.mse_loss, device_ids=[0, 1], parallel=ZeroedReplicaBuffers, dim=1,
        )
    assert "output: rows 3-5 of 6 differ: the chunk of replica 1 (rows 3-5), while replica 0's rows 0-2 match" in str(caught.value)


def test_a_wrong_gather_of_every_replica_names_every_row() -> None:
    torch.manual_seed(0)
    message = _message(nn.Linear(4, 3), 6, 2, _HalvesGather)
    assert "output: rows 0-5 of 6 differ: rows of every replica's chunk (chunks of [3, 3] rows" in message
    assert "Only the copies differ" not in message


def test_a_passing_check_names_no_rows() -> None:
    x, y = _batch(5)
    result = dpverify.assert_dp_grads_match(_ReadsABuffer(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=nn.DataParallel)
    assert not any("differ" in note for note in result.notes)


# --------------------------------------------------------------------------- a dropped chunk


def test_a_wrapper_that_drops_the_last_chunk_of_two_is_not_blamed_on_the_whole_batch() -> None:
    torch.manual_seed(0)
    message = _message(nn.Linear(4, 3), 2, 2, _DropsAChunk)
    assert "the last chunk (row 1) never ran: the wrapper dropped it" in message
    assert "The replica forward received [1] rows, 1 of 2" in message
    assert "whole batch" not in message


def test_the_chunk_dropped_is_named_from_the_rows_the_output_holds() -> None:
    torch.manual_seed(0)
    message = _message(nn.Linear(4, 3), 2, 2, _DropsTheFirstChunk)
    assert "holds the single-device row 1, so chunk 0 (row 0) never ran" in message
    assert "whole batch" not in message


def test_a_dropped_chunk_among_several_replicas_is_named() -> None:
    torch.manual_seed(0)
    message = _message(nn.Linear(4, 3), 6, 3, _DropsAChunk)
    assert "The replica forwards received [2, 2] rows, 4 of 6" in message
    assert "the last chunk (rows 4-5) never ran" in message


def test_a_wrapper_that_runs_the_whole_batch_once_is_named_so() -> None:
    torch.manual_seed(0)
    message = _message(nn.Linear(4, 3), 2, 2, WholeBatch)
    assert "A wrapper that calls the module on the whole batch" in message
    assert "never ran" not in message


# --------------------------------------------------------------------------- float32 in a float64 step


def test_a_float64_step_off_by_float32_rounding_suggests_a_float32_intermediate() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    message = _message(module, 6, 2, _GathersThroughFloat32)
    assert "This float64 step is off by float32's rounding" in message
    assert "A float32 intermediate in the parallel step is the likely cause" in message


def test_a_float64_step_with_a_large_error_gets_no_float32_hint() -> None:
    module = nn.Linear(4, 3).double()
    assert "float32's rounding" not in _message(module, 6, 2, _HalvesGather)


def test_a_float32_step_gets_no_float32_hint() -> None:
    torch.manual_seed(0)
    assert "float32's rounding" not in _message(_ReadsABuffer(), 5, 3, ZeroedReplicaBuffers)


def test_the_float32_band_is_relative_to_each_tensors_largest_entry() -> None:
    def failing(max_abs: float, size: float, **more: Any) -> TensorComparison:
        return TensorComparison(TensorId("grad", "w"), (3,), 3, mismatched=1, max_abs=max_abs, allowed=1e-15, ratio=max_abs / 1e-15, size=size, **more)

    assert float32_hint([failing(3e-8, 1.0), failing(3e-4, 1e4)]) is not None
    assert float32_hint([failing(3e-8, 1.0), failing(1e-12, 1.0)]) is not None  # a loss where rounding averaged out
    assert float32_hint([failing(3e-8, 1.0), failing(1e-3, 1.0)]) is None  # one error far beyond float32's
    assert float32_hint([failing(1e-12, 1.0)]) is None  # every error far below it
    assert float32_hint([failing(3e-8, 1.0, nonfinite=1)]) is None
    assert float32_hint([failing(3e-8, 0.0)]) is None  # the size was not measured
    assert float32_hint([TensorComparison(TensorId("grad", "w"), (3,), 3)]) is None  # nothing failed


def test_an_error_that_fails_only_the_norm_test_names_the_rows_that_carry_it() -> None:
    from dpverify.checks.dp import _rows_over
    from dpverify.core.comparison import Tolerance

    reference = torch.ones(6, 4, dtype=torch.float64)
    got = reference.clone()
    got[4:] += 1e-3  # within the elementwise allowance, beyond the norm's
    row = TensorComparison(TensorId("output", "output"), (6, 4), 24, allowed=1e-2, norm_allowed=1e-3, norm_gap=float(torch.linalg.vector_norm(got - reference)))
    assert _rows_over(got, reference, row, Tolerance(), 0) == [4, 5]
    assert bool((got[4:] - 1 - 1e-3).abs().max() < 1e-12)  # the output itself is left as it was


class _PackedGRU(nn.Module):
    """A padded-sequence model as users write it: pack, run, pad back."""

    def __init__(self, total_length: bool) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.total_length = total_length

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.size(1) if self.total_length else None)
        return padded


def test_replica_outputs_of_chunk_dependent_length_are_explained() -> None:
    # pad_packed_sequence pads each replica's chunk to its own longest sequence (5 and 2)
    torch.manual_seed(0)
    x, lengths, y = torch.randn(4, 5, 3), torch.tensor([5, 4, 2, 2]), torch.randn(4, 5, 4)
    with pytest.raises(RuntimeError) as caught:
        dpverify.assert_dp_grads_match(_PackedGRU(total_length=False), (x, lengths), y, loss_fn=F.mse_loss, device_ids=[0, 1])
    note = next(n for n in caught.value.__notes__ if "different shapes" in n)
    assert "device 0 [2, 5, 4], device 1 [2, 2, 4]" in note
    assert "total_length=x.size(1)" in note
    # the fix the note names passes
    dpverify.assert_dp_grads_match(_PackedGRU(total_length=True), (x, lengths), y, loss_fn=F.mse_loss, device_ids=[0, 1])
