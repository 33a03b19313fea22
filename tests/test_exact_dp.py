"""Exact mode of the DataParallel helpers: models of the exact set pass bit for bit on
uneven chunks, a one-ulp error in one element of one reduced gradient fails (where the
default tolerance cannot see it), and what cannot be made exact is refused by name."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_assertions import _count_steps
from torch import nn

import dpverify
from dpverify import CHECKS, Case, InvalidArgument, ParallelMismatch, StepComparison
from dpverify.checks import dp as _dp
from dpverify.checks import training as _training
from dpverify.checks.dp import SharedSteps
from dpverify.mutants import ReplicaOutputsDataParallel, WeightedCriterionParallel

SGD = functools.partial(torch.optim.SGD, lr=2**-3)
HELPERS = (dpverify.assert_dp_grads_match, dpverify.assert_grad_sum_equals_mean_loss_grad)


def sum_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).sum()


# --- models of the exact set ----------------------------------------------------------------


class ConvNet(nn.Module):
    """Conv2d, LeakyReLU(0.25), MaxPool2d, AvgPool2d(2) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.act = nn.LeakyReLU(0.25)
        self.max = nn.MaxPool2d(2)
        self.avg = nn.AvgPool2d(2)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.avg(self.max(self.act(self.conv(x)))).flatten(1))
        return out


