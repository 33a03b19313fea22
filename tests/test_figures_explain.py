"""``explain --figure``: every panel is drawn from the measured ``Explanation``, and the
drawn artists are checked against it (lanes = observed chunks, bar heights = measured bytes,
loss weights = ``1/(k·n_i)`` against ``1/B`` or ``1/N`` tokens, gradient ratios), then
rendered as a PNG of the promised size."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from figure_files import read_png
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch
from torch import nn

import dpverify
from dpverify.cli.main import main
from dpverify.explain.measure import Explanation, GradFact, explain
from dpverify.figures import save_figure
from dpverify.figures.explain import (
    BYTE_KINDS,
    explain_figure,
    loss_weights_figure,
    step_arrows,
    step_lanes,
)
from dpverify.models.user import builtin_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def uneven() -> Explanation:
    """5 rows on 4 devices: chunks [2, 2, 1], device 3 idle, device 0's chunk a view."""
    return explain(builtin_model("embedding", seed=0), batch_size=5, device_ids=[0, 1, 2, 3])


@pytest.fixture(scope="module")
def drawn(uneven: Explanation) -> Figure:
    return explain_figure(uneven)


def _axes(figure: Figure, label: str) -> Axes:
    found = [ax for ax in figure.get_axes() if ax.get_label() == label]
    assert len(found) == 1, [ax.get_label() for ax in figure.get_axes()]
    return found[0]


def test_the_lanes_are_the_observed_chunks(uneven: Explanation) -> None:
    lanes = step_lanes(uneven)
    assert list(lanes) == list(uneven.device_ids)
    assert [c.kind for c in uneven.chunks] == ["view", "copy", "copy", "idle"]
    replicas = {r.device: r for r in uneven.replicas}
    for chunk in uneven.chunks:
        cells = {cell.stage: cell for cell in lanes[chunk.device]}
        assert cells["scatter"].kind == chunk.kind
        if chunk.kind == "idle":
            # an idle device holds no replica and sends no gradient
            assert set(cells) == {"scatter"}
            continue
        assert f"{chunk.rows} ({chunk.size})" in cells["scatter"].text
        assert {"replicate", "forward", "backward"} <= set(cells)
        assert f"{replicas[chunk.device].output_grad_rows} row" in cells["backward"].text
    source = {cell.stage: cell for cell in lanes[0]}
    assert source["replicate"].kind == "module"  # replica 0 shares the module's storage
    assert {"batch", "gather", "loss", "reduce-add"} <= set(source)
    assert "Σ of\n3 replica grads" in source["reduce-add"].text


def test_the_arrows_follow_the_rows_and_the_gradients(uneven: Explanation) -> None:
    arrows = step_arrows(uneven)
    active = [1 for c in uneven.chunks if c.kind != "idle"]
    assert len(arrows) == 4 * len(active)
    assert {a.target for a in arrows if a.source == ("batch", 0)} == {("scatter", 0), ("scatter", 1), ("scatter", 2)}
    assert {a.source for a in arrows if a.target == ("reduce-add", 0)} == {("backward", d) for d in (0, 1, 2)}
    assert all(a.kind == "backward" for a in arrows if a.source[0] in ("loss", "backward"))


def test_the_drawn_boxes_are_the_lanes(uneven: Explanation, drawn: Figure) -> None:
    step = _axes(drawn, "step")
    boxes = {patch.get_gid(): patch for patch in step.patches if isinstance(patch, FancyBboxPatch)}
    texts = {text.get_gid(): text.get_text() for text in step.texts if text.get_gid()}
    cells = [cell for lane in step_lanes(uneven).values() for cell in lane]
    assert set(boxes) == {cell.gid for cell in cells}
    for cell in cells:
        assert texts[f"text {cell.gid}"] == cell.text
        box = boxes[cell.gid]
        assert (box.get_hatch() == "///") == (cell.kind == "copy")
        assert (box.get_linestyle() == "--") == (cell.kind == "idle")
    drawn_arrows = [text for text in step.texts if getattr(text, "arrow_patch", None) is not None]
    assert len(drawn_arrows) == len(step_arrows(uneven))


def test_bar_heights_are_the_measured_bytes(uneven: Explanation, drawn: Figure) -> None:
    ax = _axes(drawn, "bytes")
    assert ax.get_ylabel() == "bytes held during the step (B)"  # 2.4 KiB at most: bytes
    containers = {container.get_label(): container for container in ax.containers}
    assert list(containers) == [label for _field, label in BYTE_KINDS]
    for field, label in BYTE_KINDS:
        heights = [rect.get_height() for rect in containers[label]]
        assert heights == [getattr(b, field) for b in uneven.bytes]
    tops = [max(rect.get_y() + rect.get_height() for c in ax.containers for rect in [c[i]]) for i in range(4)]
    assert tops == [b.total for b in uneven.bytes]


