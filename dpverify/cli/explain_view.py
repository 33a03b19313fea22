"""``dpverify explain`` drawn with rich: the step diagram and the tables from the facts of
``dpverify.explain.measure``, the numbered answers from ``dpverify.explain.answers``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from dpverify.core.text import name_list, plural, shape_text, shorten_names
from dpverify.explain.answers import Answer, answers
from dpverify.explain.measure import ChunkFact, Explanation, ReplicaFact, StateFact

__all__ = ["explanation_json", "render_explanation"]


def explanation_json(e: Explanation) -> str:
    """The explanation as JSON: every measured value, and the numbered answers."""
    data: dict[str, Any] = dataclasses.asdict(e)
    data["answers"] = [dataclasses.asdict(answer) for answer in answers(e)]
    data["replicas_used"] = e.replicas_used
    data["idle_devices"] = list(e.idle_devices)
    for row, device in zip(data["bytes"], e.bytes, strict=True):
        row["total"] = device.total
    return json.dumps(data, indent=2)


def _kb(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n >= 1024 else f"{n} B"


def _rows(n: int, dim: int = 0) -> str:
    """``5 rows``, or ``5 entries along dim 1``: entries of the dimension the batch is split along."""
    if dim != 0:
        return f"{n} {'entry' if n == 1 else 'entries'} along dim {dim}"
    return f"{n} row" if n == 1 else f"{n} rows"


def _backward_cell(e: Explanation, replica: ReplicaFact) -> str:
    """What Gather's backward sent a replica: the rows of d loss/d output, or, for a forward
    that returns its loss, the one number d loss/d loss_i (the replica's weight; what it sent
    any other output is zero, the loss being computed from the replica losses alone)."""
    if e.loss_in_forward:
        if replica.loss_grad is None:
            return "d loss/d loss_i:\nnot seen"
        if not e.replicated:
            return f"d loss/d loss = {replica.loss_grad:.4g}\n(the loss itself)"
        return f"d loss/d loss_{replica.replica}\n= {replica.loss_grad:.4g} (its weight)"
    return f"d loss/d output:\n{_rows(replica.output_grad_rows, e.dim)}"


def _diagram(e: Explanation) -> Table:
    """One step as a table: a column per device, a row per stage, arrows down then up."""
    title = "One DataParallel step, measured" if e.wrapper is None else f"One step of {e.wrapper}, measured"
    if e.eval_mode_for_step:
        title += " (in eval mode: in train mode a one-row chunk makes BatchNorm raise)"
    table = Table(title=title, box=box.ROUNDED, show_lines=True, title_justify="left")
    table.add_column("stage", style="bold", no_wrap=True)
    for device in e.device_ids:
        marks = [m for m, on in (("source", device == e.device_ids[0]), ("output", device == e.output_device)) if on]
        table.add_column(f"device {device}" + (f" ({', '.join(marks)})" if marks else ""))
    chunks = {c.device: c for c in e.chunks}
    replicas = {r.device: r for r in e.replicas}
    first, out = e.device_ids[0], e.output_device

    def row(stage: str, cell: Any) -> None:
        table.add_row(stage, *[cell(d) for d in e.device_ids])

    row("batch", lambda d: f"{_rows(e.batch_size, e.dim)}, {shape_text(e.batch_shape)}" if d == first else "")
    row("▼ scatter", lambda d: _chunk_cell(chunks[d], e.dim))
    if not e.replicated:
        row("▼ replicate", lambda d: Text("none: with one device\nthe module itself runs", style="dim"))
    else:
        row("▼ replicate", lambda d: _replica_cell(replicas.get(d)))
    row("▼ forward", lambda d: f"output {shape_text(replicas[d].output_shape)}\nactivations {_kb(replicas[d].activation_bytes)}" if d in replicas else "")
    if not e.replicated:
        row("▼ gather", lambda d: Text("none: the output\nis the module's", style="dim"))
    elif e.gathered_on is None:
        row("▼ gather", lambda d: f"[bold]outputs {shape_text(e.output_shape)}[/]\n(no gather() call seen)" if d == out else "")
    else:
        gathered = e.gathered_on
        row("▼ gather", lambda d: f"[bold]outputs {shape_text(e.output_shape)}[/] ◀ {e.replicas_used} chunk{'s' if e.replicas_used != 1 else ''}" if d == gathered else (f"→ device {gathered}" if d in replicas else ""))
    at = out if e.gathered_on is None else e.gathered_on
    # a forward that returns its loss: the step's loss is the weighted sum of the gathered replica losses
    loss = f"Σ {e.weighting}·loss_i" if e.loss_in_forward and e.replicated else e.loss
    row("▼ loss", lambda d: f"[bold]{loss}[/]\n= {e.loss_value:.5g}" if d == at else "")
    row("▲ backward", lambda d: _backward_cell(e, replicas[d]) if d in replicas else "")
    if not e.replicated:
        row("▲ .grad", lambda d: "[bold].grad[/] directly\n(no replicas)")
    else:
        row("▲ reduce-add", lambda d: f"[bold].grad = Σ of {e.replicas_used}[/]\nreplica grads" if d == first else (f"grads → device {first}" if d in replicas else ""))
    return table


def _chunk_cell(chunk: ChunkFact, dim: int = 0) -> Text | str:
    if chunk.kind == "idle":
        return Text("idle (no chunk)", style="dim")
    colour = "green" if chunk.kind == "view" else "yellow"
    rows = ("row" if chunk.size == 1 else "rows") if dim == 0 else f"dim {dim}:"
    label = Text(f"{rows} {chunk.rows} ({chunk.size})\n")
    label.append(chunk.kind.upper(), style=f"bold {colour}")
    label.append(" of the batch" if chunk.kind == "view" else f" {_kb(chunk.copied_bytes)}")
    return label


def _replica_cell(replica: ReplicaFact | None) -> Text | str:
    if replica is None:
        return Text("—", style="dim")
    if replica.copied_parameters == 0:
        return Text.assemble(("replica 0 = the module\n", "bold"), ("shares storage", "green"))
    return Text.assemble(f"replica {replica.replica}: copy\n", (f"{_kb(replica.parameter_bytes)}", "yellow"))


def _loss_table(e: Explanation) -> Table | None:
    r = e.loss_average
    if r is None:
        return None
    table = Table(title="Loss averaging for this batch (float64)", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("")
    for i, _size in enumerate(r.chunk_sizes):
        table.add_column(f"replica {i}", justify="right")
    # a token-mean loss is a mean over each replica's tokens t_i: its weights are per token
    # and the exact one is 1/T, the reduction sum(t_i/T * loss_i)
    item, symbol, total = ("token", "t_i/T", "T") if r.by_tokens else ("row" if e.dim == 0 else "entry", "n_i/B", "B")
    table.add_row("chunk size n_i", *map(str, r.chunk_sizes))
    if r.by_tokens:
        table.add_row("tokens t_i", *map(str, r.counts))
    table.add_row("replica loss", *[f"{x:.6g}" for x in r.replica_losses])
    table.add_row(f"loss.mean() weight per {item}", *[f"{w:.4g}" for w in r.sample_weights])
    exact = 1 / sum(r.counts) if sum(r.counts) else 0.0
    table.add_row(f"exact weight per {item} (1/{total})", *[f"{exact:.4g}"] * len(r.chunk_sizes))
    summary = Table.grid(padding=(0, 2))
    summary.add_column()
    summary.add_column(justify="right")
    summary.add_row("mean of means, loss.mean()", f"{r.mean_of_means:.8g}")
    summary.add_row(f"weighted mean, Σ {symbol}·loss_i", f"{r.weighted_mean:.8g}")
    summary.add_row("full-batch loss", f"{r.full_batch_loss:.8g}")
    style = "bold red" if r.is_biased else "green"
    summary.add_row(Text("bias of loss.mean()", style=style), Text(f"{r.loss_bias:+.3g}", style=style))
    summary.add_row(Text("gradient bias (relative)", style=style), Text(f"{r.grad_bias:.3g}", style=style))
    outer = Table.grid()
    outer.add_row(table)
    outer.add_row(summary)
    return outer


def _grad_table(e: Explanation, width: int) -> Table | None:
    if not e.grads:
        return None
    # cut in the middle, never at the end, and wide enough that rich does not cut again
    names = shorten_names([g.parameter for g in e.grads], max(24, width * 2 // 5))
    table = Table(title=f"Gradient: sum vs average of the {plural(e.replicas_used, 'replica gradient')} vs full batch (float64)", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("parameter", no_wrap=True, min_width=max(map(len, names), default=0))
    for header in ("|full|", "max |sum - full|", "max |average - full|", "|average| / |full|"):
        table.add_column(header, justify="right")
    for g, name in zip(e.grads, names, strict=True):
        table.add_row(name, f"{g.full_norm:.4g}", Text(f"{g.sum_error:.2g}", style="green"), Text(f"{g.average_error:.3g}", style="red" if g.average_error > 1e-9 else ""), f"{g.average_ratio:.3g}")
    return table


def _bytes_table(e: Explanation) -> Table:
    table = Table(title="Estimated bytes held per device during the step", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("device", "inputs", "parameters", "activations", "gathered outputs", "gradients", "total"):
        table.add_column(name, justify="left" if name == "device" else "right")
    top = max(b.total for b in e.bytes)
    for b in e.bytes:
        style = "bold" if b.total == top else ""
        table.add_row(str(b.device), _kb(b.inputs), _kb(b.parameters), _kb(b.activations), _kb(b.outputs), _kb(b.gradients), Text(_kb(b.total), style=style))
    table.caption_justify = "left"
    table.caption = (
        "inputs: the batch on the source device, copied chunks elsewhere; parameters: the module's on "
        "the source device, replica copies elsewhere; activations: module outputs seen by forward hooks; "
        "gradients: replica contributions, the output-chunk gradient, the summed .grad (source) and the "
        "gathered output's gradient (output device)."
    )
    return table


def _splits_table(e: Explanation) -> Table:
    n = len(e.device_ids)
    title = f"torch.chunk on {n} devices" if e.wrapper is None else f"{e.wrapper} on {n} devices, measured (rows each replica's forward received)"
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    notes = any(s.note for s in e.splits)
    for header in ("batch", "chunk sizes", "replicas", "idle devices", *(["note"] if notes else [])):
        table.add_column(header, justify="right" if header in ("batch", "replicas", "idle devices") else "left")
    for s in e.splits:
        style = "bold" if s.batch_size == e.batch_size else ""
        cells = [str(s.batch_size), str(list(s.chunk_sizes)) if not s.note else "—", str(len(s.chunk_sizes)) if not s.note else "—", str(s.idle_devices) if not s.note else "—"]
        table.add_row(*cells, *([s.note] if notes else []), style=style)
    return table


def _grouped(state: Sequence[StateFact]) -> list[tuple[str, list[str], str]]:
    """``(kind, wheres, detail)``: facts with the same kind and detail as one row (every
    BatchNorm layer has the same explanation: it is shown once, for all of them)."""
    rows: dict[tuple[str, str], list[str]] = {}
    for fact in state:
        rows.setdefault((fact.kind, fact.detail), []).append(fact.where)
    return [(kind, wheres, detail) for (kind, detail), wheres in rows.items()]


def _state_table(e: Explanation, width: int) -> Table | None:
    if not e.state:
        return None
    rows = _grouped(e.state)
    room = max(24, width // 3)
    wheres = [shorten_names(names, room) for _kind, names, _detail in rows]
    # wide enough for every name, quoted and followed by a comma in a list, so that rich
    # wraps between names and never cuts one
    widest = max(len(name) + (3 if len(names) > 1 else 0) for names in wheres for name in names)
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("kind")
    table.add_column("where", min_width=widest)
    table.add_column("measured, and why")
    for (kind, names, detail), short in zip(rows, wheres, strict=True):
        where = short[0] if len(names) == 1 else f"{plural(len(names), 'module')}: {name_list(names, room, most=12)}"
        table.add_row(kind, where, detail)
    return table


def _answer(answer: Answer, extra: RenderableType | None = None) -> RenderableType:
    body: list[RenderableType] = [Text(f"{answer.number}. {answer.question}", style="bold"), Padding(Text(answer.answer), (0, 0, 0, 4))]
    if extra is not None:
        body.append(Padding(extra, (0, 0, 0, 4)))
    return Group(*body, Text(""))


def render_explanation(console: Console, e: Explanation) -> None:
    """Prints the header, the step diagram and the eleven numbered answers."""
    idle = f", device {', '.join(map(str, e.idle_devices))} idle" if e.idle_devices else ""
    title = f"dpverify explain: {e.model}" + (f" under {e.wrapper}" if e.wrapper is not None else "")
    console.print(Text(title, style="bold"))
    console.print(f"{e.parameters:,} parameters ({e.dtype}); batch of {_rows(e.batch_size, e.dim)} ({e.batch_source}); loss: {e.loss}", markup=False)
    split = "" if e.dim == 0 else f", split and gathered along dim {e.dim}"
    if e.wrapper is None:
        console.print(f"virtual devices {list(e.device_ids)}, output_device {e.output_device}{split}: chunks {list(e.chunk_sizes)}{idle}")
    else:
        planned = f" (torch's scatter: {list(e.planned_chunk_sizes)})" if list(e.planned_chunk_sizes) != list(e.chunk_sizes) else ""
        console.print(
            f"wrapper {e.wrapper}, run inside dpverify.virtual_devices({max(e.device_ids) + 1}): virtual devices "
            f"{list(e.device_ids)}, output_device {e.output_device}{split}: chunks {list(e.chunk_sizes)} as it split the batch{planned}{idle}",
            markup=False,
        )
        if not e.replica_devices_known:
            console.print(
                "the wrapper ran its replicas outside parallel_apply and torch.cuda.device: their devices are not "
                "known, and they are shown on the devices in the order they ran",
                markup=False,
            )
        if e.unanswered:
            console.print(f"not measured for this wrapper: question {', '.join(str(n) for n, _ in e.unanswered)} (the answers say why)", markup=False)
    console.print()
    console.print(_diagram(e))
    # the table under each answer that has one (None: nothing measured to show)
    extras: dict[int, RenderableType | None] = {
        3: _grad_table(e, console.width),
        4: _loss_table(e),
        7: _bytes_table(e),
        9: _splits_table(e),
        10: _state_table(e, console.width),
    }
    for answer in answers(e):
        console.print(_answer(answer, extras.get(answer.number)))
