"""The sharded checks through the front ends: the registry, ``dpverify check --backend
fsdp|tp|pp`` and ``dpverify fuzz --backend fsdp|tp|pp``, with repro scripts that raise what
the session saw."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpverify.cli.fuzz import SHARDED_CHECKS, FuzzConfig, fuzz
from dpverify.cli.main import main
from dpverify.models.layouts import PipelineLayout, TPLayout
from dpverify.registry import CHECKS, Case, Verdict

SHARDED = ("fsdp-grads", "fsdp-training", "tp-grads", "pp-grads")


def _case(layout: object = None, *, world: int = 2, rows: int = 8, hidden: int = 4) -> Case:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(rows, 3), torch.randn(rows, 2)
    return Case(module, (x,), y, F.mse_loss, tuple(range(world)), layout=layout)  # type: ignore[arg-type]


def test_the_sharded_checks_are_registered_under_their_backends() -> None:
    assert {CHECKS[name].backend for name in SHARDED} == {"fsdp", "tp", "pp"}
    assert set(SHARDED_CHECKS) == {"fsdp", "tp", "pp"}
    assert all(name in CHECKS for names in SHARDED_CHECKS.values() for name in names)


@pytest.mark.parametrize("name", SHARDED)
def test_each_sharded_check_passes_torchs_own_code_with_its_default_layout(name: str) -> None:
    result = CHECKS[name].run(_case())
    assert result.verdict is Verdict.PASS, result.detail
    assert result.tensors, "a pass rests on compared tensors"


def test_a_case_layout_is_what_the_check_runs() -> None:
    # the plan shards the second pair only; the scenario line says what ran
    report = CHECKS["tp-grads"].check(_case(TPLayout((("2", "4"),)), hidden=4))
    plan = report.scenario.split("plan ", 1)[1].split(" on a mesh", 1)[0]
    assert "'2': ColwiseParallel" in plan
    assert "'4': RowwiseParallel" in plan
    assert "'0'" not in plan
    pipeline = CHECKS["pp-grads"].check(_case(PipelineLayout((1,), 2, "1f1b")))
    assert "Schedule1F1B" in pipeline.scenario


def test_sharded_checks_skip_saying_why_a_model_cannot_be_laid_out() -> None:
    conv = Case(nn.Conv1d(2, 4, 3), (torch.randn(4, 2, 5),), torch.randn(4, 4, 3), F.mse_loss, (0, 1))
    assert "nn.Sequential" in str(CHECKS["pp-grads"].why_not(conv))
    assert "no Linear -> elementwise -> Linear pair" in str(CHECKS["tp-grads"].why_not(conv))
    odd = _case(rows=6)
    assert CHECKS["pp-grads"].why_not(odd) is None  # 6 rows: 3 equal microbatches
    few = _case(rows=1, world=2)
    assert "fewer rows than ranks" in str(CHECKS["fsdp-grads"].why_not(few))


def test_check_runs_each_sharded_backend_on_a_users_model(capsys: pytest.CaptureFixture[str]) -> None:
    for backend, title in (("fsdp", "FSDP2 grads match one device"), ("tp", "TP grads match one device"), ("pp", "pipeline grads match one device")):
        code = main(["check", "--model", "mlp", "--backend", backend, "--batch-sizes", "8", "--devices", "2", "--no-color"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert title in out
        assert "PASS" in out


#: A module with the code under test for the fuzz sessions (importable by the rank processes).
PLANTED = textwrap.dedent(
    """
    from dpverify.mutants.sharded import NoAllReduceRowwiseParallel


    def no_allreduce_plan(layout, module):
        return layout.plan(rowwise=NoAllReduceRowwiseParallel)
    """
)


@pytest.mark.parametrize("backend", ["fsdp", "tp", "pp"])
def test_a_fuzz_session_of_each_sharded_backend_passes_torchs_own_code(backend: str, tmp_path: Path) -> None:
    report = fuzz(FuzzConfig(backend=backend, devices=2, max_examples=4, seed=0, state_dir=tmp_path))
    assert report.ok, report.failure and report.failure.report
    assert report.examples == 4
    assert report.passed == 4


def test_a_fuzz_session_catches_a_broken_step_or_schedule_and_writes_its_repro(tmp_path: Path) -> None:
    from dpverify.mutants.sharded import UnscaledGPipe, fsdp_undivided_step

    for backend, target, obj, field in (
        ("fsdp", "dpverify.mutants.sharded:fsdp_undivided_step", fsdp_undivided_step, "step"),
        ("pp", "dpverify.mutants.sharded:UnscaledGPipe", UnscaledGPipe, "schedule"),
    ):
        config = FuzzConfig(backend=backend, devices=2, max_examples=10, seed=0, target=target, target_object=obj, state_dir=tmp_path / backend)
        report = fuzz(config)
        assert report.failure is not None, backend
        assert report.failure.check == SHARDED_CHECKS[backend][0]
        script = report.failure.repro.read_text()
        assert f"from {target.split(':')[0]} import {target.split(':')[1]} as target" in script
        assert f"Target({field}=target)" in script
        assert "from dpverify.models.layouts import" in script


@pytest.mark.timeout(240)
@pytest.mark.deep
def test_a_fuzz_session_catches_a_broken_plan_and_its_repro_raises_the_same(tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(PLANTED)
    command = [sys.executable, "-m", "dpverify", "fuzz", "--backend", "tp", "--devices", "2", "--target", "planted:no_allreduce_plan", "--max-examples", "10", "--seed", "0", "--no-color"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=200, check=False)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert out.startswith("dpverify fuzz: planted:no_allreduce_plan (plan builder) on 2 ranks (gloo)")
    assert "Counterexample (check 'tp-grads'" in out
    path = tmp_path / out.split("Reproduce with: python ")[1].split()[0]
    assert "Target(plan=target)" in path.read_text()
    ran = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=150, check=False)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    head = out.split("Full report:\n")[1].splitlines()[0]
    assert f"dpverify.core.errors.ParallelMismatch: {head}" in ran.stderr.splitlines()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fuzz", "--backend", "tp", "--parallel", "x:y"], "--parallel is a DataParallel-like wrapper, for --backend dp"),
        (["fuzz", "--backend", "pp", "--parallel-loss", "x:y"], "--backend pp fuzzes ranks that compute their own loss"),
        (["check", "--model", "mlp", "--backend", "fsdp", "--parallel-loss", "x:y"], "the fsdp checks compute the loss on each rank"),
    ],
)
def test_dataparallel_options_with_a_sharded_backend_are_usage_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err
