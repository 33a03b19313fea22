"""Bad inputs a new user meets get an InvalidArgument that names the argument and the fix,
before anything runs, instead of an error from deep inside torch or a silent wrong answer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify import InvalidArgument
from dpverify.cli.main import main


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) + y
        return out


@dataclasses.dataclass
class Out:
    logits: torch.Tensor


class DataclassOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Out:
        return Out(self.linear(x))


class NoOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> None:
        self.linear(x)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) * scale
        return out


def test_a_target_of_other_rows_than_the_batch_is_refused_naming_both() -> None:
    with pytest.raises(InvalidArgument, match=r"target has 6 rows \(shape \(6, 2\)\) but the batch has 8: .* pass a target with one row per sample"):
        dpverify.assert_dp_grads_match(nn.Linear(4, 2), torch.randn(8, 4), torch.randn(6, 2), loss_fn=F.mse_loss, device_ids=[0, 1])
    with pytest.raises(InvalidArgument, match="target has 6 rows"):
        dpverify.assert_grad_sum_equals_mean_loss_grad(nn.Linear(4, 2), torch.randn(8, 4), torch.randn(6, 2), loss_fn=F.mse_loss, device_ids=[0, 1])


def test_the_ranked_checks_refuse_it_too_before_any_rank_runs() -> None:
    pool = object()  # never reached: the arguments are checked in this process first
    with pytest.raises(InvalidArgument, match="target has 3 rows"):
        dpverify.assert_ddp_grads_match(nn.Linear(4, 2), torch.randn(8, 4), torch.randn(3, 2), loss_fn=F.mse_loss, world_size=2, pool=pool)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="target has 3 rows"):
        dpverify.assert_fsdp_grads_match(nn.Linear(4, 2), torch.randn(8, 4), torch.randn(3, 2), loss_fn=F.mse_loss, world_size=2, pool=pool)  # type: ignore[arg-type]


def test_targets_without_rows_or_with_the_batchs_rows_pass_the_rule() -> None:
    from dpverify.core.validation import require_target_rows

    require_target_rows(None, 8)
    require_target_rows(torch.tensor(1.0), 8)  # a scalar target has no rows to compare
    require_target_rows({"labels": torch.zeros(8, 5, dtype=torch.long)}, 8)
    with pytest.raises(InvalidArgument, match="target has 4 rows"):
        require_target_rows((torch.zeros(4),), 8)


def test_a_list_meant_as_a_tuple_of_arguments_is_refused_with_the_fix() -> None:
    with pytest.raises(InvalidArgument, match=r"inputs is a list of 2, which is one positional argument .* TwoInputs.forward takes 2 \(x, y\): pass a tuple"):
        dpverify.assert_dp_grads_match(TwoInputs(), [torch.randn(8, 4), torch.randn(8, 2)], torch.randn(8, 2), loss_fn=F.mse_loss, device_ids=[0, 1])
    # a tuple is the arguments; a list for a forward of one argument is that argument
    dpverify.assert_dp_grads_match(TwoInputs(), (torch.randn(8, 4), torch.randn(8, 2)), torch.randn(8, 2), loss_fn=F.mse_loss, device_ids=[0, 1])


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (DataclassOutput(), r"output is of type Out, which DataParallel cannot gather: torch's gather takes tensors, None, and dicts, namedtuples, tuples or lists"),
        (NoOutput(), r"NoOutput.forward returned None: DataParallel gathers None as None"),
    ],
    ids=["dataclass", "None"],
)
def test_an_output_dataparallel_cannot_gather_is_named_with_what_it_takes(module: nn.Module, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as refused:
        dpverify.assert_dp_grads_match(module, torch.randn(8, 4), torch.randn(8, 2), loss_fn=lambda out, target: F.mse_loss(out.logits, target), device_ids=[0, 1])
    assert refused.value.__cause__ is not None  # torch's own error stays attached


def test_replicas_left_without_rows_but_given_keyword_arguments_are_explained() -> None:
    with pytest.raises(InvalidArgument, match=r"2 rows make 2 chunks, yet torch's DataParallel runs 4 replicas, because scatter_kwargs copies the keyword arguments \['scale'\] .* devices \[2, 3\] .* Scaled.forward needs x"):
        dpverify.assert_dp_grads_match(Scaled(), torch.randn(2, 4), torch.randn(2, 2), loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], forward_kwargs={"scale": 0.5})
    # with enough rows every replica gets its chunk and the copy of scale
    dpverify.assert_dp_grads_match(Scaled(), torch.randn(4, 4), torch.randn(4, 2), loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], forward_kwargs={"scale": 0.5})


def test_sparse_virtual_device_ids_say_what_a_real_machine_would_need() -> None:
    result = dpverify.assert_dp_grads_match(nn.Linear(4, 2), torch.randn(8, 4), torch.randn(8, 2), loss_fn=F.mse_loss, device_ids=[0, 99])
    assert "virtual devices (a real machine would need 100 CUDA devices for these ids)" in result.scenario


def test_ids_beyond_the_gpus_of_a_gpu_machine_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dpverify.checks.dp.cuda_device_count", lambda: 2)
    with pytest.raises(InvalidArgument, match=r"device_ids=\[0, 99\]: this machine has 2 CUDA devices \(ids 0 to 1\); pass ids below 2"):
        dpverify.assert_dp_grads_match(nn.Linear(4, 2), torch.randn(8, 4), torch.randn(8, 2), loss_fn=F.mse_loss, device_ids=[0, 99])
    from dpverify.checks.dp import _require_ids_on_this_machine

    _require_ids_on_this_machine([0, 1, 2, 3])  # more devices than GPUs, as 0 .. n-1: virtual, as check --devices 4 asks


def test_an_inputs_function_that_ignores_the_batch_size_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fixed_batch.py").write_text(
        "import torch\n\n"
        "def make():\n    return torch.nn.Linear(4, 2)\n\n"
        "def batch(batch_size):\n    return torch.randn(8, 4), torch.randn(8, 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "fixed_batch:make", "--inputs", "fixed_batch:batch", "--batch-sizes", "5", "--devices", "2", "--no-color"]) == 2
    assert "--inputs fixed_batch:batch returned a batch of 8 rows when asked for batch_size=5" in capsys.readouterr().err
