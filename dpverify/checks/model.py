"""``dpverify check``: every applicable check on a user's model, over several splits.

For each split (a batch size on a number of devices) it runs the DataParallel checks
(gradients against one device, replica gradients summing to the full-batch gradient), the
loss-in-forward checks when the model returns its loss, and the DDP check when asked. A
model with BatchNorm in train mode or Dropout cannot match exactly: its mismatches are
explained (the module and the fix) rather than failed, and the same checks then run on an
eval-mode copy, which must match.

Whatever a check's code raises (the model's forward, a loss, a ``sys.exit()`` in either) is
that check's failure, with the user's frames of the traceback; only an ``InvalidArgument``
stops the run, as the command line's usage error. A run whose every check was skipped
checked nothing, and says so (``ModelCheckReport.checked_nothing``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpverify.checks.dp import assert_dp_grads_match, assert_grad_sum_equals_mean_loss_grad
from dpverify.checks.loss_average import (
    LossAverageReport,
    assert_loss_reduction_matches_full_batch,
    check_forward_loss_average,
    chunk_weighted_loss,
)
from dpverify.core.comparison import StepComparison, TensorComparison
from dpverify.core.divergence import (
    ONE_ROW_BATCHNORM,
    DivergenceSource,
    SourceGroup,
    divergence_sources,
    group_sources,
)
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.core.text import and_list, plural, shorten_names
from dpverify.core.tracebacks import describe_exception, failure_detail
from dpverify.ddp import checks_if_available
from dpverify.models.user import Batch, UserModel

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_DEVICE_COUNTS",
    "CheckProgress",
    "CheckResult",
    "ModelCheckReport",
    "Split",
    "Verdict",
    "check_model",
    "parameter_errors",
    "plan_checks",
    "render_model_check",
    "render_model_check_header",
    "runs_on",
]

#: Even chunks, uneven chunks, one-row chunks and fewer rows than devices, on 2 and 4 devices.
DEFAULT_BATCH_SIZES: tuple[int, ...] = (8, 5, 2)
DEFAULT_DEVICE_COUNTS: tuple[int, ...] = (2, 4)



class Verdict:
    """The verdicts a check can reach."""

    PASS = "PASS"
    FAIL = "FAIL"
    EXPLAINED = "EXPLAINED"  # differs because of BatchNorm/Dropout in train mode: not a bug
    WARN = "WARN"  # correct DataParallel, but a training-loop trap (loss.mean() bias)
    SKIP = "SKIP"


@dataclass(frozen=True)
class Split:
    """A batch size on a number of devices (DataParallel) or ranks (DDP)."""

    batch_size: int
    devices: int

    @property
    def label(self) -> str:
        return f"B={self.batch_size} on {self.devices}"


@dataclass(frozen=True)
class CheckResult:
    """One check on one split.

    Attributes:
        check: what was checked, short (a table row label).
        split: the batch size and device count.
        verdict: one of ``Verdict``'s values.
        summary: one line for the table.
        detail: the full report of a failure, or the explanation of a divergence.
        tensors: the compared tensors (for the per-parameter table).
    """

    check: str
    split: Split
    verdict: str
    summary: str
    detail: str = ""
    tensors: tuple[TensorComparison, ...] = ()


@dataclass(frozen=True)
class ModelCheckReport:
    """Everything ``dpverify check`` found.

    Attributes:
        model: the model's name.
        loss: the loss, in words.
        results: every check on every split, in the order they ran.
        divergence: the modules that make train mode differ (BatchNorm, Dropout).
        groups: the same, one group per shared explanation.
    """

    model: str
    loss: str
    results: tuple[CheckResult, ...]
    divergence: tuple[DivergenceSource, ...]
    groups: tuple[SourceGroup, ...] = ()

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.verdict == Verdict.FAIL)

    @property
    def checked_nothing(self) -> bool:
        """Whether no check ran: every one was skipped (or none was planned)."""
        return all(r.verdict == Verdict.SKIP for r in self.results)

    def count(self, verdict: str) -> int:
        return sum(r.verdict == verdict for r in self.results)


@dataclass(frozen=True)
class _Planned:
    check: str
    split: Split
    run: Callable[[], CheckResult]


def plan_checks(
    model: UserModel,
    *,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    device_counts: Sequence[int] = DEFAULT_DEVICE_COUNTS,
    backend: str = "dp",
) -> list[_Planned]:
    """Every check to run, in order; a model with divergence sources is checked as given
    (mismatches explained) and then in eval mode (mismatches fail)."""
    sources = divergence_sources(model.module)
    modes: list[tuple[str, nn.Module, bool]] = [("", model.module, bool(sources))]
    if sources:
        modes.append((" (eval mode)", copy.deepcopy(model.module).eval(), False))
    planned: list[_Planned] = []
    for suffix, module, explain in modes:
        for batch_size in batch_sizes:
            batch = model.make_batch(batch_size)
            for devices in device_counts:
                split = Split(batch_size, devices)
                for name, run in _checks_for(module, batch, split, backend, explain):
                    planned.append(_Planned(name + suffix, split, _named(name + suffix, split, run)))
    return planned


def _named(name: str, split: Split, run: Callable[[str, Split], CheckResult]) -> Callable[[], CheckResult]:
    return lambda: run(name, split)


Runner = Callable[[str, Split], CheckResult]


def _checks_for(module: nn.Module, batch: Batch, split: Split, backend: str, explain: bool) -> Iterator[tuple[str, Runner]]:
    ids = list(range(split.devices))
    sources = group_sources(module) if explain else ()
    if backend in ("dp", "all"):
        if batch.returns_loss:
            yield "loss.mean() of replica losses", lambda name, split: _loss_average(module, batch, ids, name, split)
            yield "n_i/B-weighted loss is exact", lambda name, split: _comparison(
                name, split, sources,
                lambda: assert_loss_reduction_matches_full_batch(module, batch.inputs, device_ids=ids, reduce=chunk_weighted_loss),
            )
        else:
            loss_fn = batch.loss_fn
            assert loss_fn is not None
            yield "DP grads match one device", lambda name, split: _comparison(
                name, split, sources,
                lambda: assert_dp_grads_match(module, batch.inputs, batch.target, loss_fn=loss_fn, device_ids=ids),
            )
            yield "replica grads sum to full", lambda name, split: _comparison(
                name, split, sources,
                lambda: assert_grad_sum_equals_mean_loss_grad(module, batch.inputs, batch.target, loss_fn=loss_fn, device_ids=ids),
            )
    if backend in ("ddp", "all"):
        yield "DDP grads match one device", lambda name, split: _ddp(module, batch, name, split, sources)


def _ddp(module: nn.Module, batch: Batch, name: str, split: Split, sources: Sequence[SourceGroup]) -> CheckResult:
    checks = checks_if_available()
    if checks is None:
        return CheckResult(name, split, Verdict.FAIL, "the DDP backend is not available in this build")
    if batch.loss_fn is None:
        return CheckResult(name, split, Verdict.SKIP, "needs loss_fn(output, target); this forward returns its loss")
    if split.batch_size < split.devices:
        return CheckResult(name, split, Verdict.SKIP, f"fewer rows than ranks ({split.batch_size} < {split.devices})")
    loss_fn = batch.loss_fn
    return _comparison(
        name, split, sources,
        lambda: checks.assert_ddp_grads_match(module, batch.inputs, batch.target, loss_fn=loss_fn, world_size=split.devices),
    )


def _comparison(name: str, split: Split, sources: Sequence[SourceGroup], run: Callable[[], StepComparison]) -> CheckResult:
    try:
        result = run()
    except ParallelMismatch as failure:
        report = failure.report
        tensors = report.tensors if isinstance(report, StepComparison) else ()
        if sources:
            return _explained(name, split, sources, tensors)
        worst = max((t for t in tensors if not t.ok), key=lambda t: t.ratio, default=None)
        summary = f"{worst.name}: {worst.max_abs:.3g} > {worst.allowed:.3g} allowed" if worst else str(failure).splitlines()[0]
        return CheckResult(name, split, Verdict.FAIL, summary, str(failure), tensors)
    except InvalidArgument:
        raise
    except (Exception, SystemExit) as error:
        if sources and ONE_ROW_BATCHNORM in str(error):
            return _explained(name, split, sources, ())
        return _raised(name, split, error)
    return CheckResult(name, split, Verdict.PASS, f"worst at {result.worst_ratio:.2g} of tolerance", "", result.tensors)


def _raised(name: str, split: Split, error: BaseException) -> CheckResult:
    """A check whose code raised, or called ``sys.exit()``: a failure, with the user's frames."""
    return CheckResult(name, split, Verdict.FAIL, describe_exception(error), failure_detail(error))