def test_loss_weights_are_one_over_k_n_against_one_over_b(uneven: Explanation, drawn: Figure) -> None:
    report = uneven.loss_average
    assert report is not None
    ax = _axes(drawn, "loss weights")
    heights = [rect.get_height() for rect in ax.containers[0]]
    assert heights == pytest.approx([1 / (3 * n) for n in (2, 2, 1)])
    exact = [line for line in ax.get_lines() if line.get_label().startswith("exact")]
    assert [line.get_ydata()[0] for line in exact] == pytest.approx([1 / 5])
    assert "biased by +" in " ".join(text.get_text() for text in ax.texts)


def test_gradient_bars_are_the_sum_and_average_ratios(uneven: Explanation, drawn: Figure) -> None:
    ax = _axes(drawn, "gradients")
    summed, averaged = ax.containers
    assert [rect.get_width() for rect in summed] == [g.sum_ratio for g in uneven.grads]
    assert [rect.get_width() for rect in averaged] == [g.average_ratio for g in uneven.grads]
    assert [g.sum_ratio for g in uneven.grads] == pytest.approx([1.0] * 3)
    assert [g.average_ratio for g in uneven.grads] == pytest.approx([1 / 3] * 3)
    assert [label.get_text() for label in ax.get_yticklabels()] == [g.parameter for g in uneven.grads]


def test_a_gradient_that_is_zero_up_to_rounding_gets_no_ratio(uneven: Explanation) -> None:
    # attention's key bias: 1e-22 next to 0.1, its ratios are rounding over rounding
    noise = GradFact("attention.key.bias", full_norm=2e-22, sum_error=1e-22, average_error=1e-22, average_ratio=0.09, sum_ratio=0.52)
    ax = _axes(explain_figure(dataclasses.replace(uneven, grads=(*uneven.grads, noise))), "gradients")
    summed, averaged = ax.containers
    assert summed[3].get_width() == averaged[3].get_width() == 0.0
    assert any("rounding only" in text.get_text() for text in ax.texts)


def test_long_names_are_cut_in_the_middle_and_many_parameters_summarised(uneven: Explanation) -> None:
    grads = tuple(
        GradFact(f"model.encoder.layers.{i}.attention.output.dense.weight", 1.0, 0.0, 0.5, 0.5, 1.0) for i in range(45)
    )
    ax = _axes(explain_figure(dataclasses.replace(uneven, grads=grads)), "gradients")
    labels = [label.get_text() for label in ax.get_yticklabels()]
    assert len(labels) == 40
    assert len(set(labels)) == 40  # the layer index survives the cut
    assert all(label.startswith(f"model.encoder.layers.{i}…") for i, label in enumerate(labels))
    assert any("and 5 more parameters" in text.get_text() for text in ax.texts)


def test_an_unmeasured_question_says_so_instead_of_drawing(uneven: Explanation) -> None:
    e = dataclasses.replace(uneven, loss_average=None, grads=(), unanswered=((3, "it raised"), (4, "it raised")), wrapper="MyDP")
    figure = explain_figure(e)
    for label, what in (("loss weights", "Loss weights"), ("gradients", "Gradients")):
        ax = _axes(figure, label)
        assert [text.get_text() for text in ax.texts] == [f"{what}: not measured for MyDP (it raised)"]


def test_a_wrapper_s_lanes_are_the_rows_its_replicas_received_not_torch_s_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    from cli_pairs_code import balanced

    e = explain(builtin_model("mlp", seed=0), batch_size=8, device_ids=[0, 1, 2, 3], parallel=balanced, parallel_name="balanced")
    assert e.planned_chunk_sizes == (2, 2, 2, 2)
    lanes = step_lanes(e)
    scatter = [next(cell for cell in lanes[d] if cell.stage == "scatter").text.split("\n")[0] for d in range(4)]
    assert scatter == ["row 0 (1)", "rows 1-3 (3)", "rows 4-5 (2)", "rows 6-7 (2)"]
    backward = [next(cell for cell in lanes[d] if cell.stage == "backward").text for d in range(4)]
    assert backward == [f"d loss / d output\n{n}" for n in ("1 row", "3 rows", "2 rows", "2 rows")]
    step = _axes(explain_figure(e), "step")
    assert step.get_title(loc="left") == "One balanced step, measured: batch of 8 on devices [0, 1, 2, 3], chunks [1, 3, 2, 2]"


