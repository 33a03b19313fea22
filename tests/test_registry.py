"""The check registry: one result type, one verdict, structured diagnoses, and the table of
checks in docs/checks.md read off it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify import CHECKS, Case, Target, Verdict
from dpverify.models.builtin import builtin_case
from dpverify.mutants import AveragingDataParallel, DeepCopyDataParallel, mean_of_replica_losses

CHECKS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "checks.md"


def _mlp_case(rows: int = 5, devices: int = 4) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    return Case(model, (torch.randn(rows, 6),), torch.randn(rows, 2), F.mse_loss, tuple(range(devices)))


class _SumLossHead(nn.Module):
    """Returns each chunk's summed loss: not a per-row mean."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = self.body(x).squeeze(-1)
        return prediction, F.mse_loss(prediction, y, reduction="sum")


def test_a_correct_step_passes_with_its_evidence() -> None:
    result = CHECKS["dp-grads"].run(_mlp_case())
    assert result.verdict is Verdict.PASS
    assert result.check == "dp-grads"
    assert result.split == dpverify.Split(5, 4)
    assert len(result.tensors) >= 4  # outputs, loss and every gradient were compared
    assert result.summary.startswith("worst at ")


def test_the_uniform_factor_is_a_field_not_a_sentence() -> None:
    result = CHECKS["dp-grads"].run(_mlp_case(), Target(parallel=AveragingDataParallel))
    assert result.verdict is Verdict.FAIL
    assert result.scale == pytest.approx(1 / 3, rel=1e-4)  # 3 replicas used for chunks [2, 2, 1]
    assert isinstance(result.error, dpverify.ParallelMismatch)
    assert result.worst is not None
    assert result.worst.name.startswith("grad ")


def test_check_raises_what_run_reports() -> None:
    with pytest.raises(dpverify.ParallelMismatch, match="No gradient reached"):
        CHECKS["dp-grads"].check(_mlp_case(), Target(parallel=DeepCopyDataParallel))
    result = CHECKS["dp-grads"].run(_mlp_case(), Target(parallel=DeepCopyDataParallel))
    assert result.verdict is Verdict.FAIL
    assert "No gradient reached" in result.detail


class _Exits(nn.Module):
    def __init__(self, module: nn.Module, device_ids: list[int], output_device: int | None = None) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise SystemExit(0)


def test_code_that_exits_fails_the_check_and_is_never_a_pass() -> None:
    result = CHECKS["dp-grads"].run(_mlp_case(), Target(parallel=_Exits))
    assert result.verdict is Verdict.FAIL
    assert isinstance(result.error, SystemExit)
    assert result.summary.startswith("SystemExit(0): the code under test called sys.exit()")


def test_an_unusable_case_is_an_invalid_argument_not_a_verdict() -> None:
    frozen = _mlp_case()
    frozen.module.requires_grad_(False)
    with pytest.raises(dpverify.InvalidArgument, match="requires"):
        CHECKS["dp-grads"].run(frozen)
    with pytest.raises(dpverify.InvalidArgument, match="'dp-loss-average' cannot run here"):
        CHECKS["dp-loss-average"].check(_mlp_case())  # this forward does not return a loss


def test_train_mode_batchnorm_is_explained_with_its_modules_and_exact_in_eval_mode() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    case = Case(model, (torch.randn(8, 4),), torch.randn(8, 2), F.mse_loss, (0, 1))
    result = CHECKS["dp-grads"].run(case)
    assert result.verdict is Verdict.EXPLAINED
    assert [g.module_type for g in result.groups] == ["BatchNorm1d"]
    assert CHECKS["dp-grads"].run(case.in_eval_mode(), eval_copy=True).verdict is Verdict.PASS
    assert model.training  # the case's module is left as it was


@pytest.mark.parametrize(("rows", "verdict"), [(8, Verdict.PASS), (5, Verdict.WARN)])
def test_loss_mean_of_per_row_means_is_biased_exactly_on_uneven_chunks(rows: int, verdict: Verdict) -> None:
    built = builtin_case("loss-in-forward", batch=rows)
    case = Case(built.module, built.inputs, device_ids=(0, 1, 2, 3), per_row_mean_loss=True)
    result = CHECKS["dp-loss-average"].run(case)
    assert result.verdict is verdict
    assert result.chunks == ((2, 2, 2, 2) if rows == 8 else (2, 2, 1))
    assert result.bias is not None
    assert (abs(result.bias) > 1e-3) == (verdict is Verdict.WARN)


def test_a_loss_that_is_not_a_per_row_mean_warns_for_a_user_and_fails_a_known_model() -> None:
    torch.manual_seed(0)
    inputs = (torch.randn(8, 3), torch.randn(8))
    user = Case(_SumLossHead(), inputs, device_ids=(0, 1))
    result = CHECKS["dp-loss-average"].run(user)
    assert result.verdict is Verdict.WARN  # equal chunks, yet loss.mean() of sums is off
    assert "not per-row means" in result.summary
    known = Case(_SumLossHead(), inputs, device_ids=(0, 1), per_row_mean_loss=True)
    assert CHECKS["dp-loss-average"].run(known).verdict is Verdict.FAIL


def test_a_reduction_under_test_is_a_target() -> None:
    built = builtin_case("loss-in-forward", batch=5)
    case = Case(built.module, built.inputs, device_ids=(0, 1, 2, 3))
    assert CHECKS["dp-weighted-loss"].run(case).verdict is Verdict.PASS
    wrong = CHECKS["dp-weighted-loss"].run(case, Target(reduce=mean_of_replica_losses))
    assert wrong.verdict is Verdict.FAIL


def test_ddp_checks_say_why_they_skip() -> None:
    built = builtin_case("loss-in-forward", batch=4)
    returns_loss = Case(built.module, built.inputs, device_ids=(0, 1))
    result = CHECKS["ddp-grads"].run(returns_loss)
    assert result.verdict is Verdict.SKIP
    assert result.summary == "needs loss_fn(output, target); this forward returns its loss"
    few = CHECKS["ddp-accumulation"].run(_mlp_case(rows=3, devices=2))
    assert few.verdict is Verdict.SKIP
    assert few.summary == "fewer rows than 2 per rank (3 < 4)"


def test_every_check_has_a_unique_name_title_and_statement() -> None:
    assert all(name == spec.name for name, spec in CHECKS.items())
    assert len({spec.title for spec in CHECKS.values()}) == len(CHECKS)
    assert all(spec.backend in ("dp", "ddp", "fsdp", "tp", "pp") and spec.statement.endswith(".") for spec in CHECKS.values())


def test_the_checks_page_lists_every_check_as_the_registry_defines_it() -> None:
    text = CHECKS_PAGE.read_text()
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| (dp|ddp|fsdp|tp|pp) \| (.+?) \| (.+?) \|$", text, flags=re.MULTILINE)
    assert {name: (backend, title, statement) for name, backend, title, statement in rows} == {
        spec.name: (spec.backend, spec.title, spec.statement) for spec in CHECKS.values()
    }


def test_the_checks_page_registry_example_runs() -> None:
    text = CHECKS_PAGE.read_text()
    section = text.split("## Running a check by name", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/checks.md", "exec"), {})
