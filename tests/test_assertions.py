"""assert_dp_grads_match and assert_grad_sum_equals_mean_loss_grad on the built-in models."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpverify
from dpverify import InvalidArgument, ParallelMismatch
from dpverify.checks.dp import SharedSteps
from dpverify.models.builtin import builtin_case
from dpverify.models.user import builtin_model
from dpverify.mutants import AveragingDataParallel, DeepCopyDataParallel
from dpverify.planner import check_model
from dpverify.registry import CHECKS, Case, Target, Verdict

MODELS = ["mlp", "conv", "embedding"]
# even chunks, uneven chunks, and a batch smaller than the device count
SPLITS = [(8, [0, 1]), (5, [0, 1, 2, 3]), (2, [0, 1, 2, 3]), (7, [2, 0, 1])]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("batch", "ids"), SPLITS)
def test_correct_data_parallel_passes(name: str, batch: int, ids: list[int]) -> None:
    case = builtin_case(name, batch=batch)
    assert case.loss_fn is not None
    result = dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=ids)
    assert result.ok
    assert {t.name for t in result.tensors} >= {"output", "loss"}
    grads = dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=ids)
    replicas = len(dpverify.chunk_sizes(batch, len(ids)))
    assert f"{replicas} replica{'s' if replicas != 1 else ''} contributed" in " ".join(grads.notes)
    assert len(grads.contrasts) == (len(case.module.state_dict()) if replicas > 1 else 0)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("batch", "ids"), [(8, [0, 1]), (5, [0, 1, 2, 3])])
def test_averaging_wrapper_is_reported_with_the_reason(name: str, batch: int, ids: list[int]) -> None:
    case = builtin_case(name, batch=batch)
    assert case.loss_fn is not None
    replicas = len(dpverify.chunk_sizes(batch, len(ids)))
    with pytest.raises(ParallelMismatch, match=rf"1/{replicas}, one over the number of replicas used\): the replica gradients were averaged"):
        dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=ids, parallel=AveragingDataParallel)
    with pytest.raises(ParallelMismatch, match="accumulated grad") as caught:
        dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=ids, parallel=AveragingDataParallel)
    # the replicas' own contributions were divided, so their sum is wrong too
    assert "sum of replica grads" in str(caught.value)


@pytest.mark.parametrize("name", MODELS)
def test_deep_copy_wrapper_is_reported_with_the_reason(name: str) -> None:
    case = builtin_case(name, batch=6)
    assert case.loss_fn is not None
    with pytest.raises(ParallelMismatch, match="No gradient reached the module's parameters") as caught:
        dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=[0, 1], parallel=DeepCopyDataParallel)
    assert "is None in the parallel step" in str(caught.value)
    # the copies' contributions do sum up, but nothing reaches the module's .grad
    with pytest.raises(ParallelMismatch, match=r"accumulated grad .*is None in the parallel step"):
        dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=[0, 1], parallel=DeepCopyDataParallel)


def test_sum_helper_shows_sum_and_average() -> None:
    case = builtin_case("mlp", batch=5)
    assert case.loss_fn is not None
    result = dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=[0, 1, 2, 3])
    assert all(t.ok for t in result.tensors)
    assert result.contrasts
    assert all(not t.ok for t in result.contrasts)
    assert all(t.name.startswith("average of replica grads") for t in result.contrasts)


def test_sum_helper_with_one_replica_has_no_contrast() -> None:
    case = builtin_case("mlp", batch=1)
    assert case.loss_fn is not None
    result = dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=[0, 1])
    assert result.contrasts == ()
    assert "1 replica contributed (chunks [1])" in result.notes[0]


def test_sum_helper_fails_when_the_wrapper_never_calls_the_module() -> None:
    class Ignores(nn.Module):
        def __init__(self, module: nn.Module, device_ids: list[int], output_device: int | None = None) -> None:
            super().__init__()
            self.module = module
            self.other = nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.other(x)

    case = builtin_case("mlp", batch=4)
    assert case.loss_fn is not None
    with pytest.raises(ParallelMismatch, match="No replica ran a forward of the module's copies"):
        dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=[0, 1], parallel=Ignores)


def _state(module: nn.Module) -> dict[str, Any]:
    return {
        "params": {k: v.detach().clone() for k, v in module.named_parameters()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in module.named_parameters()},
        "buffers": {k: v.clone() for k, v in module.named_buffers()},
        "training": [m.training for m in module.modules()],
    }


@pytest.mark.parametrize("helper", ["grads", "sum"])
def test_user_module_and_gradients_are_never_modified(helper: str) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).eval()
    module[0].weight.grad = torch.full_like(module[0].weight, 7.0)
    before = _state(module)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    run = dpverify.assert_dp_grads_match if helper == "grads" else dpverify.assert_grad_sum_equals_mean_loss_grad
    run(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
    after = _state(module)
    assert after["training"] == before["training"]
    for kind in ("params", "buffers"):
        for key, value in before[kind].items():
            assert torch.equal(after[kind][key], value), (kind, key)
    assert torch.equal(after["grads"]["0.weight"], before["grads"]["0.weight"])
    assert after["grads"]["2.weight"] is None
    assert x.grad is None


def test_batchnorm_in_train_mode_is_named_as_the_cause() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with pytest.raises(ParallelMismatch, match=r"(?s)Likely cause.*'1' \(batch statistics\): BatchNorm1d in train mode"):
        dpverify.assert_dp_grads_match(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1])
    dpverify.assert_dp_grads_match(module.eval(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1])


def test_batchnorm_with_one_row_per_replica_explains_the_error() -> None:
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        dpverify.assert_dp_grads_match(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
    notes = "\n".join(caught.value.__notes__)
    assert "raised by the parallel step" in notes
    assert "chunk sizes [1, 1, 1]" in notes
    assert "Fix: compare in eval mode" in notes


def test_dropout_is_named_as_the_cause() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with pytest.raises(ParallelMismatch, match=r"'1' \(randomness\): Dropout draws its own mask on each replica"):
        dpverify.assert_dp_grads_match(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1])
    dpverify.assert_dp_grads_match(module.eval(), x, y, loss_fn=F.mse_loss, device_ids=[0, 1])


def test_dropped_rows_are_warned_about() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * scale.mean()

    x, scale = torch.randn(8, 2), torch.ones(2, 1)
    with pytest.warns(dpverify.DroppedRowsWarning, match="inputs\\[0\\] loses 4 rows"), pytest.raises(ParallelMismatch, match="output: has shape \\(4, 1\\) in the parallel step and \\(8, 1\\)"):
        dpverify.assert_dp_grads_match(Two(), (x, scale), torch.zeros(8, 1), loss_fn=lambda o, t: o.sum(), device_ids=[0, 1, 2, 3])


def test_loss_in_forward_model_gets_a_shape_explanation() -> None:
    case = builtin_case("loss-in-forward", batch=5)
    with pytest.warns(UserWarning, match="all input tensors were scalars"), pytest.raises(ParallelMismatch, match=r"output\[1\]: has shape \(3,\) in the parallel step and \(\) in the single-device step"):
        dpverify.assert_dp_grads_match(case.module, case.inputs, None, loss_fn=lambda out, _t: out[1].mean(), device_ids=[0, 1, 2, 3])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"module": "net"}, "module=str is not a torch.nn.Module"),
        ({"inputs": torch.empty(0, 5)}, r"inputs has an empty batch \(0 rows along dim 0\)"),
        ({"inputs": ()}, r"inputs=\(\) is empty"),
        ({"inputs": (3,)}, "inputs holds no tensor with a batch dimension"),
        ({"device_ids": [0, 0]}, r"repeats device 0"),
        ({"output_device": "cpu"}, "pass -1 as output_device"),
        ({"loss_fn": "mse"}, "loss_fn='mse' is not callable"),
        ({"loss_fn": lambda o, t: (o - t).pow(2)}, r"loss_fn returned \(4, 2\); it must return a scalar"),
        ({"parallel": 3}, "parallel=3 is not callable"),
        ({"forward_kwargs": 3}, "forward_kwargs=3 is int; pass a mapping of keyword arguments"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], match: str) -> None:
    case = builtin_case("mlp", batch=4)
    arguments: dict[str, Any] = {"module": case.module, "inputs": case.inputs, "target": case.target, "loss_fn": case.loss_fn, "device_ids": [0, 1]}
    arguments.update(kwargs)
    with pytest.raises(InvalidArgument, match=match):
        dpverify.assert_dp_grads_match(arguments.pop("module"), arguments.pop("inputs"), arguments.pop("target"), **arguments)


def test_explicit_tolerances_skip_the_float64_run() -> None:
    case = builtin_case("mlp", batch=5)
    assert case.loss_fn is not None
    result = dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=[0, 1], rtol=1e-5, atol=1e-6)
    assert all(t.reference_error is None for t in result.tensors)
    assert "rtol=1.0e-05, atol=1.0e-06" in result.tolerance


def test_float64_module_is_compared_at_float64_precision() -> None:
    case = builtin_case("mlp", batch=5)
    assert case.loss_fn is not None
    module = case.module.double()
    result = dpverify.assert_dp_grads_match(module, case.inputs[0].double(), case.target.double(), loss_fn=case.loss_fn, device_ids=[0, 1, 2])
    assert max(t.allowed for t in result.tensors) < 1e-12


def test_forward_creating_default_dtype_tensors_runs_in_float64() -> None:
    class MakesTensors(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) @ torch.eye(3) + torch.zeros(3)

    dpverify.assert_dp_grads_match(MakesTensors(), torch.randn(4, 3), torch.randn(4, 3), loss_fn=F.mse_loss, device_ids=[0, 1])


def test_str_of_a_passing_result_summarises_it() -> None:
    case = builtin_case("conv", batch=5)
    assert case.loss_fn is not None
    result = dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=[0, 1, 2, 3])
    assert str(result).startswith("DataParallel outputs and gradients must match the single-device step: passed (")
    assert "chunk sizes [2, 2, 1]" in str(result)


# --- Models nobody here designed: unused, frozen and tied parameters, low precision,
# gradients that are zero in exact arithmetic, near-converged targets --------------------

BOTH = (dpverify.assert_dp_grads_match, dpverify.assert_grad_sum_equals_mean_loss_grad)


class _Pooled(nn.Module):
    """An encoder with a pooler whose output the loss ignores (as an HF classifier that
    reads the first token), a frozen embedding-like projection and an unused head."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 8).requires_grad_(False)
        self.encoder = nn.Linear(8, 8)
        self.pooler = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 3)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.encoder(self.frozen(x)))
        self.pooler(hidden)  # computed, never used by the loss
        return self.head(hidden)


