"""The data-path and metric checks on a CUDA device (``pytest -m multigpu``; skipped elsewhere).

One GPU is enough: a one-rank pool runs nccl, the evaluation loop moves its batches to the
GPU and all-reduces CUDA tensors there, and the single-device run executes the same loop in
a one-rank gloo group; DataParallel runs torch's own on ``device_ids=[0]``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dpverify
from dpverify.data.loaders import distributed_loader

pytestmark = pytest.mark.multigpu(1)


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(10, 3, generator=generator), torch.randn(10, 2, generator=generator))


def cuda_mean_loss(model: torch.nn.Module, loader: object) -> float:
    """A sum-and-count evaluation on the GPU, synchronised over the default group."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = model.to(device)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in loader:  # type: ignore[attr-defined]
            total[0] += F.mse_loss(model(x.to(device)), y.to(device), reduction="sum").double()
            total[1] += len(y)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def cuda_forward_mean(model: torch.nn.Module, loader: object) -> float:
    """A DataParallel evaluation: per-sample outputs gathered, reduced after the gather."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:  # type: ignore[attr-defined]
            out = model(x.cuda())
            total += float(F.mse_loss(out, y.to(out.device), reduction="sum"))
            count += len(y)
    return total / count


def test_a_gpu_evaluation_on_an_nccl_rank_matches_one_device() -> None:
    torch.manual_seed(0)
    with dpverify.DDPWorkerPool(1) as pool:
        assert pool.backend == "nccl"
        report = dpverify.assert_ddp_metric_matches(
            torch.nn.Linear(3, 2), _dataset(), cuda_mean_loss, world_size=1, pool=pool,
            loader_factory=distributed_loader(batch_size=4),
        )
    assert report.ok
    assert len(report.parallel) == 1


def test_a_gpu_data_check_on_an_nccl_rank_sees_every_sample() -> None:
    with dpverify.DDPWorkerPool(1) as pool:
        report = dpverify.assert_ddp_data_matches(_dataset(), distributed_loader(batch_size=4, shuffle=True), world_size=1, pool=pool)
    assert [sorted(epoch.per_rank[0]) for epoch in report.epochs] == [list(range(10))] * 2


def test_real_data_parallel_evaluation_on_one_gpu_matches_the_model_alone() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).cuda()
    report = dpverify.assert_dp_metric_matches(model, _dataset(), cuda_forward_mean, device_ids=[0])
    assert report.ok
