"""``dpverify check --inputs`` returning keyword arguments: a keyword-only model, called as
trainers call it (``model(**batch)``), is checked; given ``labels`` it computes its own loss,
which is checked as a loss in forward, with the tokens its replicas average over.

The user code is ``tests/cli_keywords_code.py`` (the tests directory is on sys.path).
"""

from __future__ import annotations

import pytest

from dpverify.cli.main import main
from dpverify.cli.user_model import user_model

MODEL = "cli_keywords_code:token_model"


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_a_dict_with_padded_labels_is_a_loss_in_forward_over_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    # exit 0: the token-weighted recipe is exact; loss.mean() is a warning, not a failure
    assert main(["check", MODEL, "--inputs", "cli_keywords_code:padded_labels", "--batch-sizes", "8", "--devices", "4", "--no-color"]) == 0
    out = _flat(capsys.readouterr().out)
    assert "loss: computed in forward" in out
    assert "WARN loss.mean() of replica losses, B=8 on 4" in out
    assert "tokens (labels != -100) [3, 7, 6, 5]): weight by t_i/T, tokens" in out
    assert "PASS item-weighted loss is exact, B=8 on 4" in out


def test_unpadded_labels_are_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, "--inputs", "cli_keywords_code:args_and_kwargs", "--batch-sizes", "8", "5", "--devices", "4", "--no-color"]) == 0
    out = _flat(capsys.readouterr().out)
    assert "PASS loss.mean() of replica losses, B=8 on 4: exact here (chunks [2, 2, 2, 2])" in out
    assert "WARN loss.mean() of replica losses, B=5 on 4" in out
    assert "weight by n_i/B" in out


def test_keyword_inputs_and_a_target_check_the_gradients(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, "--inputs", "cli_keywords_code:ids_and_target", "--batch-sizes", "5", "--devices", "2", "--no-color"]) == 0
    out = _flat(capsys.readouterr().out)
    assert "PASS DP grads match one device, B=5 on 2" in out
    assert "PASS replica grads sum to full batch, B=5 on 2" in out


def test_every_form_of_keyword_batch_is_read() -> None:
    made = user_model(MODEL, inputs_spec="cli_keywords_code:ids_and_target").make_batch(3)
    assert made.inputs == ()
    assert set(made.kwargs) == {"input_ids"}
    assert made.target is not None
    assert made.loss_fn is not None
    made = user_model(MODEL, inputs_spec="cli_keywords_code:padded_labels").make_batch(3)
    assert set(made.kwargs) == {"input_ids", "labels"}
    assert made.returns_loss


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["check", MODEL, "--inputs", "cli_keywords_code:a_string"], "returned str; fn(batch_size) must return (inputs, target)"),
    ],
)
def test_unusable_keyword_batches_are_usage_errors(command: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--no-color"]) == 2
    assert message in _flat(capsys.readouterr().err)


def test_explain_answers_the_loss_question_with_token_counts(capsys: pytest.CaptureFixture[str]) -> None:
    command = ["explain", "cli_keywords_code:positional_token_model", "--inputs", "cli_keywords_code:positional_padded", "--batch", "8", "--devices", "4", "--no-color"]
    assert main(command) == 0
    out = _flat(capsys.readouterr().out)
    assert "each replica's loss is a mean over its own tokens and the replicas hold different numbers of tokens, [3, 7, 6, 5] (inputs[1] != -100), although the chunks have equal rows [2, 2, 2, 2]" in out
    assert "weights replica i by its share of the 21 tokens, t_i/T" in out


def test_explain_walks_a_keyword_only_call(capsys: pytest.CaptureFixture[str]) -> None:
    command = ["explain", MODEL, "--inputs", "cli_keywords_code:padded_labels", "--batch", "8", "--devices", "4", "--no-color"]
    assert main(command) == 0
    out = _flat(capsys.readouterr().out)
    assert "(called as model(input_ids=…, labels=…))" in out
    assert "chunks [2, 2, 2, 2]" in out
    assert "the replicas hold different numbers of tokens, [3, 7, 6, 5]" in out
