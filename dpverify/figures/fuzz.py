"""``dpverify fuzz --figure``: a fuzzing session drawn from its report's history. How close
each example's checks came to their tolerance answers what a count of passes cannot:
whether correct scenarios pass by orders of magnitude or scrape by.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpverify.core.text import plural
from dpverify.figures.base import COLOURS, drawing, message_panel, new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dpverify.cli.fuzz import FuzzExample, FuzzFailure, FuzzReport

__all__ = ["FAILURE_BARS", "OUTCOMES", "fuzz_figure"]

#: The outcome classes of ``FuzzExample.outcome``, in the order they are drawn and listed.
OUTCOMES: tuple[str, ...] = ("pass", "nothing parallel", "BatchNorm", "Dropout", "BatchNorm + Dropout", "failure")

#: Colours of the classes without one of their own in ``COLOURS``.
_MIXED = "#8c6d31"

#: Histogram bins per decade of error/allowed: fine enough to show the spread of rounding,
#: coarse enough that a few hundred examples fill them.
_BINS_PER_DECADE = 4

#: Legends with a white frame: they sit where lines cross (the limit, a step up).
_LEGEND: dict[str, Any] = {"frameon": True, "facecolor": "white", "edgecolor": "none", "framealpha": 0.9, "handlelength": 1.6}

_STOPPED = {
    "max-examples": "stopped at --max-examples",
    "time-budget": "stopped at the time budget",
    "failure": "stopped at a failure",
    "interrupt": "interrupted",
}


def fuzz_figure(report: FuzzReport) -> Figure:
    """The session of ``report`` as a figure: examples over time by outcome, and a histogram
    of each example's worst error/allowed.

    Args:
        report: what ``dpverify.cli.fuzz.fuzz`` returned; its ``history`` is drawn.

    Returns:
        A 1200-pixel-wide figure, with the Axes labelled ``"timeline"`` and ``"ratios"``
        (``Axes.get_label``); a session without examples gives a figure that says so.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (the message says what to install).
    """
    with drawing():
        if not report.history:
            return _empty(report)
        failure = report.failure
        if failure is None:
            figure = new_figure(4.8)
            timeline, ratios = figure.subplots(1, 2, width_ratios=(1.0, 1.1))
        else:
            # the counterexample's own tensors under the session: for a replayed failure
            # (one or two examples) the session's panels hold a single point each
            below = _failure_height(failure)
            above = 4.4 if len(report.history) > 2 else 3.2
            figure = new_figure(0.4 + above + below)
            grid = figure.add_gridspec(2, 2, width_ratios=(1.0, 1.1), height_ratios=(above, below))
            timeline, ratios = figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1])
            _draw_failure(figure.add_subplot(grid[1, :]), failure)
        _draw_timeline(timeline, report)
        _draw_ratios(ratios, report.history)
        figure.suptitle(_title(report), x=0.01, ha="left", fontweight="bold")
        return figure


def _title(report: FuzzReport) -> str:
    stopped = _STOPPED.get(report.stopped_by, f"stopped by {report.stopped_by}")
    if report.stopped_by == "failure" and report.failure is not None:
        stopped += f" (example {report.failure.first_found_at}, then shrunk)"
    return f"dpverify fuzz: {plural(report.examples, 'example')} in {report.elapsed:.1f} s, {stopped}"


def _empty(report: FuzzReport) -> Figure:
    figure = new_figure(3.0)
    ax = figure.subplots()
    message_panel(ax, f"{_title(report)}.\nNo example ran, so there is nothing to draw.", "timeline")
    return figure


def _classes(history: Sequence[FuzzExample]) -> list[str]:
    """The outcome classes present, in ``OUTCOMES`` order, then any other (a divergence of
    another module family) by name."""
    present = {example.outcome for example in history}
    return [name for name in OUTCOMES if name in present] + sorted(present - set(OUTCOMES))


# --------------------------------------------------------------------------- timeline


def _draw_timeline(ax: Axes, report: FuzzReport) -> None:
    """Cumulative examples of each class against seconds since the start: a steady slope is
    a steady rate, a flat stretch slow examples (or, after a failure, shrinking)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_label("timeline")
    end = max(report.elapsed, report.history[-1].elapsed)
    for outcome in _classes(report.history):
        times = [example.elapsed for example in report.history if example.outcome == outcome]
        # from (0, 0), a step up at each example's end, flat to the session's end: the last
        # value is the class's count
        xs = [0.0, *times, end]
        ys = [0, *range(1, len(times) + 1), len(times)]
        ax.step(xs, ys, where="post", color=COLOURS.get(outcome, _MIXED), linewidth=1.8, label=f"{outcome} ({len(times)})")
        if outcome == "failure":
            _mark_failure(ax, times[0], end)
    ax.set_xlim(0.0, end if end > 0 else 1.0)
    # headroom for the legend above the lines; examples are counted in whole numbers
    ax.set_ylim(0.0, max(Counter(e.outcome for e in report.history).values()) * 1.35)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("examples")
    ax.set_title("Examples over time, by outcome")
    ax.legend(loc="upper left", **_LEGEND)


def _mark_failure(ax: Axes, found: float, end: float) -> None:
    """A cross where the failure was found, and the time after it (Hypothesis shrinking
    it, examples that are not counted) shaded."""
    ax.plot([found], [1], linestyle="none", marker="X", markersize=11, color=COLOURS["failure"], label="_failure marker")
    if end > found:
        ax.axvspan(found, end, color=COLOURS["muted"], alpha=0.15, linewidth=0, label="shrinking")


# --------------------------------------------------------------------------- ratios


