"""The data path and evaluation metrics from the command line: ``dpverify check-data`` and
``dpverify check --eval``.

``check-data MODULE:DATASET --loader MODULE:FACTORY --world-size N`` runs
``assert_ddp_data_matches`` on the user's dataset and loader factory and prints a verdict per
epoch, the report and the final verdict, as ``check`` does (under torchrun, on its ranks).
``check --eval MODULE:FN`` adds the rows of the registry checks ``ddp-metric`` and
``dp-metric`` to ``check``'s table, on ``--devices`` ranks or devices, on the user's model,
over ``--dataset`` (default: rows of the model's example batch) with ``--loader`` (default:
the torch documentation's loaders).

Everything that cannot be used (a reference that does not import, a dataset that is not
map-style, a function whose signature does not take the arguments it is called with) is an
``InvalidArgument`` naming the option, before any check runs.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import TensorDataset

from dpverify.cli.exits import EXIT_FAILED, EXIT_OK
from dpverify.cli.user_model import load_object, sendable
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.core.text import and_list, plural
from dpverify.core.tracebacks import describe_exception, failure_detail
from dpverify.models.user import UserModel
from dpverify.registry import CHECKS, Case, CheckResult, Split, Target

if TYPE_CHECKING:
    from dpverify.data.path import DataReport

__all__ = [
    "PlannedMetric",
    "allow_text",
    "check_data",
    "data_world_size",
    "eval_dataset_size",
    "example_dataset",
    "load_dataset",
    "load_eval_fn",
    "load_loader_factory",
    "plan_metric_checks",
]

_LOADER_FORM = "a module-level function loader_factory(dataset, rank, world_size, epoch) returning the rank's DataLoader"
_EVAL_FORM = "a module-level function eval_fn(model, loader) returning the metric (a number, a tensor, or a dict of them)"


# --------------------------------------------------------------------------- loading


def _takes(fn: Callable[..., Any], count: int, what: str, form: str) -> None:
    """``fn`` accepts ``count`` positional arguments, as it will be called.

    Raises:
        InvalidArgument: its signature does not; the message shows the signature and ``form``.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call will say
        return
    try:
        signature.bind(*range(count))
    except TypeError:
        raise InvalidArgument(f"{what} takes {signature}; pass {form}") from None


def load_dataset(spec: str, option: str = "MODULE:DATASET") -> Any:
    """``MODULE:DATASET``: a map-style dataset object, or a function (or class) that
    returns one when called with no arguments; it must pickle (the ranks receive it).

    Raises:
        InvalidArgument: the reference does not import, the function raises or needs
            arguments, or what it names is not a map-style dataset; the message names
            ``option``.
    """
    from dpverify.data.samples import require_dataset

    what = f"{option} {spec!r}"
    found = load_object(spec, option)
    if not (hasattr(type(found), "__len__") and hasattr(type(found), "__getitem__")) and callable(found):
        _takes(found, 0, what, "a dataset, or a function returning one when called with no arguments")
        try:
            found = found()
        except (Exception, SystemExit) as error:
            raise InvalidArgument(f"{what} raised {describe_exception(error)} (called with no arguments)") from error
    require_dataset(found, what)
    sendable(found, what, "a dataset whose class is defined at the top level of an importable module")
    return found


def load_loader_factory(spec: str, option: str = "--loader") -> Any:
    """``--loader MODULE:FACTORY``, ``loader_factory(dataset, rank, world_size, epoch)``.

    Raises:
        InvalidArgument: it does not import, is not callable, does not take the four
            arguments, or does not pickle.
    """
    return _load_function(spec, option, 4, _LOADER_FORM)


def load_eval_fn(spec: str, option: str = "--eval") -> Any:
    """``--eval MODULE:FN``, ``eval_fn(model, loader)``.

    Raises:
        InvalidArgument: it does not import, is not callable, does not take two arguments,
            or does not pickle.
    """
    return _load_function(spec, option, 2, _EVAL_FORM)


