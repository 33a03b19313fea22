"""DataParallel variants passed as ``parallel=``: run as they are, on virtual devices, and
never a pass unless the replicas really ran."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dp_lookalikes import (
    BalancedDataParallel,
    DeviceLoopDataParallel,
    FunctionsDataParallel,
    WholeBatch,
)
from torch import nn

import dpverify
from dpverify.core.virtual import current_virtual_device


class _SeesDevices(nn.Module):
    """A Linear layer that notes the virtual device of every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.devices: list[int | None] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.devices.append(current_virtual_device())
        out: torch.Tensor = self.linear(x)
        return out


def _batch(rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 3, generator=generator)


def test_plain_torch_data_parallel_runs_its_replicas_and_passes() -> None:
    torch.manual_seed(0)
    model = _SeesDevices()
    x, y = _batch()
    seen: list[list[int | None]] = []

    class Recording(nn.DataParallel[Any]):
        def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> Any:
            outputs = super().parallel_apply(replicas, inputs, kwargs)
            seen.append([current_virtual_device()] + [len(chunk[0]) for chunk in inputs])
            return outputs

    dpverify.assert_dp_grads_match(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=Recording)
    assert seen == [[None, 2, 2, 1]]  # three replicas ran, on chunks [2, 2, 1]
    dpverify.assert_dp_grads_match(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=nn.DataParallel)
    dpverify.assert_grad_sum_equals_mean_loss_grad(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=nn.DataParallel)


class _HalvesGather(nn.DataParallel[Any]):
    def gather(self, outputs: Any, output_device: Any) -> Any:
        return super().gather(outputs, output_device) / 2


def test_a_subclass_with_a_broken_gather_fails() -> None:
    x, y = _batch()
    with pytest.raises(dpverify.ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(nn.Linear(4, 3), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=_HalvesGather)
    failing = [t.name for t in caught.value.report.tensors if not t.ok]
    assert any(name.startswith("output") for name in failing), failing  # the halved outputs




@pytest.mark.parametrize("helper", ["grads", "grad-sum"])
def test_a_step_that_ran_no_replicas_is_never_a_pass(helper: str) -> None:
    x, y = _batch()
    run = dpverify.assert_dp_grads_match if helper == "grads" else dpverify.assert_grad_sum_equals_mean_loss_grad
    with pytest.raises(dpverify.ParallelMismatch, match=r"ran one forward of the module where the split calls for 3 replicas \(chunks \[2, 2, 1\]\)"):
        run(nn.Linear(4, 3), x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=WholeBatch)
    # on one device there is nothing to run in parallel: the same wrapper is right there
    run(nn.Linear(4, 3), x, y, loss_fn=F.mse_loss, device_ids=[0], parallel=WholeBatch)


@pytest.mark.parametrize(
    "wrapper",
    [functools.partial(BalancedDataParallel, 1), DeviceLoopDataParallel, FunctionsDataParallel],
    ids=["balanced", "device-loop", "functions"],
)
def test_look_alikes_of_wrappers_in_the_wild_are_verified_as_they_are(wrapper: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = _batch(8)
    dpverify.assert_dp_grads_match(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], parallel=wrapper)
    dpverify.assert_grad_sum_equals_mean_loss_grad(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], parallel=wrapper)


def test_outside_a_check_torch_is_left_as_it_was() -> None:
    x, y = _batch()
    before = (nn.DataParallel(nn.Linear(4, 3)).device_ids, torch.cuda.is_available(), torch.cuda.device_count())
    dpverify.assert_dp_grads_match(nn.Linear(4, 3), x, y, loss_fn=F.mse_loss, device_ids=[0, 1], parallel=nn.DataParallel)
    # torch's own behaviour on this machine: [] without CUDA, the visible GPUs with it
    assert (nn.DataParallel(nn.Linear(4, 3)).device_ids, torch.cuda.is_available(), torch.cuda.device_count()) == before


def test_the_documented_examples_of_verifying_your_own_data_parallel_run() -> None:
    import textwrap
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "dataparallel.md").read_text()
    section = page.split("## Verifying your own DataParallel", 1)[1].split("\n## ", 1)[0]
    blocks = [textwrap.dedent(part.split("```", 1)[0]) for part in section.split("```python\n")[1:]]
    assert len(blocks) == 2  # virtual_devices, and a model/criterion pair
    before = nn.DataParallel(nn.Linear(4, 2)).device_ids
    for code in blocks:
        exec(compile(code, "docs/dataparallel.md", "exec"), {})
    assert nn.DataParallel(nn.Linear(4, 2)).device_ids == before  # restored after the block


class _DropsLastChunk(nn.DataParallel[Any]):
    """A mutant of a balanced wrapper: it forgets the last device's chunk."""

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
        scattered, scattered_kwargs = super().scatter(inputs, kwargs, device_ids)
        return scattered[:-1], scattered_kwargs[:-1]


