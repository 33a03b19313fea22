"""The shared rank side of the ranked backends (``dpverify.ranked.rank``): shards, the
context a step sees, the step runner, the training loop and the snapshots, on one process,
and the one training loop giving DDP and FSDP2 the same parameters on gloo ranks."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpverify.ddp.pool import DDPWorkerPool
from dpverify.ddp.rank import TrainingTask, ddp_step, run_training_task
from dpverify.ranked.rank import (
    RankContext,
    RankInfo,
    RankStepTask,
    buffers_of,
    grads_of,
    items_of,
    optimizer_state_of,
    outputs_of,
    run_step,
    shard_of,
    train,
)
from dpverify.sharded.fsdp_rank import (
    FSDPTrainingTask,
    fsdp_step,
    run_fsdp_training_task,
    shard_order,
)

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def mlp() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def batches(steps: int, rows: int = 6) -> tuple[tuple[tuple[Any, ...], dict[str, Any], Any], ...]:
    generator = torch.Generator().manual_seed(1)
    return tuple(((torch.randn(rows, 5, generator=generator),), {}, torch.randn(rows, 2, generator=generator)) for _ in range(steps))


def context(module: nn.Module, rank: int = 0, world_size: int = 1, shard_sizes: tuple[int, ...] = (6,)) -> RankContext:
    return RankContext(rank, world_size, module, (), None, F.mse_loss, shard_sizes, torch.device("cpu"))


def plain_step(ctx: RankContext) -> Any:
    output = ctx.module(*ctx.inputs, **ctx.kwargs)
    ctx.loss_fn(output, ctx.target).backward()
    return output


@dataclass(frozen=True)
class Plan:
    batches: tuple[tuple[tuple[Any, ...], dict[str, Any], Any], ...]
    shard_sizes: tuple[tuple[int, ...], ...]
    step: Any = plain_step
    optimizer: Any = SGD
    seed: int = 0
    item_kinds: tuple[str, ...] = ()
    item_counts: tuple[tuple[int, ...], ...] = ()
    after_backward: Any = None
    same_seed: bool = False


def test_a_shard_is_its_rows_of_every_batched_tensor() -> None:
    x, scale, y, mask = torch.arange(10.0).view(5, 2), torch.tensor(2.0), torch.arange(5), torch.ones(5, 3)
    inputs, target, kwargs = shard_of((x, scale), y, (3, 2), 1, {"mask": mask})
    assert torch.equal(inputs[0], x[3:])
    assert inputs[1] is scale
    assert torch.equal(target, y[3:])
    assert kwargs["mask"].shape == (2, 3)


def test_items_of_gives_every_shards_count_and_this_shards_micro_batches() -> None:
    assert items_of(((2, 1), (3, 0)), 0) == ((3, 3), (2, 1))
    assert items_of((), 1) == ((), ())


def test_a_context_loads_its_shard_and_weights_its_share_of_the_items() -> None:
    ctx = context(mlp(), rank=1, world_size=2, shard_sizes=(3, 2))
    (inputs, kwargs, target), = batches(1, rows=5)
    ctx.load(inputs, target, kwargs, (3, 2))
    assert torch.equal(ctx.inputs[0], inputs[0][3:])
    assert ctx.shard_size == 2
    assert ctx.loss_weight == pytest.approx(2 * 2 / 5)
    ctx.load(inputs, target, kwargs, (3, 2), item_kind="tokens", item_counts=((3, 1), (1,)))
    assert (ctx.items, ctx.total_items, ctx.micro_batch_items) == (1, 5, (1,))
    assert ctx.loss_weight == pytest.approx(1 * 2 / 5)



@pytest.mark.parametrize("weight", [None, 0.5])
def test_backward_forwards_the_shard_and_backwards_its_mean_loss_times_the_weight(weight: float | None) -> None:
    ctx, twin = context(mlp(), rank=1, world_size=2, shard_sizes=(3, 2)), mlp()
    (inputs, kwargs, target), = batches(1, rows=5)
    ctx.load(inputs, target, kwargs, (3, 2))
    output = ctx.backward(ctx.module, weight)
    expected = twin(inputs[0][3:])
    (F.mse_loss(expected, target[3:]) * (1.0 if weight is None else weight)).backward()
    assert torch.equal(output, expected)
    for mine, theirs in zip(ctx.module.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)

@dataclass
class GroupContext(RankContext):
    """Ranks 0-1 share shard 0, ranks 2-3 shard 1 (as tensor-parallel ranks share their
    data-parallel group's shard)."""

    @property
    def shard_index(self) -> int:
        return self.rank // 2


def test_ranks_that_share_a_shard_weigh_it_over_the_shards_not_the_ranks() -> None:
    ctx = GroupContext(3, 4, mlp(), (), None, F.mse_loss, (4, 2), torch.device("cpu"))
    (inputs, kwargs, target), = batches(1)
    ctx.load(inputs, target, kwargs, (4, 2))
    assert torch.equal(ctx.target, target[4:])
    assert ctx.loss_weight == pytest.approx(2 * 2 / 6)


def test_run_step_loads_the_shard_starts_from_the_seed_and_gives_back_the_random_state() -> None:
    def noisy(ctx: RankContext) -> torch.Tensor:
        return ctx.module(*ctx.inputs) + torch.rand(())

    (inputs, _kwargs, target), = batches(1)
    task = RankStepTask(mlp(), inputs, target, F.mse_loss, (4, 2), (noisy,), seed=3)
    ctx = RankContext.for_rank(RankInfo(1, 2, "gloo", "cpu"), mlp(), F.mse_loss, (4, 2))
    first, loss = run_step(ctx, task, noisy)
    assert torch.equal(ctx.target, target[4:])
    torch.rand(5)
    before = torch.get_rng_state()
    second, _ = run_step(ctx, task, noisy)
    assert torch.equal(first, second)
    assert torch.equal(torch.get_rng_state(), before)
    assert loss == pytest.approx(float(F.mse_loss(first, target[4:]).detach()))
    assert run_step(ctx, task, lambda _ctx: None) == (None, None)


def manual_training(module: nn.Module, plan: Plan) -> list[dict[str, torch.Tensor]]:
    optimizer = plan.optimizer(module.parameters())
    history = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(plan.seed)
        for (inputs, _kwargs, target) in plan.batches:
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(module(*inputs), target).backward()
            optimizer.step()
            history.append({name: p.detach().clone() for name, p in module.named_parameters()})
    return history


@pytest.mark.parametrize("after_first_step", [False, True])
def test_train_is_the_textbook_loop_whenever_the_optimizer_is_built(after_first_step: bool) -> None:
    plan = Plan(batches(3), ((6,),) * 3)
    module = mlp()
    trained = train(context(module), plan, optimizer_after_first_step=after_first_step, read_grads=grads_of)
    expected = manual_training(mlp(), plan)
    assert len(trained.params) == len(trained.step_grads) == 3
    for got, want in zip(trained.params, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert isinstance(trained.optimizer, torch.optim.SGD)


def test_train_reads_the_buffers_and_the_optimizer_state_after_every_step() -> None:
    momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    plan = Plan(batches(3), ((6,),) * 3, optimizer=momentum)
    module = nn.Sequential(mlp(), nn.BatchNorm1d(2))
    trained = train(context(module), plan, read_buffers=buffers_of, read_state=optimizer_state_of)
    assert len(trained.buffers) == len(trained.state) == 3
    twin = nn.Sequential(mlp(), nn.BatchNorm1d(2))
    optimizer = momentum(twin.parameters())
    for index, (inputs, _kwargs, target) in enumerate(plan.batches):
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(twin(*inputs), target).backward()
        optimizer.step()
        assert trained.buffers[index]["1.running_mean"].equal(twin[1].running_mean)
        assert trained.buffers[index]["1.num_batches_tracked"].item() == index + 1
        assert trained.state[index]["0.0.weight.momentum_buffer"].equal(optimizer.state[twin[0][0].weight]["momentum_buffer"])
    assert set(trained.state[0]) == {f"{name}.momentum_buffer" for name, _p in module.named_parameters()}


def test_train_gives_each_shard_its_own_random_stream_as_launchers_do() -> None:
    """One seed on every rank gives every rank the same dropout masks; train() starts rank
    r from the stream of its shard, as run_step does, so two ranks draw different numbers
    and a rank draws the same numbers each time it runs."""
    drawn: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def noisy(ctx: RankContext) -> Any:
        drawn[ctx.rank].append(torch.rand(4))
        return plain_step(ctx)

    plan = Plan(batches(2), ((3, 3),) * 2, step=noisy)
    for rank in (0, 1, 0):
        train(context(mlp(), rank, 2, (3, 3)), plan)
    assert not torch.equal(drawn[0][0], drawn[1][0])
    assert torch.equal(torch.stack(drawn[0][:2]), torch.stack(drawn[0][2:]))


def test_train_notes_the_optimizer_step_that_raised() -> None:
    calls = []

    def second_raises(ctx: RankContext) -> None:
        calls.append(ctx.shard_size)
        if len(calls) == 2:
            raise RuntimeError("boom")
        plain_step(ctx)

    with pytest.raises(RuntimeError, match="boom") as raised:
        train(context(mlp()), Plan(batches(3), ((6,),) * 3, step=second_raises))
    assert "dpverify: raised in optimizer step 2 of 3" in raised.value.__notes__


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.b(self.a(x))}


def test_snapshots_are_cpu_copies_and_name_a_tied_parameter_once() -> None:
    module = Tied()
    output = module(torch.ones(2, 3))
    output["out"].sum().backward()
    grads = grads_of(module)
    assert set(grads) == {"a.weight", "a.bias", "b.bias"}
    assert grads["a.weight"] is not module.a.weight.grad
    assert torch.equal(grads["a.weight"], module.a.weight.grad)  # type: ignore[arg-type]
    assert set(buffers_of(module)) == {"count"}
    assert [path for path, _t in outputs_of(output)] == ["output['out']"]
    assert outputs_of(None) == ()


def test_ddp_and_fsdp2_train_to_the_same_parameters(ddp_pool: DDPWorkerPool) -> None:
    data, sizes = batches(3), ((3, 3),) * 3
    ddp = ddp_pool.run(run_training_task, TrainingTask(mlp(), data, F.mse_loss, SGD, sizes, ddp_step))
    fsdp = ddp_pool.run(
        run_fsdp_training_task,
        FSDPTrainingTask(mlp(), data, F.mse_loss, SGD, sizes, fsdp_step, shard_order(["0", "2", ""])),
    )
    assert len(ddp[0].params) == len(fsdp[0].params) == 3
    for rank in range(2):
        for got, want in zip(fsdp[rank].params, ddp[rank].params, strict=True):
            torch.testing.assert_close(got, want)
