"""The command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpverify", *args], capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.timeout(240)
def test_verify_prints_a_verdict_and_exits_zero() -> None:
    result = _run("verify")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("dpverify verify: DataParallel on ")
    assert sum(line.lstrip().startswith("PASS") for line in lines) == 24
    assert lines[-1].startswith("OK: 24 passed, 0 failed in ")
    assert "loss.mean() bias +0.133 (chunks [2, 2, 1])" in result.stdout
    assert result.stderr == ""


def test_verify_subset_and_unknown_model() -> None:
    ok = _run("verify", "--models", "conv")
    assert ok.returncode == 0
    assert ok.stdout.splitlines()[-1].startswith("OK: 6 passed, 0 failed")
    bad = _run("verify", "--models", "resnet")
    assert bad.returncode == 2
    assert "unknown --models ['resnet']" in bad.stderr


def test_no_command_prints_help_and_exits_two() -> None:
    result = _run()
    assert result.returncode == 2
    for command in ("verify", "fuzz", "check", "explain"):
        assert command in result.stdout


def test_the_console_script_is_python_m_dpverify() -> None:
    import os
    from pathlib import Path

    script = Path(sys.executable).with_name("dpverify")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable}")
    env = {**os.environ, "COLUMNS": "100"}
    by_script = subprocess.run([str(script), "fuzz", "--help"], capture_output=True, text=True, timeout=120, check=False, env=env)
    by_module = subprocess.run([sys.executable, "-m", "dpverify", "fuzz", "--help"], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert by_script.returncode == by_module.returncode == 0
    assert by_script.stdout == by_module.stdout
    assert "--time-budget DURATION" in by_module.stdout


def test_verify_a_wrong_wrapper_fails_with_the_reason() -> None:
    result = _run("verify", "--models", "mlp", "--parallel", "dpverify.mutants:AveragingDataParallel")
    assert result.returncode == 1
    assert "FAIL  mlp" in result.stdout
    assert "the replica gradients were averaged" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("FAILED: ")


def test_verify_bad_parallel_option() -> None:
    result = _run("verify", "--parallel", "no_such_module:X")
    assert result.returncode == 1
    assert "--parallel 'no_such_module:X': cannot import 'no_such_module'" in result.stderr


@pytest.mark.timeout(240)
def test_ddp_selftest_subcommand_runs_a_local_pool() -> None:
    result = _run("ddp-selftest", "--world-size", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK, 12 of 12 checks passed on 2 ranks (gloo)" in result.stdout
    assert "ddp-selftest" in _run("--help").stdout


def test_ddp_selftest_bad_world_size() -> None:
    result = _run("ddp-selftest", "--world-size", "0")
    assert result.returncode == 2
    assert "--world-size=0 must be at least 1" in result.stderr
