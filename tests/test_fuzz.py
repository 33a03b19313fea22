"""``dpverify fuzz``, run as a user runs it, and the pieces it is made of."""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from dpverify.cli import fuzz as engine
from dpverify.cli.fuzz import (
    DDP_CHECKS,
    DP_CHECKS,
    FuzzConfig,
    Outcome,
    Tally,
    _CheckFailed,
    _error_line,
    _example_runner,
    _failure,
    _on_ranks,
    fuzz,
    parse_duration,
    repro_script,
)
from dpverify.registry import CHECKS, Case
from dpverify.strategies import DeviceList, LossSpec, ModelSpec, Scenario

#: A DataParallel-like wrapper with a planted bug: it averages replica gradients.
PLANTED = textwrap.dedent(
    """
    from typing import Any

    from dpverify import VirtualDataParallel


    class AveragingDataParallel(VirtualDataParallel[Any]):
        def replicate(self, module, device_ids):
            replicas = super().replicate(module, device_ids)
            for replica in replicas:
                for sub in replica.modules():
                    for name in sub._former_parameters:
                        tensor = getattr(sub, name)
                        if tensor.requires_grad:
                            tensor.register_hook(lambda g, n=len(replicas): g / n)
            return replicas
    """
)


def _dpverify(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpverify", *args, "--no-color"],
        capture_output=True, text=True, timeout=240, check=False, cwd=cwd,
    )


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90.0), ("10m", 600.0), ("1h", 3600.0), ("45", 45.0), ("1.5m", 90.0)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten", "10x", "0s", "-5m"])
def test_bad_durations_name_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"e\.g\. 90s, 10m, 1h"):
        parse_duration(text)


