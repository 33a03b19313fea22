"""``--parallel``, ``--parallel-loss`` and ``--dim`` on the command line: ``check`` runs the
user's model/criterion pair and split, and what cannot be used is a usage error naming the
option.

The user code is ``tests/cli_pairs_code.py`` and ``tests/dp_lookalikes.py`` (the tests
directory is on sys.path), and the catalogue's pair in ``dpverify.mutants``.
"""

from __future__ import annotations

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
