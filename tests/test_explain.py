"""``dpverify explain``: every question of docs/questions.md answered with measured values."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dpverify.cli.main import main
from dpverify.cli.user_model import user_model
from dpverify.explain.answers import QUESTIONS, answers
from dpverify.explain.measure import Explanation, explain
from dpverify.models.user import Batch, UserModel, builtin_model

QUESTIONS_DOC = Path(__file__).resolve().parents[1] / "docs" / "questions.md"

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(6, 8)
            self.norm = nn.BatchNorm1d(8)
            self.out = nn.Linear(8, 3)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.out(torch.relu(self.norm(self.inp(x))))


    def make():
        return Stateful()
    """
)


@pytest.fixture(scope="module")
def default() -> Explanation:
    return explain(builtin_model("embedding"), batch_size=5, device_ids=[0, 1, 2, 3])


def test_the_questions_are_those_of_docs_questions_md() -> None:
    """docs/questions.md lists QUESTIONS one for one, numbered in order, as ``## n. question``."""
    headings = re.findall(r"^## (\d+)\. (.+?)\s*$", QUESTIONS_DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)
    assert [int(number) for number, _ in headings] == list(range(1, len(QUESTIONS) + 1))
    assert tuple(question for _, question in headings) == QUESTIONS


def test_views_copies_and_replica_zero_sharing_are_measured(default: Explanation) -> None:
    assert [(c.device, c.size, c.kind) for c in default.chunks] == [(0, 2, "view"), (1, 2, "copy"), (2, 1, "copy"), (3, 0, "idle")]
    assert default.chunks[0].copied_bytes == 0
    assert default.chunks[1].copied_bytes == 2 * 7 * 8
    first, *others = default.replicas
    assert first.copied_parameters == 0
    assert first.parameter_bytes == 0
    assert all(r.shared_parameters == 0 and r.parameter_bytes == first.shared_parameters * 0 + 141 * 4 for r in others)
    assert all(r.equal_to_module and r.leaf_parameters == 0 for r in default.replicas)
    assert "is a view of the batch" in answers(default)[0].answer


def test_gather_loss_and_backward_split_by_chunk(default: Explanation) -> None:
    assert default.gathered_on == 0
    assert default.output_shape == (5, 3)
    assert [r.output_grad_rows for r in default.replicas] == [2, 2, 1]
    assert "[2, 2, 1] rows" in answers(default)[1].answer


def test_grad_sum_is_the_full_gradient_and_the_average_a_third_of_it(default: Explanation) -> None:
    assert default.grads
    for grad in default.grads:
        assert grad.sum_error < 1e-12 * max(grad.full_norm, 1.0)
        assert grad.average_ratio == pytest.approx(1 / 3)


def test_loss_average_table_and_returned_vector(default: Explanation) -> None:
    report = default.loss_average
    assert report.chunk_sizes == (2, 2, 1)
    assert report.is_biased
    assert report.loss_bias == pytest.approx(report.predicted_bias)
    assert default.returned_loss_shape == (3,)
    assert default.one_device_loss_shape == ()
    assert default.scalar_warning


def test_first_device_holds_more(default: Explanation) -> None:
    first, *others = default.bytes
    assert first.total > max(b.total for b in others)
    assert others[-1].total == 0  # the idle device
    assert first.inputs == 5 * 7 * 8  # the whole batch of token ids


def test_output_device_elsewhere_changes_no_gradient() -> None:
    e = explain(builtin_model("mlp"), batch_size=6, device_ids=[0, 1, 2], output_device=2)
    assert e.gathered_on == 2
    assert e.other_output_device == 1
    assert e.other_output_device_grad_gap == 0.0
    assert e.bytes[2].outputs > 0
    assert e.bytes[0].outputs == 0


def test_splits_and_ddp(default: Explanation) -> None:
    splits = {s.batch_size: s.chunk_sizes for s in default.splits}
    assert splits[5] == (2, 2, 1)
    assert splits[3] == (1, 1, 1)
    assert splits[9] == (3, 3, 3)
    assert default.ddp.mode == "simulated"
    assert default.ddp.mean_loss_gap > 1e-3
    assert default.ddp.sum_loss_ratio == pytest.approx(1 / 3)
    assert default.state == ()