def test_the_loss_cell_names_a_short_loss_and_leaves_a_sentence_to_the_title() -> None:
    e = explain(builtin_model("loss-in-forward", seed=0), batch_size=7, device_ids=[0, 1, 2])
    assert len(e.loss) > 40  # "computed in forward (each replica's chunk mean)"
    cells = {cell.stage: cell for cell in step_lanes(e)[0]}
    assert cells["loss"].text == f"loss\n= {e.loss_value:.5g}"
    assert e.loss in explain_figure(e).get_suptitle()


def test_one_device_runs_the_module_itself() -> None:
    e = explain(builtin_model("mlp", seed=0), batch_size=3, device_ids=[0])
    cells = {cell.stage: cell for cell in step_lanes(e)[0]}
    assert cells["loss"].text == f"mse_loss\n= {e.loss_value:.5g}"
    assert cells["replicate"].text == "none: the module\nitself runs"
    assert cells["reduce-add"].text == ".grad directly\n(no replicas)"
    assert cells["gather"].text == "none: the output\nis the module's"


class _TokenHead(nn.Module):
    """The mean cross-entropy over the labels that are not -100."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))


def test_a_token_loss_weighs_each_token_against_one_over_n() -> None:
    ids = torch.randint(1, 11, (4, 6), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 2:] = labels[2, 4:] = -100  # 2, 6, 4 and 6 tokens
    report = dpverify.check_forward_loss_average(_TokenHead(), (), device_ids=[0, 1], forward_kwargs={"input_ids": ids, "labels": labels})
    assert report.item_counts == (8, 10)
    ax = _axes(loss_weights_figure(report), "loss weights")
    assert [rect.get_height() for rect in ax.containers[0]] == pytest.approx([1 / (2 * 8), 1 / (2 * 10)])
    exact = [line for line in ax.get_lines() if line.get_label().startswith("exact")]
    assert exact[0].get_label().startswith("exact: 1/N = 1/18")
    assert exact[0].get_ydata()[0] == pytest.approx(1 / 18)
    assert ax.get_ylabel() == "weight per token (1 = the whole loss)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0\n8 tokens", "1\n10 tokens"]


def test_the_loss_report_of_a_mismatch_draws_itself() -> None:
    report = dpverify.check_forward_loss_average(_TokenHead(), (), device_ids=[0, 1], forward_kwargs={
        "input_ids": torch.ones(3, 2, dtype=torch.long), "labels": torch.ones(3, 2, dtype=torch.long),
    })
    losses = _axes(loss_weights_figure(report), "losses")
    assert [rect.get_height() for rect in losses.containers[0]] == list(report.replica_losses)
    lines = {line.get_label().split(" = ")[0]: line.get_ydata()[0] for line in losses.get_lines()}
    assert lines == {"loss.mean()": report.mean_of_means, "full-batch loss": report.full_batch_loss}


def test_the_png_is_1200_pixels_wide_and_drawn(drawn: Figure, tmp_path: Path) -> None:
    png = read_png(save_figure(drawn, tmp_path / "explain.png"))
    assert png.format == "PNG"
    assert png.width == 1200
    assert 700 <= png.height <= 2400
    assert png.inked > 0.05
    assert save_figure(drawn, tmp_path / "explain.svg").read_text().startswith("<?xml")


def test_the_command_writes_the_figure_and_prints_the_same_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["explain", "--batch", "3", "--devices", "2", "--no-color"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--figure", str(tmp_path / "e.png")]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert captured.err.strip() == f"wrote {tmp_path / 'e.png'}"
    assert read_png(tmp_path / "e.png").width == 1200


@pytest.mark.parametrize(
    ("name", "message"),
    [("e.txt", "end the file name with one of them"), ("missing/e.png", "does not exist; create it first")],
)
def test_a_bad_figure_path_is_refused_before_anything_runs(name: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--figure", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert "--figure" in err
    assert message in err
    assert not (tmp_path / name).exists()


WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None
import dpverify
from dpverify.cli.main import main

assert main(["explain", "--batch", "2", "--devices", "2", "--no-color"]) == 0
assert main(["explain", "--figure", "e.png"]) == 2
import torch
from torch import nn
class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1)
    def forward(self, x):
        return self.fc(x).pow(2).mean()
report = dpverify.check_forward_loss_average(Head(), (torch.ones(3, 2),), device_ids=[0, 1])
from dpverify.figures import loss_weights_figure
try:
    loss_weights_figure(report)
except ModuleNotFoundError as error:
    print("RAISED", error)
"""


