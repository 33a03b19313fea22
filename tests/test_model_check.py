"""``dpverify check MODULE:FACTORY``: every applicable check on a user's model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpverify._cli import main
from dpverify._errors import InvalidArgument
from dpverify._model_check import Verdict, check_model, parameter_errors
from dpverify._user_model import builtin_model, first_layer_batch, user_model

MODELS = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Regularised(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(6, 8)
            self.norm = nn.BatchNorm1d(8)
            self.drop = nn.Dropout(0.3)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            return self.out(self.drop(F.relu(self.norm(self.inp(x)))))


    class Centred(nn.Module):
        \"\"\"Subtracts the batch mean by hand: batch-dependent, and no BatchNorm to blame.\"\"\"

        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 2)

        def forward(self, x):
            h = self.inp(x)
            return h - h.mean(0)


    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 1)

        def forward(self, x, y):
            prediction = self.body(x).squeeze(-1)
            return prediction, F.mse_loss(prediction, y)


    def regularised():
        return Regularised()


    def centred():
        return Centred()


    def head():
        return Head()


    def head_batch(rows):
        g = torch.Generator().manual_seed(rows)
        return (torch.randn(rows, 4, generator=g), torch.randn(rows, generator=g)), None


    def not_a_model():
        return 3


    def recurrent():
        return nn.Sequential(nn.LSTM(3, 4))
    """
)


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "user_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.timeout(120)
def test_batchnorm_and_dropout_are_explained_not_failed(models: Path) -> None:
    env = {**os.environ, "COLUMNS": "140"}
    result = subprocess.run(
        [sys.executable, "-m", "dpverify", "check", "user_models:regularised", "--batch-sizes", "8", "5", "--no-color"],
        capture_output=True, text=True, timeout=120, check=False, cwd=models, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("dpverify check: user_models:regularised")
    assert "x of shape (B, 6) inferred from inp (Linear(in_features=6" in out
    assert "EXPLAINED" in out
    assert "DP grads match one device (eval mode)" in out
    assert "'norm' (batch statistics)" in out
    assert "SyncBatchNorm under DistributedDataParallel" in out
    assert "'drop' (randomness)" in out
    assert "Per-parameter gradient error" in out
    assert "norm.weight" in out
    assert out.splitlines()[-1] == "OK: 8 passed, 0 failed, 8 explained"


def test_a_batch_dependent_model_fails_with_the_report(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "user_models:centred", "--batch-sizes", "4", "--devices", "2", "--no-color"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: DP grads match one device, B=4 on 2" in out
    assert "tensors are not close!" in out
    assert out.splitlines()[-1].startswith("FAILED: ")


def test_a_model_returning_its_loss_gets_the_averaging_checks(models: Path) -> None:
    model = user_model("user_models:head", inputs_spec="user_models:head_batch")
    report = check_model(model, batch_sizes=(4, 5), device_counts=(2,))
    verdicts = {(r.check, r.split.batch_size): r.verdict for r in report.results}
    assert verdicts[("loss.mean() of replica losses", 4)] == Verdict.PASS  # equal chunks
    assert verdicts[("loss.mean() of replica losses", 5)] == Verdict.WARN  # [3, 2]: biased
    assert verdicts[("n_i/B-weighted loss is exact", 5)] == Verdict.PASS
    assert {e.name for e in parameter_errors(report)} == {"body.weight", "body.bias"}


def test_builtin_model_and_ddp_skip_for_tiny_batches(capsys: pytest.CaptureFixture[str]) -> None:
    report = check_model(builtin_model("conv"), batch_sizes=(3,), device_counts=(2,))
    assert [r.verdict for r in report.results] == [Verdict.PASS, Verdict.PASS]
    # no rank starts: a rank without rows, or a forward that returns its loss, is skipped
    ddp = check_model(builtin_model("mlp"), batch_sizes=(1,), device_counts=(2,), backend="ddp")
    assert [(r.verdict, r.summary) for r in ddp.results] == [(Verdict.SKIP, "fewer rows than ranks (1 < 2)")]
    head = check_model(builtin_model("loss-in-forward"), batch_sizes=(4,), device_counts=(2,), backend="ddp")
    assert head.results[0].verdict == Verdict.SKIP
    assert main(["check", "--model", "mlp", "--batch-sizes", "2", "--devices", "2", "--no-color"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "OK: 2 passed, 0 failed"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["user_models:not_a_model"], "returned int; it must return a torch.nn.Module"),
        (["user_models:recurrent"], "is not batch_first, and DataParallel scatters along dim 0; pass --inputs"),
        (["user_models:head", "--inputs", "user_models:missing"], "--inputs 'user_models:missing': 'user_models' has no attribute 'missing'"),
        (["user_models:centred", "--loss", "hinge"], "--loss 'hinge' is not one of"),
        ([], "give MODULE:FACTORY"),
    ],
)
def test_usage_errors_exit_two(models: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *args]) == 2
    assert message in capsys.readouterr().err


def test_first_layer_inference() -> None:
    from torch import nn

    make, text = first_layer_batch(nn.Sequential(nn.Dropout(), nn.Embedding(10, 3), nn.Linear(3, 1)))
    (tokens,), target = make(4)
    assert tokens.shape == (4, 6)
    assert int(tokens.max()) < 10
    assert target is None
    assert text.startswith("token ids of shape (B, 6) in [0, 10) inferred from 1 (Embedding(10, 3))")
    make, _ = first_layer_batch(nn.Sequential(nn.Conv2d(3, 2, 3)))
    assert make(2)[0][0].shape == (2, 3, 8, 8)
    with pytest.raises(InvalidArgument, match="pass --inputs MODULE:FN"):
        first_layer_batch(nn.Sequential(nn.ReLU()))


def test_attention_first_gives_sequences() -> None:
    from torch import nn

    make, text = first_layer_batch(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True))
    assert make(3)[0][0].shape == (3, 6, 8)
    assert "MultiheadAttention" in text
