"""``check --exact`` and ``fuzz --exact``: exact mode on the command line.

A model of the exact set passes bit for bit and every line says there is no tolerance; a
model outside it is a usage error naming the operation and its module, never a silent
fallback to the tolerance; a wrapper one unit in the last place off fails in exact mode and
passes in the default one.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from dpverify.cli.fuzz import (
    EXACT_MAX_STEPS,
    EXACT_OPTIMIZERS,
    FuzzConfig,
    exact_strategy,
    repro_script,
)
from dpverify.cli.main import EXACT_OPTIMIZER, main
from dpverify.exact.case import ExactCase, prove
from dpverify.exact.proof import proving
from dpverify.models.specs import DeviceList, LossSpec, ModelSpec, Scenario
from dpverify.models.training import TrainingScenario
from dpverify.planner import DEFAULT_BATCH_SIZES, EXACT_BATCH_SIZES, plan_checks
from dpverify.registry import Case, CheckSpec

#: Models of and outside the exact set, and a DataParallel one unit in the last place off.
EXACT_MODELS = textwrap.dedent(
    """
    import math

    import torch
    from torch import nn


    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


    def tanh_mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


    def _next_up(gradient):
        moved = gradient.clone()
        flat = moved.view(-1)
        k = int(flat.abs().argmax())
        flat[k] = torch.nextafter(flat[k], torch.tensor(math.inf, dtype=flat.dtype))
        return moved


    class OneUlp(nn.DataParallel):
        # the replicas' reduced gradient of the first weight, one element one ulp up
        def __init__(self, module, **kwargs):
            super().__init__(module, **kwargs)
            next(module.parameters()).register_hook(_next_up)


    def evaluate(model, loader):
        return 0.0
    """
)


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "exact_models.py").write_text(EXACT_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path


@pytest.fixture
def exact_runs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every check run's ``Case.exact``, in order."""
    seen: list[bool] = []
    original = CheckSpec.run

    def run(self: CheckSpec, case: Case, *args: Any, **kwargs: Any) -> Any:
        seen.append(case.exact)
        return original(self, case, *args, **kwargs)

    monkeypatch.setattr(CheckSpec, "run", run)
    return seen


# --------------------------------------------------------------------------- check --exact


