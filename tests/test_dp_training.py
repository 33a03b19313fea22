"""DataParallel training against single-device training: the user's optimizer and hook over
several steps, state a forward carries to the next (lost on the replicas), and buffers
compared with the full-batch update, each in user code written with the bug and without."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify import CHECKS, Case, Target, Verdict

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.05)


def _batches(steps: int = 3, rows: int = 8, features: int = 4, outputs: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, features, generator=g), torch.randn(rows, outputs, generator=g)) for _ in range(steps)]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


# --- user models ------------------------------------------------------------------------------


class WarmupHead(nn.Module):
    """A step-dependent warm-up written inside forward: counts its calls in an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        warmup = min(1.0, self.step / 5)
        out: torch.Tensor = self.fc(x) * warmup
        return out


class BufferedWarmupHead(nn.Module):
    """The fix: the count in a buffer updated in place (replica 0 updates the module's own)."""

    step: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        warmup = min(1.0, int(self.step) / 5)
        out: torch.Tensor = self.fc(x) * warmup
        return out


class CachesInput(nn.Module):
    """Keeps the last input for a later look (an attribute set in forward, not used by it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.last_input: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_input = x.detach()
        out: torch.Tensor = self.fc(x)
        return out


class FeatureStats(nn.Module):
    """Tracks an EMA of the batch mean of its inputs in a buffer, from the rows it sees."""

    feature_mean: torch.Tensor

    def __init__(self, in_forward: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.in_forward = in_forward
        self.register_buffer("feature_mean", torch.zeros(4))

    def update(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            self.feature_mean.mul_(0.9).add_(0.1 * x.mean(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_forward:
            self.update(x)
        out: torch.Tensor = self.fc(x)
        return out


def update_stats_on_the_full_batch(ctx: Any) -> None:
    """The fix for ``FeatureStats``: the statistic updated outside the DataParallel forward,
    from the full batch (``ctx.inputs``), in the training step."""
    ctx.module.update(ctx.inputs[0])


def clip(ctx: Any) -> None:
    torch.nn.utils.clip_grad_norm_(ctx.module.parameters(), max_norm=0.05)


# --- correct training passes ----------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_correct_training_passes_with_the_users_optimizer(optimizer: Any) -> None:
    result = dpverify.assert_dp_training_matches(_mlp(), _batches(), loss_fn=F.mse_loss, optimizer=optimizer, device_ids=[0, 1, 2])
    assert result.ok
    assert result.replicas == 3  # every step ran three replica forwards
    kinds = {t.id.kind for t in result.tensors}
    assert {"output", "loss", "param"} <= kinds
    state = "optimizer momentum_buffer" if optimizer is SGD else "optimizer exp_avg"
    assert state in kinds  # the optimizer's state is compared too
    assert all(t.id.variant == "step 3" for t in result.tensors)  # the last step's table


def test_the_module_is_left_untouched() -> None:
    model = WarmupHead()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dpverify.ParallelMismatch):
        dpverify.assert_dp_training_matches(model, _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1])
    assert model.step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_clip_hook_runs_in_both_runs_and_passes() -> None:
    seen: list[tuple[bool, int, int, bool]] = []

    def recording_clip(ctx: Any) -> None:
        seen.append((ctx.reference, ctx.world_size, ctx.step_index, ctx.group is not None))
        clip(ctx)

    result = dpverify.assert_dp_training_matches(
        _mlp(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1], after_backward=recording_clip,
    )
    assert result.ok
    # the DataParallel run (reference False) and the float32 and float64 references
    assert sorted(seen) == sorted([(False, 1, i, True) for i in range(3)] + [(True, 1, i, True) for i in range(3)] * 2)
    assert any("recording_clip" in note for note in result.notes)


def test_the_three_runs_share_one_group_of_this_process_alone() -> None:
    import torch.distributed as dist

    groups: list[Any] = []

    def all_reducing_clip(ctx: Any) -> None:
        # a hook may all-reduce over ctx.group; on a group of one rank that changes nothing
        for p in ctx.module.parameters():
            dist.all_reduce(p.grad, group=ctx.group)
        groups.append(ctx.group)
        assert dist.get_world_size(ctx.group) == 1
        clip(ctx)

    result = dpverify.assert_dp_training_matches(
        _mlp(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1], after_backward=all_reducing_clip,
    )
    assert result.ok
    # one group made for the check (a gloo group costs ~10 ms to tear down), used by every
    # step of the DataParallel run and of both references, and gone afterwards
    assert len(groups) == 9
    assert all(group is groups[0] for group in groups)
    assert not dist.is_initialized()


def test_checks_share_the_group_a_block_holds_and_only_there() -> None:
    import torch.distributed as dist

    from dpverify.ranked.rank import one_rank_group_held

    groups: list[Any] = []

    def recording_clip(ctx: Any) -> None:
        groups.append(ctx.group)
        clip(ctx)

    def check() -> None:
        dpverify.assert_dp_training_matches(
            _mlp(), _batches(2), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1], after_backward=recording_clip,
        )

    with one_rank_group_held():
        assert not dist.is_initialized()  # made on first use
        check()
        check()
        assert dist.is_initialized()
    held, groups[:] = list(groups), []
    assert len(held) == 12
    assert all(group is held[0] for group in held)
    assert not dist.is_initialized()
    # outside a block, a group per check
    check()
    check()
    assert groups[0] is not groups[-1]
    assert not dist.is_initialized()


def test_a_hook_that_only_clips_under_data_parallel_is_caught_at_step_one() -> None:
    def clip_on_gpus_only(ctx: Any) -> None:
        if not ctx.reference:
            clip(ctx)

    with pytest.raises(dpverify.ParallelMismatch, match=r"The first step that differs: step 1 of 3 \(tensors from step 1\)") as caught:
        dpverify.assert_dp_training_matches(
            _mlp(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1], after_backward=clip_on_gpus_only,
        )
    assert "step 1 param" in str(caught.value)


# --- state carried across forwards ------------------------------------------------------------


def test_a_lost_counter_is_caught_naming_the_attribute_and_the_step_outputs_diverge() -> None:
    batches = _batches()
    # one step on deep copies sees nothing: both count one call
    assert dpverify.assert_dp_grads_match(WarmupHead(), *batches[0], loss_fn=F.mse_loss, device_ids=[0, 1]).ok
    with pytest.raises(dpverify.ParallelMismatch) as caught:
        dpverify.assert_dp_training_matches(WarmupHead(), batches, loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1])
    text = str(caught.value)
    assert "The replicas' attribute changes are lost" in text
    assert "attribute 'step' of the root module (WarmupHead): 0 under DataParallel, 1 on one device, after step 1" in text
    assert "; 0 and 3 after the last (under DataParallel it kept its value from before training)" in text
    assert "The outputs first diverge at step 2." in text
    assert "The first step that differs: step 1 of 3 (attributes from step 1, tensors from step 2)." in text
    assert "step 2 output" in text


def test_the_counter_kept_in_a_buffer_passes() -> None:
    result = dpverify.assert_dp_training_matches(BufferedWarmupHead(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1])
    assert result.ok
    assert "buffer" in {t.id.kind for t in result.tensors}


def test_a_cache_set_in_forward_is_caught_though_the_outputs_match() -> None:
    with pytest.raises(dpverify.ParallelMismatch, match="attribute 'last_input'") as caught:
        dpverify.assert_dp_training_matches(CachesInput(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1])
    text = str(caught.value)
    assert "None under DataParallel" in text
    assert "The outputs, parameters, buffers and optimizer state match here" in text
    assert all(t.ok for t in caught.value.report.tensors)


class LogsChunkSizes(nn.Module):
    """Appends each call's batch size to a list kept on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        out: torch.Tensor = self.fc(x)
        return out


