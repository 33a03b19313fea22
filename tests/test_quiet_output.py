"""stderr stays readable: torch's size-mismatch warning, which a wrapper that loses rows
sets off in every loss dpverify computes of its output, is silenced there (dpverify reports
the lost rows itself), and only there."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify.core.step import SIZE_MISMATCH_WARNING, quiet_size_warnings

pytestmark = pytest.mark.deep

#: A wrapper that drops its last chunk whatever the split (two devices included), and a
#: model whose mse loss then sees fewer rows than its target.
WRAPPER = textwrap.dedent(
    """
    import torch
    from torch import nn


    class DropsLastChunk(nn.DataParallel):
        def forward(self, *inputs, **kwargs):
            chunks, keywords = self.scatter(inputs, kwargs, self.device_ids)
            kept = max(1, len(chunks) - 1)
            replicas = self.replicate(self.module, self.device_ids[:kept])
            return self.gather(self.parallel_apply(replicas, chunks[:kept], keywords[:kept]), self.output_device)


    def model():
        torch.manual_seed(0)
        return nn.Linear(4, 3)
    """
)


def _dpverify(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "lossy.py").write_text(WRAPPER)
    return subprocess.run(
        [sys.executable, "-m", "dpverify", *args, "--no-color"],
        capture_output=True, text=True, timeout=240, check=False, cwd=tmp_path,
    )


def test_fuzz_of_a_wrapper_that_loses_rows_keeps_stderr_free_of_torchs_size_warning(tmp_path: Path) -> None:
    ran = _dpverify(tmp_path, "fuzz", "--parallel", "lossy:DropsLastChunk", "--max-examples", "12", "--seed", "0", "--devices", "3")
    assert ran.returncode == 1, ran.stdout[-2000:] + ran.stderr[-2000:]  # the lost rows are a failure
    assert "Using a target size" not in ran.stderr
    assert "UserWarning" not in ran.stderr


@pytest.mark.parametrize("batch", ["2", "5"])
def test_explain_parallel_of_a_wrapper_that_loses_rows_keeps_stderr_free_of_it(tmp_path: Path, batch: str) -> None:
    ran = _dpverify(tmp_path, "explain", "lossy:model", "--parallel", "lossy:DropsLastChunk", "--batch", batch, "--devices", "2")
    assert "Using a target size" not in ran.stderr
    assert "UserWarning" not in ran.stderr
    assert ran.returncode in (0, 2), ran.stderr[-2000:]  # explained, or a usage error naming --parallel


def test_the_filter_holds_for_that_warning_in_that_call_only() -> None:
    output, target = torch.zeros(2, 3), torch.zeros(4, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet = quiet_size_warnings(lambda out: F.mse_loss(out, target[:1]))
        quiet(output)
        F.mse_loss(output, target[:1])  # outside the quiet call: torch's warning as ever

        def warns_otherwise(out: torch.Tensor) -> torch.Tensor:
            warnings.warn("another warning", UserWarning, stacklevel=1)
            return out.sum()

        quiet_size_warnings(warns_otherwise)(output)
    messages = [str(w.message) for w in caught]
    assert sum("Using a target size" in m for m in messages) == 1
    assert "another warning" in messages
    assert re.match(SIZE_MISMATCH_WARNING, next(m for m in messages if "Using a target size" in m))


def test_the_diagnosis_of_a_split_along_another_dim_warns_nothing() -> None:
    class ZeroesCopiesBuffers(nn.DataParallel):  # type: ignore[type-arg]
        def replicate(self, module: nn.Module, device_ids: object) -> object:
            replicas = super().replicate(module, device_ids)  # type: ignore[arg-type]
            for replica in replicas[1:]:
                replica.shift = torch.zeros_like(replica.shift)
            return replicas

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)
            self.register_buffer("shift", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = (self.linear(x.t()) + self.shift).t()
            return out

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=generator), torch.randn(6, 3, generator=generator)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target.t())  # the target kept row-major: the loss transposes it

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(dpverify.ParallelMismatch):
            dpverify.assert_dp_grads_match(Transposed(), x, y, loss_fn=loss, device_ids=[0, 1], parallel=ZeroesCopiesBuffers, dim=1)
    assert not [str(w.message) for w in caught if "Using a target size" in str(w.message)]