def _load_function(spec: str, option: str, arity: int, form: str) -> Any:
    """``MODULE:FN`` of ``option``: importable, callable with ``arity`` positional
    arguments, and picklable (the ranks receive it); ``form`` says what to pass instead."""
    fn = load_object(spec, option)
    what = f"{option} {spec!r}"
    if not callable(fn):
        raise InvalidArgument(f"{what} is {type(fn).__name__}, not callable; pass {form}")
    _takes(fn, arity, what, form)
    sendable(fn, what, form)
    return fn


def allow_text(text: str) -> tuple[str, ...]:
    """``--allow padding,dropped``: the costs ``check-data`` accepts (an argparse type)."""
    from dpverify.data.path import ALLOWED

    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in ALLOWED]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--allow {text!r}: choose among {', '.join(ALLOWED)}, comma-separated (e.g. padding,dropped)")
    return names


# --------------------------------------------------------------------------- check --eval


def eval_dataset_size(device_counts: Sequence[int], batch_size: int) -> int:
    """The rows of the default evaluation dataset: the smallest prime above twice the
    largest device count and above ``batch_size``, so that no device count above 1 divides
    it (a DistributedSampler pads it, DataParallel's chunks are uneven) and the loader's
    last batch is partial."""
    size = max(2 * max(device_counts), batch_size) + 1
    while any(size % d == 0 for d in range(2, int(size**0.5) + 1)):
        size += 1
    return size


def example_dataset(model: UserModel, rows: int) -> TensorDataset:
    """A ``TensorDataset`` of ``rows`` rows of the model's example batch: its positional
    inputs, then its target where the loss is computed outside the forward.

    Raises:
        InvalidArgument: the batch has keyword inputs, or inputs or a target that are not
            tensors with ``rows`` rows along dim 0; the message says to pass ``--dataset``.
    """
    batch = model.make_batch(rows)
    instead = "pass --dataset MODULE:DATASET, the evaluation set eval_fn iterates"
    if batch.kwargs:
        raise InvalidArgument(
            f"--eval: the example batch ({model.batch_source}) passes keyword arguments ({', '.join(batch.kwargs)}), "
            f"which a TensorDataset of rows cannot hold; {instead}"
        )
    parts = [*batch.inputs, *([batch.target] if batch.target is not None else [])]
    wrong = [type(part).__name__ if not isinstance(part, torch.Tensor) else f"a tensor of shape {tuple(part.shape)}"
             for part in parts if not (isinstance(part, torch.Tensor) and part.dim() > 0 and part.shape[0] == rows)]
    if wrong or not parts:
        raise InvalidArgument(
            f"--eval: the example batch ({model.batch_source}) of {rows} rows is not tensors of {rows} rows each "
            f"({and_list(wrong) or 'nothing'}); {instead}"
        )
    return TensorDataset(*(part.detach() for part in parts))


@dataclass(frozen=True)
class PlannedMetric:
    """One metric row of ``check --eval``: a registry check (``dp-metric``, ``ddp-metric``)
    on a case of the evaluation set, the code under test, and the split whose column the
    row sits in (the largest batch size: the default loaders' batch size)."""

    check: str
    case: Case
    target: Target
    split: Split

    @property
    def title(self) -> str:
        return CHECKS[self.check].title

    def result(self) -> CheckResult:
        """The registry's verdict (``CheckSpec.run``), in the row's column."""
        return replace(CHECKS[self.check].run(self.case, self.target), split=self.split)


@dataclass(frozen=True)
class EvalSetup:
    """What ``check --eval`` evaluates: the function, the dataset and its description, and
    the loader factory (None: the default loaders)."""

    eval_fn: Any
    dataset: Any
    dataset_text: str
    loader: Any
    loader_text: str

    def describe(self, eval_spec: str) -> str:
        """The header's line."""
        return f"evaluation: {eval_spec} over {self.dataset_text}; loader: {self.loader_text}"