def _explained(name: str, split: Split, sources: Sequence[SourceGroup], tensors: tuple[TensorComparison, ...]) -> CheckResult:
    # one explanation per group, not per module: 34 BatchNorm layers share one
    summary = "differs because of " + and_list([group.cause() for group in sources])
    detail = "\n".join(group.describe() for group in sources)
    return CheckResult(name, split, Verdict.EXPLAINED, summary, detail, tensors)


def _loss_average(module: nn.Module, batch: Batch, ids: list[int], name: str, split: Split) -> CheckResult:
    report: LossAverageReport = check_forward_loss_average(module, batch.inputs, device_ids=ids)
    if report.is_biased:
        return CheckResult(
            name, split, Verdict.WARN,
            f"biased by {report.loss_bias:+.3g} (chunks {list(report.chunk_sizes)}): "
            + ("weight by n_i/B" if report.weighted_is_exact else "the replica losses are not per-row means"),
            str(report),
        )
    return CheckResult(name, split, Verdict.PASS, f"exact here (chunks {list(report.chunk_sizes)})", str(report))


def check_model(
    model: UserModel,
    *,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    device_counts: Sequence[int] = DEFAULT_DEVICE_COUNTS,
    backend: str = "dp",
    on_result: Callable[[CheckResult], None] | None = None,
    on_start: Callable[[str, Split], None] | None = None,
    plan: Sequence[_Planned] | None = None,
) -> ModelCheckReport:
    """Runs every planned check; ``on_start`` sees each check's name and split before it
    runs, and ``on_result`` its result as it comes.

    Args:
        model: the model and its batches.
        batch_sizes: the batch sizes to check.
        device_counts: the device counts (DataParallel) or world sizes (DDP).
        backend: ``"dp"``, ``"ddp"`` or ``"all"``.
        on_result: called with each result.
        on_start: called before each check.
        plan: the checks ``plan_checks`` returned for these arguments, when the caller has
            them already (planning makes every batch).

    Raises:
        InvalidArgument: the model, its batches or the arguments cannot be checked (the
            message says why); anything else a check raises is that check's failure.
    """
    results: list[CheckResult] = []
    if plan is None:
        plan = plan_checks(model, batch_sizes=batch_sizes, device_counts=device_counts, backend=backend)
    for planned in plan:
        if on_start is not None:
            on_start(planned.check, planned.split)
        try:
            result = planned.run()
        except InvalidArgument:
            raise
        except (Exception, SystemExit) as error:  # the loss-average checks run the forward unguarded
            result = _raised(planned.check, planned.split, error)
        results.append(result)
        if on_result is not None:
            on_result(result)
    loss = model.make_batch(max(batch_sizes)).loss_name
    return ModelCheckReport(model.name, loss, tuple(results), divergence_sources(model.module), group_sources(model.module))