def test_lost_state_and_batchnorm_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "stateful_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    e = explain(user_model("stateful_models:make"), batch_size=6, device_ids=[0, 1, 2])
    found = {(s.kind, s.where) for s in e.state}
    assert {("attribute", "calls"), ("buffer", "norm.running_mean"), ("batch statistics", "norm")} <= found
    assert e.eval_mode_for_losses
    assert answers(e)[2].answer.startswith("Measured on an eval-mode copy")
    assert all(g.sum_error < 1e-12 for g in e.grads)
    # a one-row chunk makes BatchNorm raise in train mode: the step is shown in eval mode
    one_row = explain(user_model("stateful_models:make"), batch_size=5, device_ids=[0, 1, 2, 3])
    assert one_row.eval_mode_for_step


def test_single_device_runs_the_module_itself() -> None:
    e = explain(builtin_model("loss-in-forward"), batch_size=3, device_ids=[0])
    assert not e.replicated
    assert e.returned_loss_shape == ()
    assert answers(e)[1].answer.startswith("With one device DataParallel runs the module itself")


@pytest.mark.timeout(120)
def test_default_explain_answers_every_question_as_a_user_sees_it() -> None:
    env = {**os.environ, "COLUMNS": "120"}
    result = subprocess.run([sys.executable, "-m", "dpverify", "explain", "--no-color"], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("dpverify explain: embedding")
    assert "One DataParallel step, measured" in out
    for text in ("VIEW of the batch", "COPY", "replica 0 = the module", "idle (no chunk)", "outputs 5x3", "Σ of 3"):
        assert text in out
    lines = out.splitlines()
    for number, question in enumerate(QUESTIONS, 1):
        assert any(line.startswith(f"{number}. {question[:40]}") for line in lines), number
    for table in ("Loss averaging for this batch", "Estimated bytes held per device", "torch.chunk on 4 devices"):
        assert table in out


def test_json_and_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "mlp", "--batch", "4", "--devices", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [a["number"] for a in data["answers"]] == list(range(1, 12))
    assert data["chunk_sizes"] == [2, 2]
    assert data["loss_average"]["is_biased"] is False
    assert data["bytes"][0]["total"] > data["bytes"][1]["total"]
    svg = tmp_path / "step.svg"
    assert main(["explain", "--model", "mlp", "--svg", str(svg), "--no-color"]) == 0
    assert svg.read_text().startswith("<svg")
    assert "One DataParallel step" in svg.read_text().replace("&#160;", " ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--output-device", "7"], "--output-device 7 is not one of the devices [0, 1, 2, 3]"),
        (["no_such_module_x:make"], "cannot import 'no_such_module_x'"),
        (["--model", "mlp", "--inputs", "a:b"], "--inputs, --loss and --output-key apply to MODULE:FACTORY"),
    ],
)
def test_usage_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", *args]) == 2
    assert message in capsys.readouterr().err


def test_user_model_with_inputs_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "two_inputs.py").write_text(textwrap.dedent(
        """
        import torch
        from torch import nn


        class Add(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(3, 2)
                self.b = nn.Linear(4, 2)

            def forward(self, x, z):
                return self.a(x) + self.b(z)


        def make():
            return Add()


        def batch(rows):
            return (torch.randn(rows, 3), torch.randn(rows, 4)), torch.randint(0, 2, (rows,))
        """
    ))
    monkeypatch.chdir(tmp_path)
    model: UserModel = user_model("two_inputs:make", inputs_spec="two_inputs:batch")
    batch = model.make_batch(4)
    assert batch.loss_name == "cross_entropy"
    assert len(batch.inputs) == 2
    e = explain(model, batch_size=4, device_ids=[0, 1])
    assert e.chunk_sizes == (2, 2)
    assert all(g.sum_error < 1e-12 for g in e.grads)
    assert isinstance(model.module, nn.Module)
    assert torch.is_tensor(batch.target)


def test_real_ddp_runs_on_the_users_target_not_explains_float64_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # explain's simulated steps run in float64 with a float64 copy of the target; the real
    # DDP ranks run the user's float32 step, where torch 2.11's mse_loss of a float32
    # output and a float64 target raised
    from types import SimpleNamespace

    from dpverify.registry import CHECKS, Verdict

    seen: list[torch.dtype] = []

    def spy(case: Any) -> Any:
        seen.append(case.target.dtype)
        return SimpleNamespace(verdict=Verdict.PASS, scale=None, summary="spied")

    monkeypatch.setitem(CHECKS, "dp-ddp-agree", SimpleNamespace(run=spy))
    model = builtin_model("mlp")
    e = explain(model, batch_size=4, device_ids=[0, 1], real_ddp=True)
    assert seen == [model.make_batch(4).target.dtype] == [torch.float32]
    assert e.ddp.detail == "real DDP on 2 ranks agrees with DataParallel (spied)"


