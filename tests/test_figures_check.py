"""``comparison_figure(step_comparison)`` and ``dpverify check --figure``: the drawn bars are the
report's numbers (error / allowed per tensor, worst first), in the report's colours."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from figure_files import read_png
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import nn

import dpverify
from dpverify import ParallelMismatch
from dpverify.cli.main import main
from dpverify.core.comparison import StepComparison, TensorComparison, TensorId
from dpverify.core.text import ELLIPSIS
from dpverify.figures.base import COLOURS, save_figure
from dpverify.figures.check import MAX_BARS, NAME_WIDTH, check_figure, comparison_figure
from dpverify.models.builtin import builtin_case
from dpverify.models.user import Batch, UserModel, builtin_model
from dpverify.mutants import AveragingDataParallel, DeepCopyDataParallel
from dpverify.planner import ModelCheckReport, check_model
from dpverify.registry import CheckResult, Split, Target, Verdict

# --------------------------------------------------------------------------- helpers


def _mismatch(parallel: type[nn.Module]) -> StepComparison:
    """The report of a real failing DataParallel check on the built-in MLP."""
    case = builtin_case("mlp", batch=8)
    assert case.loss_fn is not None
    with pytest.raises(ParallelMismatch) as caught:
        dpverify.assert_dp_grads_match(case.module, case.inputs, case.target, loss_fn=case.loss_fn, device_ids=[0, 1], parallel=parallel)
    report = caught.value.report
    assert isinstance(report, StepComparison)
    return report


def _axes(fig: Figure, label: str) -> Axes:
    found = [ax for ax in fig.axes if ax.get_label() == label]
    assert len(found) == 1, [ax.get_label() for ax in fig.axes]
    return found[0]


def _bars(ax: Axes) -> list[Rectangle]:
    return [patch for patch in ax.patches if isinstance(patch, Rectangle)]


def _ticks(ax: Axes) -> list[str]:
    return [tick.get_text() for tick in ax.get_yticklabels()]


def _texts(fig: Figure) -> str:
    """Every text of the figure: its own (the suptitle among them), its axes' titles and
    texts."""
    parts = [text.get_text() for text in fig.texts]
    for ax in fig.axes:
        parts += [ax.get_title(loc="left"), *(text.get_text() for text in ax.texts)]
    return "\n".join(parts)


def _worst_first(tensors: Sequence[TensorComparison]) -> list[TensorComparison]:
    """The text report's order: tensors without a ratio first, then by ratio, descending."""
    return sorted(tensors, key=lambda t: (t.problem is None, -t.ratio))


def _has_limit_line(ax: Axes) -> bool:
    return any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.get_lines())  # type: ignore[arg-type]


def _assert_widths(ax: Axes, ratios: Sequence[float]) -> None:
    """The bars are the ratios, but for an exact one (0, which a log axis cannot show):
    a stub inside the axes, shorter than every measured ratio."""
    widths = [bar.get_width() for bar in _bars(ax)]
    assert len(widths) == len(ratios)
    measured = [r for r in ratios if r > 0]
    for width, ratio in zip(widths, ratios, strict=True):
        if ratio > 0:
            assert width == ratio
        else:
            assert ax.get_xlim()[0] < width < min(measured, default=1.0)


def _shown(ratio: float) -> str:
    """A ratio as the label after its bar reads."""
    return "exact" if ratio == 0 else f"{ratio:.2g}"


def _row(name: str, ratio: float, *, numel: int = 4) -> TensorComparison:
    """A tensor row as a check builds it: mismatched elements exactly when over the limit."""
    return TensorComparison(name, (numel,), numel, mismatched=numel if ratio > 1 else 0, max_abs=ratio, allowed=1.0, ratio=ratio)


def _comparison(rows: Sequence[TensorComparison]) -> StepComparison:
    return StepComparison(check="gradients must match", scenario="chunks [2, 2]", tolerance="t", tensors=tuple(rows))


# --------------------------------------------------------------------------- one comparison


