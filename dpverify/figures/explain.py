"""``dpverify explain --figure``: one measured DataParallel step as a picture.

``step_lanes`` and ``step_arrows`` are the diagram as data (what the tests compare with the
observed chunks); ``explain_figure`` draws them with the other panels, each from the
``Explanation``'s measured facts, never from a fixed drawing; ``loss_weights_figure`` is the
loss panel alone, for a ``LossAverageReport``.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpverify.core.text import plural, shape_text, shorten_names
from dpverify.figures.base import COLOURS, drawing, message_panel, new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dpverify.checks.loss_average import LossAverageReport
    from dpverify.explain.measure import ChunkFact, Explanation, ReplicaFact

__all__ = ["Arrow", "Cell", "explain_figure", "loss_weights_figure", "step_arrows", "step_lanes"]

#: The diagram's columns, left to right: the forward pass, then the backward pass.
STAGES: tuple[str, ...] = ("batch", "scatter", "replicate", "forward", "gather", "loss", "backward", "reduce-add")

#: The byte kinds of ``DeviceBytes``, bottom to top of each bar.
BYTE_KINDS: tuple[tuple[str, str], ...] = (
    ("inputs", "inputs"),
    ("parameters", "parameters"),
    ("activations", "activations"),
    ("outputs", "gathered outputs"),
    ("gradients", "gradients"),
)

#: Parameters drawn in the gradient panel; more are summarised in a line.
MOST_PARAMETERS = 40

# Characters a parameter name may take on the gradient panel's axis at 1,200 px.
_NAME_WIDTH = 44

# A full-batch gradient this small against the model's largest is zero in exact arithmetic
# (attention's key bias, say): its ratios are rounding over rounding, and not drawn.
_ROUNDING_ONLY = 1e-12


@dataclass(frozen=True)
class Cell:
    """One box of the step diagram.

    Attributes:
        stage: its column, one of ``STAGES``.
        device: its lane.
        text: what it says.
        kind: what it is, which decides its look: ``"view"``, ``"copy"``, ``"idle"`` (a
            chunk), ``"module"`` (replica 0 sharing the module's storage, or the module
            itself on one device), ``"replica"`` (a copy), ``"plain"``, ``"gather"``,
            ``"loss"``, ``"backward"``.
    """

    stage: str
    device: int
    text: str
    kind: str

    @property
    def gid(self) -> str:
        """The id its box carries in the drawn figure: ``"scatter:1"``."""
        return f"{self.stage}:{self.device}"


@dataclass(frozen=True)
class Arrow:
    """An arrow between two cells, ``(stage, device)`` to ``(stage, device)``.

    Attributes:
        kind: ``"forward"`` (rows and outputs) or ``"backward"`` (gradients).
    """

    source: tuple[str, int]
    target: tuple[str, int]
    kind: str


# --------------------------------------------------------------------------- the step as data


def _size(n: int) -> str:
    """Bytes in the unit that reads best: ``512 B``, ``1.5 KiB``, ``2.0 MiB``."""
    for unit, scale in (("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def _loss_text(name: str, value: float, width: int = 20) -> str:
    """The loss cell: its name in at most two lines of ``width`` characters (a cell is
    small; a longer name, a sentence, is in the figure's title), and its value."""
    lines = textwrap.wrap(name, width)
    return "\n".join([*(lines if len(lines) <= 2 else ["loss"]), f"= {value:.5g}"])


def _entries(n: int, dim: int) -> str:
    """``5 rows``, or ``5 along dim 1``: entries of the dimension the batch is split along."""
    return plural(n, "row") if dim == 0 else f"{n:,} along dim {dim}"


def _chunk_cell(chunk: ChunkFact, dim: int = 0) -> Cell:
    if chunk.kind == "idle":
        return Cell("scatter", chunk.device, "idle: no rows" if dim == 0 else "idle: no chunk", "idle")
    if dim != 0:
        rows = f"dim {dim}: {chunk.rows}"
    else:
        rows = f"row {chunk.rows}" if chunk.size == 1 else f"rows {chunk.rows}"
    what = "VIEW of the batch" if chunk.kind == "view" else f"COPY, {_size(chunk.copied_bytes)}"
    return Cell("scatter", chunk.device, f"{rows} ({chunk.size})\n{what}", chunk.kind)


def _replica_cell(e: Explanation, replica: ReplicaFact) -> Cell:
    if not e.replicated:
        return Cell("replicate", replica.device, "none: the module\nitself runs", "module")
    if replica.copied_parameters == 0:
        return Cell("replicate", replica.device, f"replica {replica.replica}\n= the module,\nshares storage", "module")
    return Cell("replicate", replica.device, f"replica {replica.replica}: copy\n{_size(replica.parameter_bytes)}", "replica")


def _backward_cell(e: Explanation, replica: ReplicaFact) -> Cell:
    """What Gather's backward sent a replica: rows of d loss / d output, or, for a forward
    that returns its loss (a scalar per replica), the one number d loss / d loss_i, the
    replica's weight in the step's loss."""
    if e.loss_in_forward:
        if replica.loss_grad is None:
            text = "d loss / d loss_i\nnot seen"
        elif not e.replicated:
            text = f"d loss / d loss\n= {replica.loss_grad:.4g} (the loss)"
        else:
            text = f"d loss / d loss_{replica.replica}\n= {replica.loss_grad:.4g} ({e.weighting})"
        return Cell("backward", replica.device, text, "backward")
    return Cell("backward", replica.device, f"d loss / d output\n{_entries(replica.output_grad_rows, e.dim)}", "backward")


def _loss_device(e: Explanation) -> int:
    """Where the loss was computed: where the outputs were gathered, else ``output_device``."""
    return e.output_device if e.gathered_on is None else e.gathered_on


def step_lanes(e: Explanation) -> dict[int, tuple[Cell, ...]]:
    """The step diagram's cells, a lane per device in ``device_ids`` order.

    Every lane has its scatter cell (the rows its replica's forward received, view, copy or
    idle); a device whose replica ran has its replica, forward and backward cells; the
    source device holds the batch and the reduce-add, the gathering device the gathered
    output and the loss.
    """
    replicas = {r.device: r for r in e.replicas}
    chunks = {c.device: c for c in e.chunks}
    source, at = e.device_ids[0], _loss_device(e)
    lanes: dict[int, tuple[Cell, ...]] = {}
    for device in e.device_ids:
        cells: list[Cell] = []
        if device == source:
            cells.append(Cell("batch", device, f"batch: {_entries(e.batch_size, e.dim)}\n{shape_text(e.batch_shape)}", "plain"))
        cells.append(_chunk_cell(chunks[device], e.dim))
        replica = replicas.get(device)
        if replica is not None:
            cells.append(_replica_cell(e, replica))
            cells.append(Cell("forward", device, f"output {shape_text(replica.output_shape)}\nactivations {_size(replica.activation_bytes)}", "plain"))
        if device == at:
            if not e.replicated:
                cells.append(Cell("gather", device, "none: the output\nis the module's", "plain"))
            else:
                seen = "" if e.gathered_on is not None else "\n(no gather() seen)"
                cells.append(Cell("gather", device, f"outputs {shape_text(e.output_shape)}\n◀ {plural(e.replicas_used, 'chunk')}{seen}", "gather"))
            cells.append(Cell("loss", device, _loss_text(e.loss, e.loss_value), "loss"))
        if replica is not None:
            cells.append(_backward_cell(e, replica))
        if device == source:
            text = ".grad directly\n(no replicas)" if not e.replicated else f".grad = Σ of\n{plural(e.replicas_used, 'replica grad')}"
            cells.append(Cell("reduce-add", device, text, "backward"))
        lanes[device] = tuple(cells)
    return lanes


def step_arrows(e: Explanation) -> tuple[Arrow, ...]:
    """The arrows between the cells: the batch's rows to each chunk, each output to the
    gather, the loss's gradient back to each replica, and each replica's gradient to the
    reduce-add on the source device."""
    source, at = e.device_ids[0], _loss_device(e)
    active = [r.device for r in e.replicas]
    arrows = [Arrow(("batch", source), ("scatter", c.device), "forward") for c in e.chunks if c.kind != "idle"]
    arrows += [Arrow(("forward", d), ("gather", at), "forward") for d in active]
    arrows += [Arrow(("loss", at), ("backward", d), "backward") for d in active]
    arrows += [Arrow(("backward", d), ("reduce-add", source), "backward") for d in active]
    return tuple(arrows)


# --------------------------------------------------------------------------- drawing


def _lane_title(e: Explanation, device: int) -> str:
    roles = [role for role, on in (("source", device == e.device_ids[0]), ("output", device == _loss_device(e))) if on]
    return f"device {device}" + (f"\n({', '.join(roles)})" if roles else "")


def _draw_cell(ax: Axes, cell: Cell, x: float, y: float) -> None:
    from matplotlib.patches import FancyBboxPatch

    face = COLOURS[cell.kind] if cell.kind in ("view", "copy", "module", "replica", "gather", "loss", "backward") else None
    box = FancyBboxPatch(
        (x - 0.46, y - 0.36), 0.92, 0.72, boxstyle="round,pad=0.0,rounding_size=0.08",
        facecolor=(face or "white") if cell.kind != "idle" else "white",
        alpha=0.22 if face else 1.0,
        edgecolor=face or COLOURS["muted"],
        linestyle="--" if cell.kind == "idle" else "-",
        hatch="///" if cell.kind == "copy" else None,
        linewidth=1.2,
    )
    box.set_gid(cell.gid)
    ax.add_patch(box)
    weight = "bold" if cell.kind in ("view", "copy", "module", "gather", "loss") else "normal"
    colour = COLOURS["muted"] if cell.kind == "idle" else COLOURS["limit"]
    label = ax.text(x, y, cell.text, ha="center", va="center", fontsize=7.5, color=colour, fontweight=weight)
    label.set_gid(f"text {cell.gid}")


def _draw_step(ax: Axes, e: Explanation) -> None:
    lanes = step_lanes(e)
    row = {device: -i for i, device in enumerate(e.device_ids)}
    where = {(cell.stage, cell.device): (float(STAGES.index(cell.stage)), float(row[cell.device])) for cells in lanes.values() for cell in cells}
    for device, cells in lanes.items():
        y = row[device]
        idle = all(cell.kind == "idle" for cell in cells)
        ax.axhspan(y - 0.47, y + 0.47, color=COLOURS["idle"] if idle else "#f4f6f8", alpha=0.35 if idle else 1.0, zorder=0)
        ax.text(-0.55, y, _lane_title(e, device), ha="right", va="center", fontsize=9, fontweight="bold")
        for cell in cells:
            _draw_cell(ax, cell, *where[(cell.stage, cell.device)])
    for arrow in step_arrows(e):
        (x0, y0), (x1, y1) = where[arrow.source], where[arrow.target]
        colour = COLOURS["backward"] if arrow.kind == "backward" else COLOURS["limit"]
        ax.annotate(
            "", xy=(x1 - 0.45, y1), xytext=(x0 + 0.45, y0),
            arrowprops={"arrowstyle": "-|>", "color": colour, "lw": 0.9, "alpha": 0.7, "shrinkA": 0, "shrinkB": 0},
        )
    for i, stage in enumerate(STAGES):
        ax.text(i, 0.62, ("▲ " if i >= STAGES.index("backward") else "▼ ") + stage, ha="center", va="bottom", fontsize=9, fontweight="bold")
    ax.set_xlim(-1.35, len(STAGES) - 0.48)
    ax.set_ylim(-len(e.device_ids) + 0.45, 0.95)
    ax.set_axis_off()
    ax.set_label("step")
    under = "DataParallel" if e.wrapper is None else e.wrapper
    mode = " (in eval mode: a one-row chunk makes BatchNorm raise in train mode)" if e.eval_mode_for_step else ""
    if not e.replica_devices_known:
        mode += " (replicas ran outside parallel_apply: placed on the devices in the order they ran)"
    ax.set_title(
        f"One {under} step, measured: batch of {e.batch_size} on devices {list(e.device_ids)}, "
        f"chunks {list(e.chunk_sizes)}{mode}",
    )
    from matplotlib.patches import Patch

    legend = [
        Patch(facecolor=COLOURS["view"], alpha=0.22, edgecolor=COLOURS["view"], label="view of the batch (no copy)"),
        Patch(facecolor=COLOURS["copy"], alpha=0.22, edgecolor=COLOURS["copy"], hatch="///", label="copy"),
        Patch(facecolor="white", edgecolor=COLOURS["muted"], linestyle="--", label="idle device"),
        Patch(facecolor=COLOURS["backward"], alpha=0.22, edgecolor=COLOURS["backward"], label="backward (gradients)"),
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=4, fontsize=8)


def _unit(largest: int) -> tuple[str, int]:
    """The unit a bytes axis reads best in, for its largest value."""
    for unit, scale in (("MiB", 1024**2), ("KiB", 1024)):
        if largest >= 10 * scale:
            return unit, scale
    return "B", 1


def _draw_bytes(ax: Axes, e: Explanation) -> None:
    unit, scale = _unit(max((b.total for b in e.bytes), default=0))
    names = [str(b.device) for b in e.bytes]
    bottom = [0.0] * len(e.bytes)
    for field, label in BYTE_KINDS:
        heights = [getattr(b, field) / scale for b in e.bytes]
        ax.bar(names, heights, bottom=bottom, label=label, color=COLOURS[label], width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, top in enumerate(bottom):
        ax.text(i, top, f"{top:,.0f}" if scale == 1 else f"{top:,.1f}", ha="center", va="bottom", fontsize=7.5)
    ax.set_ylabel(f"bytes held during the step ({unit})")
    ax.set_xlabel("device")
    ax.set_title("Bytes held per device, measured")
    ax.set_ylim(0, max(bottom, default=0.0) * 1.15 or 1.0)
    # right of the axes, where no bar and no bar's label can be, whichever device holds most
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    ax.set_label("bytes")


def _draw_loss_weights(ax: Axes, r: LossAverageReport) -> None:
    """The weight ``loss.mean()`` gives one item of each replica, against the exact one."""
    noun = "token" if r.by_tokens else "row"
    total = sum(r.counts)
    names = [f"{i}\n{n} {noun}{'s' if n != 1 else ''}" for i, n in enumerate(r.counts)]
    weights = [w if w != float("inf") else 0.0 for w in r.sample_weights]
    exact = 1.0 / total if total else 0.0
    colours = [COLOURS["fail"] if abs(w - exact) > 1e-12 * max(exact, 1e-300) else COLOURS["pass"] for w in weights]
    ax.bar(names, weights, color=colours, width=0.6, label="under loss.mean() of replica losses: 1/(k·n_i)")
    symbol = "N" if r.by_tokens else "B"
    ax.axhline(exact, color=COLOURS["limit"], linestyle="--", linewidth=1.2, label=f"exact: 1/{symbol} = 1/{total} = {exact:.3g}")
    for i, w in enumerate(weights):
        ax.text(i, w, f"{w:.3g}", ha="center", va="bottom", fontsize=7.5)
    verdict = f"loss.mean() is biased by {r.loss_bias:+.3g}" if r.is_biased else "loss.mean() is unbiased here"
    ax.set_title(f"Weight per {noun} in the loss")
    ax.text(1.0, 1.0, verdict, transform=ax.transAxes, ha="right", va="bottom", fontsize=9, color=COLOURS["fail"] if r.is_biased else COLOURS["pass"])
    ax.set_xlabel("replica, and what its loss is a mean over")
    ax.set_ylabel(f"weight per {noun} (1 = the whole loss)")
    ax.set_ylim(0, max([*weights, exact]) * 1.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_label("loss weights")


def _draw_grads(ax: Axes, e: Explanation) -> None:
    grads = list(e.grads[:MOST_PARAMETERS])
    largest = max((g.full_norm for g in e.grads), default=0.0)
    zero = [g.full_norm <= _ROUNDING_ONLY * largest for g in grads]
    names = shorten_names([g.parameter for g in grads], _NAME_WIDTH)
    y = list(range(len(grads)))
    height = 0.38
    sums = [0.0 if z else g.sum_ratio for g, z in zip(grads, zero, strict=True)]
    averages = [0.0 if z else g.average_ratio for g, z in zip(grads, zero, strict=True)]
    ax.barh([i - height / 2 for i in y], sums, height=height, color=COLOURS["pass"], label="|Σ replica grads| / |full|: what torch does")
    ax.barh([i + height / 2 for i in y], averages, height=height, color=COLOURS["fail"], label="|average of replica grads| / |full|")
    ax.axvline(1.0, color=COLOURS["limit"], linestyle="--", linewidth=1.2, label="full-batch mean-loss gradient = 1")
    for i, z in enumerate(zero):
        if z:
            ax.text(0.01, i, "full-batch gradient ≈ 0 (rounding only): no ratio", va="center", fontsize=7.5, color=COLOURS["muted"])
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("gradient norm relative to the full batch's (1 = equal)")
    ax.set_title(f"Gradients: the sum vs the average of the {plural(e.replicas_used, 'replica gradient')} vs the full batch (float64)", pad=22)
    ax.set_xlim(0, max([1.0, *sums, *averages]) * 1.12)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=3, fontsize=8)
    left = e.grads[MOST_PARAMETERS:]
    if left:
        lo = min(min(g.sum_ratio, g.average_ratio) for g in left)
        hi = max(max(g.sum_ratio, g.average_ratio) for g in left)
        ax.text(0.0, -0.08, f"and {plural(len(left), 'more parameter')}, ratios between {lo:.3g} and {hi:.3g}", transform=ax.transAxes, fontsize=8, va="top")
    ax.set_label("gradients")


def _unanswered(e: Explanation, question: int, what: str) -> str:
    reason = dict(e.unanswered).get(question)
    return f"{what}: not measured for {e.under_test}" + (f" ({reason})" if reason else "")


def explain_figure(e: Explanation) -> Figure:
    """The explanation as one figure: the step diagram, bytes per device, loss weights and
    gradient ratios, each from the measured facts.

    Args:
        e: what ``dpverify.explain.measure.explain`` measured.

    Returns:
        A matplotlib figure 1,200 px wide; ``dpverify.figures.save_figure`` writes it.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (``pip install 'dpverify[plot]'``).
    """
    lanes = len(e.device_ids)
    shown = min(len(e.grads), MOST_PARAMETERS)
    heights = [0.9 + 0.85 * lanes, 3.4, 1.4 + 0.24 * max(shown, 2)]
    with drawing():
        figure = new_figure(sum(heights))
        # a subfigure per row: each lays out its own margins, so that long parameter names
        # on the gradient axis do not push the step diagram aside
        rows: Any = figure.subfigures(3, 1, height_ratios=heights)  # an array of 3 (typed as one or many)
        step, middle, bottom = rows
        _draw_step(step.add_subplot(), e)
        bytes_ax, weights = middle.subplots(1, 2, width_ratios=[1.0, 1.0])
        _draw_bytes(bytes_ax, e)
        if e.loss_average is not None:
            _draw_loss_weights(weights, e.loss_average)
        else:
            message_panel(weights, _unanswered(e, 4, "Loss weights"), "loss weights")
        grads = bottom.add_subplot()
        if e.grads:
            _draw_grads(grads, e)
        else:
            message_panel(grads, _unanswered(e, 3, "Gradients"), "gradients")
        figure.suptitle(f"dpverify explain: {e.model}, {e.parameters:,} parameters ({e.dtype}), loss {e.loss}", fontweight="bold", x=0.01, ha="left")
    return figure


def loss_weights_figure(r: LossAverageReport) -> Figure:
    """A loss-averaging report as a figure: each replica's loss against ``loss.mean()``,
    the weighted mean and the full-batch loss, and the weight each row (or token) gets
    against ``1/B`` (``1/N``)::

        except ParallelMismatch as error:
            loss_weights_figure(error.report).savefig("loss.png")

    Args:
        r: the report of ``check_forward_loss_average`` or of a ``ParallelMismatch``.

    Returns:
        A figure with a ``"losses"`` and a ``"loss weights"`` axes.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (``pip install 'dpverify[plot]'``).
    """
    with drawing():
        figure = new_figure(4.2)
        losses, weights = figure.subplots(1, 2)
        _draw_losses(losses, r)
        _draw_loss_weights(weights, r)
        figure.suptitle(
            f"A loss computed in forward, averaged after DataParallel: batch of {r.batch_size}, chunks {list(r.chunk_sizes)}",
            fontweight="bold", x=0.01, ha="left",
        )
    return figure


def _draw_losses(ax: Axes, r: LossAverageReport) -> None:
    names = [f"replica {i}" for i in range(len(r.replica_losses))]
    ax.bar(names, r.replica_losses, color=COLOURS["replica"], width=0.6, label="replica losses")
    lines = (
        (r.mean_of_means, COLOURS["fail"] if r.is_biased else COLOURS["pass"], "-", f"loss.mean() = {r.mean_of_means:.6g}"),
        (r.full_batch_loss, COLOURS["limit"], "--", f"full-batch loss = {r.full_batch_loss:.6g}"),
    )
    for value, colour, style, label in lines:
        ax.axhline(value, color=colour, linestyle=style, linewidth=1.4, label=label)
    ax.set_ylabel("loss (the model's units)")
    ax.set_title("Each replica's loss, and what averaging them gives")
    finite = [x for x in (*r.replica_losses, r.full_batch_loss) if x == x]
    ax.set_ylim(min(0.0, *finite) if finite else 0.0, (max(finite) * 1.3) if finite else 1.0)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_label("losses")