def test_what_the_wrapper_really_ran_is_reported_not_torchs_plan() -> None:
    x, y = _batch(8)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    # balanced: [1, 3, 2, 2] where torch's scatter gives [2, 2, 2, 2], and correct
    dpverify.assert_grad_sum_equals_mean_loss_grad(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2, 3], parallel=functools.partial(BalancedDataParallel, 1))
    # a loss that takes what comes back, so that the dropped rows show in the gradients
    def rows_back(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target[: output.shape[0]])

    with pytest.raises(dpverify.ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(model, x, y, loss_fn=rows_back, device_ids=[0, 1, 2, 3], parallel=_DropsLastChunk)
    assert "the wrapper ran 3 replica forwards on chunks of [2, 2, 2] rows (6 of 8; torch's scatter would give [2, 2, 2, 2])" in str(caught.value)


def test_the_balanced_offset_mutant_is_caught_with_the_split_it_ran() -> None:
    from dpverify.mutants import MUTANTS, BalancedOffsetDataParallel

    assert MUTANTS["balanced-offset"].caught_by == "dp-grads"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = _batch(8)
    with pytest.raises(dpverify.ParallelMismatch, match="tensors are not close") as caught:
        dpverify.assert_dp_grads_match(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=BalancedOffsetDataParallel)
    failing = {t.name for t in caught.value.report.tensors if not t.ok}
    assert "output" in failing  # the duplicated rows show in the gathered output
    # the right sizes [1, 4, 3] at the wrong offsets: every row count adds up, the rows do not
    assert "the wrapper ran 3 replica forwards on chunks of [1, 4, 3] rows (8 of 8;" in str(caught.value)


@pytest.mark.parametrize("rows", [8, 5])
def test_plain_torch_data_parallel_gets_the_loss_average_checks_too(rows: int) -> None:
    from dpverify.models.builtin import builtin_case

    built = builtin_case("loss-in-forward", batch=rows)
    report = dpverify.check_forward_loss_average(built.module, built.inputs, device_ids=[0, 1, 2, 3], parallel=nn.DataParallel)
    assert report.chunk_sizes == ((2, 2, 2, 2) if rows == 8 else (2, 2, 1))
    assert len(report.replica_losses) == len(report.chunk_sizes)  # every replica ran
    assert report.is_biased == (rows == 5)
    dpverify.assert_loss_reduction_matches_full_batch(
        built.module, built.inputs, device_ids=[0, 1, 2, 3], reduce=dpverify.chunk_weighted_loss, parallel=nn.DataParallel
    )


def test_plain_torch_data_parallel_keeps_replica_zeros_buffers() -> None:
    from dpverify.models.specs import BufferCounter

    x = torch.randn(5, 4)
    # torch's DataParallel on 3 virtual devices: rows_seen counts replica 0's chunk only
    dpverify.assert_dp_buffers_match(BufferCounter(4, 3), x, device_ids=[0, 1, 2], parallel=nn.DataParallel)


def test_the_loss_average_report_uses_the_split_the_wrapper_made() -> None:
    from dpverify.models.builtin import builtin_case

    built = builtin_case("loss-in-forward", batch=8)
    balanced = functools.partial(BalancedDataParallel, 1)
    report = dpverify.check_forward_loss_average(built.module, built.inputs, device_ids=[0, 1, 2, 3], parallel=balanced)
    # torch's scatter would give [2, 2, 2, 2]; the wrapper ran [1, 3, 2, 2], and its replica
    # losses are per-row means of those: the n_i/B weighting is exact, loss.mean() is biased
    assert report.chunk_sizes == (1, 3, 2, 2)
    assert report.weighted_is_exact, str(report)
    assert report.is_biased
    assert "not the per-row means" not in str(report)


def test_reduce_receives_the_split_the_wrapper_made() -> None:
    from dpverify.models.builtin import builtin_case

    built = builtin_case("loss-in-forward", batch=8)
    received: list[list[int]] = []

    def weighted(losses: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        received.append(list(sizes))
        return dpverify.chunk_weighted_loss(losses, sizes)

    balanced = functools.partial(BalancedDataParallel, 1)
    dpverify.assert_loss_reduction_matches_full_batch(built.module, built.inputs, device_ids=[0, 1, 2, 3], reduce=weighted, parallel=balanced)
    assert received == [[1, 3, 2, 2]]
    assert not built.module._forward_pre_hooks  # the user's module is left as it was


def test_the_buffer_check_compares_with_what_replica_zero_really_ran() -> None:
    from dpverify.models.specs import BufferCounter

    x = torch.randn(8, 4)
    balanced = functools.partial(BalancedDataParallel, 1)  # replica 0 gets 1 row, not 2
    result = dpverify.assert_dp_buffers_match(BufferCounter(4, 3), x, device_ids=[0, 1, 2, 3], parallel=balanced)
    assert "Replica 0 ran on 1 row;" in "\n".join(result.notes)


# --- no vacuous pass, on any model kind -----------------------------------------------------


class _NoSplit(nn.Module):
    """A wrapper whose forward is ``self.module(*inputs, **kwargs)``: it never splits."""

    def __init__(self, module: nn.Module, device_ids: list[int], output_device: int | None = None) -> None:
        super().__init__()
        self.module = module

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)


class _Kinds(nn.Module):
    """One model of every kind a forward can be: it returns a tensor, its loss (a scalar or
    a dict with a ``loss`` key), a dict or a tuple, called positionally or keyword-only. It
    reads a buffer, so that the buffer check applies too."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((1,), 1.5))

    def _forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        out = self.linear(x) * self.scale
        if self.kind == "dict":
            return {"pred": out, "aux": out.detach().sum(-1)}
        if self.kind == "tuple":
            return out, x.sum(-1)
        if y is None:
            return out
        loss = F.mse_loss(out, y)
        return {"pred": out, "loss": loss} if self.kind == "loss-dict" else loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.kind.startswith("keyword-only"):
            assert not args, "keyword-only"
            return self._forward(kwargs["x"], kwargs.get("y"))
        return self._forward(*args)


_KINDS = ["output", "loss", "loss-dict", "keyword-only", "keyword-only-loss", "dict", "tuple"]


def _kind_case(kind: str) -> dpverify.Case:
    torch.manual_seed(0)
    x, y = _batch(6)
    module = _Kinds(kind)
    returns_loss = "loss" in kind
    loss_fn: Any = None
    if not returns_loss:
        def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
            pred = out["pred"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out
            return F.mse_loss(pred, target)
    arguments = {"x": x, **({"y": y} if returns_loss else {})}
    if kind.startswith("keyword-only"):
        return dpverify.Case(module, (), None if returns_loss else y, loss_fn, (0, 1, 2), forward_kwargs=arguments)
    return dpverify.Case(module, tuple(arguments.values()), None if returns_loss else y, loss_fn, (0, 1, 2))


#: every DataParallel check of the registry that takes a wrapper (dp-state checks torch's
#: own), with each model kind it applies to
_KIND_CHECKS = [
    (kind, name) for kind in _KINDS for name, spec in dpverify.CHECKS.items()
    if spec.backend == "dp" and name != "dp-state" and spec.applies(_kind_case(kind))
]


def test_every_model_kind_meets_the_checks_meant_for_it() -> None:
    assert {kind for kind, _ in _KIND_CHECKS} == set(_KINDS)
    names = {name for _, name in _KIND_CHECKS}
    assert names == {"dp-grads", "dp-grad-sum", "dp-loss-average", "dp-weighted-loss", "dp-buffers", "dp-training"}


@pytest.mark.parametrize(("kind", "name"), _KIND_CHECKS)
def test_a_wrapper_that_never_splits_fails_every_check_on_every_model_kind(kind: str, name: str) -> None:
    case = _kind_case(kind)
    spec = dpverify.CHECKS[name]
    # torch's DataParallel passes the same case: what fails is the wrapper's one forward
    assert spec.run(case).verdict is dpverify.Verdict.PASS
    result = spec.run(case, dpverify.Target(parallel=_NoSplit))
    assert result.verdict is dpverify.Verdict.FAIL, result
    assert result.summary.startswith("The parallel step ran one forward of the module where the split calls for 3 replicas (chunks [2, 2, 2])")


@pytest.mark.parametrize("kind", _KINDS)
def test_every_data_parallel_helper_fails_a_wrapper_that_never_splits(kind: str) -> None:
    case = _kind_case(kind)
    common: dict[str, Any] = {"device_ids": [0, 1, 2], "parallel": _NoSplit, "forward_kwargs": case.forward_kwargs}
    helpers: list[Any] = [functools.partial(dpverify.assert_dp_buffers_match, case.module, case.inputs, **common)]
    if case.loss_fn is None:
        helpers += [
            functools.partial(dpverify.check_forward_loss_average, case.module, case.inputs, **common),
            functools.partial(
                dpverify.assert_loss_reduction_matches_full_batch, case.module, case.inputs,
                reduce=lambda losses, sizes: dpverify.chunk_weighted_loss(losses, sizes), **common,
            ),
        ]
    else:
        helpers += [
            functools.partial(helper, case.module, case.inputs, case.target, loss_fn=case.loss_fn, **common)
            for helper in (dpverify.assert_dp_grads_match, dpverify.assert_grad_sum_equals_mean_loss_grad)
        ]
    for helper in helpers:
        with pytest.raises(dpverify.ParallelMismatch, match=r"ran one forward of the module where the split calls for 3 replicas") as caught:
            helper()
        assert caught.value.report.replicas == 1, helper.func.__name__


class _Doubles(_NoSplit):
    """Doubles the output, whatever the devices: wrong on one device too."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return 2 * self.module(*inputs, **kwargs)


def test_a_one_replica_split_skips_a_match_but_keeps_a_mismatch() -> None:
    case = dataclasses.replace(_kind_case("output"), device_ids=(0,))
    matched = dpverify.CHECKS["dp-grads"].run(case, dpverify.Target(parallel=_NoSplit))
    assert matched.serial, matched
    # a wrapper wrong on its one-device path is wrong: the evidence of a mismatch stands
    failed = dpverify.CHECKS["dp-grads"].run(case, dpverify.Target(parallel=_Doubles))
    assert failed.verdict is dpverify.Verdict.FAIL, failed
