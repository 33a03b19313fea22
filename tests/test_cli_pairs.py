"""``--parallel``, ``--parallel-loss`` and ``--dim`` on the command line: ``check``, ``fuzz`` and
``explain`` run the user's model/criterion pair, split and wrapper, and what cannot be used
is a usage error naming the option.

The user code is ``tests/cli_pairs_code.py`` and ``tests/dp_lookalikes.py`` (the tests
directory is on sys.path), and the catalogue's pair in ``dpverify.mutants``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpverify.cli.main import main
from dpverify.explain.answers import answers
from dpverify.explain.measure import explain
from dpverify.models.user import builtin_model
from dpverify.mutants import BalancedOffsetDataParallel

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
    assert capsys.readouterr().out.splitlines()[-1] == "OK: 3 passed, 0 failed"


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
@pytest.mark.deep
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


@pytest.mark.deep
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


# --- explain ------------------------------------------------------------------------------


def test_explain_parallel_reports_the_split_the_wrapper_made(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "mlp", "--batch", "8", "--devices", "4", "--parallel", "cli_pairs_code:balanced", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["wrapper"] == "cli_pairs_code:balanced"
    assert data["chunk_sizes"] == [1, 3, 2, 2]
    assert data["planned_chunk_sizes"] == [2, 2, 2, 2]
    assert [(c["device"], c["rows"], c["size"]) for c in data["chunks"]] == [(0, "0", 1), (1, "1-3", 3), (2, "4-5", 2), (3, "6-7", 2)]
    # what each replica's backward got, and the loss-averaging table, follow the real split
    assert [r["output_grad_rows"] for r in data["replicas"]] == [1, 3, 2, 2]
    assert data["loss_average"]["chunk_sizes"] == [1, 3, 2, 2]
    # the other batch sizes are measured by running the wrapper, not by torch.chunk
    assert {s["batch_size"]: s["chunk_sizes"] for s in data["splits"]}[9] == [1, 3, 3, 2]
    assert data["unanswered"] == []
    by_number = {a["number"]: a["answer"] for a in data["answers"]}
    assert "cli_pairs_code:balanced split B=8 on 4 devices into [1, 3, 2, 2]" in by_number[9]
    assert "torch.chunk gives [2, 2, 2, 2]" in by_number[9]
    assert "the output_device the wrapper passed to its gather" in by_number[2]


def test_explain_parallel_names_the_wrapper_in_its_header(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "mlp", "--batch", "8", "--devices", "4", "--parallel", "cli_pairs_code:balanced", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "dpverify explain: mlp under cli_pairs_code:balanced"
    flat = _flat(out)
    assert "run inside dpverify.virtual_devices(4)" in flat
    assert "chunks [1, 3, 2, 2] as it split the batch (torch's scatter: [2, 2, 2, 2])" in flat
    assert "One step of cli_pairs_code:balanced, measured" in flat


def test_explain_a_wrapper_that_loses_and_repeats_rows_says_which() -> None:
    e = explain(builtin_model("mlp"), batch_size=8, device_ids=[0, 1, 2, 3], parallel=BalancedOffsetDataParallel)
    assert [c.rows for c in e.chunks] == ["0", "1-3", "3-4", "5-6"]
    state = {fact.kind: fact.detail for fact in e.state}
    assert state["dropped rows"].startswith("row 7 (1 of 8) reached no replica")
    assert state["repeated rows"].startswith("row 3 reached more than one replica")
    said = answers(e)
    # its replica gradients do not add up to the full-batch gradient, and the answer says so
    assert "but under BalancedOffsetDataParallel they do not" in said[2].answer
    assert "Not this one" in said[9].answer


def test_explain_a_question_the_wrapper_cannot_be_measured_for_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    # the wrapper refuses to gather scalars: the step runs, the losses returned by forward cannot
    assert main(["explain", "--model", "mlp", "--parallel", "cli_pairs_code:NoScalarGather", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [number for number, _ in data["unanswered"]] == [4, 6]
    assert data["loss_average"] is None
    assert data["returned_loss_shape"] is None
    by_number = {a["number"]: a["answer"] for a in data["answers"]}
    for number in (4, 6):
        assert by_number[number].startswith("Not answered for cli_pairs_code:NoScalarGather: the measurement runs the wrapper")
        assert "ValueError: this wrapper gathers batches, not scalars" in by_number[number]
    assert by_number[3].startswith("With a mean loss over the gathered batch")


@pytest.mark.parametrize(
    ("wrapper", "message"),
    [
        ("no_such_module_here:X", "--parallel 'no_such_module_here:X': cannot import"),
        ("cli_pairs_code:NOT_CALLABLE", "--parallel 'cli_pairs_code:NOT_CALLABLE' is int, not callable"),
        # one output per replica, no gather: there is no loss to explain without its criterion
        (PER_DEVICE, f"--parallel {PER_DEVICE}: the loss (mse_loss) of what the wrapper returned (list of 3)"),
    ],
    ids=["not-importable", "not-callable", "no-gather"],
)
def test_explain_unusable_parallel_is_a_usage_error(wrapper: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "mlp", "--parallel", wrapper]) == 2
    err = capsys.readouterr().err
    assert message in err
    if wrapper == PER_DEVICE:
        assert "dpverify check --parallel MODULE:CALLABLE --parallel-loss MODULE:CALLABLE" in err


# --- verify -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wrapper", "model"),
    [
        ("ZeroedReplicaBuffers", "buffered"),
        ("DroppedKeywords", "keywords"),
        ("IgnoredDim", "time-major"),
        ("MangledDict", "dict-output"),
    ],
)
def test_verify_catches_a_bug_that_only_one_kind_of_model_shows(wrapper: str, model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--parallel", f"dp_lookalikes:{wrapper}"]) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = {line.split()[1] for line in lines if line.startswith("  FAIL  ")}
    # the model made for the bug fails, on every split; the others pass: each bug needs its model
    assert failed == {model}
    assert sum(line.lstrip().startswith(f"FAIL  {model} ") for line in lines) == 9
    assert lines[-1].startswith("FAILED: 68 passed, 9 failed, 1 warned")


def test_verify_passes_a_correct_wrapper_and_says_what_it_covered(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--parallel", "dp_lookalikes:DeviceLoopDataParallel"]) == 0
    lines = capsys.readouterr().out.splitlines()
    covered = next(line for line in lines if line.startswith("covered: "))
    for behaviour in (
        "buffers read in forward (buffered)", "loss computed in forward (loss-in-forward)", "keyword arguments (keywords)",
        "split along dim=1 (time-major)", "tuple output (loss-in-forward, tuple-output)", "dict output (dict-output)",
    ):
        assert behaviour in covered
    assert "splits: B=8 on 2 (chunks [4, 4]), B=5 on 4 (chunks [2, 2, 1]), B=2 on 4 (chunks [1, 1])" in lines
    assert not any(line.startswith("not covered") for line in lines)
    assert lines[-1].startswith("OK: 77 passed, 0 failed, 1 warned")


def test_verify_on_some_models_says_what_it_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--models", "mlp", "keywords"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "covered: tensor output (mlp); keyword arguments (keywords)" in lines
    missing = next(line for line in lines if line.startswith("not covered: "))
    assert "buffers read in forward" in missing
    assert "split along dim=1" in missing