def _draw_ratios(ax: Axes, history: Sequence[FuzzExample]) -> None:
    """A histogram of each example's worst error/allowed on a log axis, correct examples
    and the failure stacked apart, the limit (1) and the worst correct example marked;
    what a log axis cannot place (exact results, ratio 0; an unbounded ratio; no
    comparison) is counted in the legend."""
    import numpy

    ax.set_label("ratios")
    correct = [e.worst_ratio for e in history if e.outcome != "failure" and e.worst_ratio is not None]
    failed = [e.worst_ratio for e in history if e.outcome == "failure" and e.worst_ratio is not None]
    low, high = _span([r for r in (*correct, *failed) if _drawable(r)])
    bins: list[float] = numpy.geomspace(low, high, max(8, round(math.log10(high / low) * _BINS_PER_DECADE)) + 1).tolist()
    groups = [
        ("correct", [r for r in correct if _drawable(r)], COLOURS["pass"]),
        ("failure", [r for r in failed if _drawable(r)], COLOURS["failure"]),
    ]
    shown = [(f"{name} ({len(values)})", values, colour) for name, values, colour in groups if values]
    tallest = 0.0
    if shown:
        heights, _, _ = ax.hist([values for _, values, _ in shown], bins=bins, stacked=True,
                                color=[colour for _, _, colour in shown], label=[label for label, _, _ in shown])
        tallest = float(numpy.max(heights))
    ax.axvline(1.0, color=COLOURS["limit"], linestyle="--", linewidth=1.2, label="allowed (error = tolerance)")
    if correct:
        # the margin correct code left: how far below the limit a bug of its size would hide
        worst = max(correct)
        if _drawable(worst):
            ax.axvline(worst, color=COLOURS["pass"], linestyle=":", linewidth=1.4,
                       label=f"correct examples reached at most {worst:.2g} x the allowed error ({len(correct):,} examples)")
    for line in _not_drawn(history):
        ax.plot([], [], linestyle="none", label=line)
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    # headroom for the legend above the bars
    ax.set_ylim(0.0, max(tallest, 1.0) * 1.6)
    ax.set_xlabel("worst error / allowed, per example (log scale)")
    ax.set_ylabel("examples")
    ax.set_title("How close the checks came to their tolerance")
    ax.legend(loc="upper left", **_LEGEND)


def _drawable(ratio: float) -> bool:
    """Whether a log axis can place ``ratio``: 0 (exact) and inf (error where none is
    allowed) it cannot."""
    return 0.0 < ratio < math.inf


def _span(ratios: Sequence[float]) -> tuple[float, float]:
    """The x range: every drawable ratio and the limit, out to whole decades, at least one
    decade either side of the limit."""
    low = min((*ratios, 0.1))
    high = max((*ratios, 10.0))
    return 10.0 ** math.floor(math.log10(low) + 1e-9), 10.0 ** math.ceil(math.log10(high) - 1e-9)


def _not_drawn(history: Sequence[FuzzExample]) -> list[str]:
    """Legend lines for the examples the histogram leaves out, and why."""
    counts = (
        (sum(1 for e in history if e.worst_ratio == 0.0), "exact (ratio 0) not drawn"),
        (sum(1 for e in history if e.worst_ratio == math.inf), "unbounded (error where 0 is allowed) not drawn"),
        (sum(1 for e in history if e.worst_ratio is None), "compared no tensor, not drawn"),
    )
    return [f"{count:,} {why}" for count, why in counts if count]


# --------------------------------------------------------------------------- the counterexample

#: The most tensors the counterexample's panel draws, worst first; the rest are counted.
FAILURE_BARS = 12

# Characters per line of the counterexample's title (11 pt bold across 1,200 pixels).
_FAILURE_TITLE_CHARS = 130


def _failure_height(failure: FuzzFailure) -> float:
    """Inches for the counterexample's panel: its title, and a row per bar (or the report's
    first lines when its code raised)."""
    if not failure.tensors:
        return 2.4
    return 1.9 + 0.24 * min(len(failure.tensors), FAILURE_BARS)


def _failure_title(failure: FuzzFailure) -> str:
    import textwrap

    where = "replayed from the example database" if failure.replayed else f"example {failure.first_found_at}, shrunk"
    mode = " on the eval-mode copy" if failure.eval_mode else ""
    head = f"The counterexample ({where}): check {failure.check!r}{mode}, each tensor's error / allowed"
    if not failure.tensors:
        head = f"The counterexample ({where}): check {failure.check!r}{mode} raised"
    scenario = textwrap.wrap(repr(failure.scenario), _FAILURE_TITLE_CHARS, break_on_hyphens=False)
    if len(scenario) > 3:
        scenario = [*scenario[:2], scenario[2][: _FAILURE_TITLE_CHARS - 1] + "\u2026"]
    return "\n".join([head, *scenario, f"reproduce with: python {failure.repro}"])


def _draw_failure(ax: Axes, failure: FuzzFailure) -> None:
    """The failing example's compared tensors as ``comparison_figure`` draws them (at most
    ``FAILURE_BARS``); or, when the check's code raised, the report's first lines."""
    from dpverify.figures.check import ratio_panel

    if not failure.tensors:
        ax.set_title(_failure_title(failure), loc="left", fontsize=10)
        lines = [line for line in failure.report.splitlines() if line.strip()][:5]
        message_panel(ax, "\n".join(line if len(line) <= 170 else line[:169] + "\u2026" for line in lines), "failure")
        return
    ratio_panel(ax, "failure", _failure_title(failure), failure.tensors, FAILURE_BARS)
    hidden = len(failure.tensors) - FAILURE_BARS
    more = f"; {hidden} more tensors not drawn, all at or below the last" if hidden > 0 else ""
    ax.set_xlabel(f"error / allowed (log scale; below 1 passes){more}")
