"""``--parallel``, ``--parallel-loss`` and ``--dim`` on the command line: ``check`` and ``fuzz``
run the user's model/criterion pair and split, and what cannot be used is a usage error
naming the option.

The user code is ``tests/cli_pairs_code.py`` and ``tests/dp_lookalikes.py`` (the tests
directory is on sys.path), and the catalogue's pair in ``dpverify.mutants``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpverify.cli.main import main

MEAN = "dpverify.mutants:MeanCriterionParallel"
WEIGHTED = "dpverify.mutants:WeightedCriterionParallel"
PER_DEVICE = "dp_lookalikes:OutputsPerDevice"
#: batch 5 on 3 devices: chunks [2, 2, 1], where a plain mean of per-chunk means is biased
UNEVEN = ["--batch-sizes", "5", "--devices", "3", "--no-color"]
#: a seq-first GRU, its batch along dim 1
GRU = ["cli_pairs_code:seq_first_gru", "--inputs", "cli_pairs_code:seq_first_inputs", "--dim", "1", "--batch-sizes", "5", "--devices", "2", "--no-color"]


def _flat(text: str) -> str:
    """Rich's output as one line of words: panels' borders and wrapping removed."""
    return " ".join(text.replace("│", " ").split())


# --- check --------------------------------------------------------------------------------


def test_check_a_criterion_that_averages_uneven_chunks_fails_as_the_loss_averaging_trap(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "mlp", "--parallel", PER_DEVICE, "--parallel-loss", MEAN, *UNEVEN]) == 1
    out = _flat(capsys.readouterr().out)
    assert f"{PER_DEVICE} with criterion wrapper {MEAN} on virtual devices" in out
    assert "The loss-averaging trap: the parallel loss" in out
    assert "[2/5, 2/5, 1/5]" in out


@pytest.mark.parametrize(
    "pair",
    [
        ["--parallel", PER_DEVICE, "--parallel-loss", WEIGHTED],
        # alone, the criterion wrapper receives torch's gathered output (not one per replica),
        # and this one then runs its criterion on the whole batch: exact
        ["--parallel-loss", MEAN],
    ],
    ids=["weighted-pair", "criterion-alone"],
)
def test_check_a_correct_pair_passes(pair: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model", "mlp", *pair, *UNEVEN]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "OK: 2 passed, 0 failed"


@pytest.mark.parametrize(("wrapper", "code"), [(None, 0), ("cli_pairs_code:ignores_dim", 1)], ids=["torch", "ignores-dim"])
def test_check_dim_splits_a_seq_first_batch_along_it(wrapper: str | None, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *GRU, *(["--parallel", wrapper] if wrapper else [])]) == code
    out = _flat(capsys.readouterr().out)
    assert "batch split along dim 1" in out
    if code:
        # split along time instead: the GRU restarts its hidden state in the second chunk
        assert "FAIL DP grads match one device, B=5 on 2: grad 'gru." in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "mlp", "--parallel-loss", "no_such_module_here:X"], "--parallel-loss 'no_such_module_here:X': cannot import 'no_such_module_here'"),
        (["--model", "mlp", "--parallel-loss", "cli_pairs_code:NOT_CALLABLE"], "--parallel-loss 'cli_pairs_code:NOT_CALLABLE' is int, not callable"),
        (["--model", "mlp", "--parallel-loss", MEAN, "--backend", "ddp"], "--parallel-loss is a DataParallel criterion wrapper, for --backend dp or all"),
        (["--model", "loss-in-forward", "--parallel-loss", MEAN], "this model's forward returns its loss, so there is no criterion to wrap"),
        (["cli_pairs_code:seq_first_gru", "--dim", "1"], "--dim 1: the batch inferred from the first layer has its rows along dim 0; pass --inputs"),
        (["--model", "mlp", "--dim", "1"], "--dim 1: the built-in models batch along dim 0"),
        ([*GRU[:3], "--dim", "2"], "the batch of size 8 from --inputs cli_pairs_code:seq_first_inputs has 4 rows along dim 2"),
    ],
    ids=["not-importable", "not-callable", "ddp", "loss-in-forward", "dim-without-inputs", "dim-built-in", "dim-wrong-rows"],
)
def test_check_unusable_pair_or_dim_is_a_usage_error(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


# --- fuzz ---------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_fuzz_catches_a_criterion_that_averages_and_its_repro_runs_the_same_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    session = ["fuzz", "--parallel", "dpverify.mutants:ReplicaOutputsDataParallel", "--parallel-loss", MEAN, "--seed", "0", "--no-color"]
    # found within 30 examples on every seed measured (example 5 on seed 0)
    assert main([*session, "--max-examples", "60", "--time-budget", "60s"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"dpverify fuzz: dpverify.mutants:ReplicaOutputsDataParallel (DataParallel-like wrapper) with criterion wrapper {MEAN} on ")
    assert "Counterexample (check 'dp-grads'" in out
    assert "The loss-averaging trap" in out
    repro = out.split("Reproduce with: python ")[1].split()[0]
    script = (tmp_path / repro).read_text()
    assert f"from {MEAN.replace(':', ' import ')} as parallel_loss" in script
    assert "Target(parallel=target, parallel_loss=parallel_loss)" in script
    ran = subprocess.run([sys.executable, str(tmp_path / repro)], capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "dpverify.core.errors.ParallelMismatch" in ran.stderr
    assert "The loss-averaging trap" in ran.stderr


def test_fuzz_a_correct_pair_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # mean losses only, and no model that computes its loss in forward (no criterion to wrap):
    # the exact n_i/B combination of per-chunk means is what a pair is held to
    monkeypatch.chdir(tmp_path)
    args = ["fuzz", "--parallel", "dpverify.mutants:ReplicaOutputsDataParallel", "--parallel-loss", WEIGHTED, "--max-examples", "25", "--seed", "3", "--no-color"]
    assert main(args) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK: 25 examples, no failure")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel-loss", MEAN, "--backend", "ddp"], "--parallel-loss is a DataParallel criterion wrapper, for --backend dp"),
        (["--parallel-loss", MEAN, "--backend", "all"], "--parallel-loss is a DataParallel criterion wrapper, for --backend dp"),
        (["--parallel-loss", "no_such_module_here:X"], "--parallel-loss 'no_such_module_here:X': cannot import"),
        (["--parallel-loss", "cli_pairs_code:NOT_CALLABLE"], "--parallel-loss 'cli_pairs_code:NOT_CALLABLE' is int, not callable"),
    ],
    ids=["ddp", "all", "not-importable", "not-callable"],
)
def test_fuzz_unusable_parallel_loss_is_a_usage_error(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", *args]) == 2
    assert message in capsys.readouterr().err