def test_a_real_failure_draws_every_ratio_worst_first_in_its_colour() -> None:
    report = _mismatch(AveragingDataParallel)
    fig = comparison_figure(report)
    ax = _axes(fig, "tensors")
    ordered = _worst_first(report.tensors)
    assert all(t.problem is None for t in ordered)
    # each bar is its tensor's error / allowed, worst at the top; a passing tensor may match
    # exactly on one CPU and not on another (ratio 0: a stub labelled "exact"), so neither
    # case is assumed
    ratios = [t.ratio for t in ordered]
    assert ratios == sorted((t.ratio for t in report.tensors), reverse=True)
    _assert_widths(ax, ratios)
    assert [text.get_text() for text in ax.texts if text.get_text() in {_shown(r) for r in ratios}] == [_shown(r) for r in ratios]
    assert _ticks(ax) == [t.name for t in ordered]
    assert ax.yaxis_inverted()
    assert [bar.get_y() + bar.get_height() / 2 for bar in _bars(ax)] == list(range(len(ordered)))
    fail, good = to_rgba(COLOURS["fail"]), to_rgba(COLOURS["pass"])
    assert [bar.get_facecolor() for bar in _bars(ax)] == [good if t.ok else fail for t in ordered]
    assert sum(not t.ok for t in ordered) == 6  # the six gradients, averaged; output and loss pass
    assert _has_limit_line(ax)
    assert "allowed (error = tolerance)" in _texts(fig)
    assert ax.get_xscale() == "log"
    assert ax.get_xlabel() == "error / allowed (log scale; below 1 passes)"
    lo, hi = ax.get_xlim()
    assert lo < min(bar.get_width() for bar in _bars(ax))
    assert hi > max(ratios)
    title = ax.get_title(loc="left")
    assert report.check in title
    assert "FAILED: 6 of 8 compared tensors do not match" in title
    assert "AveragingDataParallel" in title  # the scenario, wrapped


def test_tensors_without_a_ratio_are_markers_that_say_why() -> None:
    report = _mismatch(DeepCopyDataParallel)
    ax = _axes(comparison_figure(report), "tensors")
    missing = [t for t in report.tensors if t.problem is not None]
    assert missing
    # only the compared tensors are bars; the missing gradients lead the rows
    assert len(_bars(ax)) == len(report.tensors) - len(missing)
    assert _ticks(ax)[: len(missing)] == [t.name for t in missing]
    said = [text.get_text() for text in ax.texts if text.get_text().startswith("is None in the parallel step")]
    assert len(said) == len(missing)
    markers = [line for line in ax.get_lines() if line.get_marker() == "<"]
    assert [to_rgba(line.get_color()) for line in markers] == [to_rgba(COLOURS["fail"])] * len(missing)


def test_an_exact_tensor_sits_at_the_floor_labelled_exact() -> None:
    rows = [_row("output", 0.25), _row("loss", 0.0), _row("grad 'w'", 3e-4)]
    ax = _axes(comparison_figure(_comparison(rows)), "tensors")
    widths = [bar.get_width() for bar in _bars(ax)]
    assert _ticks(ax) == ["output", "grad 'w'", "loss"]
    # measured ratios are drawn as they are; the exact one below all of them, inside the axes
    assert widths[:2] == [0.25, 3e-4]
    assert ax.get_xlim()[0] < widths[2] < 3e-4
    assert "exact" in [text.get_text() for text in ax.texts]
    assert "passed: all 3 compared tensors within tolerance" in ax.get_title(loc="left")


def test_a_parameter_without_a_gradient_is_said_so_not_drawn_as_exact() -> None:
    absent = TensorComparison(TensorId("grad", "unused.weight"), (4,), 4, absent=True)
    ax = _axes(comparison_figure(_comparison([_row("output", 0.25), absent, _row("loss", 0.0)])), "tensors")
    assert len(_bars(ax)) == 2  # output and the exact loss; nothing for the absent gradient
    texts = [text.get_text() for text in ax.texts]
    assert "no gradient" in texts
    assert texts.count("exact") == 1


def test_long_names_are_shortened_in_the_middle_and_stay_apart() -> None:
    short = [f"grad 'bert.encoder.layer.{i}.attention.self.query.weight'" for i in range(12)]
    long = [f"sum of replica grads 'bert.encoder.layer.{i}.attention.output.LayerNorm.weight'" for i in range(12)]
    names = short + long
    # distinct falling ratios: the drawn order is the order given
    rows = [_row(name, 0.9 - 0.01 * k) for k, name in enumerate(names)]
    ticks = _ticks(_axes(comparison_figure(_comparison(rows)), "tensors"))
    assert len(ticks) == len(set(ticks)) == len(names)
    for name, tick, index in zip(names, ticks, [*range(12), *range(12)], strict=True):
        assert (ELLIPSIS in tick) == (len(name) > NAME_WIDTH), (name, tick)
        assert tick == name or len(tick) < len(name)
        assert re.search(rf"layer\.{index}[.{ELLIPSIS}]", tick), tick  # the layer index survives the cut
        assert tick.endswith("weight'")


def test_over_thirty_tensors_draws_the_worst_thirty_and_counts_the_rest() -> None:
    rows = [_row(f"grad 'layer.{i}.weight'", 2.0 ** (10 - i)) for i in range(MAX_BARS + 10)]
    ax = _axes(comparison_figure(_comparison(rows)), "tensors")
    ratios = sorted((r.ratio for r in rows), reverse=True)
    assert [bar.get_width() for bar in _bars(ax)] == ratios[:MAX_BARS]
    assert _ticks(ax) == [f"grad 'layer.{i}.weight'" for i in range(MAX_BARS)]
    more = [text.get_text() for text in ax.texts if "more" in text.get_text()]
    assert more == [f"  {ELLIPSIS} and 10 more, all at or below {_shown(ratios[MAX_BARS])} of allowed"]


