"""The pipeline training check: several optimizer steps of every stage against one device,
the user's hook between the schedule's backward and the optimizer step (a tied
embedding's all-reduce), an objective apart from the per-microbatch loss, and the
token-mean trap over microbatches, in user code written buggy and fixed."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.ddp.pool import DDPWorkerPool
from dpverify.mutants import UnscaledGPipe

VOCAB, DIM, SEQ = 16, 8, 4
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.05)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyGPT(nn.Module):
    """A GPT-like language model whose output projection is its input embedding (weight
    tying, as GPT-2 does): a pipeline puts the two on the first and the last stage."""

    def __init__(self, seed: int = 0, *, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block(DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(ids))))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def sync_tied_embedding(ctx: Any) -> None:
    """The fix: sum the tied weight's gradient over the first and the last stage."""
    if ctx.num_stages == 1:  # one device: one weight with the whole gradient
        return
    if ctx.is_first:
        weight = ctx.module.embed.weight
    elif ctx.is_last:
        weight = ctx.module.head.weight
    else:
        return
    dist.all_reduce(weight.grad, group=ctx.tied_group)


def average_tied_embedding(ctx: Any) -> None:
    """The bug: the data-parallel habit, averaging the copies' gradients (each holds only
    a part of the gradient, not a whole one)."""
    if ctx.reference:
        return
    weight = ctx.module.embed.weight if ctx.is_first else ctx.module.head.weight
    dist.all_reduce(weight.grad, group=ctx.tied_group)
    weight.grad /= dist.get_world_size(ctx.tied_group)