@pytest.mark.parametrize("check", BOTH)
@pytest.mark.parametrize(("batch", "ids"), [(8, [0, 1]), (5, [0, 1, 2, 3]), (2, [1, 0, 3])])
def test_unused_and_frozen_parameters_are_as_on_one_device(check: Any, batch: int, ids: list[int]) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(batch, 6), torch.randn(batch, 3)
    result = check(_Pooled(), x, y, loss_fn=F.mse_loss, device_ids=ids)
    assert result.ok
    names = {t.name for t in result.tensors}
    assert "grad 'unused.weight'" in names or "sum of replica grads 'unused.weight'" in names
    frozen = [t for t in result.tensors if "frozen" in t.name]
    assert frozen
    assert all(t.ok and t.numel == 0 for t in frozen)  # None on both sides, as torch leaves it


def test_no_trainable_parameter_is_an_argument_error() -> None:
    frozen = nn.Linear(4, 2).requires_grad_(False)
    for check in BOTH:
        with pytest.raises(InvalidArgument, match=r"module=Linear has no parameter that requires grad"):
            check(frozen, torch.randn(4, 4), torch.randn(4, 2), loss_fn=F.mse_loss, device_ids=[0, 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "ids"), [(6, [0, 1, 2]), (5, [0, 1, 2, 3])])