def test_a_comparison_without_tensors_says_so() -> None:
    fig = comparison_figure(StepComparison(check="calls must be lost", scenario="chunks [1, 1]", tolerance="exact", tensors=()))
    assert "no tensors were compared" in _texts(fig)
    assert not _bars(_axes(fig, "tensors"))


# --------------------------------------------------------------------------- dpverify check


def _panels(report: ModelCheckReport) -> dict[str, list[CheckResult]]:
    panels: dict[str, list[CheckResult]] = {}
    for result in report.results:
        if result.verdict in (Verdict.PASS, Verdict.FAIL) and result.tensors:
            panels.setdefault(result.check, []).append(result)
    return panels


def _worst_per_tensor(results: Sequence[CheckResult]) -> dict[str, tuple[float, str]]:
    worst: dict[str, tuple[float, str]] = {}
    for result in results:
        for tensor in result.tensors:
            if tensor.name not in worst or tensor.ratio > worst[tensor.name][0]:
                worst[tensor.name] = (tensor.ratio, result.split.label)
    return worst


@pytest.mark.parametrize("parallel", [None, AveragingDataParallel], ids=["torch", "averaging"])
def test_check_figure_draws_each_tensors_worst_split_per_check(parallel: type[nn.Module] | None) -> None:
    report = check_model(builtin_model("mlp", seed=0), batch_sizes=[5], device_counts=[2, 4], backend="dp", target=Target(parallel=parallel))
    fig = check_figure(report)
    panels = _panels(report)
    assert list(panels) == ["dp-grads", "dp-grad-sum", "dp-training"]
    assert [ax.get_label() for ax in fig.axes] == list(panels)  # nothing else to note
    for name, results in panels.items():
        ax = _axes(fig, name)
        worst = _worst_per_tensor(results)
        order = sorted(worst, key=lambda tensor: -worst[tensor][0])
        _assert_widths(ax, [worst[tensor][0] for tensor in order])
        assert _ticks(ax) == order
        # the value and the split it came from, after each bar
        notes = [text.get_text() for text in ax.texts if "B=" in text.get_text()]
        assert notes == [f"{_shown(worst[tensor][0])}  {worst[tensor][1]}" for tensor in order]
        fail, good = to_rgba(COLOURS["fail"]), to_rgba(COLOURS["pass"])
        assert [bar.get_facecolor() for bar in _bars(ax)] == [fail if worst[tensor][0] > 1 else good for tensor in order]
        assert _has_limit_line(ax)
        assert ax.get_xscale() == "log"
    passed, failed = report.count(Verdict.PASS), report.count(Verdict.FAIL)
    assert (passed, failed) == ((6, 0) if parallel is None else (0, 6))
    assert f"dpverify check: mlp (loss: mse_loss): {passed} passed, {failed} failed" in _texts(fig)


def _batchnorm_model() -> UserModel:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def make(batch_size: int) -> Batch:
        rows = torch.Generator().manual_seed(batch_size)
        return Batch((torch.randn(batch_size, 6, generator=rows),), torch.randn(batch_size, 3, generator=rows), F.mse_loss, "mse_loss")

    return UserModel("bn", module, "test", make)


def test_explained_divergences_are_a_footnote_not_bars() -> None:
    report = check_model(_batchnorm_model(), batch_sizes=[4], device_counts=[2], backend="dp")
    explained = [r for r in report.results if r.verdict is Verdict.EXPLAINED]
    assert {r.check for r in explained} == {"dp-grads", "dp-grad-sum", "dp-training"}
    fig = check_figure(report)
    text = _texts(fig)
    assert "dp-grads on B=4 on 2: explained by BatchNorm1d in train mode, not errors" in text
    assert "dp-grad-sum on B=4 on 2: explained by BatchNorm1d in train mode, not errors" in text
    assert f"dpverify check: bn (loss: mse_loss): {report.count(Verdict.PASS)} passed, 0 failed, 3 explained" in text
    # the bars are the eval-mode copy's, which must match, and say so
    ax = _axes(fig, "dp-grads")
    eval_mode = [r for r in report.results if r.check == "dp-grads" and r.verdict is Verdict.PASS]
    assert len(_bars(ax)) == len(eval_mode[0].tensors)
    assert all(text.get_text().endswith("B=4 on 2 (eval mode)") for text in ax.texts if "B=" in text.get_text())
    assert _axes(fig, "notes").texts