def test_check_exact_passes_bit_for_bit_and_says_there_is_no_tolerance(
    models: Path, exact_runs: list[bool], capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(["check", "exact_models:mlp", "--loss", "mse", "--exact", "--no-color"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert exact_runs
    assert all(exact_runs)
    assert "Tolerance: none" in out
    verdicts = re.findall(r"^\[\s*\d+/\d+\] (\w+) .*?: (.*)$", out, re.MULTILINE)
    assert verdicts
    assert {summary for verdict, summary in verdicts if verdict == "PASS"} == {"bit-identical (exact mode, tolerance none)"}
    assert out.rstrip().splitlines()[-1].endswith("(exact mode, tolerance none)")
    # exact defaults: power-of-two batches, one step of SGD with one-bit numbers
    splits = set(re.findall(r"B=(\d+) on \d+", out))
    assert splits == {str(b) for b in EXACT_BATCH_SIZES}
    assert "1 optimizer step of SGD(lr=0.125, momentum=0.5)" in out
    assert "DP training, 1 step," in out


def test_check_without_exact_keeps_the_tolerance_and_its_defaults(models: Path, exact_runs: list[bool], capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["check", "exact_models:mlp", "--loss", "mse", "--checks", "dp-grads", "--no-color"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert exact_runs
    assert not any(exact_runs)
    assert "tolerance none" not in out
    assert set(re.findall(r"B=(\d+) on \d+", out)) == {str(b) for b in DEFAULT_BATCH_SIZES}


def test_check_exact_refuses_an_operation_outside_the_exact_set_naming_it_and_its_module(
    models: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(["check", "exact_models:tanh_mlp", "--loss", "mse", "--exact", "--checks", "dp-grads", "--no-color"])
    err = capsys.readouterr().err
    assert status == 2
    assert "exact=True: aten.tanh in the forward of module '1' (Tanh) is outside the exact set" in err
    assert "check without exact=True" in err


def test_check_exact_refuses_a_mean_over_a_batch_that_is_not_a_power_of_two(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["check", "exact_models:mlp", "--loss", "mse", "--exact", "--checks", "dp-grads", "--batch-sizes", "5", "--no-color"])
    err = capsys.readouterr().err
    assert status == 2
    assert "divides by 10, not a power of two" in err


def test_check_exact_refuses_an_optimizer_that_cannot_be_exact(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main([
        "check", "exact_models:mlp", "--loss", "mse", "--exact", "--checks", "dp-training", "--optimizer", "sgd:lr=0.1", "--no-color",
    ])
    err = capsys.readouterr().err
    assert status == 2
    assert "0.1" in err
    assert "short dyadic number" in err


def test_check_exact_refuses_the_metric_checks(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["check", "exact_models:mlp", "--loss", "mse", "--exact", "--eval", "exact_models:evaluate", "--no-color"])
    err = capsys.readouterr().err
    assert status == 2
    assert "--exact with --eval" in err


@pytest.mark.parametrize(("exact", "status"), [(True, 1), (False, 0)])
def test_one_ulp_in_one_gradient_element_fails_in_exact_mode_only(
    models: Path, exact: bool, status: int, capsys: pytest.CaptureFixture[str],
) -> None:
    command = [
        "check", "exact_models:mlp", "--loss", "mse", "--parallel", "exact_models:OneUlp", "--checks", "dp-grads",
        "--devices", "2", "--batch-sizes", "8", "--no-color",
    ]
    assert main(command + (["--exact"] if exact else [])) == status
    out = capsys.readouterr().out
    if exact:
        assert "FAIL" in out
        assert "0.weight" in out


def test_plan_checks_marks_every_case_exact_only_when_asked() -> None:
    from dpverify.models.user import builtin_model

    model = builtin_model("mlp", seed=0)
    exact = plan_checks(model, batch_sizes=(4,), device_counts=(2,), exact=True)
    default = plan_checks(model, batch_sizes=(4,), device_counts=(2,))
    assert exact
    assert all(planned.case.exact for planned in exact)
    assert default
    assert not any(planned.case.exact for planned in default)


def test_the_exact_optimizer_default_has_short_dyadic_numbers() -> None:
    from dpverify.models.training import OptimizerSpec

    spec = OptimizerSpec.parse(EXACT_OPTIMIZER, "--optimizer")
    for value in (spec.lr, spec.momentum):
        assert value > 0
        assert torch.frexp(torch.tensor(value)).mantissa.item() == 0.5  # a power of two: one significant bit


# --------------------------------------------------------------------------- fuzz --exact


def test_fuzz_exact_runs_every_check_in_exact_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exact_runs: list[bool], capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    # one worker: the checks record their runs in this process
    status = main(["fuzz", "--exact", "--max-examples", "6", "--seed", "3", "--devices", "3", "--workers", "1", "--no-color"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert exact_runs
    assert all(exact_runs)
    assert "tolerance none" in out.splitlines()[0]
    assert "OK: 6 examples" in out


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "tp", "pp", "all"])
def test_fuzz_exact_on_ranks_needs_a_power_of_two_of_them(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    status = main(["fuzz", "--exact", "--backend", backend, "--devices", "3", "--max-examples", "1", "--no-color"])
    assert status == 2
    assert f"--exact --backend {backend} --devices 3" in capsys.readouterr().err


@pytest.mark.deep
@pytest.mark.parametrize("backend", ["ddp", "fsdp", "tp", "pp"])
def test_fuzz_exact_runs_on_ranks(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exact_runs: list[bool], capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    status = main(["fuzz", "--exact", "--backend", backend, "--devices", "2", "--max-examples", "2", "--seed", "0", "--no-color"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert exact_runs
    assert all(exact_runs)


def _inside_the_exact_set(scenario: Scenario, steps: int, optimizer: Any, pieces: list[int]) -> None:
    """The drawn scenario's single-device step, its ``pieces`` and ``steps`` optimizer steps
    are all shown exact (else ``InvalidArgument``)."""
    built = scenario.build()
    case = ExactCase.of(built.module, tuple(built.inputs), built.target, built.kwargs)
    prove(case, scenario.loss, pieces=pieces)
    trained = torch.optim.SGD(case.module.parameters(), lr=optimizer.lr, momentum=optimizer.momentum, weight_decay=optimizer.weight_decay)
    with proving(case.module):
        for _ in range(steps):
            trained.zero_grad()
            scenario.loss(case.module(*case.args, **case.kwargs), case.target).backward()
            trained.step()


@pytest.mark.parametrize("backend", ["dp", "ddp", "fsdp", "tp", "pp"])
def test_fuzz_exact_draws_only_training_runs_of_the_exact_set(backend: str) -> None:
    @settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(exact_strategy(FuzzConfig(backend=backend, devices=2 if backend != "dp" else 4, exact=True)))
    def drawn(training: TrainingScenario) -> None:
        assert training.optimizer in EXACT_OPTIMIZERS
        assert training.clip is None
        assert training.steps <= EXACT_MAX_STEPS
        plain = training.plain
        world = len(plain.devices.device_ids)
        # the rows a mean divides by: the batch's (DataParallel gathers), else a rank's shard
        rows = plain.batch_size if backend in ("dp", "tp", "pp") else plain.batch_size // world
        if plain.loss.reduction == "mean":
            assert (rows * plain.model.outputs) & (rows * plain.model.outputs - 1) == 0, plain
        _inside_the_exact_set(plain, training.steps, training.optimizer, plain.chunk_sizes if backend == "dp" else [])

    drawn()


def test_a_repro_script_of_an_exact_session_runs_its_check_in_exact_mode(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    checked: list[bool] = []
    original = CheckSpec.check

    def check(self: CheckSpec, case: Case, *args: Any, **kwargs: Any) -> Any:
        checked.append(case.exact)
        return original(self, case, *args, **kwargs)

    monkeypatch.setattr(CheckSpec, "check", check)
    scenario = Scenario(ModelSpec(kind="mlp", activation="relu", outputs=2, train=False), 4, DeviceList((0, 1)), LossSpec("mse"))
    script = repro_script("dp-grads", scenario, target=None, exact=True)
    assert "dataclasses.replace(Case.from_scenario(scenario), exact=True)" in script
    exec(compile(script, "repro.py", "exec"), {"__name__": "__main__"})
    assert checked == [True]
    assert "passed: the failure does not reproduce" in capsys.readouterr().out
    plain = repro_script("dp-grads", scenario, target=None)
    assert "exact=True" not in plain
    assert "import dataclasses" not in plain


def test_the_exact_fuzz_config_keeps_its_examples_apart() -> None:
    config = FuzzConfig(backend="dp", devices=4)
    assert config.database_key != dataclasses.replace(config, exact=True).database_key