class ResidualCat(nn.Module):
    """A residual add and a concatenation of the block's output with its input."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.block(x)) + x
        out: torch.Tensor = self.head(torch.cat([hidden, x], dim=1))
        return out


class Bag(nn.Module):
    """An Embedding summed over the tokens of each row."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(tokens).sum(1))
        return out


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _case(name: str, rows: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    target = torch.randn(rows, 2)
    if name == "mlp-mse":
        return _mlp(), torch.randn(rows, 4), target, F.mse_loss
    if name == "conv-l1":
        return ConvNet(), torch.randn(rows, 2, 4, 4), target, F.l1_loss
    if name == "residual-cat-sum":
        return ResidualCat(), torch.randn(rows, 4), target, sum_loss
    return Bag(), torch.randint(0, 10, (rows, 3)), target, sum_loss


# Uneven chunks: 8 rows on 3 devices are [3, 3, 2] (a mean over 16 outputs stays a power of
# two); a sum loss takes 7 rows on 2 devices, [4, 3].
CASES = [
    ("mlp-mse", 8, [0, 1, 2], [3, 3, 2]), ("conv-l1", 8, [0, 1, 2], [3, 3, 2]),
    ("residual-cat-sum", 7, [0, 1], [4, 3]), ("embedding-sum", 7, [0, 1], [4, 3]),
]


@pytest.mark.parametrize(("name", "rows", "ids", "chunks"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("helper", HELPERS, ids=["grads", "grad-sum"])
def test_exact_set_models_pass_bit_for_bit_on_uneven_chunks(helper: Any, name: str, rows: int, ids: list[int], chunks: list[int]) -> None:
    module, x, y, loss_fn = _case(name, rows)
    result = helper(module, x, y, loss_fn=loss_fn, device_ids=ids, exact=True)
    assert result.ok
    assert f"chunk sizes {chunks}" in result.scenario
    assert all(t.max_abs == 0 for t in result.tensors)
    assert "none: every element must be equal" in result.tolerance
    note = next(n for n in result.notes if n.startswith("Exact: every one of"))
    assert "bit-identical with the batch reversed" in note
    assert "give the full batch's gradients bit for bit" in note
    assert str(result).startswith(f"{result.check}: passed (")
    assert "every element equal to the single-device one: no tolerance" in str(result)


# --- one ulp ----------------------------------------------------------------------------------


def _nudging(where: Callable[[torch.Tensor], None]) -> type[nn.DataParallel[Any]]:
    """A DataParallel that moves its module's first parameter's reduced gradient by one ulp
    (``where`` changes it in place), after the replicas' gradients are summed into it."""

    class Nudging(nn.DataParallel):  # type: ignore[type-arg]
        def __init__(self, module: nn.Module, **kwargs: Any) -> None:
            super().__init__(module, **kwargs)

            def nudge(param: torch.Tensor) -> None:
                assert param.grad is not None
                with torch.no_grad():
                    where(param.grad)

            next(module.parameters()).register_post_accumulate_grad_hook(nudge)

    return Nudging


def _up(tensor: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(tensor, torch.full_like(tensor, torch.inf))


def _one_element(grad: torch.Tensor) -> None:
    flat = grad.view(-1)
    flat[5] = _up(flat[5])


def _whole_tensor(grad: torch.Tensor) -> None:
    grad.copy_(_up(grad))


@pytest.mark.parametrize("nudge", [_one_element, _whole_tensor], ids=["one-element", "whole-tensor"])
@pytest.mark.parametrize("helper", HELPERS, ids=["grads", "grad-sum"])
def test_one_ulp_is_caught_exactly_and_missed_by_the_tolerance(helper: Any, nudge: Callable[[torch.Tensor], None]) -> None:
    module, x, y, loss_fn = _case("mlp-mse", 8)
    wrapper = _nudging(nudge)
    assert helper(module, x, y, loss_fn=loss_fn, device_ids=[0, 1, 2], parallel=wrapper).ok  # the tolerance misses it
    with pytest.raises(ParallelMismatch) as caught:
        helper(module, x, y, loss_fn=loss_fn, device_ids=[0, 1, 2], parallel=wrapper, exact=True)
    report = caught.value.report
    assert isinstance(report, StepComparison)
    bad = [t for t in report.tensors if not t.ok]
    assert {t.id.name for t in bad} == {"0.weight"}
    assert {t.mismatched for t in bad} == ({1} if nudge is _one_element else {32})
    assert {t.max_ulps for t in bad} == {1.0}
    if nudge is _one_element:
        assert "Bit for bit: 1 of the 32 elements differs; the greatest differs by 1 ulp at index (1, 1)" in str(caught.value)


def test_a_failing_exact_check_runs_no_second_look(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    module, x, y, loss_fn = _case("mlp-mse", 8)
    with pytest.raises(ParallelMismatch):
        dpverify.assert_dp_grads_match(module, x, y, loss_fn=loss_fn, device_ids=[0, 1, 2], parallel=_nudging(_one_element), exact=True)
    # the parallel step and the single-device one: no float64 anchor, probe, jitter, split or settle sample
    assert counts == {"parallel": 1, "None": 1}


@pytest.mark.parametrize("helper", HELPERS, ids=["grads", "grad-sum"])
def test_a_criterion_pair_runs_exact_where_its_chunk_losses_are(helper: Any) -> None:
    module, x, y, loss_fn = _case("mlp-mse", 8)
    pair: dict[str, Any] = {"parallel": ReplicaOutputsDataParallel, "parallel_loss_fn": WeightedCriterionParallel, "exact": True}
    result = helper(module, x, y, loss_fn=loss_fn, device_ids=[0, 1], **pair)  # chunks [4, 4]: means over 8 outputs
    assert result.ok
    assert "no tolerance" in str(result)
    # chunks [3, 3, 2]: each replica's mean over 6 outputs rounds, which a correct pair would
    # show as a mismatch; it is refused instead
    with pytest.raises(InvalidArgument, match=r"in the loss of piece 0 of 3 \(rows 0:3 of the batch\) .*divides by 6.*with parallel_loss_fn, loss_fn runs on each replica's chunk"):
        helper(module, x, y, loss_fn=loss_fn, device_ids=[0, 1, 2], **pair)


def test_checks_grouped_on_one_batch_prove_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    proofs: list[tuple[int, ...]] = []
    real = _dp.prove

    def counting(*args: Any, **kwargs: Any) -> Any:
        proofs.append(tuple(kwargs["pieces"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(_dp, "prove", counting)
    module, x, y, loss_fn = _case("mlp-mse", 8)
    shared = SharedSteps()
    for ids in ([0, 1, 2], [0, 1, 2], [0, 1]):
        for name in ("dp-grads", "dp-grad-sum"):
            assert CHECKS[name].check(Case(module, (x,), y, loss_fn, tuple(ids), steps=shared, exact=True)).ok
    assert proofs == [(3, 3, 2), (4, 4)]  # once per split


def test_the_registry_runs_exact_mode_from_the_case() -> None:
    module, x, y, loss_fn = _case("residual-cat-sum", 7)
    for name in ("dp-grads", "dp-grad-sum"):
        report = CHECKS[name].check(Case(module, (x,), y, loss_fn, (0, 1), exact=True))
        assert isinstance(report, StepComparison)
        assert report.tolerance.startswith("none")
        assert any(note.startswith("Exact: ") for note in report.notes)
    with pytest.raises(InvalidArgument, match=r"aten\.tanh"):
        CHECKS["dp-grads"].check(Case(nn.Sequential(nn.Linear(4, 2), nn.Tanh()), (x,), y, loss_fn, (0, 1), exact=True))


# --- refusals ---------------------------------------------------------------------------------


def _mean_rows(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).abs().sum(1).mean()


REFUSALS = [
    ("tanh", nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), 8, F.mse_loss, r"aten\.tanh in the forward of module '1' \(Tanh\)"),
    ("cross-entropy", _mlp(), 8, "ce", r"aten\._log_softmax in the loss"),
    ("mean-over-12-rows", _mlp(), 12, _mean_rows, r"aten\.mean in the loss cannot be exact: .*divides by 12"),
]


@pytest.mark.parametrize(("module", "rows", "loss_fn", "match"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
@pytest.mark.parametrize("helper", HELPERS, ids=["grads", "grad-sum"])
def test_what_cannot_be_exact_is_refused_by_name(helper: Any, module: nn.Module, rows: int, loss_fn: Any, match: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, 4)
    y: torch.Tensor = torch.randint(0, 2, (rows,)) if loss_fn == "ce" else torch.randn(rows, 2)
    with pytest.raises(InvalidArgument, match=rf"^exact=True: {match}") as refused:
        helper(module, x, y, loss_fn=F.cross_entropy if loss_fn == "ce" else loss_fn, device_ids=[0, 1], exact=True)
    assert "check without exact=True" in str(refused.value) or "power of two" in str(refused.value)


@pytest.mark.parametrize(
    ("options", "match"),
    [({"rtol": 1e-5, "atol": 1e-6}, r"exact=True with rtol=1e-05, atol=1e-06: .*not both"), ({"exact": "yes"}, r"exact='yes' must be True or False")],
    ids=["with-tolerance", "not-a-bool"],
)
@pytest.mark.parametrize("helper", [*HELPERS, "training"], ids=["grads", "grad-sum", "training"])
def test_bad_exact_arguments_name_the_argument(helper: Any, options: dict[str, Any], match: str) -> None:
    module, x, y, loss_fn = _case("mlp-mse", 8)
    options = {"exact": True, **options}
    if helper == "training":
        helper = functools.partial(dpverify.assert_dp_training_matches, module, [(x, y)], optimizer=SGD)
    else:
        helper = functools.partial(helper, module, x, y)
    with pytest.raises(InvalidArgument, match=match):
        helper(loss_fn=loss_fn, device_ids=[0, 1], **options)


def test_the_users_module_and_tensors_are_untouched() -> None:
    torch.manual_seed(0)
    module, x, y, loss_fn = ConvNet(), torch.randn(8, 2, 4, 4), torch.randn(8, 2), F.l1_loss
    module.conv.weight.grad = torch.ones_like(module.conv.weight)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    inputs, target = x.clone(), y.clone()
    for helper in HELPERS:
        helper(module, x, y, loss_fn=loss_fn, device_ids=[0, 1, 2], exact=True)
    dpverify.assert_dp_training_matches(module, [(x, y)] * 2, loss_fn=loss_fn, optimizer=SGD, device_ids=[0, 1, 2], exact=True)
    assert all(v.dtype == torch.float32 and torch.equal(state[k], v) for k, v in module.state_dict().items())
    assert torch.equal(module.conv.weight.grad, torch.ones_like(module.conv.weight))
    assert module.head.weight.grad is None
    assert x.dtype == y.dtype == torch.float32
    assert torch.equal(x, inputs)
    assert torch.equal(y, target)


# --- training ---------------------------------------------------------------------------------


def _linear_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(steps)]


def test_exact_training_proves_every_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[Any] = []
    real = _training._train

    def counting(*args: Any, **kwargs: Any) -> Any:
        runs.append((kwargs["parallel"], kwargs["dtype"], kwargs.get("exact", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(_training, "_train", counting)
    torch.manual_seed(0)
    result = dpverify.assert_dp_training_matches(
        nn.Linear(4, 2), _linear_batches(4), loss_fn=F.l1_loss, optimizer=SGD, device_ids=[0, 1, 2], exact=True,
    )
    assert result.ok
    assert "no tolerance" in str(result)
    # the single-device run under the proof, the DataParallel run, and no float64 anchor
    assert runs == [(False, None, True), (True, None, False)]
    assert all(t.max_abs == 0 and t.id.variant == "step 4" for t in result.tensors)
    assert any(n.startswith("Exact: every one of") for n in result.notes)
    assert any(n.startswith("The single-device training, optimizer steps included: every one of") for n in result.notes)


def test_exact_training_catches_one_ulp_in_one_element() -> None:
    # The gradient is compared through the momentum buffer, which holds it after step 1:
    # the weights alone may not show it, as the parallel run's update rounds the nudge away.
    momentum = functools.partial(torch.optim.SGD, lr=2**-3, momentum=2**-1)
    options: dict[str, Any] = {"loss_fn": F.l1_loss, "optimizer": momentum, "device_ids": [0, 1, 2], "parallel": _nudging(_one_element)}
    torch.manual_seed(0)
    assert dpverify.assert_dp_training_matches(nn.Linear(4, 2), _linear_batches(2), **options).ok
    torch.manual_seed(0)
    with pytest.raises(ParallelMismatch, match=r"step 1 optimizer momentum_buffer 'weight'.*\n(.*\n){3}Bit for bit: 1 of the 8 elements differs"):
        dpverify.assert_dp_training_matches(nn.Linear(4, 2), _linear_batches(2), exact=True, **options)


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        (functools.partial(torch.optim.SGD, lr=0.1), r"aten\.add_ in the optimizer step of step 1 cannot be exact: .*-0\.1\b.*\(in step 1 of 3 "),
        (functools.partial(torch.optim.SGD, lr=2**-3, momentum=0.9), r"aten\.mul_ in the optimizer step of step 2 cannot be exact: .*\b0\.9\b.*\(in step 2 of 3 of the single-device training\)$"),
    ],
    ids=["lr-0.1", "momentum-0.9"],
)
def test_exact_training_refuses_a_non_dyadic_optimizer_by_its_number(optimizer: Any, match: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(InvalidArgument, match=rf"^exact=True: {match}"):
        dpverify.assert_dp_training_matches(nn.Linear(4, 2), _linear_batches(3), loss_fn=F.l1_loss, optimizer=optimizer, device_ids=[0, 1], exact=True)


def test_exact_training_beyond_float64_names_the_step() -> None:
    torch.manual_seed(0)
    with pytest.raises(InvalidArgument, match=r"needs \d+ significand bits .*\(in step 2 of 3 of the single-device training; .*pass at most 1 batch\)$"):
        dpverify.assert_dp_training_matches(_mlp(), _linear_batches(3), loss_fn=F.mse_loss, optimizer=SGD, device_ids=[0, 1], exact=True)


def test_a_check_without_an_exact_mode_skips_an_exact_case_saying_why() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    exact, inexact = Case(model, (x,), y, F.mse_loss, exact=True), Case(model, (x,), y, F.mse_loss)
    without = [spec for spec in CHECKS.values() if spec.inexact is not None]
    assert {spec.name for spec in without} >= {"dp-buffers", "dp-state", "dp-loss-average", "ddp-buffers", "ddp-sync-batchnorm", "ddp-data"}
    for spec in without:
        assert spec.skip_on(exact) == f"no exact mode: {spec.inexact}"
    result = CHECKS["dp-buffers"].run(exact)
    assert result.verdict == "SKIP"
    assert result.summary.startswith("no exact mode: the running statistics it compares round")
    assert CHECKS["dp-buffers"].run(inexact).verdict == "PASS"