@pytest.mark.timeout(120)
@pytest.mark.deep
def test_a_passing_session_within_a_time_budget(tmp_path: Path) -> None:
    # seeded: the examples, though not their number within the budget, are the same every run
    result = _dpverify("fuzz", "--time-budget", "3s", "--seed", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("dpverify fuzz: torch.nn.DataParallel on virtual devices 0-3")
    assert "seed 0 (a seeded session does not use the example database)" in lines[0]
    assert any(line.split()[:1] == ["passed"] for line in lines)
    assert lines[-1].startswith("OK: ")
    assert "time budget reached" in lines[-1]
    assert "\x1b[" not in result.stdout  # no escape codes when stdout is not a terminal


def test_max_examples_and_outcome_classes(tmp_path: Path) -> None:
    seen: list[int] = []
    report = fuzz(FuzzConfig(max_examples=12, seed=7, state_dir=tmp_path), on_example=lambda t: seen.append(t.run))
    assert report.ok
    assert report.stopped_by == "max-examples"
    assert report.examples == 12 == seen[-1]
    assert report.passed + report.serial + sum(n for _, n in report.diverged) == 12
    assert {name for name, _ in report.diverged} <= {"BatchNorm", "Dropout"}


def test_a_ctrl_c_whose_keyboard_interrupt_is_lost_still_stops_the_session_at_the_next_example(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Python cannot raise out of a finalizer or a gc callback (Hypothesis has one): a Ctrl-C
    that lands there is handed to sys.unraisablehook, which printed a traceback, and the
    session ran on. Here one lands in a finalizer after the third example: the session
    notes it, stops at the next example, and prints no traceback."""
    import os
    import signal

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # the handler runs here, inside the finalizer

    def ctrl_c_in_a_finalizer(tally: Tally) -> None:
        if tally.run == 3:
            Finalized()

    report = fuzz(FuzzConfig(max_examples=50, seed=0, state_dir=tmp_path), on_example=ctrl_c_in_a_finalizer)
    assert report.stopped_by == "interrupt"
    assert report.examples == 3
    assert "KeyboardInterrupt" not in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_an_example_that_ran_one_replica_is_not_counted_as_passed(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """On one device every check is skipped (nothing ran in parallel): such examples are
    counted apart, never as passes, and a session of nothing else checked nothing (exit 3)."""
    report = fuzz(FuzzConfig(max_examples=5, seed=0, devices=1, state_dir=tmp_path))
    assert report.serial == report.examples == 5
    assert report.passed == 0
    assert {example.outcome for example in report.history} == {"nothing parallel"}
    from dpverify.cli.main import main

    monkeypatch.chdir(tmp_path)  # the command keeps its state in ./.dpverify
    assert main(["fuzz", "--devices", "1", "--max-examples", "3", "--seed", "0", "--no-color"]) == 3
    out = capsys.readouterr().out
    assert "NOTHING CHECKED: 3 examples, none ran in parallel" in out
    mixed = fuzz(FuzzConfig(max_examples=30, seed=1, devices=2, state_dir=tmp_path))
    assert mixed.ok
    assert mixed.passed > 0
    assert mixed.serial == sum(1 for example in mixed.history if example.outcome == "nothing parallel")


@pytest.mark.timeout(120)
@pytest.mark.deep
def test_planted_wrapper_fails_shrinks_and_its_repro_fails_the_same_way(tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(PLANTED)
    # Unseeded, so that the failure goes to the example database (Hypothesis keeps none for a
    # seeded run). The session stops at the first failure; 300 examples make missing the bug
    # (found within 6 examples on every seed measured) practically impossible.
    target = ["fuzz", "--target", "planted:AveragingDataParallel", "--max-examples", "300"]
    first = _dpverify(*target, cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    out = first.stdout
    assert "Counterexample (check 'dp-grads'" in out
    spec = next(line for line in out.splitlines() if line.startswith("Scenario("))
    # shrunk to one Linear layer and a few rows on two or more devices (Hypothesis's shrinker
    # usually reaches 2 rows, the fewest that give two replicas, but does not promise it)
    assert spec.startswith("Scenario(model=ModelSpec(kind='linear', features=1, hidden=1, outputs=1")
    shrunk = re.search(r"batch_size=(\d+), devices=DeviceList\(device_ids=\(\d(, \d)+\)", spec)
    assert shrunk, spec
    assert int(shrunk.group(1)) <= 4, spec
    assert spec.endswith("loss=LossSpec(name='mse', reduction='mean'), dtype=torch.float32, seed=0)")
    assert "the replica gradients were averaged" in out
    assert out.splitlines()[-1].startswith("FAILED: a failure after ")
    repro = out.split("Reproduce with: python ")[1].split()[0]
    assert (tmp_path / ".dpverify" / "examples").is_dir()

    # the repro script runs alone, from anywhere, and raises the same mismatch
    ran = subprocess.run([sys.executable, str(tmp_path / repro)], capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 1
    report_head = out.split("Full report:\n")[1].splitlines()[0]
    assert f"dpverify.core.errors.ParallelMismatch: {report_head}" in ran.stderr
    assert "the replica gradients were averaged" in ran.stderr

    # the failure is replayed first next time: in one process, the saved examples run before
    # any new one, and the failure is one of them. Both workers of the first session may have
    # saved examples (a worker stopped mid-shrink keeps its candidates), so which comes first
    # is not fixed: the failure comes within the saved ones
    saved = sum(1 for entry in (tmp_path / ".dpverify" / "examples").rglob("*") if entry.is_file())
    again = _dpverify(*target, "--workers", "1", cwd=tmp_path)
    assert again.returncode == 1
    assert "replayed from the example database" in again.stdout
    count = re.search(r"^FAILED: a failure after (\d+) examples? \(pass --seed S for a repeatable session\)$", again.stdout.splitlines()[-1])
    assert count, again.stdout.splitlines()[-1]
    assert 1 <= int(count.group(1)) <= saved


#: A DDP step with a planted bug: it divides the loss by the world size, on top of DDP's average.
PLANTED_STEP = textwrap.dedent(
    """
    def halved_step(ctx):
        model = ctx.ddp()
        output = model(*ctx.inputs)
        (ctx.loss_fn(output, ctx.target) / ctx.world_size).backward()
        return output
    """
)


@pytest.mark.timeout(180)
def test_ddp_backend_session_passes(tmp_path: Path) -> None:
    report = fuzz(FuzzConfig(backend="ddp", devices=2, max_examples=4, seed=0, state_dir=tmp_path))
    assert report.ok
    assert report.examples == 4


@pytest.mark.timeout(180)
@pytest.mark.deep
def test_ddp_step_target_fails_with_a_repro(tmp_path: Path) -> None:
    (tmp_path / "steps.py").write_text(PLANTED_STEP)
    result = _dpverify("fuzz", "--backend", "ddp", "--devices", "2", "--target", "steps:halved_step", "--max-examples", "10", "--seed", "0", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("dpverify fuzz: steps:halved_step (DDP step) on 2 DDP ranks (gloo)")
    assert "Counterexample (check 'ddp-grads'" in out
    assert "divided by the world size twice" in out
    path = tmp_path / out.split("Reproduce with: python ")[1].split()[0]
    repro = path.read_text()
    assert "from steps import halved_step as target" in repro
    assert 'CHECKS["ddp-grads"].check(Case.from_scenario(scenario), Target(step=target))' in repro
    assert "devices=DeviceList(device_ids=(0, 1)" in repro  # the world size the session ran
    assert 'if __name__ == "__main__":' in repro  # rank processes import the script
    # run from elsewhere, it raises what the session reported
    ran = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=150, check=False)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    report_head = out.split("Full report:\n")[1].splitlines()[0]
    assert f"dpverify.core.errors.ParallelMismatch: {report_head}" in ran.stderr.splitlines()


#: Planted bugs, one module: an importable ``--target`` for the session and its repro scripts.
PLANTED_TARGETS = PLANTED + textwrap.dedent(
    """
    from torch import nn


    class Raising(nn.DataParallel):
        def forward(self, *inputs, **kwargs):
            raise RuntimeError("the wrapper broke")


    class EvalAveraging(AveragingDataParallel):
        \"\"\"Right in train mode, averaging in eval mode: only the eval-mode copy fails.\"\"\"

        def replicate(self, module, device_ids):
            if module.training:
                return VirtualDataParallel.replicate(self, module, device_ids)
            return super().replicate(module, device_ids)
    """
) + PLANTED_STEP

#: torch's DataParallel with a planted bug: the module runs once on the whole batch.
WHOLE_BATCH = "import dpverify.core.virtual as v; v.data_parallel = lambda module, ids, output_device=None: module"

#: For each check a session runs: a scenario it applies to, and the planted target that makes
#: it fail (None: torch's own, broken by ``WHOLE_BATCH``).
FAILING = {
    "dp-grads": (Scenario(ModelSpec(kind="mlp"), batch_size=5, devices=DeviceList((0, 1, 2))), "AveragingDataParallel"),
    "dp-grad-sum": (Scenario(ModelSpec(kind="kwargs"), batch_size=3, devices=DeviceList((0, 1))), "AveragingDataParallel"),
    "dp-loss-average": (Scenario(ModelSpec(kind="loss-head"), batch_size=5, devices=DeviceList((0, 1, 2, 3))), "Raising"),
    "dp-weighted-loss": (Scenario(ModelSpec(kind="loss-head"), batch_size=5, devices=DeviceList((0, 1, 2))), "AveragingDataParallel"),
    "dp-buffers": (Scenario(ModelSpec(kind="batchnorm"), batch_size=6, devices=DeviceList((0, 1, 2))), "Raising"),
    "dp-state": (Scenario(ModelSpec(kind="buffer-counter"), batch_size=5, devices=DeviceList((0, 1))), None),
    "ddp-grads": (Scenario(ModelSpec(kind="linear"), batch_size=4, devices=DeviceList((0, 1)), loss=LossSpec("mse")), "halved_step"),
}


def _planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str | None) -> Any:
    """The planted target ``name`` (None: none), importable here and in rank processes, from
    ``tmp_path/fuzzed``: the directory a session would run in, whose ``.dpverify`` folder
    the repro scripts are written to."""
    if name is None:
        return None
    (tmp_path / "fuzzed").mkdir(exist_ok=True)
    (tmp_path / "fuzzed" / "planted_targets.py").write_text(PLANTED_TARGETS)
    monkeypatch.syspath_prepend(str(tmp_path / "fuzzed"))
    sys.modules.pop("planted_targets", None)
    return getattr(importlib.import_module("planted_targets"), name)


def _run_script(path: Path, *, patch: str = "") -> subprocess.CompletedProcess[str]:
    """Runs a repro script from outside the fuzzed directory, as a user may (``patch``
    first)."""
    run = f"{patch}; import runpy; runpy.run_path({str(path)!r}, run_name='__main__')" if patch else None
    command = [sys.executable, "-c", run] if run else [sys.executable, str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=150, check=False, cwd=path.parent.parent.parent)


def test_the_session_runs_registry_checks() -> None:
    assert set(FAILING) == {*DP_CHECKS, *DDP_CHECKS}
    assert {*DP_CHECKS, *DDP_CHECKS} <= set(CHECKS)
    assert {CHECKS[name].backend for name in DP_CHECKS} == {"dp"}
    assert {CHECKS[name].backend for name in DDP_CHECKS} == {"ddp"}
    assert engine.CHECKS is CHECKS  # one table of checks: the registry's


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", sorted(FAILING))
@pytest.mark.deep
def test_every_check_s_repro_script_raises_what_the_session_saw(check: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario, planted = FAILING[check]
    ddp = check in DDP_CHECKS
    target = _planted(tmp_path, monkeypatch, planted)
    if planted is None:
        monkeypatch.setattr("dpverify.core.virtual.data_parallel", lambda module, ids, output_device=None: module)
    # the session's own path: the example fails at this check, and the failure writes its repro
    monkeypatch.setattr(engine, "DDP_CHECKS" if ddp else "DP_CHECKS", (check,))
    config = FuzzConfig(
        backend="ddp" if ddp else "dp", devices=2, target=planted and f"planted_targets:{planted}",
        target_object=target, state_dir=tmp_path / "fuzzed" / ".dpverify",
    )
    with pytest.raises(_CheckFailed) as failed:
        _example_runner(config)(scenario)
    assert failed.value.check == check
    tally = Tally()
    tally.record(failed.value)
    failure = _failure(config, tally, replayable=0)
    script = failure.repro.read_text()
    field = "step" if ddp else "parallel"
    assert f'CHECKS["{check}"].check(Case.from_scenario(scenario), Target({field}=target))' in script
    assert f"scenario = {scenario!r}" in script
    assert "dpverify.strategies" not in script  # torch and dpverify only, no Hypothesis
    expected = _error_line(failed.value.error)
    assert expected in script  # its docstring says what it raises

    # run alone, from elsewhere, with the bug: the same error
    ran = _run_script(failure.repro, patch="" if planted else WHOLE_BATCH)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert expected in ran.stderr.splitlines()  # the traceback's exception line
    assert "passed" not in ran.stdout
    # without it (torch's own code), the same script passes
    clean = failure.repro.with_name("repro_clean.py")
    clean.write_text(repro_script(check, scenario, target=None))
    passed = _run_script(clean)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.strip() == "passed: the failure does not reproduce"


@pytest.mark.deep
def test_an_eval_mode_failure_is_reproduced_on_the_eval_mode_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = _planted(tmp_path, monkeypatch, "EvalAveraging")
    scenario = Scenario(ModelSpec(kind="batchnorm"), batch_size=6, devices=DeviceList((0, 1, 2)))
    config = FuzzConfig(target="planted_targets:EvalAveraging", target_object=wrapper, state_dir=tmp_path / "fuzzed" / ".dpverify")
    with pytest.raises(_CheckFailed) as failed:
        _example_runner(config)(scenario)
    assert (failed.value.check, failed.value.eval_mode) == ("dp-grads", True)
    tally = Tally()
    tally.record(failed.value)
    failure = _failure(config, tally, replayable=0)
    assert failure.report.startswith("On the eval-mode copy")
    script = failure.repro.read_text()
    assert 'CHECKS["dp-grads"].check(Case.from_scenario(scenario).in_eval_mode(), Target(parallel=target))' in script
    ran = _run_script(failure.repro)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert _error_line(failed.value.error) in ran.stderr.splitlines()
    assert "the replica gradients were averaged" in ran.stderr


@pytest.mark.parametrize(
    ("scenario", "diverged"),
    [
        (Scenario(ModelSpec(kind="mlp"), batch_size=5, devices=DeviceList((0, 1, 2))), ()),
        (Scenario(ModelSpec(kind="batchnorm"), batch_size=6, devices=DeviceList((0, 1, 2))), ("BatchNorm",)),
        # a one-row chunk: train-mode BatchNorm raises, which is explained too
        (Scenario(ModelSpec(kind="batchnorm"), batch_size=3, devices=DeviceList((0, 1, 2))), ("BatchNorm",)),
        (Scenario(ModelSpec(kind="dropout"), batch_size=6, devices=DeviceList((0, 1))), ("Dropout",)),
        (Scenario(ModelSpec(kind="batchnorm", train=False), batch_size=6, devices=DeviceList((0, 1, 2))), ()),
    ],
)
def test_expected_divergences_are_counted_by_module_class(scenario: Scenario, diverged: tuple[str, ...]) -> None:
    outcome = _example_runner(FuzzConfig())(scenario)
    assert outcome.diverged == diverged
    # every one of these compares tensors; the ratio is the run that had to match (the
    # eval-mode copy's for a divergence, whose train-mode difference is far beyond 1)
    assert outcome.worst_ratio is not None
    assert 0.0 <= outcome.worst_ratio < 1.0


def test_an_example_s_ratio_is_the_worst_of_its_checks_and_none_without_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    ratios = {"dp-grads": 0.25, "dp-grad-sum": None}

    def record(name: str, scenario: Scenario, target: object) -> Outcome:
        return Outcome(worst_ratio=ratios[name])

    monkeypatch.setattr(engine, "_run_check", record)
    run = _example_runner(FuzzConfig())
    mlp = Scenario(ModelSpec(kind="mlp"), batch_size=4, devices=DeviceList((0, 1)))
    assert run(mlp) == Outcome((), 0.25)
    ratios["dp-grad-sum"] = 0.5
    assert run(mlp) == Outcome((), 0.5)
    ratios["dp-grads"] = ratios["dp-grad-sum"] = None
    assert run(mlp) == Outcome((), None)
    assert Outcome(("Dropout",), 0.1) | Outcome(("BatchNorm",), None) == Outcome(("BatchNorm", "Dropout"), 0.1)


def test_a_failure_s_ratio_is_the_failing_result_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario, planted = FAILING["dp-grads"]
    config = FuzzConfig(target_object=_planted(tmp_path, monkeypatch, planted), target="planted_targets:x")
    with pytest.raises(_CheckFailed) as failed:
        _example_runner(config)(scenario)
    ratio = failed.value.worst_ratio
    assert ratio is not None
    assert ratio > 1.0  # averaged gradients: far beyond rounding
    assert ratio == max(t.ratio for t in failed.value.result.tensors if t.problem is None)
    # a wrapper that raises compares nothing: no ratio
    config = FuzzConfig(target_object=_planted(tmp_path, monkeypatch, "Raising"), target="planted_targets:Raising")
    with pytest.raises(_CheckFailed) as raised:
        _example_runner(config)(scenario)
    assert raised.value.worst_ratio is None


@pytest.mark.parametrize(
    ("kind", "torch_wrapper", "checks"),
    [
        ("mlp", True, ["dp-grads", "dp-grad-sum"]),
        ("loss-head", True, ["dp-loss-average", "dp-weighted-loss"]),
        ("batchnorm", True, ["dp-grads", "dp-buffers"]),
        ("dropout", True, ["dp-grads"]),
        ("buffer-counter", True, ["dp-grads", "dp-grad-sum", "dp-buffers", "dp-state"]),
        ("buffer-counter", False, ["dp-grads", "dp-grad-sum", "dp-buffers"]),
        ("attribute-counter", True, ["dp-grads", "dp-grad-sum", "dp-state"]),
    ],
)
def test_which_checks_a_dp_example_runs(kind: str, torch_wrapper: bool, checks: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def record(name: str, scenario: Scenario, target: object) -> Outcome:
        ran.append(name)
        return Outcome()

    monkeypatch.setattr(engine, "_run_check", record)
    config = FuzzConfig(target=None if torch_wrapper else "x:y")
    _example_runner(config)(Scenario(ModelSpec(kind=kind), batch_size=4, devices=DeviceList((0, 1))))
    assert ran == checks


def test_ddp_examples_run_on_one_device_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, Scenario]] = []

    def record(name: str, scenario: Scenario, target: object) -> Outcome:
        ran.append((name, scenario))
        return Outcome()

    monkeypatch.setattr(engine, "_run_check", record)
    drawn = Scenario(ModelSpec(kind="mlp"), batch_size=4, devices=DeviceList((0, 1), output_device=1))
    _example_runner(FuzzConfig(backend="all", devices=3))(drawn)
    # DataParallel on the drawn devices, DDP on --devices ranks: its Case has that world size
    assert [(name, s.devices) for name, s in ran] == [
        ("dp-grads", drawn.devices), ("dp-grad-sum", drawn.devices), ("ddp-grads", DeviceList((0, 1, 2))),
    ]
    assert Case.from_scenario(ran[-1][1]).world_size == 3
    assert _on_ranks(ran[-1][1], 3) is ran[-1][1]
    # fewer rows than ranks, or a summed loss: not DDP's contract, no DDP check
    for devices, scenario in ((5, drawn), (3, dataclasses.replace(drawn, loss=LossSpec("mse", "sum")))):
        ran.clear()
        _example_runner(FuzzConfig(backend="all", devices=devices))(scenario)
        assert [name for name, _ in ran] == ["dp-grads", "dp-grad-sum"]


def test_repro_with_target_imports_it_from_the_fuzzed_directory() -> None:
    scenario = FAILING["dp-grads"][0]
    script = repro_script("dp-grads", scenario, target="pkg.wrappers:MyDP", expected='a """quoted""" \\ line')
    assert "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))" in script
    assert "from pkg.wrappers import MyDP as target" in script
    assert "Target(parallel=target)" in script
    compile(script, "repro", "exec")


def test_repro_of_a_pair_imports_the_criterion_wrapper_too() -> None:
    scenario = FAILING["dp-grads"][0]
    alone = repro_script("dp-grads", scenario, target=None, parallel_loss="pkg.losses:Criterion")
    assert "target = None  # torch's own DataParallel / DistributedDataParallel" in alone
    assert "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))" in alone
    assert "from pkg.losses import Criterion as parallel_loss" in alone
    assert "Target(parallel=target, parallel_loss=parallel_loss)" in alone
    compile(alone, "repro", "exec")
    pair = repro_script("dp-grads", scenario, target="pkg.wrappers:MyDP", parallel_loss="pkg.losses:Criterion")
    assert "from pkg.wrappers import MyDP as target" in pair
    assert "target = None" not in pair
    compile(pair, "repro", "exec")


def test_a_criterion_wrapper_is_fuzzed_with_mean_losses_and_no_loss_in_forward(tmp_path: Path) -> None:
    from hypothesis import given, settings

    seen: list[Scenario] = []
    config = FuzzConfig(parallel_loss="m:c", parallel_loss_object=object(), state_dir=tmp_path)

    @settings(max_examples=60, database=None, deadline=None)
    @given(engine.scenario_strategy(config))
    def draw(scenario: Scenario) -> None:
        seen.append(scenario)

    draw()
    assert {s.loss.reduction for s in seen} == {"mean"}
    assert "loss-head" not in {s.model.kind for s in seen}
    assert FuzzConfig(parallel_loss="m:c").database_key != FuzzConfig().database_key


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "x:y", "--backend", "all"], "--target fuzzes one backend"),
        (["--target", "no_such_module_here:X"], "--target 'no_such_module_here:X': cannot import"),
        (["--profile", "nope"], "--profile 'nope' is not a Hypothesis profile"),
        (["--parallel", "x:y", "--target", "a:b"], "give either --parallel (a DataParallel-like wrapper) or --target, not both"),
        (["--parallel", "x:y", "--backend", "ddp"], "--parallel is a DataParallel-like wrapper, for --backend dp"),
        (["--parallel-loss", "x:y", "--backend", "ddp"], "--parallel-loss is a DataParallel criterion wrapper, for --backend dp"),
    ],
)
def test_usage_errors_exit_two_naming_the_option(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dpverify.cli.main import main

    assert main(["fuzz", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [(["--time-budget", "ten"], "'ten' is not a duration"), (["--devices", "0"], "--devices '0' must be a positive integer")])
def test_bad_values_are_argparse_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dpverify.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fuzz", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


#: A wrapper that always raises: every session fails at its first example.
RAISING = textwrap.dedent(
    """
    from torch import nn


    class Raising(nn.DataParallel):
        def forward(self, *inputs, **kwargs):
            raise RuntimeError("the wrapper broke")
    """
)


def test_a_failure_is_said_to_be_replayed_only_when_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from dpverify.cli.main import main

    (tmp_path / "raising_wrapper.py").write_text(RAISING)
    monkeypatch.chdir(tmp_path)
    session = ["fuzz", "--target", "raising_wrapper:Raising", "--max-examples", "5", "--no-color"]
    # seeded: the example database is neither read nor written
    assert main([*session, "--seed", "0"]) == 1
    seeded = capsys.readouterr().out
    assert "replayed from the example database" not in seeded
    assert "found at example 1 of a seeded session (the example database is not used)" in seeded
    # unseeded, with nothing saved yet: generated, not replayed; the next session replays it
    assert main(session) == 1
    first = capsys.readouterr().out
    assert "replayed from the example database" not in first
    assert "Counterexample (check 'dp-grads', found at example 1, shrunk)" in first
    assert main(session) == 1
    assert "Counterexample (check 'dp-grads', replayed from the example database, shrunk)" in capsys.readouterr().out
    # seeded again, with the failure now saved: still not read, so not "replayed"
    assert main([*session, "--seed", "0"]) == 1
    seeded_again = capsys.readouterr().out
    assert "replayed from the example database" not in seeded_again
    assert "found at example 1 of a seeded session (the example database is not used)" in seeded_again


def test_parallel_is_the_dataparallel_spelling_of_target(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from dpverify.cli.main import main

    monkeypatch.chdir(tmp_path)
    args = ["fuzz", "--max-examples", "5", "--seed", "0", "--no-color"]
    assert main([*args, "--parallel", "dpverify.mutants:ScratchDataParallel"]) == 0
    assert "dpverify.mutants:ScratchDataParallel" in capsys.readouterr().out
    assert main([*args, "--parallel", "dpverify.mutants:AveragingDataParallel"]) == 1
    assert "the replica gradients were averaged" in capsys.readouterr().out