def test_low_precision_models_pass_and_averaging_is_still_caught(dtype: torch.dtype, batch: int, ids: list[int]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
    x, y = torch.randn(batch, 4, dtype=dtype), torch.randn(batch, 3, dtype=dtype)
    for check in BOTH:
        assert check(model, x, y, loss_fn=F.mse_loss, device_ids=ids).ok
    with pytest.raises(ParallelMismatch, match="replica gradients were averaged"):
        dpverify.assert_dp_grads_match(model, x, y, loss_fn=F.mse_loss, device_ids=ids, parallel=AveragingDataParallel)


class _TwoFeatureNorm(nn.Module):
    """LayerNorm over two features: its output is +-1 whatever the input, so the gradient
    of everything before it is zero in exact arithmetic, and only rounding noise in floats."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 2)
        self.norm = nn.LayerNorm(2, eps=0.0)
        self.out = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inp(x)))


class _KeyBiasAttention(nn.Module):
    """Self-attention: the key bias's gradient is zero in exact arithmetic (softmax is shift
    invariant along the keys)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True, dtype=dtype)
        self.out = nn.Linear(8, 3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attention(x, x, x, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("batch", "ids"), [(8, [0, 1]), (7, [0, 1, 2, 3]), (3, [0, 2, 1])])
def test_gradients_zero_in_exact_arithmetic_are_no_false_alarm(seed: int, batch: int, ids: list[int]) -> None:
    torch.manual_seed(seed)
    x, y = torch.randn(batch, 5), torch.randn(batch, 3)
    for check in BOTH:
        check(_TwoFeatureNorm(), x, y, loss_fn=F.mse_loss, device_ids=ids)
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(seed)
        tokens, target = torch.randn(batch, 5, 8, dtype=dtype) * 4, torch.randn(batch, 3, dtype=dtype)
        for check in BOTH:
            result = check(_KeyBiasAttention(dtype), tokens, target, loss_fn=F.mse_loss, device_ids=ids)
            assert result.ok


@pytest.mark.parametrize("residual", [1e-3, 1e-6, 1e-9])
def test_near_converged_targets_are_no_false_alarm(residual: float) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(13, 6)
    with torch.no_grad():
        y = model.double()(x.double()).float()
    model.float()
    y = y + residual * torch.randn_like(y)
    for ids in ([0, 1], [0, 1, 2, 3], [3, 1, 2]):
        for check in BOTH:
            assert check(model, x, y, loss_fn=F.mse_loss, device_ids=ids).ok


def test_full_size_replica_gradients_are_still_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with pytest.raises(ParallelMismatch, match=r"matches the full-batch gradient and their sum does not"):
        dpverify.assert_grad_sum_equals_mean_loss_grad(model, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2], parallel=_FullSizeReplicas)


