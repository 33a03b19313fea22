"""How ``dpverify check`` looks: the header, the live progress, the verdict table, the
explanations and the per-parameter errors (rich)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dpverify.core.text import and_list, plural, shape_text, shorten_names
from dpverify.models.user import UserModel
from dpverify.planner import ModelCheckReport, parameter_errors
from dpverify.registry import CheckResult, Split, Verdict

__all__ = ["EXACT_HEADER", "CheckProgress", "render_model_check", "render_model_check_header", "runs_on"]


#: ``check --exact``'s line in the header.
EXACT_HEADER = (
    "exact mode: float64 copies of the model, inputs and target on a dyadic grid, every operation shown exact "
    "(or refused, naming it); the parallel step must be bit-identical. Tolerance: none."
)

_STYLES = {
    Verdict.PASS: "green",
    Verdict.FAIL: "bold red",
    Verdict.EXPLAINED: "cyan",
    Verdict.WARN: "yellow",
    Verdict.SKIP: "dim",
}


def _group_backend() -> str | None:
    """The backend of the initialised default process group (torchrun's), whose ranks the
    ranked checks run on; None without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from dpverify.ddp.torchrun import ProcessGroupRunner

    return ProcessGroupRunner().backend


def _ddp_backend(world_size: int) -> str:
    """The process group backend the DDP check's ranks get: torchrun's group's, else that
    of a pool of ``world_size`` ranks."""
    group = _group_backend()
    if group is not None:
        return group
    try:
        from dpverify.ddp.pool import default_backend
    except ImportError:  # no DDP in this build: the command refused --backend ddp already
        return "gloo"
    return default_backend(world_size)


#: The sharded backends, in words.
_SHARDED = {
    "fsdp": "FSDP2 (fully_shard)",
    "tp": "tensor parallelism (parallelize_module)",
    "pp": "pipeline parallelism (torch.distributed.pipelining)",
}


def runs_on(
    backend: str, device_counts: Sequence[int], wrapper: str | None = None, *, criterion: str | None = None, dim: int = 0,
) -> str:
    """What runs the checks, in words: DataParallel on virtual or CUDA devices; DDP, FSDP2,
    tensor and pipeline parallelism as real processes, one per rank, in gloo or nccl
    process groups.

    Args:
        backend: ``"dp"``, ``"ddp"``, ``"fsdp"``, ``"tp"``, ``"pp"`` or ``"all"``.
        device_counts: the device counts, which are the world sizes of the ranked backends.
        wrapper: the DataParallel-like wrapper under test (default torch's DataParallel).
        criterion: the criterion wrapper of a model/criterion pair, if one is under test.
        dim: the dimension DataParallel splits the batch along.
    """
    from dpverify.core.devices import cuda_device_count

    parts: list[str] = []
    if backend == "dp" or (backend == "all" and _group_backend() is None):  # under torchrun, "all" is the ranked ones
        gpus = cuda_device_count()
        where = f"{plural(gpus, 'CUDA device')} where enough exist, virtual ones otherwise" if gpus else "virtual devices (no CUDA here)"
        pair = f" with criterion wrapper {criterion}" if criterion else ""
        along = f", batch split along dim {dim}" if dim != 0 else ""
        parts.append(f"{wrapper or 'DataParallel'}{pair} on {where}{along}")
    sizes: dict[str, list[int]] = {}
    for size in sorted(set(device_counts)):
        sizes.setdefault(_ddp_backend(size), []).append(size)
    ranks = and_list([
        f"{name} ranks ({and_list([str(n) for n in counts])} {'process' if counts == [1] else 'processes'})"
        for name, counts in sizes.items()
    ])
    if backend in ("ddp", "all"):
        parts.append(f"real DDP on {ranks}")
    sharded = [what for name, what in _SHARDED.items() if backend in (name, "all")]
    if sharded:
        parts.append(f"{and_list(sharded)} on the same {ranks}" if backend == "all" else f"{sharded[0]} on {ranks}")
    return and_list(parts)


def render_model_check_header(
    console: Any, model: UserModel, *, loss: str, backend: str, device_counts: Sequence[int], wrapper: str | None = None,
    criterion: str | None = None, dim: int = 0, training: str | None = None, exact: bool = False,
) -> None:
    """Prints what is checked, on what, before any check runs (a long run shows at once
    what it is doing): the wrapper and criterion wrapper under test among them, where
    a training check runs, ``training``: its steps, optimizer and code after backward, and
    with ``exact``, that the checks run in exact mode, without tolerance."""
    from rich.text import Text

    console.print(Text(f"dpverify check: {model.name}", style="bold"))
    console.print(
        f"{plural(model.parameter_count, 'parameter')}; batch: {model.batch_source}; loss: {loss}; "
        f"{runs_on(backend, device_counts, wrapper, criterion=criterion, dim=dim)}; torch {torch.__version__}",
        markup=False,
    )
    if training is not None:
        console.print(training, markup=False)
    if exact:
        console.print(EXACT_HEADER, markup=False)


class CheckProgress:
    """The progress of ``dpverify check``.

    On a terminal, a live bar: checks done of all, the time so far, the check running. Elsewhere
    (a pipe, a CI log) one line per check as it finishes, ``[3/12] PASS  check, split:
    summary``, each flushed at once, so that a run of minutes shows its progress in a log.
    """

    def __init__(self, console: Any, total: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = console
        self.total = total
        self.done = 0
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]check"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self.task = self.progress.add_task("starting", total=total)

    def __enter__(self) -> CheckProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.stop()

    def start(self, check: str, split: Split) -> None:
        """Shows the check about to run (a check can take minutes on a large model)."""
        self.progress.update(self.task, description=f"{check}, {split.label}")

    def finished(self, result: CheckResult) -> None:
        """Counts a finished check; off a terminal, prints its line."""
        self.done += 1
        self.progress.update(self.task, advance=1)
        if not self.console.is_terminal:
            summary = result.summary.splitlines()[0] if result.summary else ""
            count = f"[{self.done:>{len(str(self.total))}}/{self.total}]"
            self.console.print(f"{count} {result.verdict}  {result.title}, {result.split.label}: {summary}", markup=False, highlight=False, soft_wrap=True)
            self.console.file.flush()  # a pipe is block-buffered: the line must reach the log now


def render_model_check(console: Any, report: ModelCheckReport) -> None:
    """Prints a verdict per check and split, explanations, failures, the per-parameter
    error table and the final verdict line (the header came before the checks ran)."""
    from rich.table import Table
    from rich.text import Text

    splits = list(dict.fromkeys(r.split for r in report.results))
    table = Table(title="Verdict per check and split", title_justify="left")
    table.add_column("check")
    for split in splits:
        table.add_column(split.label)
    for check in dict.fromkeys(r.title for r in report.results):
        cells: list[Text | str] = []
        for split in splits:
            found = [r for r in report.results if r.title == check and r.split == split]
            cells.append(Text(found[0].verdict, style=_STYLES[found[0].verdict]) if found else "")
        table.add_row(check, *cells)
    console.print(table)
    _render_notes(console, report)
    _render_parameters(console, report)
    if report.failed:
        status = Text("FAILED", style="bold red")
    elif report.checked_nothing:
        # not OK: a run that compared nothing must not read as a pass
        status = Text("NOTHING CHECKED", style="bold yellow")
    else:
        status = Text("OK", style="bold green")
    console.print(Text.assemble(status, f": {report.counts()}", " (exact mode, tolerance none)" if report.exact else ""))


def _render_notes(console: Any, report: ModelCheckReport) -> None:
    from rich.panel import Panel
    from rich.text import Text

    explained = [r for r in report.results if r.verdict == Verdict.EXPLAINED]
    if explained:
        # each explanation once, for all its modules (a long list keeps its first and last few)
        width = max(24, console.width // 2)
        text = "\n".join(group.describe(group.names(width, most=12)) for group in report.groups) or explained[0].detail
        reason = "this reason" if len(report.groups) <= 1 else "these reasons"
        differ = "differs" if len(explained) == 1 else "differ"
        console.print(Panel(
            Text(f"{text}\n{plural(len(explained), 'check')} {differ} for {reason}; they are not failures. The eval-mode rows are the verdict."),
            title="Expected divergence (train mode)", title_align="left", border_style="cyan",
        ))
    warned = [r for r in report.results if r.verdict == Verdict.WARN]
    if warned:
        console.print(Panel(Text(warned[0].detail), title=f"loss.mean() of replica losses is biased ({warned[0].split.label})", title_align="left", border_style="yellow"))
    skipped = [r for r in report.results if r.verdict == Verdict.SKIP]
    if skipped:
        # the reasons, so that a skip is a decision to read rather than a silent gap
        lines = "\n".join(f"{r.title}, {r.split.label}: {r.summary}" for r in skipped)
        serial = sum(r.serial for r in skipped)
        if report.checked_nothing and serial == len(skipped):
            title = "Nothing ran in parallel: every check ran one replica (one device, or one row)"
        elif report.checked_nothing:
            title = "Nothing was checked: every check was skipped"
        else:
            title = f"Skipped: {plural(len(skipped), 'check')}" + (f", {serial} of them ran one replica (nothing in parallel)" if serial else " did not run")
        console.print(Panel(Text(lines), title=title, title_align="left", border_style="yellow" if report.checked_nothing else "dim"))
    for result in report.failed:
        console.print(Panel(Text(result.detail or result.summary), title=f"FAIL: {result.title}, {result.split.label}", title_align="left", border_style="red"))


def _render_parameters(console: Any, report: ModelCheckReport) -> None:
    """The worst gradient error of every parameter, one line per parameter at any width of
    80 columns or more: the names are cut in the middle to the room the other columns
    leave, the check is named by its short name, and no cell wraps."""
    from rich.table import Table
    from rich.text import Text

    rows = parameter_errors(report)
    if not rows:
        return
    cells = [
        (
            shape_text(row.shape),
            Text("no gradient", style="dim") if row.absent else Text(f"{row.ratio:.3g}", style="bold red" if row.ratio > 1 else "green"),
            "" if row.absent else f"{row.max_abs:.3g}",
            "" if row.absent else f"{row.allowed:.3g}",
            row.where,
        )
        for row in rows
    ]
    headers = ("shape", "error/allowed", "max |Δ|", "allowed", "where")
    widths = [max(len(header), *(len(cell[i]) for cell in cells)) for i, header in enumerate(headers)]
    # 7 borders and 2 spaces of padding per column; the names get what the others leave,
    # and on a narrow console the split they came from is cut at its end
    chrome = 7 + 2 * 6
    names = shorten_names([row.name for row in rows], max(16, min(console.width - chrome - sum(widths), max(len(row.name) for row in rows))))
    where_room = max(8, console.width - chrome - max(map(len, names)) - sum(widths[:-1]))
    table = Table(title="Per-parameter gradient error (worst over checks and splits)", title_justify="left")
    table.add_column("parameter", no_wrap=True, min_width=max(map(len, names)))
    for header in headers[:-1]:
        table.add_column(header, justify="left" if header == "shape" else "right", no_wrap=True)
    table.add_column("where", no_wrap=True, overflow="ellipsis", max_width=where_room)
    for name, (shape, ratio, gap, allowed, where) in zip(names, cells, strict=True):
        table.add_row(name, shape, ratio, gap, allowed, where)
    console.print(table)
