"""``dpverify fuzz --figure``: the session's history, and the figure drawn from it."""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy
import pytest
from figure_files import read_png

from dpverify.cli.fuzz import FuzzConfig, FuzzExample, FuzzFailure, FuzzReport, fuzz
from dpverify.core.comparison import TensorComparison, TensorId
from dpverify.figures.base import save_figure
from dpverify.figures.fuzz import fuzz_figure
from dpverify.strategies import DeviceList, ModelSpec, Scenario

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# --------------------------------------------------------------------------- the history


@pytest.fixture(scope="module")
def passing(tmp_path_factory: pytest.TempPathFactory) -> FuzzReport:
    """A seeded session of torch's DataParallel: passes and expected divergences."""
    return fuzz(FuzzConfig(max_examples=12, seed=7, state_dir=tmp_path_factory.mktemp("passing")))


def test_the_history_is_the_session_s_examples_in_order(passing: FuzzReport) -> None:
    history = passing.history
    assert len(history) == passing.examples == 12
    assert [e.index for e in history] == list(range(1, 13))
    times = [e.elapsed for e in history]
    assert times == sorted(times)
    assert times[0] > 0.0
    assert times[-1] <= passing.elapsed


def test_the_history_s_outcomes_add_up_to_the_report_s_counts(passing: FuzzReport) -> None:
    outcomes = Counter(e.outcome for e in passing.history)
    assert outcomes["pass"] == passing.passed
    assert outcomes["nothing parallel"] == passing.serial
    assert "failure" not in outcomes
    # each divergence class counts once in its own family (both families: once in each)
    families: Counter[str] = Counter()
    for outcome, count in outcomes.items():
        if outcome not in ("pass", "nothing parallel"):
            for family in outcome.split(" + "):
                families[family] += count
    assert dict(families) == dict(passing.diverged)
    assert set(outcomes) <= {"pass", "nothing parallel", "BatchNorm", "Dropout", "BatchNorm + Dropout"}


def test_correct_examples_stay_below_their_tolerance(passing: FuzzReport) -> None:
    ratios = [e.worst_ratio for e in passing.history]
    assert all(r is None or 0.0 <= r < 1.0 for r in ratios), ratios
    # the DataParallel checks compare gradients on every example that passed in parallel; one
    # that ran one replica (one row) is skipped and has none
    assert all(e.worst_ratio is not None for e in passing.history if e.outcome == "pass")
    assert all(e.worst_ratio is None for e in passing.history if e.outcome == "nothing parallel")
    assert sum(r is not None for r in ratios) >= len(ratios) // 2


@pytest.mark.timeout(120)
def test_a_failing_session_ends_its_history_at_the_failure_without_shrink_attempts(tmp_path: Path) -> None:
    from dpverify.mutants import AveragingDataParallel

    config = FuzzConfig(
        max_examples=50, seed=0, state_dir=tmp_path, target="dpverify.mutants:AveragingDataParallel",
        target_object=AveragingDataParallel,
    )
    report = fuzz(config)
    assert report.stopped_by == "failure"
    assert report.failure is not None
    # shrinking ran more examples, none of them recorded
    assert len(report.history) == report.examples == report.failure.first_found_at
    last = report.history[-1]
    assert last.outcome == "failure"
    assert last.index == report.examples
    # averaged gradients are far beyond rounding, or the code raised before comparing
    assert last.worst_ratio is None or last.worst_ratio > 1.0
    assert all(e.outcome != "failure" for e in report.history[:-1])
    # the shrunk counterexample keeps its compared tensors, for the figure's failure panel
    assert any(not t.ok for t in report.failure.tensors)


# --------------------------------------------------------------------------- the figure

#: A synthetic session: 6 passes (2 exact, 1 without a comparison), 2 BatchNorm, 1 Dropout,
#: 1 of both, and a failure at example 11, then 4 s of shrinking.
HISTORY = (
    FuzzExample(1, 0.5, "pass", 0.02),
    FuzzExample(2, 0.9, "BatchNorm", 0.1),
    FuzzExample(3, 1.4, "pass", 0.0),
    FuzzExample(4, 2.0, "pass", 0.3),
    FuzzExample(5, 2.2, "Dropout", 0.004),
    FuzzExample(6, 3.1, "pass", None),
    FuzzExample(7, 3.5, "BatchNorm + Dropout", 0.05),
    FuzzExample(8, 4.0, "pass", 0.0),
    FuzzExample(9, 4.4, "BatchNorm", 0.6),
    FuzzExample(10, 5.0, "pass", 0.07),
    FuzzExample(11, 5.5, "failure", 250.0),
)


def _report(history: tuple[FuzzExample, ...] = HISTORY, elapsed: float = 9.5) -> FuzzReport:
    failed = any(e.outcome == "failure" for e in history)
    failure = FuzzFailure(
        "dp-grads", Scenario(ModelSpec(kind="linear"), batch_size=2, devices=DeviceList((0, 1))), "report",
        Path("repro.py"), first_found_at=len(history),
    ) if failed else None
    outcomes = Counter(e.outcome for e in history)
    return FuzzReport(
        examples=len(history), passed=outcomes["pass"], diverged=(("BatchNorm", 3), ("Dropout", 2)),
        failure=failure, elapsed=elapsed, stopped_by="failure" if failed else "max-examples", history=history,
    )