def token_batches(steps: int = 2, rows: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        found.append((ids, torch.roll(ids, -1, dims=1)))
    return found


def train(pool: DDPWorkerPool | None = None, **options: Any) -> dpverify.StepComparison:
    kwargs: dict[str, Any] = {
        "loss_fn": lm_loss, "optimizer": SGD, "world_size": 2, "n_microbatches": 2, "split_points": ["block"], "pool": pool,
    }
    kwargs.update(options)
    batches = kwargs.pop("batches", None) or token_batches()
    return dpverify.assert_pipeline_training_matches(TinyGPT(), batches, **kwargs)


def test_a_tied_embedding_without_a_hook_is_named(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool)
    text = str(caught.value)
    print(text)
    assert "step 1 stage 1 param 'embed.weight' (as 'head.weight')" in text
    assert "'embed.weight' is one weight tied across stages" in text
    assert "no after_backward hook" in text


def test_the_tied_embedding_summed_over_its_stages_passes(ddp_pool: DDPWorkerPool) -> None:
    result = train(ddp_pool, after_backward=sync_tied_embedding, optimizer=ADAM)
    print(result)
    assert result.ok


def test_averaging_the_tied_gradients_is_named(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool, after_backward=average_tied_embedding)
    text = str(caught.value)
    print(text)
    assert "averaged over the 2 stages instead of summed" in text


ROWS = 4


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The bug: the microbatch's summed token loss, with scale_grads=False: the schedule
    backpropagates the raw sum over the batch."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def batch_share_loss(logits: torch.Tensor, labels: torch.Tensor, *, tokens: int) -> torch.Tensor:
    """The fix: the microbatch's summed token loss over the batch's token count."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / tokens


def test_the_raw_sum_passes_without_an_objective_and_is_caught_with_one(ddp_pool: DDPWorkerPool) -> None:
    summed = {"loss_fn": summed_token_loss, "scale_grads": False, "after_backward": sync_tied_embedding}
    assert train(ddp_pool, **summed).ok  # one loss_fn is both: the sum is its own objective
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool, objective=lm_loss, **summed)
    text = str(caught.value)
    print(text)
    assert "objective lm_loss" in text
    assert "the sum of the 2 microbatch losses (scale_grads=False) of loss_fn=summed_token_loss" in text
    assert f"({ROWS * SEQ} times it)" in text
    fixed = functools.partial(batch_share_loss, tokens=ROWS * SEQ)
    assert train(ddp_pool, loss_fn=fixed, scale_grads=False, objective=lm_loss, after_backward=sync_tied_embedding).ok


def padded_batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches whose second microbatch (rows 2-3) is mostly padding: 8 and 4 tokens
    count (labels -100 are ignored), 12 in every batch."""
    found = []
    for ids, labels in token_batches(steps):
        labels = labels.clone()
        labels[2, 1:] = -100
        labels[3, 3:] = -100
        found.append((ids, labels))
    return found


TRAP = "the loss-averaging trap under a pipeline"


def test_the_token_mean_of_each_microbatch_is_the_trap_and_the_batch_count_fixes_it(ddp_pool: DDPWorkerPool) -> None:
    with pytest.raises(ParallelMismatch) as caught:
        train(ddp_pool, batches=padded_batches(), after_backward=sync_tied_embedding)
    text = str(caught.value)
    print(text)
    assert TRAP in text
    assert "tokens: [8, 4] (target != -100), 12 in all" in text
    assert "[1/16, 1/8] instead of 1/T = 1/12" in text
    assert "is one weight tied" not in text  # the tie is summed: not the cause
    fixed = functools.partial(batch_share_loss, tokens=12)
    assert train(ddp_pool, batches=padded_batches(), loss_fn=fixed, scale_grads=False, after_backward=sync_tied_embedding).ok


def test_the_gradient_check_names_the_trap_only_when_the_evidence_fits(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = padded_batches(1)[0]
    options: dict[str, Any] = {"loss_fn": lm_loss, "world_size": 2, "n_microbatches": 2, "split_points": ["block"], "pool": ddp_pool}
    with pytest.raises(ParallelMismatch) as caught:
        dpverify.assert_pipeline_grads_match(TinyGPT(tie=False), ids, labels, **options)
    assert TRAP in str(caught.value)
    # the same uneven tokens, but a schedule that never divides by n_microbatches: the
    # stages' gradients are not the mean of the microbatch losses', so the trap is not the cause
    with pytest.raises(ParallelMismatch) as caught:
        dpverify.assert_pipeline_grads_match(TinyGPT(tie=False), ids, labels, schedule=UnscaledGPipe, **options)
    print(caught.value)
    assert TRAP not in str(caught.value)


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    # no pool is passed and none needs to start: validation comes first
    batches = token_batches()
    options: dict[str, Any] = {"loss_fn": lm_loss, "optimizer": SGD, "world_size": 2, "n_microbatches": 2, "split_points": ["block"]}
    with pytest.raises(InvalidArgument, match=r"batches\[1\] has shapes .*pad the batches"):
        dpverify.assert_pipeline_training_matches(TinyGPT(), [batches[0], (batches[1][0][:2], batches[1][1][:2])], **options)
    with pytest.raises(InvalidArgument, match="after_backward=3 is not callable"):
        dpverify.assert_pipeline_training_matches(TinyGPT(), batches, after_backward=3, **options)
    with pytest.raises(InvalidArgument, match="objective='mean' is not callable"):
        dpverify.assert_pipeline_training_matches(TinyGPT(), batches, objective="mean", **options)
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):
        dpverify.assert_pipeline_training_matches(TinyGPT(), batches, step=print, **options)


@pytest.mark.deep  # a pool of 3 ranks starts in about 10 s here; the checks take about 1 s
def test_three_stages_sum_the_tied_weight_over_the_first_and_last_only(ddp_pools: Any) -> None:
    # the middle stage holds no tied weight: ctx.tied_group is the subgroup of stages 0
    # and 2, made by the harness on every rank
    pool = ddp_pools(3)
    options: dict[str, Any] = {"pool": pool, "world_size": 3, "split_points": ["block", "norm"], "schedule": "1f1b", "n_microbatches": 4}
    batches = token_batches(rows=8)
    assert train(after_backward=sync_tied_embedding, optimizer=ADAM, batches=batches, **options).ok
    with pytest.raises(ParallelMismatch, match=r"'head\.weight' on stage 2"):
        train(batches=batches, **options)


class RowCounter(nn.Module):
    """Counts the rows it has seen in a buffer (as a running statistic does), user-style."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rows_seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows_seen += x.size(0)
        return x


class CountingGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__(tie=False)
        self.count = RowCounter()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.count(self.head(self.norm(self.block(self.embed(ids)))))


def test_a_buffer_updated_in_forward_gets_torchs_shape_inference_forward_too(ddp_pool: DDPWorkerPool) -> None:
    # found here: PipelineStage runs the stage's forward once before the first step to
    # infer shapes, so a counter of rows (a running statistic) counts the first
    # microbatch once more than one device does; the buffer is compared and the extra
    # forward named
    with pytest.raises(ParallelMismatch) as caught:
        dpverify.assert_pipeline_training_matches(
            CountingGPT(), token_batches(), loss_fn=lm_loss, optimizer=SGD, world_size=2, n_microbatches=2,
            split_points=["block"], pool=ddp_pool,
        )
    text = str(caught.value)
    print(text)
    assert "step 1 stage 1 buffer 'count.rows_seen': tensors are not close" in text
    assert "Stage 1's module ran forward 1 time outside any microbatch in step 1" in text
    assert "_forward_metadata_inference" in text


def test_the_registry_check_sums_tied_weights_unless_the_target_brings_its_hook() -> None:
    from dpverify.models.layouts import PipelineLayout, ShardedScenario
    from dpverify.mutants import MUTANTS
    from dpverify.strategies import ModelSpec, Scenario

    scenario = ShardedScenario(Scenario(ModelSpec("tied-sequential", hidden=4, depth=2, train=False), 4), PipelineLayout((2,), 2))
    case = dpverify.Case.from_scenario(scenario)
    passed = dpverify.CHECKS["pp-training"].run(case)
    assert passed.verdict is dpverify.Verdict.PASS, passed.detail
    assert passed.tensors  # a pass rests on compared tensors
    mutant = MUTANTS["pp-untied-embedding"]
    caught = dpverify.CHECKS["pp-training"].run(case, mutant.target)
    assert caught.verdict is dpverify.Verdict.FAIL
    assert "'0.weight' is one weight tied across stages" in caught.detail
    assert mutant.message in caught.detail


def test_the_gradient_check_holds_the_schedule_to_the_objective(ddp_pool: DDPWorkerPool) -> None:
    ids, labels = token_batches(1)[0]
    options: dict[str, Any] = {"world_size": 2, "n_microbatches": 2, "split_points": ["block"], "pool": ddp_pool, "scale_grads": False}
    assert dpverify.assert_pipeline_grads_match(TinyGPT(tie=False), ids, labels, loss_fn=summed_token_loss, **options).ok
    with pytest.raises(ParallelMismatch, match="The schedule optimises a different loss than the objective"):
        dpverify.assert_pipeline_grads_match(TinyGPT(tie=False), ids, labels, loss_fn=summed_token_loss, objective=lm_loss, **options)
    fixed = functools.partial(batch_share_loss, tokens=ROWS * SEQ)
    assert dpverify.assert_pipeline_grads_match(TinyGPT(tie=False), ids, labels, loss_fn=fixed, objective=lm_loss, **options).ok
