"""The user's training step under DDP and FSDP2, verified over several optimizer steps:
gradient clipping after backward (``after_backward=``), the optimizer's state and the
buffers compared with single-device training after every step, and a running statistic
updated from the local batch. Each bug is written the way users write it, in a buggy and a
fixed variant: the buggy one is caught with a message naming its cause, the fixed one passes."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_loss_tokens import VOCAB, tiny_gpt2
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from dpverify import (
    InvalidArgument,
    ParallelMismatch,
    assert_ddp_buffers_match,
    assert_ddp_training_matches,
)
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.registry import CHECKS, Case, Target, Verdict
from dpverify.sharded.fsdp import FSDPContext, assert_fsdp_training_matches

MAX_NORM = 0.05
SGD = functools.partial(torch.optim.SGD, lr=0.5)
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)


def mlp() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def batches(steps: int = 3, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 4, generator=generator), torch.randn(rows, 3, generator=generator)) for _ in range(steps)]


# --------------------------------------------------------------------------- the user's hooks


def clip(ctx: Any) -> None:
    """Fixed: torch's clip over the module's parameters (DDP: each rank holds the averaged
    gradient; FSDP2: DTensor gradients, whose norm torch takes over every shard)."""
    torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), MAX_NORM)


def _scale_to(params: list[nn.Parameter], norm: torch.Tensor) -> None:
    scale = (MAX_NORM / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(scale)  # type: ignore[union-attr]


def clip_reduced_twice(ctx: Any) -> None:
    """Buggy under DDP: the squared norm all-reduced over ranks that already hold the same
    averaged gradient sums world_size copies."""
    params = [p for p in ctx.module.parameters() if p.grad is not None]
    squared = torch.stack([p.grad.pow(2).sum() for p in params]).sum()
    dist.all_reduce(squared, group=ctx.group)
    _scale_to(params, squared.sqrt())


def clip_local_shard(ctx: Any) -> None:
    """Buggy under FSDP2: the norm of this rank's shard of every gradient."""
    params = [p for p in ctx.module.parameters() if p.grad is not None]
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    _scale_to(params, torch.norm(torch.stack([g.norm() for g in local])))


def clip_shards_all_reduced(ctx: Any) -> None:
    """Fixed by hand under FSDP2: the squared norms of the local shards summed over the
    group FSDP2 reduces over (``ctx.group``; in the single-device reference a group of one)."""
    params = [p for p in ctx.module.parameters() if p.grad is not None]
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    squared = torch.stack([g.pow(2).sum() for g in local]).sum()
    dist.all_reduce(squared, group=ctx.group)
    _scale_to(params, squared.sqrt())


# --------------------------------------------------------------------------- DDP clipping


def test_ddp_clip_reduced_twice_is_caught_and_named_while_torchs_clip_passes(ddp_pool: DDPWorkerPool) -> None:
    data = batches()
    passed = assert_ddp_training_matches(mlp(), data, loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=ddp_pool, after_backward=clip)
    assert passed.ok
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_training_matches(mlp(), data, loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=ddp_pool, after_backward=clip_reduced_twice)
    report = caught.value.report
    assert "the table shows step 1" in str(caught.value)
    assert report.scale == pytest.approx(2**-0.5, rel=1e-3)
    assert "after_backward=clip_reduced_twice" in str(caught.value)
    assert "1/sqrt(2)" in str(caught.value)


def test_adam_hides_a_clip_scale_in_its_first_update_but_not_in_its_state(ddp_pool: DDPWorkerPool) -> None:
    # Adam's first update is about lr * sign(g): the clip scale shows in exp_avg, not in
    # the parameters, so the first step that differs is found from the optimizer state
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_training_matches(mlp(), batches(), loss_fn=F.mse_loss, optimizer=ADAM, world_size=2, pool=ddp_pool, after_backward=clip_reduced_twice)
    report = caught.value.report
    first = [t for t in report.tensors if not t.ok]
    assert all(t.id.variant == "step 1" for t in first)
    assert {t.id.kind for t in first} >= {"optimizer state"}
    assert any(t.id.name.endswith(".exp_avg") for t in first)
    assert "optimizer state (exp_avg) is 0.707" in str(caught.value)


# --------------------------------------------------------------------------- FSDP2 clipping