def _axes(figure: Figure, label: str) -> Axes:
    (ax,) = [ax for ax in figure.axes if ax.get_label() == label]
    return ax


def _legend(ax: Axes) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None
    return [text.get_text() for text in legend.get_texts()]


def _class_lines(ax: Axes) -> dict[str, tuple[int, float]]:
    """Each outcome class's line: its count as labelled, and its last y value."""
    lines = {}
    for line in ax.get_lines():
        match = re.fullmatch(r"(.+) \((\d+)\)", str(line.get_label()))
        if match:
            lines[match.group(1)] = (int(match.group(2)), float(numpy.asarray(line.get_ydata())[-1]))
    return lines


@pytest.fixture(scope="module")
def figure() -> Figure:
    return fuzz_figure(_report())


def test_each_class_s_line_ends_at_its_count(figure: Figure) -> None:
    lines = _class_lines(_axes(figure, "timeline"))
    expected = Counter(e.outcome for e in HISTORY)
    assert {name: count for name, (count, _) in lines.items()} == dict(expected)
    assert {name: last for name, (_, last) in lines.items()} == {name: float(n) for name, n in expected.items()}


def test_the_timeline_runs_to_the_session_s_end_and_marks_the_failure(figure: Figure) -> None:
    ax = _axes(figure, "timeline")
    assert ax.get_xlabel() == "seconds since start"
    assert ax.get_ylabel() == "examples"
    assert ax.get_xlim() == (0.0, 9.5)
    markers = [line for line in ax.get_lines() if line.get_marker() not in (None, "None", "")]
    assert [(numpy.asarray(m.get_xdata()).tolist(), numpy.asarray(m.get_ydata()).tolist()) for m in markers] == [([5.5], [1])]
    # the 4 s after the failure were shrinking, and say so
    assert "shrinking" in _legend(ax)


def test_the_histogram_counts_every_positive_ratio(figure: Figure) -> None:
    ax = _axes(figure, "ratios")
    heights = [patch.get_height() for container in ax.containers for patch in container]
    positive = [e.worst_ratio for e in HISTORY if e.worst_ratio]
    assert sum(heights) == len(positive) == 8
    # correct examples and the failure apart: the failure's bar lies beyond the limit
    correct, failure = ax.containers
    assert sum(p.get_height() for p in failure) == 1
    assert all(p.get_x() > 1.0 for p in failure if p.get_height())
    assert all(p.get_x() + p.get_width() <= 1.0 for p in correct if p.get_height())


def test_the_ratio_axes_are_log_scale_with_the_limit_marked(figure: Figure) -> None:
    ax = _axes(figure, "ratios")
    assert ax.get_xscale() == "log"
    assert ax.get_xlabel() == "worst error / allowed, per example (log scale)"
    assert ax.get_ylabel() == "examples"
    limits = [line for line in ax.get_lines() if numpy.asarray(line.get_xdata()).tolist() == [1.0, 1.0]]
    assert [line.get_label() for line in limits] == ["allowed (error = tolerance)"]
    low, high = ax.get_xlim()
    assert low <= 0.004 < 250.0 <= high


def test_what_the_log_axis_cannot_draw_is_counted(figure: Figure) -> None:
    texts = _legend(_axes(figure, "ratios"))
    assert "2 exact (ratio 0) not drawn" in texts
    assert "1 compared no tensor, not drawn" in texts
    # the margin correct code left: the largest correct ratio, of the 9 correct with one
    assert "correct examples reached at most 0.6 x the allowed error (9 examples)" in texts


def test_an_unbounded_ratio_is_counted_not_drawn() -> None:
    history = (FuzzExample(1, 0.1, "pass", 0.5), FuzzExample(2, 0.2, "failure", math.inf))
    ax = _axes(fuzz_figure(_report(history, elapsed=0.4)), "ratios")
    assert sum(patch.get_height() for container in ax.containers for patch in container) == 1
    texts = _legend(ax)
    assert "1 unbounded (error where 0 is allowed) not drawn" in texts


def test_the_title_says_examples_time_and_why_it_stopped(figure: Figure) -> None:
    title = figure.get_suptitle()
    assert title == "dpverify fuzz: 11 examples in 9.5 s, stopped at a failure (example 11, then shrunk)"
    passing = fuzz_figure(_report(HISTORY[:4], elapsed=2.5)).get_suptitle()
    assert passing == "dpverify fuzz: 4 examples in 2.5 s, stopped at --max-examples"


def test_a_session_without_examples_says_so() -> None:
    report = FuzzReport(examples=0, passed=0, diverged=(), failure=None, elapsed=0.01, stopped_by="interrupt")
    figure = fuzz_figure(report)
    texts = [text.get_text() for ax in figure.axes for text in ax.texts]
    assert texts == ["dpverify fuzz: 0 examples in 0.0 s, interrupted.\nNo example ran, so there is nothing to draw."]
    assert not any(ax.get_lines() for ax in figure.axes)