def test_skips_raised_failures_and_warnings_are_listed_and_nothing_to_draw_says_so() -> None:
    split = Split(1, 2)
    results = (
        CheckResult("ddp-grads", "DDP grads match one device", split, Verdict.SKIP, "fewer rows than ranks (1 < 2)"),
        CheckResult("dp-grads", "DP grads match one device", split, Verdict.FAIL, "RuntimeError: the wrapper broke"),
        CheckResult("dp-loss-average", "loss.mean() of replica losses", split, Verdict.WARN, "biased by +0.1 (chunks [1])"),
    )
    fig = check_figure(ModelCheckReport("user:model", "mse_loss", results, ()))
    text = _texts(fig)
    assert "nothing to draw" in text
    assert "ddp-grads on B=1 on 2: skipped: fewer rows than ranks (1 < 2)" in text
    assert "dp-grads on B=1 on 2: FAILED (no tensors compared): RuntimeError: the wrapper broke" in text
    assert "dp-loss-average on B=1 on 2: warning: biased by +0.1" in text
    assert "0 passed, 1 failed, 1 warned, 1 skipped" in text
    assert not any(_bars(ax) for ax in fig.axes)


# --------------------------------------------------------------------------- files


def _check_report() -> ModelCheckReport:
    return check_model(builtin_model("mlp", seed=0), batch_sizes=[5], device_counts=[2], backend="dp", target=Target(parallel=AveragingDataParallel))


def test_the_figure_is_written_as_a_png_1200_pixels_wide_and_as_svg(tmp_path: Path) -> None:
    fig = check_figure(_check_report())
    png = read_png(save_figure(fig, tmp_path / "check.png"))
    assert png.width == 1200
    assert 400 <= png.height <= 3000
    assert png.inked > 0.02
    svg = save_figure(fig, tmp_path / "check.svg").read_text()
    assert "<svg" in svg
    assert "dp-grad-sum" in svg


def test_cli_figure_writes_the_png_and_leaves_the_report_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command = ["check", "--model", "mlp", "--batch-sizes", "5", "--devices", "2", "--no-color"]
    assert main(command) == 0
    plain = capsys.readouterr()
    target = tmp_path / "c.png"
    assert main([*command, "--figure", str(target)]) == 0
    drawn = capsys.readouterr()
    assert drawn.out == plain.out
    assert f"wrote {target}" in drawn.err
    assert read_png(target).width == 1200


def test_cli_figure_with_another_suffix_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "c.txt"
    assert main(["check", "--model", "mlp", "--batch-sizes", "5", "--devices", "2", "--no-color", "--figure", str(target)]) == 2
    assert "--figure" in capsys.readouterr().err
    assert not target.exists()


# --------------------------------------------------------------------------- the title


def _inside(fig: Figure) -> list[str]:
    """The titles (the figure's, each panel's) that the renderer measures past the figure's
    edges, once drawn (none, when all fit)."""
    from matplotlib.text import Text

    fig.draw_without_rendering()  # lays the figure out as saving it does
    wanted = {fig.get_suptitle(), *(ax.get_title(loc=loc) for ax in fig.axes for loc in ("left", "center", "right"))} - {""}
    titles = [text for text in fig.findobj(Text) if text.get_text() in wanted]
    assert {text.get_text() for text in titles} == wanted
    return [text.get_text() for text in titles if not fig.bbox.contains(*text.get_window_extent().max)]


@pytest.mark.parametrize("model", ["user_models_with_a_rather_long_module_name:transformer_factory_for_the_trial", "m:f"])
def test_the_title_fits_the_figure_however_long(model: str) -> None:
    split = Split(5, 2)
    tensor = TensorComparison(TensorId("grad", "w"), (3,), 3, ratio=0.1)
    results = (
        *(CheckResult("dp-grads", "DP grads match one device", Split(b, d), Verdict.PASS, "ok", tensors=(tensor,)) for b in (8, 5, 2) for d in (2, 4)),
        *(CheckResult("dp-loss-average", "loss.mean() of replica losses", Split(b, d), Verdict.WARN, "biased") for b in (8, 5, 2) for d in (2, 4)),
        CheckResult("dp-grad-sum", "replica grads sum", split, Verdict.SKIP, "skipped"),
    )
    loss = "computed in forward (each replica's chunk mean, weighted as the model returns it)"
    fig = check_figure(ModelCheckReport(model, loss, results, ()))
    assert _inside(fig) == []
    title = fig.get_suptitle()
    assert " ".join(title.split()) == f"dpverify check: {model} (loss: {loss}): 6 passed, 0 failed, 6 warned, 1 skipped"
    assert title.endswith("6 warned, 1 skipped")  # whole, not cut
