"""The parent-side pieces the sharded checks share (``dpverify.ranked.sharded``), without ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpverify.ranked.items import PieceItems
from dpverify.ranked.sharded import module_paths, send_steps, trap_text
from dpverify.sharded.fsdp import FSDPCheck, fsdp_step, weighted_fsdp_step
from dpverify.sharded.fsdp_rank import FSDPRankStep, FSDPStepTask


def _check() -> FSDPCheck:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    return FSDPCheck.of(module, torch.randn(5, 3), torch.randn(5, 1), F.mse_loss, 2, {"shards": [3, 2]})


def test_module_paths_lists_every_submodule_or_says_there_is_none() -> None:
    assert module_paths(nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.Tanh()))) == "'0', '1', '1.0'"
    assert module_paths(nn.Linear(1, 1)) == "(none: the module has no submodule)"


def test_send_steps_verifies_the_weighted_step_beside_the_plain_one_on_uneven_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[FSDPStepTask] = []

    def send(self: FSDPCheck, fn: object, task: FSDPStepTask, what: str) -> tuple[tuple[str, ...], ...]:
        sent.append(task)
        return tuple(tuple(f"rank {r} {step.__name__}" for step in task.steps) for r in range(2))

    monkeypatch.setattr(FSDPCheck, "send", send)
    check = _check()
    counted, chosen, verified, naive = send_steps(
        check, None, fsdp_step, weighted_fsdp_step, print, "title", FSDPStepTask, shard_modules=check.shard_modules,
    )
    assert (counted.kind, counted.unequal_ranks, chosen) == ("rows", True, weighted_fsdp_step)
    assert verified == ["rank 0 weighted_fsdp_step", "rank 1 weighted_fsdp_step"]
    assert naive == ["rank 0 fsdp_step", "rank 1 fsdp_step"]
    assert sent[0].shard_sizes == (3, 2)
    assert sent[0].shard_modules == check.shard_modules
    assert (sent[0].item_kind, sent[0].item_counts) == ("rows", ())
    _c, chosen, verified, naive = send_steps(check, fsdp_step, fsdp_step, weighted_fsdp_step, print, "title", FSDPStepTask, shard_modules=())
    assert (chosen, naive, sent[1].steps) == (fsdp_step, ["rank 0 fsdp_step", "rank 1 fsdp_step"], (fsdp_step, fsdp_step))


def test_trap_text_words_a_row_mean_trap_with_the_backend_names() -> None:
    check = _check()
    rows = PieceItems("rows", ((3,), (2,)), ((3,), (2,)))
    reference = check.reference(None)
    naive = [FSDPRankStep(dict(reference.grads), (), None, {}, True, None) for _ in range(2)]
    text = trap_text(check, rows, naive, reference, "ignored for rows: ", averages="X averages", plain="p_step", weighted="w_step")
    assert text.startswith("Uneven shards [3, 2]: X averages")
    assert "(ctx.loss_weight; w_step)" in text
    assert "ignored for rows" not in text
