"""``dpverify fuzz``, run as a user runs it, and the pieces it is made of."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpverify.cli.fuzz import CHECKS, FuzzConfig, fuzz, parse_duration, repro_script
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
    assert report.passed + sum(n for _, n in report.diverged) == 12
    assert {name for name, _ in report.diverged} <= {"BatchNorm", "Dropout"}


@pytest.mark.timeout(120)
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

    # the failure is replayed first next time
    again = _dpverify(*target, cwd=tmp_path)
    assert again.returncode == 1
    assert "replayed from the example database" in again.stdout
    assert again.stdout.splitlines()[-1] == "FAILED: a failure after 1 example (pass --seed S for a repeatable session)"


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
def test_ddp_step_target_fails_with_a_repro(tmp_path: Path) -> None:
    (tmp_path / "steps.py").write_text(PLANTED_STEP)
    result = _dpverify("fuzz", "--backend", "ddp", "--devices", "2", "--target", "steps:halved_step", "--max-examples", "10", "--seed", "0", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("dpverify fuzz: steps:halved_step (DDP step) on 2 DDP ranks (gloo)")
    assert "Counterexample (check 'ddp-grads'" in out
    assert "divided by the world size twice" in out
    repro = (tmp_path / out.split("Reproduce with: python ")[1].split()[0]).read_text()
    assert "from steps import halved_step as target" in repro
    assert "dpverify.assert_ddp_grads_match(" in repro
    assert "world_size=2, step=target" in repro
    assert 'if __name__ == "__main__":' in repro  # rank processes import the script


SCENARIOS = {
    "dp-grads": Scenario(ModelSpec(kind="mlp"), batch_size=5, devices=DeviceList((0, 1, 2))),
    "dp-grad-sum": Scenario(ModelSpec(kind="kwargs"), batch_size=3, devices=DeviceList((0, 1))),
    "dp-loss-average": Scenario(ModelSpec(kind="loss-head"), batch_size=5, devices=DeviceList((0, 1, 2, 3))),
    "dp-buffers": Scenario(ModelSpec(kind="batchnorm"), batch_size=6, devices=DeviceList((0, 1, 2))),
    "dp-state": Scenario(ModelSpec(kind="buffer-counter"), batch_size=5, devices=DeviceList((0, 1))),
    "ddp-grads": Scenario(ModelSpec(kind="linear"), batch_size=4, loss=LossSpec("mse")),
}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_every_repro_template_is_a_script_that_runs_the_check(check: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = repro_script(check, SCENARIOS[check], target=None, path=Path(".dpverify/repro_x.py"), expected="x")
    compile(script, "repro", "exec")
    assert f"scenario = {SCENARIOS[check]!r}" in script
    if check == "ddp-grads":
        assert "world_size=2, step=target" in script
        return  # needs rank processes; test_ddp_backend_session covers the check itself
    path = tmp_path / "repro.py"
    path.write_text(script)
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip() == "passed: the failure does not reproduce"


def test_repro_with_target_imports_it_from_the_fuzzed_directory() -> None:
    script = repro_script("dp-grads", SCENARIOS["dp-grads"], target="pkg.wrappers:MyDP", expected='a """quoted""" \\ line')
    assert "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))" in script
    assert "from pkg.wrappers import MyDP as target" in script
    assert "parallel=target" in script
    compile(script, "repro", "exec")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "x:y", "--backend", "all"], "--target fuzzes one backend"),
        (["--target", "no_such_module_here:X"], "--target 'no_such_module_here:X': cannot import"),
        (["--profile", "nope"], "--profile 'nope' is not a Hypothesis profile"),
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
