"""How close each compared tensor came to its tolerance: ``dpverify check --figure`` and
``comparison_figure(step_comparison)``, one bar of error over allowed error per tensor
(``TensorComparison.ratio``) on a log scale, worst first, the limit at 1 drawn as a line: a
passing check shows how much room it had, a failing one by how many orders of magnitude it
missed.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpverify.core.comparison import worst_first
from dpverify.core.text import ELLIPSIS, and_list, plural, shorten_names
from dpverify.figures.base import COLOURS, DPI, WIDTH, drawing, message_panel, new_figure
from dpverify.registry import CHECKS, Verdict

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dpverify.core.comparison import StepComparison, TensorComparison
    from dpverify.planner import ModelCheckReport
    from dpverify.registry import CheckResult

__all__ = ["MAX_BARS", "NAME_WIDTH", "check_figure", "comparison_figure", "ratio_panel"]

#: The most bars a panel draws; the rest, all below the last drawn, are counted in a line.
MAX_BARS = 30

#: Characters of a tensor name that fit left of the bars at 1,200 pixels (9 pt labels).
NAME_WIDTH = 60

# Inches: per bar row, and a panel's title, x axis and margins around its rows.
_ROW, _PANEL = 0.22, 1.25
# Pixels per character: 9 pt tick labels and notes, 11 pt bold titles (DejaVu Sans, 100 dpi).
_LABEL_PX, _TITLE_PX = 6.2, 8.6
# Characters per footnote line: the figure's width, from its left edge.
_NOTE_CHARS = 165
# The x axis runs this many times past the worst ratio (1.6 decades): room for its label.
_HEADROOM = 40.0


@dataclass(frozen=True)
class _Row:
    """One tensor as drawn: its worst comparison, and where that came from (a split, in
    ``check_figure``; empty for a single comparison)."""

    tensor: TensorComparison
    where: str = ""


@dataclass(frozen=True)
class _Panel:
    """One axes: its rows worst first, at most ``MAX_BARS`` of them, and its title's
    lines (wrapped to the room the tick labels leave)."""

    label: str
    lines: tuple[str, ...]
    rows: tuple[_Row, ...]
    hidden: tuple[_Row, ...]

    def title(self, width: int) -> str:
        return "\n".join(_wrap(line, width) for line in self.lines)

    @property
    def inner(self) -> float:
        """The axes' own height: a row per bar, one above them for the limit's label, one
        below for "and N more"."""
        return _ROW * (len(self.rows) + (2 if self.hidden else 1))

    def height(self, width: int) -> float:
        """The axes and its title, tick labels and x label."""
        return _PANEL + 0.18 * self.title(width).count("\n") + self.inner


def _limit(rows: Sequence[_Row], most: int = MAX_BARS) -> tuple[tuple[_Row, ...], tuple[_Row, ...]]:
    """The rows worst first: the ``most`` drawn, and the rest."""
    ordered = sorted(rows, key=lambda row: worst_first(row.tensor))
    return tuple(ordered[:most]), tuple(ordered[most:])


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) or text


def _clip(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut at the end (a sentence, not a name)."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1].rstrip() + ELLIPSIS


# --------------------------------------------------------------------------- scale


def _floor(ratios: Sequence[float]) -> float:
    """Where an exact tensor (ratio 0) is drawn: a decade below the smallest nonzero ratio,
    and at most 1e-2, so that it sits apart from every measured one."""
    smallest = min((r for r in ratios if r > 0 and math.isfinite(r)), default=1.0)
    return 10.0 ** (math.floor(math.log10(min(smallest, 1e-1))) - 1)


def _xlimits(ratios: Sequence[float], floor: float) -> tuple[float, float]:
    finite = [r for r in ratios if math.isfinite(r)]
    return floor / 3.0, max([1.0, *finite]) * _HEADROOM


def _width(ratio: float, floor: float, right: float) -> float:
    # an infinite ratio (a NaN where the reference is finite) runs to the edge
    return min(max(ratio, floor), right) if math.isfinite(ratio) else right


def _value(ratio: float) -> str:
    if ratio == 0:
        return "exact"
    return f"{ratio:.2g}" if math.isfinite(ratio) else "inf"


# --------------------------------------------------------------------------- drawing


def _draw(ax: Axes, panel: _Panel, title: str, floor: float, limits: tuple[float, float]) -> None:
    """One panel: a bar per row, a marker for a tensor without a ratio, the limit at 1."""
    rows = panel.rows
    fail, ink = COLOURS["fail"], COLOURS["limit"]
    ax.set_label(panel.label)
    ax.set_xscale("log")
    ax.set_xlim(*limits)
    ys = list(range(len(rows)))
    names = [row.tensor.name for row in rows]
    labels = shorten_names(names, NAME_WIDTH) if any(len(n) > NAME_WIDTH for n in names) else names
    ax.set_yticks(ys, labels)
    for y, row, tick in zip(ys, rows, ax.get_yticklabels(), strict=True):
        tick.set_color(ink if row.tensor.ok else fail)
        _draw_row(ax, y, row, floor, limits[1])
    # the limit, labelled in the empty row above the worst bar
    ax.axvline(1.0, color=ink, linestyle="--", linewidth=1.2, label="allowed (error = tolerance)")
    ax.text(1.0, -1, "  allowed (error = tolerance)", ha="left", va="center", fontsize=8, color=ink)
    bottom = len(rows)
    if panel.hidden:
        ax.text(limits[0], bottom, "  " + _more(panel.hidden), ha="left", va="center", fontsize=9, color=COLOURS["muted"])
        bottom += 1
    ax.set_ylim(bottom - 0.5, -1.5)  # inverted: the worst row on top
    ax.set_xlabel("error / allowed (log scale; below 1 passes)")
    ax.set_title(title, loc="left")
    ax.grid(axis="x", which="major", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)


def _draw_row(ax: Axes, y: int, row: _Row, floor: float, right: float) -> None:
    """One tensor's bar and its value (and split), or the marker of one without a ratio."""
    from matplotlib.transforms import blended_transform_factory

    tensor = row.tensor
    fail = COLOURS["fail"]
    if tensor.problem is not None:
        # no ratio to draw: a marker at the right edge says what went wrong instead
        edge = blended_transform_factory(ax.transAxes, ax.transData)
        ax.plot([0.995], [y], marker="<", markersize=8, color=fail, transform=edge, clip_on=False)
        # the field itself, cut short, never a number read back out of it
        text = _clip(tensor.problem, 64) + (f"  ({row.where})" if row.where else "")
        # on white, above the limit line it may cross
        ax.text(0.98, y, text, transform=edge, ha="right", va="center", color=fail, fontsize=9, zorder=3, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
        return
    if tensor.absent:
        # nothing compared: no bar, which would read as an exact match
        note = "no gradient" + (f"  {row.where}" if row.where else "")
        ax.text(floor, y, note, ha="left", va="center", fontsize=8, color=COLOURS["muted"])
        return
    width = _width(tensor.ratio, floor, right)
    ax.barh(y, width, height=0.7, color=COLOURS["pass"] if tensor.ok else fail, edgecolor="none")
    note = _value(tensor.ratio) + (f"  {row.where}" if row.where else "")
    ax.text(width * 1.12, y, note, ha="left", va="center", fontsize=8, color=COLOURS["limit"])


def _more(hidden: Sequence[_Row]) -> str:
    """``… and 12 more, all at or below 0.031 of allowed``, for the rows a panel leaves
    out (the best ones: tensors without a ratio come first, so are drawn)."""
    measured = [row.tensor.ratio for row in hidden if row.tensor.problem is None]
    bad = sum(not row.tensor.ok for row in hidden)
    failing = f" ({bad} of them mismatched)" if bad else ""
    bound = f", all at or below {_value(max(measured))} of allowed" if measured else ""
    return f"{ELLIPSIS} and {len(hidden)} more{failing}{bound}"


def _title_chars(panels: Sequence[_Panel]) -> int:
    """Characters per title line: titles start at the axes' left edge, which the longest
    tick label (of any panel: they share it) pushes right."""
    label = max((min(len(row.tensor.name), NAME_WIDTH + 4) for panel in panels for row in panel.rows), default=0)
    return max(int((WIDTH * DPI - 40 - _LABEL_PX * label) / _TITLE_PX), 40)


def ratio_panel(ax: Axes, label: str, title: str, tensors: Sequence[TensorComparison], most: int = MAX_BARS) -> None:
    """One panel of error over allowed error per tensor, worst first, at most ``most``
    bars, on ``ax`` (labelled ``label``): what ``comparison_figure`` draws, for a figure
    of its own (``dpverify.figures.fuzz``'s counterexample)."""
    rows, hidden = _limit([_Row(t) for t in tensors], most)
    ratios = [row.tensor.ratio for row in rows if row.tensor.problem is None]
    floor = _floor(ratios)
    _draw(ax, _Panel(label, (), rows, hidden), title, floor, _xlimits(ratios, floor))


def _figure(panels: Sequence[_Panel], notes: Sequence[str], suptitle: str | None) -> Figure:
    """The panels stacked, each as tall as its rows, and the notes under them."""
    chars = _title_chars(panels)
    note_height = 0.3 + 0.19 * len(notes) if notes else 0.0
    fig = new_figure(sum(panel.height(chars) for panel in panels) + note_height + (0.55 if suptitle else 0.1))
    # constrained layout shares out what the titles and labels leave: by the axes' own heights
    heights = [panel.inner for panel in panels]
    ratios = [r.tensor.ratio for panel in panels for r in panel.rows if r.tensor.problem is None]
    floor = _floor(ratios)
    limits = _xlimits(ratios, floor)
    axes = fig.subplots(len(panels) + bool(notes), 1, squeeze=False, height_ratios=[*heights, *([note_height] if notes else [])])[:, 0]
    for ax, panel in zip(axes, panels, strict=False):
        _draw(ax, panel, panel.title(chars), floor, limits)
    if notes:
        _footnote(fig, axes[-1], notes)
    if suptitle:
        _suptitle(fig, suptitle)
    return fig


def _suptitle(fig: Figure, text: str) -> None:
    """The figure's title from its left edge, wrapped where the renderer measures it wider
    than the figure (a long model name, a loss computed in forward, many verdict counts),
    the figure made taller by the lines it adds."""
    title = fig.suptitle(text, x=0.01, ha="left", fontweight="bold", fontsize=12)
    room = fig.bbox.width * 0.97
    width = title.get_window_extent().width
    if width <= room:
        return
    lines = textwrap.wrap(text, max(20, int(len(text) * room / width)), break_on_hyphens=False)
    # the estimate is proportional; a line of wide letters can still be too long
    while max(_width_of(fig, line) for line in lines) > room:
        lines = textwrap.wrap(text, max(10, max(map(len, lines)) - 4), break_on_hyphens=False)
    title.set_text("\n".join(lines))
    fig.set_figheight(fig.get_figheight() + 0.24 * (len(lines) - 1))


def _width_of(fig: Figure, line: str) -> float:
    """Pixels ``line`` takes in the title's font, measured by the figure's renderer."""
    probe = fig.text(0, 0, line, fontweight="bold", fontsize=12)
    try:
        return float(probe.get_window_extent().width)
    finally:
        probe.remove()


def _footnote(fig: Figure, ax: Axes, notes: Sequence[str]) -> None:
    """The notes from the figure's left edge, not the axes' (which sits right of the
    panels' tick labels), each cut to fit the width."""
    from matplotlib.transforms import blended_transform_factory

    ax.set_label("notes")
    ax.set_axis_off()
    text = "Not drawn as bars:\n" + "\n".join(f"- {_clip(note, _NOTE_CHARS)}" for note in notes)
    where = blended_transform_factory(fig.transFigure, ax.transAxes)
    note = ax.text(0.01, 1.0, text, transform=where, ha="left", va="top", fontsize=9, color=COLOURS["limit"], linespacing=1.4)
    # lines already cut to the figure's width: laid out, they would squeeze every panel
    note.set_in_layout(False)


def _message(text: str, notes: Sequence[str], suptitle: str | None, label: str) -> Figure:
    """A figure that says why there are no bars, instead of empty axes."""
    fig = new_figure(1.4 + (0.55 if suptitle else 0.0) + 0.19 * len(notes))
    ax = fig.subplots()
    lines = [text, *(f"- {_clip(note, _NOTE_CHARS)}" for note in notes)]
    message_panel(ax, "\n".join(lines), label)
    if suptitle:
        _suptitle(fig, suptitle)
    return fig


# --------------------------------------------------------------------------- one comparison


def _comparison_title(comparison: StepComparison) -> tuple[str, ...]:
    bad = sum(not t.ok for t in comparison.tensors)
    count = len(comparison.tensors)
    if comparison.ok:
        verdict = f"passed: all {plural(count, 'compared tensor')} within tolerance (worst at {_value(comparison.worst_ratio)} of allowed)"
    elif bad:
        verdict = f"FAILED: {bad} of {plural(count, 'compared tensor')} do not match"
    else:
        verdict = f"FAILED: {_clip(comparison.failures[0], 120)}"
    return (comparison.check, comparison.scenario, verdict)


def comparison_figure(comparison: StepComparison) -> Figure:
    """Error over allowed error per tensor of one comparison, worst first.

    A bar per compared tensor (red: mismatched, green: within tolerance) on a log scale,
    the limit at 1 as a dashed line; a tensor that could not be compared (missing, or of
    another shape) is a red marker at the right edge with the reason, and an exact one
    (ratio 0) a short bar labelled ``exact``. Over ``MAX_BARS`` tensors, the worst are
    drawn and the others counted. The title is the check, the scenario and the verdict.
    For example::

        try:
            dpverify.assert_dp_grads_match(model, inputs, target, loss_fn=loss_fn, device_ids=[0, 1])
        except ParallelMismatch as e:
            comparison_figure(e.report).savefig("x.png")

    Args:
        comparison: what ``assert_dp_grads_match`` and the other helpers return, or a
            ``ParallelMismatch``'s ``report``.

    Returns:
        A 1,200-pixel-wide figure whose axes is labelled ``"tensors"``.

    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    with drawing():
        if not comparison.tensors:
            reason = "failed: " + "; ".join(comparison.failures) if comparison.failures else "passed"
            return _message(f"{comparison.check}: no tensors were compared ({_clip(reason, 160)}).", (), None, "tensors")
        rows, hidden = _limit([_Row(t) for t in comparison.tensors])
        panel = _Panel("tensors", _comparison_title(comparison), rows, hidden)
        return _figure([panel], (), None)


# --------------------------------------------------------------------------- dpverify check


def _where(result: CheckResult) -> str:
    """The split a result ran on, and the mode when it was the eval-mode copy."""
    return result.split.label + (" (eval mode)" if result.eval_copy else "")


def _worst_rows(results: Sequence[CheckResult]) -> list[_Row]:
    """Per tensor name, its worst comparison over the results (one check's splits)."""
    worst: dict[str, _Row] = {}
    for result in results:
        for tensor in result.tensors:
            kept = worst.get(tensor.name)
            if kept is None or worst_first(tensor) < worst_first(kept.tensor):
                worst[tensor.name] = _Row(tensor, _where(result))
    return list(worst.values())


def _check_title(name: str, results: Sequence[CheckResult], rows: Sequence[_Row]) -> tuple[str, ...]:
    title = CHECKS[name].title
    failed = [r for r in results if r.verdict is Verdict.FAIL]
    bad = sum(not row.tensor.ok for row in rows)
    splits = plural(len(results), "split")
    if failed:
        where = ", ".join(dict.fromkeys(_where(r) for r in failed))
        verdict = f"FAILED on {len(failed)} of {splits} ({where}): {bad} of {plural(len(rows), 'tensor')} mismatched at worst"
    else:
        worst = max((row.tensor.ratio for row in rows if row.tensor.problem is None), default=0.0)
        verdict = f"passed on {splits}: all {plural(len(rows), 'tensor')} within tolerance, worst at {_value(worst)} of allowed"
    return (f"{name}: {title}", verdict)


def _grouped_notes(results: Sequence[CheckResult]) -> list[str]:
    """One line per check and reason, for results that are not bars: explained divergences,
    warnings, skips, and passes or failures without tensors (a check that raised)."""
    groups: dict[tuple[str, str], list[CheckResult]] = {}
    for result in results:
        groups.setdefault((result.check, _reason(result)), []).append(result)
    notes = []
    for (check, reason), members in groups.items():
        splits = ", ".join(dict.fromkeys(_where(r) for r in members))
        on = f"on {plural(len(members), 'split')} ({splits})" if len(members) > 1 else f"on {splits}"
        notes.append(f"{check} {on}: {reason}")
    return notes


def _reason(result: CheckResult) -> str:
    if result.verdict is Verdict.EXPLAINED:
        types = and_list(list(dict.fromkeys(group.module_type for group in result.groups))) if result.groups else ""
        return f"explained by {types} in train mode, not errors" if types else f"explained, not errors: {result.summary}"
    if result.verdict is Verdict.SKIP:
        return f"skipped: {_clip(result.summary, 110)}"
    if result.verdict is Verdict.WARN:
        return f"warning: {_clip(result.summary, 110)}"
    if result.verdict is Verdict.FAIL:
        return f"FAILED (no tensors compared): {_clip(result.summary, 110)}"
    return f"passed: {_clip(result.summary, 110)}"


def check_figure(report: ModelCheckReport) -> Figure:
    """Error over allowed error per tensor for every check ``dpverify check`` ran, worst
    first.

    One panel per check that passed or failed with compared tensors, in the order the
    checks first ran; each tensor's bar is its worst ratio over the check's splits, and
    the split it came from is written after the value. The limit at 1 is a dashed line; a
    panel draws at most ``MAX_BARS`` tensors and counts the rest. Explained divergences
    (BatchNorm, Dropout in train mode: not errors), warnings, skips and failures without
    tensors (a check whose code raised) are listed under the panels.

    Args:
        report: what ``dpverify.planner.check_model`` returned.

    Returns:
        A 1,200-pixel-wide figure, each panel's axes labelled with its check's name
        (``"dp-grads"``), the notes' axes ``"notes"``.

    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    by_check: dict[str, list[CheckResult]] = {}
    others: list[CheckResult] = []
    for result in report.results:
        if result.verdict in (Verdict.PASS, Verdict.FAIL) and result.tensors:
            by_check.setdefault(result.check, []).append(result)
        else:
            others.append(result)
    suptitle = f"dpverify check: {report.model} (loss: {report.loss}): {report.counts()}"
    notes = _grouped_notes(others)
    with drawing():
        if not by_check:
            return _message("No check passed or failed with compared tensors: there is nothing to draw as bars.", notes, suptitle, "nothing")
        panels = []
        for name, results in by_check.items():
            rows, hidden = _limit(_worst_rows(results))
            panels.append(_Panel(name, _check_title(name, results, [*rows, *hidden]), rows, hidden))
        return _figure(panels, notes, suptitle)