def test_a_list_every_replica_appends_to_is_caught_with_what_each_appended() -> None:
    with pytest.raises(dpverify.ParallelMismatch, match=r"attribute 'seen' of the root module \(LogsChunkSizes\): \(4, 4\) under DataParallel, \(8,\) on one device") as caught:
        dpverify.assert_dp_training_matches(LogsChunkSizes(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1])
    assert "every replica changes the same object, once per replica" in str(caught.value)


def test_a_lost_attribute_in_a_submodule_names_the_submodule() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), WarmupHead())
    with pytest.raises(dpverify.ParallelMismatch, match=r"attribute 'step' of module '1' \(WarmupHead\)"):
        dpverify.assert_dp_training_matches(model, _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1])


# --- buffers against the full-batch update ----------------------------------------------------


def test_an_ema_of_the_local_chunk_is_caught_with_replica_zeros_evidence() -> None:
    with pytest.raises(dpverify.ParallelMismatch) as caught:
        dpverify.assert_dp_training_matches(FeatureStats(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1])
    text = str(caught.value)
    assert "step 1 buffer 'feature_mean'" in text
    assert "DataParallel keeps replica 0's buffers" in text
    assert "(4 rows of 8)" in text
    assert "Here it equals the update from replica 0's chunk alone." in text


def test_the_ema_updated_on_the_full_batch_outside_forward_passes() -> None:
    result = dpverify.assert_dp_training_matches(
        FeatureStats(in_forward=False), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1],
        after_backward=update_stats_on_the_full_batch,
    )
    assert result.ok
    ema = next(t for t in result.tensors if t.id.kind == "buffer")
    assert ema.name == "step 3 buffer 'feature_mean'"


def test_the_buffer_check_names_a_local_ema_and_fails_on_it_with_full_batch() -> None:
    x = _batches()[0][0]
    result = dpverify.assert_dp_buffers_match(FeatureStats(), x, device_ids=[0, 1])  # torch's semantics hold
    assert any("Buffers 'feature_mean' differ from the single-device full-batch update" in n for n in result.notes)
    with pytest.raises(dpverify.ParallelMismatch, match="full batch buffer 'feature_mean': tensors are not close"):
        dpverify.assert_dp_buffers_match(FeatureStats(), x, device_ids=[0, 1], full_batch=True)
    assert dpverify.assert_dp_buffers_match(FeatureStats(in_forward=False), x, device_ids=[0, 1], full_batch=True).ok