def test_the_png_is_1200_pixels_wide_and_drawn(figure: Figure, tmp_path: Path) -> None:
    png = read_png(save_figure(figure, tmp_path / "fuzz.png"))
    assert png.width == 1200
    assert 300 <= png.height <= 1500
    assert png.inked > 0.02
    svg = save_figure(figure, tmp_path / "fuzz.svg").read_text()
    assert svg.lstrip().startswith("<?xml")
    assert "How close the checks came to their tolerance" in svg


def test_the_module_imports_without_matplotlib_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import matplotlib` fail, as where it is not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "dpverify.figures.fuzz")
    fresh = importlib.import_module("dpverify.figures.fuzz")
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'dpverify[plot]'")):
        fresh.fuzz_figure(_report())


# --------------------------------------------------------------------------- the command


def test_fuzz_writes_its_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from dpverify.cli.main import main

    monkeypatch.chdir(tmp_path)
    target = tmp_path / "f.png"
    assert main(["fuzz", "--max-examples", "3", "--seed", "0", "--no-color", "--figure", str(target)]) == 0
    assert f"wrote {target}" in capsys.readouterr().err
    png = read_png(target)
    assert png.width == 1200
    assert png.inked > 0.02


def test_fuzz_refuses_a_figure_it_cannot_write_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dpverify.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--max-examples", "3", "--seed", "0", "--no-color", "--figure", "f.txt"]) == 2
    out = capsys.readouterr()
    message = out.err + out.out
    assert "--figure 'f.txt'" in message
    assert ".png, .svg, .pdf" in message
    assert not (tmp_path / ".dpverify").exists()  # nothing ran
    assert not (tmp_path / "f.txt").exists()


def _replayed(tensors: tuple[TensorComparison, ...], report: str = "report") -> FuzzReport:
    failure = FuzzFailure(
        "dp-grads", Scenario(ModelSpec(kind="linear"), batch_size=2, devices=DeviceList((0, 1))), report,
        Path(".dpverify/repro_0123abcd.py"), first_found_at=1, replayed=True, tensors=tensors,
    )
    return FuzzReport(
        examples=1, passed=0, diverged=(), failure=failure, elapsed=0.8, stopped_by="failure",
        history=(FuzzExample(1, 0.4, "failure", max((t.ratio for t in tensors), default=None)),),
    )


def test_a_replayed_failure_draws_its_tensors_worst_first() -> None:
    tensors = (
        *(
            TensorComparison(TensorId("grad", f"layer{i}.weight"), (3, 3), 9, mismatched=9 if ratio > 1 else 0, ratio=ratio)
            for i, ratio in enumerate([0.3, 2e5, 40.0, 0.0])
        ),
        TensorComparison(TensorId("output", "output"), (2, 3), 6, mismatched=6, problem="has shape (1, 3) in the parallel step"),
        TensorComparison(TensorId("grad", "unused.weight"), (3,), 3, absent=True),
    )
    figure = fuzz_figure(_replayed(tensors))
    ax = _axes(figure, "failure")
    title = ax.get_title(loc="left")
    assert "replayed from the example database" in title
    assert "check 'dp-grads'" in title
    assert "python .dpverify/repro_0123abcd.py" in title
    assert "batch_size=2" in title  # the scenario, pasteable
    # the tensor without a ratio first, then by ratio, largest first
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "output", "grad 'layer1.weight'", "grad 'layer2.weight'", "grad 'layer0.weight'", "grad 'layer3.weight'",
        "grad 'unused.weight'",
    ]
    bars = [patch for container in ax.containers for patch in container]
    assert len(bars) == 4  # one per tensor with a ratio
    assert any("has shape (1, 3)" in text.get_text() for text in ax.texts)
    assert {text.get_text() for text in ax.texts} >= {"2e+05", "40", "0.3", "exact", "no gradient"}
    assert ax.get_xscale() == "log"
    # the session's panels are there too
    _axes(figure, "timeline")
    _axes(figure, "ratios")


def test_a_replayed_failure_of_code_that_raised_shows_its_report() -> None:
    figure = fuzz_figure(_replayed((), report="RuntimeError: the wrapper raised\nwhile gathering"))
    ax = _axes(figure, "failure")
    assert "raised" in ax.get_title(loc="left")
    assert any("RuntimeError: the wrapper raised" in text.get_text() for text in ax.texts)


def test_a_failure_draws_at_most_its_worst_tensors() -> None:
    from dpverify.figures.fuzz import FAILURE_BARS

    tensors = tuple(TensorComparison(TensorId("grad", f"w{i}"), (2,), 2, mismatched=2, ratio=10.0 + i) for i in range(FAILURE_BARS + 5))
    ax = _axes(fuzz_figure(_replayed(tensors)), "failure")
    assert len([patch for container in ax.containers for patch in container]) == FAILURE_BARS
    assert "5 more tensors not drawn" in ax.get_xlabel()


def test_a_passing_session_has_no_failure_panel() -> None:
    figure = fuzz_figure(_report(HISTORY[:4], elapsed=2.5))
    assert "failure" not in [ax.get_label() for ax in figure.axes]
