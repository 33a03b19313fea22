"""``dpverify explain`` and ``dpverify check`` on the same model, inputs and split agree.

explain's question 3 says whether the replica gradients add up to the full-batch gradient
(``Explanation.grads_add_up``): that is what check's gradient checks pass or fail on
(``dp-grads`` and ``dp-grad-sum`` for a loss on the gathered output, ``dp-weighted-loss``
for a forward that returns its loss). explain's question 4 says whether ``loss.mean()`` of
the replica losses is biased: check's ``dp-loss-average`` warns exactly then. The models are
the built-ins, a tiny Hugging Face BERT and GPT-2 built from local configs, a user's
token-mean language model that returns its loss, a sequence-first LSTM split along dim 1,
and a wrapper that averages the replica gradients (both must call it wrong).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dpverify.cli.main import main
from dpverify.cli.user_model import user_model
from dpverify.explain.answers import answers
from dpverify.explain.measure import Explanation, explain
from dpverify.models.user import UserModel, builtin_model
from dpverify.mutants import AveragingDataParallel
from dpverify.planner import check_model
from dpverify.registry import Target, Verdict

pytestmark = pytest.mark.deep

TESTS = Path(__file__).resolve().parent

#: check's gradient checks, whose verdict question 3 answers
GRADIENT_CHECKS = ("dp-grads", "dp-grad-sum", "dp-weighted-loss")


@dataclass(frozen=True)
class Case:
    """One model, split and wrapper that explain and check both run."""

    id: str
    model: Callable[[], UserModel]
    batch_size: int
    devices: int
    dim: int = 0
    parallel: Callable[..., Any] | None = None
    needs: str = ""


def _user(factory: str, inputs: str | None = None) -> Callable[[], UserModel]:
    return lambda: user_model(f"explain_user_models:{factory}", inputs_spec=None if inputs is None else f"explain_user_models:{inputs}")


CASES = [
    Case("mlp", lambda: builtin_model("mlp"), 5, 4),
    Case("conv", lambda: builtin_model("conv"), 5, 2),
    Case("embedding", lambda: builtin_model("embedding"), 5, 4),
    Case("loss-in-forward", lambda: builtin_model("loss-in-forward"), 7, 3),
    Case("token-mean-lm", _user("token_lm", "token_batch"), 8, 4),
    Case("seq-first-lstm-dim-1", _user("seq_first_lstm", "seq_first_batch"), 5, 4, dim=1),
    Case("tiny-bert", _user("tiny_bert"), 3, 2, needs="transformers"),
    Case("tiny-gpt2-loss-in-forward", _user("tiny_gpt2", "gpt2_batch"), 5, 2, needs="transformers"),
    Case("averaging-wrapper", lambda: builtin_model("mlp"), 4, 2, parallel=AveragingDataParallel),
    Case("averaging-wrapper-token-lm", _user("token_lm", "token_batch"), 4, 2, parallel=AveragingDataParallel),
    Case("averaging-wrapper-dim-1", _user("seq_first_lstm", "seq_first_batch"), 4, 2, dim=1, parallel=AveragingDataParallel),
]


@pytest.fixture(autouse=True)
def _user_models_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_explain_and_check_give_the_same_verdict(case: Case) -> None:
    if case.needs:
        pytest.importorskip(case.needs, reason=f"{case.needs} is a test extra: pip install -e '.[test]'")
    model = case.model()
    e = explain(model, batch_size=case.batch_size, device_ids=list(range(case.devices)), dim=case.dim, parallel=case.parallel)
    report = check_model(
        model, batch_sizes=[case.batch_size], device_counts=[case.devices], backend="dp", dim=case.dim,
        target=Target(parallel=case.parallel),
    )
    gradient = [r for r in report.results if r.check in GRADIENT_CHECKS]
    assert gradient, [r.check for r in report.results]  # check compared gradients: no vacuous agreement
    check_correct = all(r.verdict is not Verdict.FAIL for r in gradient)
    assert e.grads_add_up is check_correct, [(r.check, r.verdict, r.summary) for r in gradient]
    broken = "they do not" in answers(e)[2].answer
    assert broken is not check_correct, answers(e)[2].answer
    averaged = [r for r in report.results if r.check == "dp-loss-average"]
    if averaged:
        assert e.loss_average is not None
        assert e.loss_average.is_biased is (averaged[0].verdict is not Verdict.PASS), averaged[0].summary
    if case.parallel is None:
        # torch's DataParallel is correct on every one of these models
        assert check_correct


def _verdicts(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    status = main(argv)
    return status, capsys.readouterr().out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("model", "extra"),
    [
        (["explain_user_models:token_lm", "--inputs", "explain_user_models:token_batch"], []),
        (["explain_user_models:seq_first_lstm", "--inputs", "explain_user_models:seq_first_batch"], ["--dim", "1"]),
    ],
    ids=["token-mean-lm", "seq-first-lstm-dim-1"],
)
def test_the_commands_agree_as_a_user_runs_them(model: list[str], extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``dpverify check`` passes, and ``dpverify explain`` on the same split says the
    replica gradients add up, with no claim that DataParallel is broken."""
    status, out = _verdicts(capsys, ["check", *model, *extra, "--batch-sizes", "5", "--devices", "4", "--no-color"])
    assert status == 0, out
    status, out = _verdicts(capsys, ["explain", *model, *extra, "--batch", "5", "--devices", "4", "--no-color"])
    assert status == 0
    text = " ".join(out.split())
    assert "the replica gradients add up to the full-batch gradient" in text
    assert "they do not" not in text
    assert "names the parameters and the likely bug" not in text


@pytest.mark.parametrize("command", [["check", "--batch-sizes", "5"], ["explain", "--batch", "5"]])
def test_a_batch_along_dim_1_split_along_dim_0_is_a_usage_error_for_both(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A sequence-first LSTM's batch of 5 has 5 time steps too: split along dim 0 it would be
    cut along time and reported as a broken DataParallel. Both commands see from a batch of
    another size that the rows are along dim 1, and say to pass --dim 1."""
    argv = [command[0], "explain_user_models:seq_first_lstm", "--inputs", "explain_user_models:seq_first_batch", *command[1:], "--no-color"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the batch grows along dim 1, not along dim 0" in err
    assert "(--dim 1)" in err


def test_the_loss_in_forward_answers_are_what_was_measured() -> None:
    """On a token-mean loss returned by forward, over equal chunks of rows: each replica
    computed its own loss (no 'computed once' on the gathered output), Gather's backward
    sent each one its weight t_i/T, and DDP's bias is put on the token counts, not on
    'uneven shards'."""
    e = _token_lm_explained()
    assert e.chunk_sizes == (2, 2, 2, 2)
    assert e.loss_in_forward
    assert e.weighting == "t_i/T"
    counts = e.loss_counts
    assert len(set(counts)) > 1  # equal rows, unequal tokens
    weights = [r.loss_grad for r in e.replicas]
    assert weights == pytest.approx([n / sum(counts) for n in counts])
    texts = [a.answer for a in answers(e)]
    assert texts[1].startswith("No: this forward returns its loss")
    assert "computed once" not in texts[1]
    assert "0 rows" not in texts[1]
    assert "uneven shards" not in texts[10]
    assert f"the shards hold different numbers of tokens, {list(counts)}" in texts[10]
    assert e.grads_add_up


def _token_lm_explained() -> Explanation:
    return explain(user_model("explain_user_models:token_lm", inputs_spec="explain_user_models:token_batch"), batch_size=8, device_ids=[0, 1, 2, 3])