def eval_setup(args: argparse.Namespace, model: UserModel) -> EvalSetup:
    """``--eval``, ``--dataset`` and ``--loader`` loaded and checked, before any output.

    Raises:
        InvalidArgument: an option that cannot be used, or a backend whose ranks the
            metric checks do not run on; the message names the option.
    """
    if args.backend not in ("dp", "ddp", "all"):
        raise InvalidArgument(f"--eval runs the metric checks with --backend dp (DataParallel), ddp or all; not with --backend {args.backend}")
    if args.dim != 0:
        raise InvalidArgument(f"--eval: the metric checks split each batch along dim 0, and --dim is {args.dim}; leave --eval out, or --dim")
    eval_fn = load_eval_fn(args.eval)
    batch_size = max(args.batch_sizes)
    if args.dataset is not None:
        dataset = load_dataset(args.dataset, "--dataset")
        dataset_text = f"{args.dataset} ({plural(len(dataset), 'sample')})"
    else:
        rows = eval_dataset_size(args.devices, batch_size)
        dataset = example_dataset(model, rows)
        dataset_text = f"{plural(rows, 'row')} of the example batch ({model.batch_source}; --dataset for your own)"
    if args.loader is not None:
        return EvalSetup(eval_fn, dataset, dataset_text, load_loader_factory(args.loader), args.loader)
    defaults = []
    if args.backend in ("dp", "all"):
        defaults.append(f"DataLoader(batch_size={batch_size}) in dataset order through DataParallel")
    if args.backend in ("ddp", "all"):
        defaults.append(f"DataLoader(batch_size={batch_size}) over DistributedSampler(shuffle=False) on each rank")
    return EvalSetup(eval_fn, dataset, dataset_text, None, f"{'; '.join(defaults)} (--loader for your own)")


def plan_metric_checks(args: argparse.Namespace, model: UserModel, setup: EvalSetup, *, parallel: Any, on_ranks_only: bool) -> list[PlannedMetric]:
    """The metric rows: ``dp-metric`` on each device count with ``--backend dp`` or ``all``
    (not ``on_ranks_only``: torchrun's), ``ddp-metric`` on each world size with ``ddp`` or
    ``all``, each at the split of the largest batch size (the default loaders' batch size)."""
    from dpverify.data.loaders import batch_loader, distributed_loader

    batch_size = max(args.batch_sizes)
    defaults = {"dp-metric": functools.partial(batch_loader, batch_size=batch_size), "ddp-metric": distributed_loader(batch_size=batch_size)}
    wanted = [name for name, backend in (("dp-metric", "dp"), ("ddp-metric", "ddp")) if args.backend in (backend, "all")]
    if on_ranks_only:
        wanted = [name for name in wanted if name != "dp-metric"]
    target = Target(parallel=parallel, loader=setup.loader, evaluate=setup.eval_fn)
    return [
        PlannedMetric(
            name, Case(model.module, (), dataset=setup.dataset, loader=defaults[name], device_ids=tuple(range(devices))),
            target, Split(batch_size, devices),
        )
        for name in wanted for devices in args.devices
    ]


# --------------------------------------------------------------------------- check-data


def check_data(args: argparse.Namespace, console: Any) -> int:
    """``dpverify check-data``: the header, the check, a verdict per epoch, the report and
    the final verdict; returns the exit status (``EXIT_FAILED`` when an epoch differs from
    one device's, or the loader factory raised on a rank).

    Raises:
        InvalidArgument: an option that cannot be used; the message names it.
    """
    from dpverify.data.path import DataReport, assert_ddp_data_matches

    world = data_world_size(args)
    dataset = load_dataset(args.dataset)
    factory = load_loader_factory(args.loader)
    allow = tuple(args.allow or ())
    _data_header(console, args, dataset, world, allow)
    try:
        report = assert_ddp_data_matches(dataset, factory, world_size=world, epochs=args.epochs, allow=allow)
    except ParallelMismatch as failure:
        if not isinstance(failure.report, DataReport):
            raise
        report = failure.report
    except InvalidArgument:
        raise
    except (Exception, SystemExit) as error:  # the user's loader factory raised (on a rank)
        from rich.panel import Panel
        from rich.text import Text

        console.print(Panel(Text(failure_detail(error)), title="FAIL: the loader factory raised", title_align="left", border_style="red"))
        console.print(Text.assemble(Text("FAILED", style="bold red"), f": {describe_exception(error)}"))
        return EXIT_FAILED
    _render_data_report(console, report)
    return EXIT_OK if report.ok else EXIT_FAILED