_PARAMETER = re.compile(r"grad '(?P<name>[^']+)'$")


@dataclass(frozen=True)
class ParameterError:
    """The worst gradient error of one parameter over every check and split.

    Attributes:
        name: the parameter.
        shape: its shape.
        ratio: greatest difference as a fraction of the allowed difference (> 1 fails).
        max_abs: the greatest absolute difference there.
        allowed: the allowed difference there.
        where: the check and split it came from.
    """

    name: str
    shape: tuple[int, ...]
    ratio: float
    max_abs: float
    allowed: float
    where: str


def parameter_errors(report: ModelCheckReport) -> list[ParameterError]:
    """Per parameter, the worst gradient error among checks that passed or failed
    (explained divergences are left out: they are not errors)."""
    worst: dict[str, ParameterError] = {}
    for result in report.results:
        if result.verdict not in (Verdict.PASS, Verdict.FAIL):
            continue
        for tensor in result.tensors:
            match = _PARAMETER.search(tensor.name)
            if match is None or tensor.problem is not None or not tensor.name.startswith(("grad ", "rank ")):
                continue
            name = match.group("name")
            current = worst.get(name)
            if current is None or tensor.ratio > current.ratio:
                where = f"{result.check}, {result.split.label}"
                worst[name] = ParameterError(name, tensor.shape, tensor.ratio, tensor.max_abs, tensor.allowed, where)
    return list(worst.values())


# --------------------------------------------------------------------------- display

_STYLES = {
    Verdict.PASS: "green",
    Verdict.FAIL: "bold red",
    Verdict.EXPLAINED: "cyan",
    Verdict.WARN: "yellow",
    Verdict.SKIP: "dim",
}


def _ddp_backend(world_size: int) -> str:
    """The process group backend the DDP check's pool of ``world_size`` ranks gets."""
    try:
        from dpverify.ddp.pool import default_backend
    except ImportError:  # no DDP in this build: the command refused --backend ddp already
        return "gloo"
    return default_backend(world_size)