class _FullSizeReplicas(dpverify.VirtualDataParallel):  # type: ignore[type-arg]
    """Scales every replica's contribution by the number of replicas (as a loss that is each
    chunk's own mean would, on even chunks): the average of the replica gradients then
    equals the full-batch gradient, and their sum is k times too large."""

    def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> list[Any]:
        outputs = super().parallel_apply(replicas, inputs, kwargs)
        k = len(outputs)
        for output in outputs:
            output.register_hook(lambda g: g * k)
        return outputs


@pytest.mark.parametrize(
    ("seed", "batch", "ids", "dtype", "check"),
    [
        # false alarms of the fixed 256-ulp floor on ill-conditioned attention (scaled inputs)
        (24, 7, [0, 1, 2, 3], torch.float64, dpverify.assert_grad_sum_equals_mean_loss_grad),
        (28, 3, [0, 2, 1], torch.float32, dpverify.assert_dp_grads_match),
        (28, 3, [0, 2, 1], torch.float32, dpverify.assert_grad_sum_equals_mean_loss_grad),
    ],
)
def test_ill_conditioned_attention_is_no_false_alarm(seed: int, batch: int, ids: list[int], dtype: torch.dtype, check: Any) -> None:
    torch.manual_seed(seed)
    model = _KeyBiasAttention(dtype)
    tokens, target = torch.randn(batch, 5, 8, dtype=dtype) * 30, torch.randn(batch, 3, dtype=dtype)
    assert check(model, tokens, target, loss_fn=F.mse_loss, device_ids=ids).ok


