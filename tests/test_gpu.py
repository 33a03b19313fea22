"""The gradient and training checks on one CUDA device (``pytest -m multigpu``; skipped elsewhere).

One GPU runs what the CPU suite cannot: the single-device references and the float64
anchor on the GPU, torch's own DataParallel on ``device_ids=[0]``, a one-rank nccl pool,
and the TF32 switch, which Ampere and newer GPUs turn on for cuDNN convolutions by
default (a 10-bit mantissa: no float32 comparison survives it). Every check must pass
with the user's TF32 settings on and leave them as it found them, and a broken wrapper
must still fail on the GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify

pytestmark = pytest.mark.multigpu(1)


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def _batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 3, 16, 16, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


@pytest.fixture
def tf32_on() -> Iterator[None]:
    """The user's TF32 switches on, as many training scripts set them."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_turns_a_float32_convolution_away_from_float64() -> None:
    # the premise: with TF32 on, a float32 convolution on this GPU is far from float64
    # (skip where the GPU has no TF32, e.g. before Ampere)
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs compute capability 8.0 or newer")
    x = torch.randn(8, 64, 32, 32, device="cuda")
    w = torch.randn(64, 64, 3, 3, device="cuda")
    exact = F.conv2d(x.double(), w.double())
    saved = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        tf32 = F.conv2d(x, w).double()
        torch.backends.cudnn.allow_tf32 = False
        fp32 = F.conv2d(x, w).double()
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    assert (tf32 - exact).abs().max() > 100 * (fp32 - exact).abs().max()


def test_a_conv_net_passes_on_one_gpu_with_tf32_on_and_the_switches_are_restored(tf32_on: None) -> None:
    model = _conv_net().cuda()
    x, y = _batch()
    report = dpverify.assert_dp_grads_match(model, x.cuda(), y.cuda(), loss_fn=F.cross_entropy, device_ids=[0])
    assert report.ok
    assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.allow_tf32


def test_training_with_adam_passes_on_one_gpu(tf32_on: None) -> None:
    model = _conv_net().cuda()
    x, y = _batch()
    batches = [(x.cuda(), y.cuda())] * 3
    report = dpverify.assert_dp_training_matches(
        model, batches, loss_fn=F.cross_entropy, optimizer=functools.partial(torch.optim.Adam, lr=1e-3), device_ids=[0],
    )
    assert report.ok


class _ScaledDataParallel(nn.DataParallel):  # type: ignore[type-arg]
    """torch's DataParallel whose output is 0.1% too large: a stray rescale."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return super().forward(*inputs, **kwargs) * 1.001


def test_a_rescaling_wrapper_fails_on_the_gpu() -> None:
    model = _conv_net().cuda()
    x, y = _batch()
    with pytest.raises(dpverify.ParallelMismatch, match="do not match"):
        dpverify.assert_dp_grads_match(model, x.cuda(), y.cuda(), loss_fn=F.cross_entropy, device_ids=[0], parallel=_ScaledDataParallel)


def test_ddp_grads_and_training_on_a_one_rank_nccl_pool() -> None:
    x, y = _batch()
    with dpverify.DDPWorkerPool(1) as pool:
        assert pool.backend == "nccl"
        grads = dpverify.assert_ddp_grads_match(_conv_net(), x, y, loss_fn=F.cross_entropy, world_size=1, pool=pool)
        training = dpverify.assert_ddp_training_matches(
            _conv_net(), [(x, y)] * 2, loss_fn=F.cross_entropy, world_size=1, pool=pool,
            optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        )
    assert grads.ok
    assert training.ok