@pytest.mark.timeout(180)
def test_real_ddp_for_question_eleven() -> None:
    e = explain(builtin_model("mlp"), batch_size=4, device_ids=[0, 1], real_ddp=True)
    assert e.ddp.mode == "measured"
    assert e.ddp.detail.startswith("real DDP on 2 ranks agrees with DataParallel")
    assert "Measured: real DDP on 2 ranks agrees" in answers(e)[10].answer



@pytest.mark.timeout(180)
def test_real_ddp_with_a_sum_loss_reports_the_measured_factor() -> None:
    import dataclasses
    import functools

    import torch.nn.functional as F

    from dpverify.explain.measure import _measured_ddp
    from dpverify.models.user import Batch

    model = builtin_model("mlp")
    batch = model.make_batch(4)
    summed = Batch(batch.inputs, batch.target, functools.partial(F.mse_loss, reduction="sum"), "sum of squares")
    simulated = explain(model, batch_size=4, device_ids=[0, 1]).ddp
    fact = _measured_ddp(model.module, summed, 2, dataclasses.replace(simulated))
    assert fact.mode == "measured"
    # DDP averages the ranks' gradients of a summed loss: half of DataParallel's sum
    assert fact.detail == "real DDP on 2 ranks gives 0.5 times DataParallel's gradients"

def test_long_names_keep_both_ends_and_a_repeated_explanation_is_shown_once() -> None:
    import io

    from rich.console import Console

    from dpverify.cli.explain_view import render_explanation

    e = explain(user_model("hf_like_models:with_norm"), batch_size=6, device_ids=[0, 1])
    console = Console(width=100, no_color=True, record=True, file=io.StringIO())
    render_explanation(console, e)
    text = console.export_text()
    # the gradient table: a row per parameter, each name whole or cut in its middle only
    names = [g.parameter for g in e.grads]
    assert any(len(name) > 40 for name in names)
    lines = text.splitlines()
    grads = text.split("Gradient: sum vs average")[1].splitlines()
    start = next(i for i, line in enumerate(grads) if line.strip().startswith("─")) + 1
    end = next(i for i in range(start, len(grads)) if not grads[i].strip())
    cells = [line.split()[0] for line in grads[start:end]]
    assert len(cells) == len(names) == len(set(cells)), cells
    for name, cell in zip(names, cells, strict=True):
        head, _, tail = cell.partition("…")
        assert name.startswith(head), (name, cell)
        assert name.endswith(tail), (name, cell)
        assert tail, cell  # never cut off at the end
    # the BatchNorm explanation once, in one row for the three modules
    rows = [i for i, line in enumerate(lines) if line.strip().startswith("batch statistics ")]
    assert len(rows) == 1, text
    end = next(i for i in range(rows[0], len(lines)) if not lines[i].strip())
    row = " ".join(lines[rows[0]:end])
    assert "3 modules:" in row
    assert row.count("in train mode") == 1
    for layer in range(3):
        assert f"layer.{layer}.attention.batch_norm'" in row


def test_one_copy_is_spoken_of_in_the_singular() -> None:
    answer = answers(explain(builtin_model("embedding"), batch_size=2, device_ids=[0, 1]))[0].answer
    assert "Device 1 received a copy" in answer
    assert "replica 1 holds a copy" in answer
    assert "Devices 1 " not in answer