@pytest.mark.deep
def test_without_matplotlib_everything_else_works_and_a_figure_says_what_to_install(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WITHOUT_MATPLOTLIB)], cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--figure needs matplotlib, which is not installed: pip install 'dpverify[plot]'" in done.stderr
    assert "RAISED a figure needs matplotlib, which is not installed: pip install 'dpverify[plot]'" in done.stdout
    assert not (tmp_path / "e.png").exists()


def tiny_bert() -> nn.Module:
    """A BERT classifier from a tiny local config (nothing downloaded): a model this project
    did not design, for the explain figure (imported as ``test_figures_explain:tiny_bert``)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
    )
    return transformers.BertForSequenceClassification(config).eval()


def test_a_tiny_bert_is_drawn_from_its_own_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[test]'")
    from dpverify.cli.user_model import user_model

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    e = explain(user_model("test_figures_explain:tiny_bert"), batch_size=3, device_ids=[0, 1])
    ax = _axes(explain_figure(e), "gradients")
    summed, averaged = ax.containers
    assert len(summed) == min(len(e.grads), 40)
    largest = max(g.full_norm for g in e.grads)
    # attention's key bias gets no gradient in exact arithmetic (softmax ignores a shift):
    # measured here as rounding, drawn as no ratio
    noise = [i for i, g in enumerate(e.grads[:40]) if g.full_norm <= 1e-12 * largest]
    assert [e.grads[i].parameter for i in noise] == [f"bert.encoder.layer.{n}.attention.self.key.bias" for n in (0, 1)]
    assert all(summed[i].get_width() == averaged[i].get_width() == 0.0 for i in noise)
    others = [i for i in range(len(summed)) if i not in noise]
    assert [summed[i].get_width() for i in others] == pytest.approx([1.0] * len(others))
    assert [averaged[i].get_width() for i in others] == pytest.approx([0.5] * len(others))
    labels = [label.get_text() for label in ax.get_yticklabels()]
    assert len(set(labels)) == len(labels)  # cut in the middle, still told apart
    assert "bert.embeddings.word_embeddings.weight" in labels


def test_a_forward_that_returns_its_loss_gets_its_weight_back_not_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each replica's forward returned one number, its loss: Gather's backward sent it one
    number back, d loss / d loss_i, its weight in the step's loss (n_i/B for per-row means,
    t_i/T for token means), never 'd loss / d output, 0 rows'."""
    from dpverify.cli.user_model import user_model

    rows = explain(builtin_model("loss-in-forward", seed=0), batch_size=7, device_ids=[0, 1, 2])
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    tokens = explain(user_model("explain_user_models:token_lm", inputs_spec="explain_user_models:token_batch"), batch_size=8, device_ids=[0, 1, 2, 3])
    for e, counts, symbol in ((rows, rows.chunk_sizes, "n_i/B"), (tokens, tokens.loss_counts, "t_i/T")):
        lanes = step_lanes(e)
        backward = [next(cell for cell in lanes[r.device] if cell.stage == "backward") for r in e.replicas]
        assert all("0 rows" not in cell.text and "d loss / d output" not in cell.text for cell in backward)
        for replica, cell, n in zip(e.replicas, backward, counts, strict=True):
            assert replica.loss_grad == pytest.approx(n / sum(counts))
            assert cell.text == f"d loss / d loss_{replica.replica}\n= {replica.loss_grad:.4g} ({symbol})"
    one = explain(builtin_model("loss-in-forward", seed=0), batch_size=3, device_ids=[0])
    cell = next(cell for cell in step_lanes(one)[0] if cell.stage == "backward")
    assert cell.text == "d loss / d loss\n= 1 (the loss)"


@pytest.mark.parametrize(("kind", "batch", "ids"), [("mlp", 8, [0, 1]), ("embedding", 2, [0, 1]), ("embedding", 5, [0, 1, 2, 3])])
def test_the_bytes_legend_covers_no_bar_and_no_bar_label(kind: str, batch: int, ids: list[int]) -> None:
    figure = explain_figure(explain(builtin_model(kind, seed=0), batch_size=batch, device_ids=ids))
    figure.draw_without_rendering()  # lays the figure out as saving it does
    ax = _axes(figure, "bytes")
    legend = ax.get_legend()
    assert legend is not None
    box = legend.get_window_extent()
    labels = [text for text in ax.texts if text.get_text()]
    assert len(labels) == len(ids)  # a total over every device's bar
    assert not [text.get_text() for text in labels if text.get_window_extent().overlaps(box)]
    assert not [rect for container in ax.containers for rect in container if rect.get_height() and rect.get_window_extent().overlaps(box)]
    assert figure.bbox.contains(*box.max)  # and the legend is on the figure