def runs_on(backend: str, device_counts: Sequence[int]) -> str:
    """What runs the checks, in words: DataParallel on virtual or CUDA devices; DDP as
    real processes, one per rank, in gloo or nccl process groups.

    Args:
        backend: ``"dp"``, ``"ddp"`` or ``"all"``.
        device_counts: the device counts, which are the world sizes under DDP.
    """
    from dpverify.core.devices import cuda_device_count

    parts: list[str] = []
    if backend in ("dp", "all"):
        gpus = cuda_device_count()
        where = f"{plural(gpus, 'CUDA device')} where enough exist, virtual ones otherwise" if gpus else "virtual devices (no CUDA here)"
        parts.append(f"DataParallel on {where}")
    if backend in ("ddp", "all"):
        sizes: dict[str, list[int]] = {}
        for size in sorted(set(device_counts)):
            sizes.setdefault(_ddp_backend(size), []).append(size)
        groups = [
            f"{name} ranks ({and_list([str(n) for n in counts])} {'process' if counts == [1] else 'processes'})"
            for name, counts in sizes.items()
        ]
        parts.append(f"real DDP on {and_list(groups)}")
    return and_list(parts)


def render_model_check_header(console: Any, model: UserModel, *, loss: str, backend: str, device_counts: Sequence[int]) -> None:
    """Prints what is checked, on what, before any check runs (a long run shows at once
    what it is doing)."""
    from rich.text import Text

    console.print(Text(f"dpverify check: {model.name}", style="bold"))
    console.print(
        f"{plural(model.parameter_count, 'parameter')}; batch: {model.batch_source}; loss: {loss}; "
        f"{runs_on(backend, device_counts)}; torch {torch.__version__}",
        markup=False,
    )


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
            self.console.print(f"{count} {result.verdict}  {result.check}, {result.split.label}: {summary}", markup=False, highlight=False, soft_wrap=True)
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
    for check in dict.fromkeys(r.check for r in report.results):
        cells: list[Text | str] = []
        for split in splits:
            found = [r for r in report.results if r.check == check and r.split == split]
            cells.append(Text(found[0].verdict, style=_STYLES[found[0].verdict]) if found else "")
        table.add_row(check, *cells)
    console.print(table)
    _render_notes(console, report)
    _render_parameters(console, report)
    words = {Verdict.PASS: "passed", Verdict.FAIL: "failed", Verdict.EXPLAINED: "explained", Verdict.WARN: "warned", Verdict.SKIP: "skipped"}
    text = ", ".join(f"{report.count(v)} {word}" for v, word in words.items() if report.count(v) or v in (Verdict.PASS, Verdict.FAIL))
    if report.failed:
        status = Text("FAILED", style="bold red")
    elif report.checked_nothing:
        # not OK: a run that compared nothing must not read as a pass
        status = Text("NOTHING CHECKED", style="bold yellow")
    else:
        status = Text("OK", style="bold green")
    console.print(Text.assemble(status, f": {text}"))


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
        lines = "\n".join(f"{r.check}, {r.split.label}: {r.summary}" for r in skipped)
        title = "Nothing was checked: every check was skipped" if report.checked_nothing else f"Skipped: {plural(len(skipped), 'check')} did not run"
        console.print(Panel(Text(lines), title=title, title_align="left", border_style="yellow" if report.checked_nothing else "dim"))
    for result in report.failed:
        console.print(Panel(Text(result.detail or result.summary), title=f"FAIL: {result.check}, {result.split.label}", title_align="left", border_style="red"))


def _render_parameters(console: Any, report: ModelCheckReport) -> None:
    from rich.table import Table
    from rich.text import Text

    rows = parameter_errors(report)
    if not rows:
        return
    # cut in the middle, never at the end, and wide enough that rich does not cut again
    names = shorten_names([row.name for row in rows], max(24, console.width // 3))
    table = Table(title="Per-parameter gradient error (worst over checks and splits)", title_justify="left")
    table.add_column("parameter", no_wrap=True, min_width=max(map(len, names)))
    table.add_column("shape")
    table.add_column("error / tolerance", justify="right")
    table.add_column("max |Δ|", justify="right")
    table.add_column("allowed", justify="right")
    table.add_column("where")
    for row, name in zip(rows, names, strict=True):
        style = "bold red" if row.ratio > 1 else "green"
        table.add_row(name, "x".join(map(str, row.shape)) or "scalar", Text(f"{row.ratio:.3g}", style=style), f"{row.max_abs:.3g}", f"{row.allowed:.3g}", row.where)
    console.print(table)