def data_world_size(args: argparse.Namespace) -> int:
    """``--world-size``; under torchrun, the group's (``--world-size`` may only repeat it).

    Raises:
        InvalidArgument: no ``--world-size`` outside torchrun, or another one under it.
    """
    from dpverify.ddp.torchrun import under_torchrun

    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world:
            raise InvalidArgument(
                f"--world-size {args.world_size} under torchrun: the loaders run on the {world} ranks of torchrun's process "
                f"group (WORLD_SIZE={world}); leave --world-size out, or start torchrun with the ranks you mean"
            )
        return world
    if args.world_size is None:
        raise InvalidArgument("--world-size N is needed: the number of ranks whose loaders split the dataset (under torchrun, its world size)")
    given: int = args.world_size
    return given


def _ranks_backend(world: int) -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from dpverify.ddp.torchrun import ProcessGroupRunner

        return ProcessGroupRunner().backend
    try:
        from dpverify.ddp.pool import default_backend
    except ImportError:
        return "gloo"
    return default_backend(world)


def _data_header(console: Any, args: argparse.Namespace, dataset: Any, world: int, allow: Sequence[str]) -> None:
    from rich.text import Text

    console.print(Text(f"dpverify check-data: {args.dataset}", style="bold"))
    allowed = f"; allowed: {', '.join(allow)}" if allow else ""
    console.print(
        f"{plural(len(dataset), 'sample')} ({type(dataset).__name__}); loader: {args.loader}; "
        f"{plural(args.epochs, 'epoch')} on {world} {_ranks_backend(world)} {'rank' if world == 1 else 'ranks'}{allowed}; "
        f"torch {torch.__version__}",
        markup=False, soft_wrap=True,
    )


def _epoch_verdict(report: DataReport, epoch: int) -> str:
    """An epoch's verdict: FAIL when a finding there fails, ALLOWED when all are allowed
    costs, PASS when it saw every sample once."""
    found = [f for f in report.findings if f.epoch == epoch]
    if any(not f.allowed for f in found):
        return "FAIL"
    return "ALLOWED" if found else "PASS"


def _render_data_report(console: Any, report: DataReport) -> None:
    """A verdict per epoch (the samples per rank, what was found), the report in a panel,
    and the final verdict line."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Verdict per epoch", title_justify="left")
    for column in ("epoch", "samples per rank", "seen", "verdict", "found"):
        table.add_column(column)
    styles = {"FAIL": "bold red", "ALLOWED": "yellow", "PASS": "green"}
    for epoch in report.epochs:
        found = [f for f in report.findings if f.epoch == epoch.epoch]
        verdict = _epoch_verdict(report, epoch.epoch)
        verdict_text = Text(verdict, style=styles[verdict])
        kinds = ", ".join(f"{f.kind}{' (allowed)' if f.allowed else ''}" for f in found)
        table.add_row(str(epoch.epoch), str(epoch.sizes), f"{sum(epoch.sizes)} of {report.dataset_size}", verdict_text, kinds or "-")
    console.print(table)
    failing = [f for f in report.findings if not f.allowed]
    allowed = [f for f in report.findings if f.allowed]
    if failing:
        console.print(Panel(Text(report.message()), title="FAIL: the ranks' samples differ from one device's epoch", title_align="left", border_style="red"))
    elif allowed:
        console.print(Panel(Text(report.message()), title="Allowed costs", title_align="left", border_style="yellow"))
    verdicts = [_epoch_verdict(report, epoch.epoch) for epoch in report.epochs]
    counts = (
        f"{plural(len(report.epochs), 'epoch')} on {plural(report.world_size, 'rank')}: {verdicts.count('PASS')} passed, "
        f"{verdicts.count('FAIL')} failed, {verdicts.count('ALLOWED')} allowed"
    )
    status = Text("FAILED", style="bold red") if failing else Text("OK", style="bold green")
    console.print(Text.assemble(status, f": {counts}"))