def test_train_mode_batchnorm_stays_explained_in_the_buffer_check() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    result = dpverify.assert_dp_buffers_match(model, _batches()[0][0], device_ids=[0, 1], full_batch=True)
    assert result.ok
    assert any(n.startswith("BatchNorm '1' in train mode: its running statistics follow replica 0's chunk") for n in result.notes)


# --- the registry -----------------------------------------------------------------------------


def _case(module: nn.Module, devices: int = 2) -> Case:
    x, y = _batches(steps=1)[0]
    return Case(module, (x,), y, F.mse_loss, tuple(range(devices)))


def test_the_registry_check_runs_the_targets_hook_and_explains_batchnorm() -> None:
    assert CHECKS["dp-training"].run(_case(_mlp()), Target(after_backward=clip)).verdict is Verdict.PASS
    lost = CHECKS["dp-training"].run(_case(WarmupHead()))
    assert lost.verdict is Verdict.FAIL
    assert "attribute changes are lost" in lost.detail
    torch.manual_seed(0)
    normed = CHECKS["dp-training"].run(_case(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))))
    assert normed.verdict is Verdict.EXPLAINED


class AveragingDataParallel(nn.DataParallel):  # type: ignore[type-arg]
    """A user's DataParallel that "averages the GPUs' gradients" on top of torch's sum."""

    def replicate(self, module: nn.Module, device_ids: Any) -> Any:
        replicas = super().replicate(module, device_ids)
        count = len(replicas)
        for replica in replicas:
            for sub in replica.modules():
                for name in getattr(sub, "_former_parameters", {}):
                    getattr(sub, name).register_hook(lambda g: g / count)
        return replicas


def test_a_users_wrapper_is_trained_as_given_and_caught_at_its_first_step() -> None:
    with pytest.raises(dpverify.ParallelMismatch, match="The first step that differs: step 1 of 3") as caught:
        dpverify.assert_dp_training_matches(_mlp(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1], parallel=AveragingDataParallel)
    assert "wrapper AveragingDataParallel" in str(caught.value)
    assert "step 1 param" in str(caught.value)
    assert dpverify.assert_dp_training_matches(_mlp(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1], parallel=nn.DataParallel).ok


def test_a_wrapper_that_never_splits_is_never_a_pass() -> None:
    def whole_batch(module: nn.Module, device_ids: list[int], output_device: int | None = None) -> nn.Module:
        return module

    with pytest.raises(dpverify.ParallelMismatch, match="nothing ran in parallel"):
        dpverify.assert_dp_training_matches(_mlp(), _batches(), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1], parallel=whole_batch)


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"optimizer": torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)}, r"optimizer is a SGD instance, .* pass a factory params -> Optimizer"),
        ({"optimizer": "sgd"}, r"optimizer='sgd' is not callable; pass a factory params -> Optimizer"),
        ({"batches": []}, r"batches=\[\]: pass a non-empty list of \(inputs, target\) pairs"),
        ({"after_backward": "clip"}, r"after_backward='clip' is not callable; pass hook\(ctx\)"),
        ({"batches": [(torch.randn(8, 4),)]}, r"batches\[0\] is not an \(inputs, target\) pair"),
        ({"batches": [(torch.randn(8, 4), torch.randn(6, 3))]}, r"batches\[0\] target"),
    ],
    ids=["optimizer-instance", "optimizer-name", "empty-batches", "hook-not-callable", "no-target", "target-rows"],
)
def test_bad_input_is_an_invalid_argument_naming_it(changes: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"batches": _batches(), "optimizer": SGD} | changes
    with pytest.raises(dpverify.InvalidArgument, match=message):
        dpverify.assert_dp_training_matches(_mlp(), arguments.pop("batches"), loss_fn=F.mse_loss, device_ids=[0, 1], **arguments)


def test_a_model_criterion_pair_trains_through_its_criterion_wrapper() -> None:
    """A pair's model wrapper leaves one output per replica and its criterion wrapper makes
    the loss: the training check takes the loss from ``parallel_loss_fn`` (the outputs are
    not gathered, so they are not compared), and catches a criterion that averages the
    replicas' mean losses over uneven chunks."""
    from dpverify.mutants import (
        MeanCriterionParallel,
        ReplicaOutputsDataParallel,
        WeightedCriterionParallel,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    batches = [(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(2)]
    train = functools.partial(
        dpverify.assert_dp_training_matches, model, batches, loss_fn=F.mse_loss, device_ids=[0, 1, 2],
        optimizer=functools.partial(torch.optim.SGD, lr=0.1), parallel=ReplicaOutputsDataParallel,
    )
    train(parallel_loss_fn=WeightedCriterionParallel)
    with pytest.raises(dpverify.ParallelMismatch, match="step 1 loss"):
        train(parallel_loss_fn=MeanCriterionParallel)
