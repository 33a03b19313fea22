"""The parent-side pieces the sharded checks share (``dpverify.ranked.sharded``), without ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpverify.ranked.items import PieceItems
from dpverify.ranked.sharded import module_paths, step_task, trap_text
from dpverify.sharded.fsdp import FSDPCheck, fsdp_step
from dpverify.sharded.fsdp_rank import FSDPRankStep, FSDPStepTask


def _check() -> FSDPCheck:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    return FSDPCheck.of(module, torch.randn(5, 3), torch.randn(5, 1), F.mse_loss, 2, {"shards": [3, 2]})


def test_module_paths_lists_every_submodule_or_says_there_is_none() -> None:
    assert module_paths(nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.Tanh()))) == "'0', '1', '1.0'"
    assert module_paths(nn.Linear(1, 1)) == "(none: the module has no submodule)"


def test_step_task_carries_the_batch_the_steps_and_only_token_counts() -> None:
    check = _check()
    rows = PieceItems("rows", ((3,), (2,)), ((3,), (2,)))
    task = step_task(FSDPStepTask, check, [fsdp_step], rows, shard_modules=check.shard_modules)
    assert task.steps == (fsdp_step,)
    assert task.shard_sizes == (3, 2)
    assert task.shard_modules == check.shard_modules
    assert (task.item_kind, task.item_counts) == ("rows", ())


def test_trap_text_words_a_row_mean_trap_with_the_backend_names() -> None:
    check = _check()
    rows = PieceItems("rows", ((3,), (2,)), ((3,), (2,)))
    reference = check.reference(None)
    naive = [FSDPRankStep(dict(reference.grads), (), None, {}, True, None) for _ in range(2)]
    text = trap_text(check, rows, naive, reference, "ignored for rows: ", averages="X averages", plain="p_step", weighted="w_step")
    assert text.startswith("Uneven shards [3, 2]: X averages")
    assert "(ctx.loss_weight; w_step)" in text
    assert "ignored for rows" not in text