@pytest.mark.deep
def test_the_measurement_does_not_import_the_prose() -> None:
    """explain measures, explain_answers words it, explain_view shows both: importing the
    measurement alone loads neither of the others."""
    code = (
        "import sys, dpverify.explain.measure; "
        "print(sorted(m for m in sys.modules if m.startswith(('dpverify.explain', 'dpverify.cli.explain'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "['dpverify.explain', 'dpverify.explain.measure']"


@pytest.mark.parametrize("module", ["explain/__init__", "explain/measure", "explain/answers", "cli/explain_view"])
def test_the_explain_modules_name_only_what_exists(module: str) -> None:
    """Every ``dpverify.x.y`` the explain modules name is a module, or a name in one."""
    import importlib

    source = (Path(__file__).resolve().parents[1] / "dpverify" / f"{module}.py").read_text(encoding="utf-8")
    named = set(re.findall(r"\bdpverify(?:\.\w+)+", source))
    assert named
    for dotted in sorted(named):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: Any = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attribute in parts[cut:]:
            assert hasattr(found, attribute), dotted
            found = getattr(found, attribute)


def _seq_first(monkeypatch: pytest.MonkeyPatch) -> UserModel:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    return user_model("explain_user_models:seq_first_lstm", inputs_spec="explain_user_models:seq_first_batch")


def test_dim_1_splits_a_sequence_first_batch_and_speaks_of_dim_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """A T x B x F batch split along dim 1: the chunks are B's entries, every replica ran its
    whole sequence, the gradients add up, and the words are of dim 1, not of rows."""
    import io

    from rich.console import Console

    from dpverify.cli.explain_view import render_explanation

    e = explain(_seq_first(monkeypatch), batch_size=5, device_ids=[0, 1, 2, 3], dim=1)
    assert e.dim == 1
    assert e.chunk_sizes == (2, 2, 1)
    assert [c.start for c in e.chunks if c.kind != "idle"] == [0, 2, 4]
    assert [r.output_shape for r in e.replicas] == [(5, 2, 3), (5, 2, 3), (5, 1, 3)]
    assert [r.output_grad_rows for r in e.replicas] == [2, 2, 1]
    assert e.grads_add_up
    texts = [a.answer for a in answers(e)]
    assert "entries 0-1 along dim 1" in texts[0]
    assert "gathered along dim 1" in texts[1]
    assert "[2, 2, 1] entries along dim 1" in texts[1]
    assert "they do not" not in texts[2]
    console = Console(file=io.StringIO(), width=120, no_color=True)
    render_explanation(console, e)
    out = " ".join(console.file.getvalue().split())  # type: ignore[attr-defined]
    assert "batch of 5 entries along dim 1" in out
    assert "split and gathered along dim 1" in out
    assert "batch of 5 rows" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dim", "1"], "--dim 1: the built-in model embedding batches along dim 0"),
        (["--model", "mlp", "--dim", "1"], "--dim 1: the built-in models batch along dim 0"),
        (["explain_user_models:seq_first_lstm", "--dim", "1"], "--dim 1: the batch inferred from the first layer has its rows along dim 0"),
        (["explain_user_models:seq_first_lstm", "--inputs", "explain_user_models:seq_first_batch", "--dim", "1", "--batch", "6"], None),
        (["explain_user_models:seq_first_lstm", "--inputs", "explain_user_models:seq_first_batch", "--dim", "3"], "dim=3 is not a dimension"),
    ],
)
def test_dim_usage_errors(args: list[str], message: str | None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    if message is None:  # a valid call: not refused
        assert main(["explain", *args, "--devices", "2", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["dim"] == 1
        return
    assert main(["explain", *args]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_a_token_mean_loss_table_weighs_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss table of a token-mean loss returned by forward: the counts are tokens, the
    exact weight 1/T, and the exact reduction is labelled Σ t_i/T·loss_i (not n_i/B)."""
    import io

    from rich.console import Console

    from dpverify.cli.explain_view import render_explanation

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    e = explain(user_model("explain_user_models:token_lm", inputs_spec="explain_user_models:token_batch"), batch_size=8, device_ids=[0, 1, 2, 3])
    assert e.loss_average is not None
    assert e.loss_average.by_tokens
    console = Console(file=io.StringIO(), width=120, no_color=True)
    render_explanation(console, e)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "weighted mean, Σ t_i/T·loss_i" in out
    assert "Σ n_i/B" not in out
    assert re.search(r"tokens t_i +" + r" +".join(map(str, e.loss_average.counts)), out)
    assert "exact weight per token (1/T)" in out
    assert "d loss/d output" not in out  # each replica got one number, d loss/d loss_i
    assert "d loss/d loss_0" in out


def test_a_float64_run_hands_the_loss_a_target_of_its_own_dtype() -> None:
    """explain's float64 runs cast the target as the checks do: on torch 2.11 ``mse_loss``
    of a float64 output and a float32 target fails in backward ("Found dtype Float but
    expected Double"); this loss refuses the mix on any torch."""
    mlp = builtin_model("mlp")
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def strict_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append((output.dtype, target.dtype))
        if output.dtype != target.dtype:
            raise RuntimeError(f"Found dtype {target.dtype} but expected {output.dtype}")
        return torch.nn.functional.mse_loss(output, target)

    def make(batch_size: int) -> Batch:
        batch = mlp.make_batch(batch_size)
        return replace(batch, loss_fn=strict_mse, loss_name="strict_mse")

    explanation = explain(replace(mlp, make_batch=make), batch_size=5, device_ids=[0, 1, 2, 3])
    assert (torch.float64, torch.float64) in seen
    assert not explanation.unanswered