def test_fsdp_local_shard_clip_is_caught_per_shard_while_global_clips_pass(ddp_pool: DDPWorkerPool) -> None:
    data = batches()
    for fixed in (clip, clip_shards_all_reduced):
        assert assert_fsdp_training_matches(mlp(), data, loss_fn=F.mse_loss, optimizer=MOMENTUM, world_size=2, pool=ddp_pool, after_backward=fixed).ok
    with pytest.raises(ParallelMismatch) as caught:
        assert_fsdp_training_matches(mlp(), data, loss_fn=F.mse_loss, optimizer=MOMENTUM, world_size=2, pool=ddp_pool, after_backward=clip_local_shard)
    text = str(caught.value)
    assert "the table shows step 1" in text
    assert "on the rows each rank stores" in text
    assert "local shard (p.grad.to_local())" in text


def group_of_the_mesh(ctx: Any) -> None:
    """Checks, on the ranks, that ``ctx.group`` is the group FSDP2 reduces over."""
    if not ctx.reference:
        assert isinstance(ctx, FSDPContext)
        assert dist.get_world_size(ctx.group) == ctx.world_size == 2
        mesh = next(p.device_mesh for p in ctx.module.parameters() if isinstance(p, DTensor))
        assert ctx.group == mesh.get_group()


def test_fsdp_context_group_is_the_meshs(ddp_pool: DDPWorkerPool) -> None:
    assert assert_fsdp_training_matches(mlp(), batches(2), loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=ddp_pool, after_backward=group_of_the_mesh).ok


