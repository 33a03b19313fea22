"""What ``check_model`` lets go between checks: a split's own steps after its last check, a
batch's after its last, and never anything a later check reads (the same comparisons)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpverify.checks.dp import SharedSteps
from dpverify.models.user import builtin_model
from dpverify.planner import check_model, plan_checks
from dpverify.registry import CHECKS, Case, CheckResult, Verdict


class _Centred(nn.Module):
    """Subtracts the mean of the rows it receives: chunk-dependent in its own code, with no
    divergence source, so every gradient fails the tolerance and is replayed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


def _chunk_dependent() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), _Centred(), nn.ReLU(), nn.Linear(8, 3))


def _both(module: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: SharedSteps) -> list[CheckResult]:
    case = Case(module, (x,), y, F.mse_loss, (0, 1, 2), steps=steps)
    return [CHECKS[name].run(case) for name in ("dp-grads", "dp-grad-sum")]


def test_a_split_forgets_what_only_its_checks_use_and_its_checks_come_out_the_same() -> None:
    module = _chunk_dependent()
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    steps = SharedSteps()
    first = _both(module, x, y, steps)
    assert [r.verdict for r in first] == [Verdict.FAIL, Verdict.FAIL]
    assert steps.replays
    assert any(key.divisor != 1 for key, _step in steps.picked)
    assert any(kind.startswith("split ") for kind in steps.steps)  # the split's chunk-by-chunk steps
    batch_steps = {kind: step for kind, step in steps.steps.items() if not kind.startswith("split ")}
    steps.forget_split()
    assert not steps.replays
    assert all(key.divisor == 1 for key, _step in steps.picked)
    assert steps.steps == batch_steps  # the batch's own steps stay for its other splits
    held = {id(t) for t in steps.picked.values()}
    assert all(id(t) in held for entry in steps.derived.values() for t in entry[:4] if t is not None)
    again = _both(module, x, y, steps)
    assert [r.verdict for r in again] == [r.verdict for r in first]
    assert [r.tensors for r in again] == [r.tensors for r in first]
    assert steps.replays  # made again where needed


def test_check_model_forgets_each_split_after_its_last_check_and_releases_each_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = builtin_model("mlp")
    plan = plan_checks(model, batch_sizes=(8, 5), device_counts=(2, 3), checks=("dp-grads", "dp-grad-sum"))
    calls: list[tuple[str, int, Any]] = []
    seen: list[int] = []
    for name in ("forget_split", "release"):
        real = getattr(SharedSteps, name)

        def spy(self: SharedSteps, _name: str = name, _real: Any = real) -> None:
            calls.append((_name, len(seen), id(self)))
            _real(self)

        monkeypatch.setattr(SharedSteps, name, spy)
    report = check_model(model, plan=plan, on_result=lambda result: seen.append(1))
    assert report.count(Verdict.PASS) == len(plan) == 8
    batch = {8: id(plan[0].case.steps), 5: id(plan[4].case.steps)}
    # two checks a split, two splits a batch: forgotten after the first split, released after the second
    assert calls == [("forget_split", 2, batch[8]), ("release", 4, batch[8]), ("forget_split", 6, batch[5]), ("release", 8, batch[5])]