# --------------------------------------------------------------------------- shared steps


def _count_steps(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the steps the checks run, by kind, from now on."""
    from dpverify.checks import dp as _assertions

    counts: dict[str, int] = {}
    from dpverify.core.step import run_step as real

    def counting(*args: Any, **kwargs: Any) -> Any:
        wrap = kwargs.get("wrap")
        if isinstance(wrap, _assertions._Split):  # the chunk-by-chunk rounding sample of a failing tensor
            kind = f"{kwargs.get('dtype')} split"
        else:
            kind = "parallel" if wrap else f"{kwargs.get('dtype')}{' jittered' if kwargs.get('jitter') else ''}"
        counts[kind] = counts.get(kind, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_assertions, "run_step", counting)
    return counts


def _case(module: nn.Module, inputs: Any, target: Any, ids: list[int], shared: SharedSteps | None, **fields: Any) -> Case:
    return Case(module, inputs if isinstance(inputs, tuple) else (inputs,), target, F.mse_loss, tuple(ids), steps=shared, **fields)


def _both_checks(module: nn.Module, inputs: Any, target: Any, ids: list[int], shared: SharedSteps | None = None) -> tuple[Any, Any]:
    """The gradient and replica-sum checks of one split: through the public assertions,
    or, given ``shared``, grouped on it as the planner groups them."""
    if shared is None:
        first = dpverify.assert_dp_grads_match(module, inputs, target, loss_fn=F.mse_loss, device_ids=ids)
        second = dpverify.assert_grad_sum_equals_mean_loss_grad(module, inputs, target, loss_fn=F.mse_loss, device_ids=ids)
        return first, second
    case = _case(module, inputs, target, ids, shared)
    return CHECKS["dp-grads"].check(case), CHECKS["dp-grad-sum"].check(case)


def test_checks_grouped_on_one_batch_run_the_single_device_and_float64_steps_once(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    case = builtin_case("mlp", batch=8)
    shared = SharedSteps()
    first, second = _both_checks(case.module, case.inputs, case.target, [0, 1], shared)
    assert first.ok
    assert second.ok
    # the checks of a split run one parallel step and one set of references, and no
    # second rounding sample: every tensor passed (contrasts, meant to differ, ask for none)
    assert counts == {"parallel": 1, "None": 1, "torch.float64": 1}
    # the same batch on another device count needs another parallel step, the same references
    _both_checks(case.module, case.inputs, case.target, [0, 1, 2, 3], shared)
    assert counts == {"parallel": 2, "None": 1, "torch.float64": 1}


def test_the_planner_shares_a_batchs_steps_across_its_device_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    report = check_model(builtin_model("mlp", seed=0), batch_sizes=[8, 5], device_counts=[2, 4], checks=["dp-grads", "dp-grad-sum"])
    assert [r.verdict for r in report.results] == [Verdict.PASS] * 8
    # one parallel step per split, one set of references per batch
    assert counts == {"parallel": 4, "None": 2, "torch.float64": 2}


def test_a_public_assertion_called_twice_computes_its_steps_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    case = builtin_case("mlp", batch=8)
    for _ in range(2):
        dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=F.mse_loss, device_ids=[0, 1])
    assert counts == {"parallel": 2, "None": 2, "torch.float64": 2}
    _both_checks(case.module, case.inputs, case.target, [0, 1])  # public calls share nothing
    for _ in range(2):
        dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=F.mse_loss, device_ids=[0, 1])
    assert counts == {"parallel": 6, "None": 6, "torch.float64": 6}


def test_shared_steps_give_the_verdicts_of_fresh_ones() -> None:
    case = builtin_case("mlp", batch=5)
    shared = _both_checks(case.module, case.inputs, case.target, [0, 1, 2], SharedSteps())
    fresh = dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
    assert [(t.name, t.max_abs, t.allowed) for t in shared[1].tensors] == [(t.name, t.max_abs, t.allowed) for t in fresh.tensors]


def test_only_a_parallel_step_a_replica_sum_check_may_take_keeps_each_replicas_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpverify.checks import dp as _assertions
    from dpverify.core.step import run_step as real

    kept: list[bool | str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if kwargs.get("wrap"):
            kept.append(kwargs.get("record_replicas", False))
            # what was recorded is what was asked for: copies of every replica's gradients, or none
            assert all(bool(grads) == (kwargs.get("record_replicas") is True) for _device, grads in result.contributions)
        return result

    monkeypatch.setattr(_assertions, "run_step", recording)
    case = builtin_case("mlp", batch=5)
    alone = dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
    grouped, summed = _both_checks(case.module, case.inputs, case.target, [0, 1, 2], SharedSteps())
    # alone, nobody reads the replicas' gradients; grouped, the replica-sum check takes them
    assert kept == ["magnitudes", True]
    assert summed.ok
    assert any(t.id.variant == "sum of replica" for t in summed.tensors)
    # the magnitudes the tolerance reads are recorded either way: the same allowances
    assert [(t.name, t.max_abs, t.allowed) for t in alone.tensors] == [(t.name, t.max_abs, t.allowed) for t in grouped.tensors]


def _add_in_place(module: nn.Module) -> None:
    with torch.no_grad():
        next(module.parameters()).add_(0.5)


def _write_through_data(module: nn.Module) -> None:
    # ``.data`` bypasses the version counter
    next(module.parameters()).data.mul_(-1)


def _permute_through_data(module: nn.Module) -> None:
    # the same values (the same sum, and the same bits in another order) in other places
    weight = next(module.parameters())
    weight.data.copy_(weight.data.flip(0))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = self.linear(x) * self.scale
        return scaled


def _swap_a_parameter(module: _Scaled) -> None:
    module.linear.weight = nn.Parameter(module.linear.weight.detach() * 2)


def _change_a_hyperparameter(module: _Scaled) -> None:
    module.scale = 3.0


_CHANGES = [_add_in_place, _write_through_data, _permute_through_data, _swap_a_parameter, _change_a_hyperparameter, lambda m: m.eval()]


@pytest.mark.parametrize("change", _CHANGES)
def test_a_module_changed_between_public_calls_is_seen(monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
    counts = _count_steps(monkeypatch)
    torch.manual_seed(0)
    module = _Scaled()
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    _both_checks(module, x, y, [0, 1])
    assert counts["None"] == counts["torch.float64"] == 2
    change(module)
    first, second = _both_checks(module, x, y, [0, 1])
    assert counts["None"] == counts["torch.float64"] == 4
    # what a module never checked before gives: references of the module before the
    # change would give other comparisons (test_steps_kept_across_a_change_are_wrong)
    fresh = _both_checks(copy.deepcopy(module), x, y, [0, 1])
    assert first.tensors == fresh[0].tensors
    assert second.tensors == fresh[1].tensors


@pytest.mark.parametrize("change", [_write_through_data, _permute_through_data])
def test_steps_kept_across_a_change_are_wrong(change: Any) -> None:
    # what the test above rules out: steps shared across the change (a promise broken)
    torch.manual_seed(0)
    module = _Scaled()
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    shared = SharedSteps()
    CHECKS["dp-grads"].check(_case(module, x, y, [0, 1], shared))
    change(module)
    stale = CHECKS["dp-grads"].run(_case(module, x, y, [0, 1], shared))
    fresh = CHECKS["dp-grads"].run(_case(copy.deepcopy(module), x, y, [0, 1], None))
    assert stale.tensors != fresh.tensors


def test_another_batch_or_target_gets_fresh_references(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    case = builtin_case("mlp", batch=8)
    _both_checks(case.module, case.inputs, case.target, [0, 1])
    other = builtin_case("mlp", batch=5)
    assert other.target is not None
    _both_checks(case.module, other.inputs, other.target, [0, 1])  # another split's batch
    assert counts["None"] == counts["torch.float64"] == 4
    target = other.target.clone()
    target[0, 0] += 1e-3  # a new target, one value off
    _both_checks(case.module, other.inputs, target, [0, 1])
    assert counts["None"] == counts["torch.float64"] == 6
    with torch.no_grad():
        other.inputs[0].add_(1)  # the batch changed in place
    _both_checks(case.module, other.inputs, target, [0, 1])
    assert counts["None"] == counts["torch.float64"] == 8


def _rows_reversed(x: torch.Tensor) -> torch.Tensor:
    return x.flip(0)  # the same values (the same sum and xor of the bits) in other rows


def _zeros_signed(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[0, 0], y[1, 0] = -0.0, 0.0  # equal to the batch below for torch.equal, not bitwise
    return y


def _zeros_signed_the_other_way(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[0, 0], y[1, 0] = 0.0, -0.0
    return y


@pytest.mark.parametrize(("make_first", "make_second"), [(lambda x: x, _rows_reversed), (_zeros_signed, _zeros_signed_the_other_way)])
def test_a_batch_of_the_same_values_in_other_places_gets_fresh_references(monkeypatch: pytest.MonkeyPatch, make_first: Any, make_second: Any) -> None:
    counts = _count_steps(monkeypatch)
    case = builtin_case("mlp", batch=8)
    (x,) = case.inputs
    first, second = make_first(x), make_second(x)
    dpverify.assert_dp_grads_match(case.module, first, case.target, loss_fn=F.mse_loss, device_ids=[0, 1])
    # stale references would compare the rows of one batch with the other's
    assert dpverify.assert_dp_grads_match(case.module, second, case.target, loss_fn=F.mse_loss, device_ids=[0, 1]).ok
    assert counts == {"parallel": 2, "None": 2, "torch.float64": 2}


# --------------------------------------------------------------------------- shared parallel step


def test_the_checks_of_a_split_share_the_parallel_step_and_give_the_verdicts_of_fresh_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    case = builtin_case("mlp", batch=5)
    steps = SharedSteps()
    shared = _both_checks(case.module, case.inputs, case.target, [0, 1, 2], steps)
    assert counts["parallel"] == 1
    # the replica-sum check took the step: it is not kept
    assert steps.left is None
    fresh = dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
    assert counts["parallel"] == 2
    assert str(shared[1]) == str(fresh)
    assert shared[1].tensors == fresh.tensors
    assert shared[1].contrasts == fresh.contrasts
    alone = dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
    assert shared[0].tensors == alone.tensors


@pytest.mark.parametrize("change", _CHANGES)
def test_a_module_changed_between_checks_gets_a_fresh_parallel_step(monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
    counts = _count_steps(monkeypatch)
    torch.manual_seed(0)
    module = _Scaled()
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    dpverify.assert_dp_grads_match(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1])
    change(module)
    # a stale parallel step would carry the old module's gradients into the sum check
    second = dpverify.assert_grad_sum_equals_mean_loss_grad(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1])
    assert second.ok
    assert counts["parallel"] == 2


def test_another_wrapper_split_or_output_device_gets_a_fresh_parallel_step(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    case = builtin_case("mlp", batch=8)
    shared = SharedSteps()

    def grads(ids: list[int], **fields: Any) -> Any:
        return CHECKS["dp-grads"].check(_case(case.module, case.inputs, case.target, ids, shared, **fields))

    def summed(ids: list[int], parallel: Any = None) -> Any:
        return CHECKS["dp-grad-sum"].check(_case(case.module, case.inputs, case.target, ids, shared), Target(parallel=parallel))

    grads([0, 1])
    summed([0, 1])  # the same split and wrapper: shared
    assert counts["parallel"] == 1
    grads([0, 1])
    summed([0, 1, 2])  # another split
    grads([1, 0], output_device=0)
    summed([1, 0])  # outputs gathered on device 1, not 0
    assert counts["parallel"] == 5
    # another wrapper never gets this one's step: the averaging bug must be found
    grads([1, 0])
    with pytest.raises(ParallelMismatch, match=r"sum of replica grads '\S+': tensors are not close"):
        summed([1, 0], parallel=AveragingDataParallel)
    assert counts["parallel"] == 7


def test_a_wrapper_whose_attributes_changed_gets_a_fresh_parallel_step(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    case = builtin_case("mlp", batch=8)

    class Wrapper:
        def __init__(self) -> None:
            self.factor = 1.0

        def __call__(self, module: nn.Module, device_ids: list[int], output_device: int) -> Any:
            wrapped = dpverify.VirtualDataParallel(module, device_ids, output_device)
            for param in module.parameters():
                param.register_hook(lambda g: g * self.factor)
            return wrapped

    wrapper = Wrapper()
    dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=F.mse_loss, device_ids=[0, 1], parallel=wrapper)
    wrapper.factor = 0.5  # the accumulated gradients are now halved, the replicas' are not
    with pytest.raises(ParallelMismatch, match=r"accumulated grad '\S+'"):
        dpverify.assert_grad_sum_equals_mean_loss_grad(case.module, case.inputs, case.target, loss_fn=F.mse_loss, device_ids=[0, 1], parallel=wrapper)
    assert counts["parallel"] == 2


def test_a_failing_parallel_step_is_run_again_by_the_next_check(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_steps(monkeypatch)
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    x, y = torch.randn(3, 4), torch.randn(3, 1)
    for helper in (dpverify.assert_dp_grads_match, dpverify.assert_grad_sum_equals_mean_loss_grad):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
            helper(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1, 2])
        assert "raised by the parallel step" in "\n".join(caught.value.__notes__)
    assert counts == {"parallel": 2}


# --------------------------------------------------------------------------- second rounding sample


def _one_tensor_off() -> Any:
    """A wrapper that moves the first parameter's gradient by a relative 1e-3: a failing
    tensor, which gets the second sample where the module has no divergence source."""

    class Nudged(dpverify.VirtualDataParallel[Any]):
        def forward(self, *inputs: Any, **kwargs: Any) -> Any:
            first = next(self.module.parameters())
            if not getattr(first, "_nudged", False):
                first._nudged = True  # type: ignore[attr-defined]
                first.register_hook(lambda g: g * (1 + 1e-3))
            return super().forward(*inputs, **kwargs)

    return Nudged


@pytest.mark.parametrize("divergence", [False, True])
def test_the_second_rounding_sample_is_taken_only_without_divergence_sources(monkeypatch: pytest.MonkeyPatch, divergence: bool) -> None:
    counts = _count_steps(monkeypatch)
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)]
    if divergence:
        layers.insert(1, nn.Dropout(0.5))
    module = nn.Sequential(*layers)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    with pytest.raises(ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(module, x, y, loss_fn=F.mse_loss, device_ids=[0, 1], parallel=_one_tensor_off())
    jittered = counts.get("None jittered", 0)
    if divergence:
        # the mismatch names its likely cause whatever the rounding: no further step
        assert jittered == 0
        assert "Likely cause" in str(caught.value)
        assert "'1' (randomness): Dropout draws its own mask" in str(caught.value)
    else:
        assert jittered == 1
        assert "Likely cause" not in str(caught.value)