def bf16_step(ctx: FSDPContext) -> Any:
    """The user's mixed-precision FSDP2 step: bfloat16 compute, float32 reduction."""
    model = ctx.fsdp(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    output = model(*ctx.inputs)
    F.mse_loss(output.float(), ctx.target).backward()
    return output


def mse_float(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target.float())


def test_fsdp_mixed_precision_runs_the_hook_in_both_runs(ddp_pool: DDPWorkerPool) -> None:
    data = batches(2)
    result = assert_fsdp_training_matches(mlp(), data, loss_fn=mse_float, optimizer=SGD, world_size=2, step=bf16_step, pool=ddp_pool, after_backward=clip)
    assert any(note.startswith("Mixed precision") for note in result.notes)
    with pytest.raises(ParallelMismatch) as caught:
        assert_fsdp_training_matches(mlp(), data, loss_fn=mse_float, optimizer=SGD, world_size=2, step=bf16_step, pool=ddp_pool, after_backward=clip_local_shard)
    failing = [t for t in caught.value.report.tensors if not t.ok]
    assert any(t.id.kind == "grad" and t.id.variant == "step 1" for t in failing)


# --------------------------------------------------------------------------- running statistics


class InputCentering(nn.Module):
    """Centres its input by a running mean of the batches it has seen (an EMA buffer,
    updated in forward), as normalising front ends and codebook EMAs do."""

    def __init__(self, all_reduce: bool = False) -> None:
        super().__init__()
        self.net = mlp()
        self.register_buffer("ema", torch.zeros(4))
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            stat = x.mean(0).detach()
            if self.all_reduce and dist.is_available() and dist.is_initialized():
                dist.all_reduce(stat)
                stat /= dist.get_world_size()
            self.ema.mul_(0.9).add_(0.1 * stat)
        return self.net(x - self.ema)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_a_running_statistic_of_the_local_batch_is_caught_and_its_all_reduce_passes(ddp_pool: DDPWorkerPool, backend: str) -> None:
    helper = assert_ddp_training_matches if backend == "ddp" else assert_fsdp_training_matches
    data = batches()
    assert helper(InputCentering(all_reduce=True), data, loss_fn=F.mse_loss, optimizer=MOMENTUM, world_size=2, pool=ddp_pool).ok
    with pytest.raises(ParallelMismatch) as caught:
        helper(InputCentering(), data, loss_fn=F.mse_loss, optimizer=MOMENTUM, world_size=2, pool=ddp_pool)
    text = str(caught.value)
    assert "rank 0 step 1 buffer 'ema'" in text
    assert "Buffers ['ema'] differ from what one device computes over the full batch" in text
    assert ("broadcast_buffers=True" in text) == (backend == "ddp")


def test_the_all_reduced_statistic_passes_with_a_hook_that_makes_a_reference_group(ddp_pool: DDPWorkerPool) -> None:
    # with a hook, the single-device reference has a process group of one rank: the
    # user's all-reduce then runs there too, and averages over that one rank
    assert assert_ddp_training_matches(InputCentering(all_reduce=True), batches(), loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=ddp_pool, after_backward=clip).ok


def test_ddp_buffers_match_compares_a_running_statistic_with_the_full_batch(ddp_pool: DDPWorkerPool) -> None:
    x, y = batches(1)[0]
    assert assert_ddp_buffers_match(InputCentering(all_reduce=True), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool).ok
    with pytest.raises(ParallelMismatch) as caught:
        assert_ddp_buffers_match(InputCentering(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool)
    failing = {t.name for t in caught.value.report.tensors if not t.ok}
    assert "rank 0 buffer 'ema' after its step" in failing
    assert "broadcast_buffers=True" in str(caught.value)


def bn_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def test_batchnorm_statistics_stay_a_known_divergence(ddp_pool: DDPWorkerPool) -> None:
    x, y = batches(1, rows=8)[0]
    # one step: BatchNorm's running statistics are each rank's own shard's, as torch means
    assert assert_ddp_buffers_match(bn_model(), x, y, loss_fn=F.mse_loss, world_size=2, pool=ddp_pool).ok
    # training: explained by BatchNorm (train mode), not a failure, and no local-statistic note
    case = Case(bn_model(), (x,), y, F.mse_loss, device_ids=(0, 1), batches=tuple(batches(3, rows=8)))
    result = CHECKS["ddp-training"].run(case, Target(pool=ddp_pool))
    assert result.verdict is Verdict.EXPLAINED
    assert "Buffers [" not in result.detail


# --------------------------------------------------------------------------- rounding


def cancelling_bias_batches(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Targets off the model's outputs by +r on rank 0's rows and -r on rank 1's: the output
    bias's gradient cancels to rounding over the full batch, not on either rank."""
    generator = torch.Generator().manual_seed(0)
    found = []
    for _ in range(3):
        x = torch.randn(6, 3, generator=generator, dtype=torch.float64)
        with torch.no_grad():
            pred = model(x)
        signs = torch.tensor([1.0, 1, 1, -1, -1, -1], dtype=torch.float64)[:, None]
        found.append((x, pred + signs * torch.rand(1, 2, generator=generator, dtype=torch.float64)))
    return found


def test_state_that_cancels_over_the_batch_is_judged_by_its_rounding_not_its_size(ddp_pool: DDPWorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    # the momentum buffer after step 1 is the gradient, whose bias entries are float64
    # rounding of cancelling terms: without the jittered run's sample of that rounding
    # (training_rows' second look) the check calls it a mismatch
    import dpverify.ddp.checks as ddp_checks

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    data = cancelling_bias_batches(model)
    assert assert_ddp_training_matches(model, data, loss_fn=F.mse_loss, optimizer=MOMENTUM, world_size=2, pool=ddp_pool).ok
    monkeypatch.setattr(ddp_checks, "jittered_training", lambda *args, **kwargs: None)
    with pytest.raises(ParallelMismatch, match=re.escape("step 1 optimizer state '2.bias.momentum_buffer'")):
        assert_ddp_training_matches(model, data, loss_fn=F.mse_loss, optimizer=MOMENTUM, world_size=2, pool=ddp_pool)


def test_a_hook_the_ranks_cannot_import_is_refused_naming_the_argument(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(InvalidArgument, match="after_backward"):
        assert_fsdp_training_matches(mlp(), batches(1), loss_fn=F.mse_loss, optimizer=SGD, world_size=2, pool=ddp_pool, after_backward=lambda ctx: None)


# --------------------------------------------------------------------------- a model we did not write


class _Logits(nn.Module):
    """Hugging Face's GPT-2 as a training script calls it: token ids in, logits out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=ids).logits
        return logits


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.deep  # about 5 s idle: three training runs of a transformer on two backends
def test_a_tiny_hf_gpt2_trains_like_one_device_under_ddp_and_fsdp2_and_a_twice_reduced_clip_is_named(ddp_pool: DDPWorkerPool) -> None:
    """A model nobody here designed (transformers' GPT-2, its output projection tied to the
    token embedding, built from a config in train mode with its dropout at p=0: its
    attention dropout runs inside scaled_dot_product_attention, where no mask can be
    replayed): torch's clip passes three AdamW steps on DDP and FSDP2; the twice-reduced
    clip is caught, with its cause, under SGD."""
    gpt2 = _Logits(tiny_gpt2().train())
    for layer in gpt2.modules():
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0
    generator = torch.Generator().manual_seed(0)
    data = [(ids, ids) for ids in (torch.randint(0, VOCAB, (6, 8), generator=generator) for _ in range(3))]
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    for helper in (assert_ddp_training_matches, assert_fsdp_training_matches):
        assert helper(gpt2, data, loss_fn=next_token_loss, optimizer=adamw, world_size=2, pool=ddp_pool, after_backward=clip).ok
    with pytest.raises(ParallelMismatch, match=r"1/sqrt\(2\)"):
        assert_ddp_training_matches(gpt2, data, loss_fn=next_token_loss, optimizer=SGD, world_size=2, pool=ddp_pool, after_backward=clip_reduced_twice)
