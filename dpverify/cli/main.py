"""The ``dpverify`` command line (also ``python -m dpverify``).

Subcommands: ``verify`` (the built-in models, one line per check), ``fuzz`` (the property
suite's checks on random scenarios), ``check MODULE:FACTORY`` (every check on your model;
``--eval`` adds your evaluation loop's), ``check-data MODULE:DATASET`` (your loaders' samples
per epoch) and ``explain [MODULE:FACTORY]`` (the questions of ``docs/questions.md`` answered by measurement).

Exit statuses: ``dpverify.cli.exits``; ``main`` says which errors become which.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dpverify.cli.exits import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOTHING_CHECKED,
    EXIT_OK,
    EXIT_USAGE,
    usage_error,
)
from dpverify.cli.user_model import load_object, user_model, with_loss
from dpverify.core.devices import cuda_device_count
from dpverify.core.errors import InvalidArgument
from dpverify.core.text import plural
from dpverify.core.tracebacks import describe_exception, user_traceback
from dpverify.models.builtin import BUILTIN_MODELS, VERIFY_MODELS, builtin_case
from dpverify.models.user import UserModel, builtin_model

if TYPE_CHECKING:
    from rich.console import Console

    from dpverify.cli.fuzz import FuzzConfig, FuzzReport
    from dpverify.planner import TrainingOptions
    from dpverify.registry import CheckResult

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NOTHING_CHECKED",
    "EXIT_OK",
    "EXIT_USAGE",
    "load_object",
    "main",
]

#: (batch size, device count): even chunks, uneven chunks, fewer rows than devices.
SPLITS: tuple[tuple[int, int], ...] = ((8, 2), (5, 4), (2, 4))

#: The built-in model ``explain`` uses when no factory is given.
DEFAULT_EXPLAIN_MODEL = "embedding"


# --------------------------------------------------------------------------- verify


#: What the options naming a callable take, for the message when theirs is not callable.
_CALLABLES = {
    "--parallel": "a DataParallel-like class or function called as CALLABLE(module, device_ids=..., output_device=...)",
    "--parallel-loss": "a criterion wrapper called as CALLABLE(criterion, device_ids=..., output_device=...) "
    "that returns loss(outputs, target)",
}


def _load_callable(spec: str | None, option: str) -> Any:
    """The callable ``spec`` names (``MODULE:CALLABLE``), or None when it is None.

    Raises:
        InvalidArgument: it cannot be imported, or is not callable.
    """
    if spec is None:
        return None
    loaded = load_object(spec, option)
    if not callable(loaded):
        what = f"; pass {_CALLABLES[option]}" if option in _CALLABLES else ""
        raise InvalidArgument(f"{option} {spec!r} is {type(loaded).__name__}, not callable{what}")
    return loaded


def _verify_model(name: str, args: argparse.Namespace) -> UserModel:
    """A built-in model for ``verify``, with ``--loss`` instead of its own where given."""
    model = builtin_model(name, seed=args.seed)
    return with_loss(model, args.loss) if args.loss else model


def _verify(args: argparse.Namespace) -> int:
    """``check`` on the built-in models, one line per check, for a wrapper under test."""
    from dpverify.planner import check_model
    from dpverify.registry import Target, Verdict

    models = args.models or list(VERIFY_MODELS)
    unknown = sorted(set(models) - set(VERIFY_MODELS))
    if unknown:
        raise InvalidArgument(f"unknown --models {unknown}; choose from {sorted(VERIFY_MODELS)}")
    target = Target(parallel=_load_callable(args.parallel, "--parallel"))
    # every model before any output: a loss that does not fit one is a usage error
    built = {name: _verify_model(name, args) for name in models}
    gpus = cuda_device_count()
    where = plural(gpus, "CUDA device") if gpus else "virtual devices (no CUDA here)"
    wrapper = args.parallel or "DataParallel"
    print(f"dpverify verify: {wrapper} on {where}, torch {torch.__version__}")
    results: list[tuple[str, CheckResult]] = []
    started = time.perf_counter()
    for name in models:
        def show(result: CheckResult, name: str = name) -> None:
            # flushed: piped into a log, each verdict shows as it comes
            print(f"  {result.verdict:<4}  {name:<16} {result.split.label:<10} {result.title:<34} {result.summary}", flush=True)

        dim = builtin_case(name, batch=1, seed=args.seed).dim
        report = check_model(built[name], splits=SPLITS, target=target, on_result=show, dim=dim)
        results += [(name, result) for result in report.results]
    failed = [(name, r) for name, r in results if r.verdict is Verdict.FAIL]
    for name, result in failed:
        print(f"\n--- {name}, {result.split.label}: {result.title}\n{result.detail}")
    elapsed = time.perf_counter() - started
    counts = {v: sum(r.verdict is v for _, r in results) for v in Verdict}
    text = f"{counts[Verdict.PASS]} passed, {counts[Verdict.FAIL]} failed"
    text += "".join(f", {counts[v]} {word}" for v, word in ((Verdict.WARN, "warned"), (Verdict.EXPLAINED, "explained"), (Verdict.SKIP, "skipped")) if counts[v])
    print()
    for line in _verify_coverage(results, seed=args.seed):
        print(line)
    if failed:
        print(f"\nFAILED: {text} in {elapsed:.1f}s")
        return EXIT_FAILED
    if all(r.verdict is Verdict.SKIP for _, r in results):
        print(f"\nNOTHING CHECKED: {text} in {elapsed:.1f}s")
        return EXIT_NOTHING_CHECKED
    print(f"\nOK: {text} in {elapsed:.1f}s")
    return EXIT_OK


def _verify_coverage(results: list[tuple[str, CheckResult]], *, seed: int) -> list[str]:
    """What the run exercised, so that its OK means something: each behaviour a built-in
    model covers (``BuiltinCase.covers``) and each split, where a check of it ran (not
    skipped); and what the chosen models left out."""
    from dpverify.core.scatter import chunk_sizes
    from dpverify.registry import Verdict

    ran = [(name, r) for name, r in results if r.verdict is not Verdict.SKIP]
    models = {name for name, _ in ran}
    behaviours: dict[str, list[str]] = {}
    for name in VERIFY_MODELS:
        for behaviour in builtin_case(name, batch=1, seed=seed).covers:
            behaviours.setdefault(behaviour, []).append(name)
    covered = [f"{b} ({', '.join(n for n in names if n in models)})" for b, names in behaviours.items() if models & set(names)]
    missing = [b for b, names in behaviours.items() if not models & set(names)]
    splits = {r.split.label: r.chunks or tuple(chunk_sizes(r.split.batch_size, r.split.devices)) for _, r in ran}
    lines = [
        "covered: " + ("; ".join(covered) or "nothing"),
        "splits: " + (", ".join(f"{label} (chunks {list(chunks)})" for label, chunks in splits.items()) or "none"),
    ]
    if missing:
        lines.append(f"not covered: {'; '.join(missing)} (their models did not run)")
    return lines


# --------------------------------------------------------------------------- shared


def _console(args: argparse.Namespace, *, record: bool = False) -> Console:
    """A rich console on stdout; no colour with --no-color or NO_COLOR, and 100 columns
    where stdout is not a terminal (rich's 80 would wrap the tables)."""
    from rich.console import Console

    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 100
    return Console(no_color=bool(args.no_color) or None, highlight=False, record=record, width=width)


def _positive(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option} {text!r} must be a positive integer")
        return value

    return parse


def _duration(text: str) -> float:
    from dpverify.cli.fuzz import parse_duration

    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


#: DistributedDataParallel's arguments that each rank sets itself (the module, its device,
#: the process group) or that would move the batch off dim 0, where the ranks shard it.
_RANK_SET_DDP_KWARGS = ("self", "module", "device_ids", "output_device", "process_group", "device_mesh", "dim")


def _ddp_kwargs_text(text: str) -> dict[str, bool | int | float | None]:
    """``--ddp-kwargs KEY=VALUE[,KEY=VALUE...]``, values ``true``, ``false``, ``none`` or a
    number (an argparse type: the keys are checked against DDP when the command runs)."""
    parsed: dict[str, bool | int | float | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key:
            raise argparse.ArgumentTypeError(
                f"--ddp-kwargs {text!r}: {item!r} is not KEY=VALUE; write e.g. find_unused_parameters=true,broadcast_buffers=false"
            )
        literal: bool | int | float | None
        if value.lower() in ("true", "false"):
            literal = value.lower() == "true"
        elif value.lower() == "none":
            literal = None
        else:
            try:
                literal = int(value)
            except ValueError:
                try:
                    literal = float(value)
                except ValueError:
                    raise argparse.ArgumentTypeError(
                        f"--ddp-kwargs {text!r}: {key}={value!r} is not true, false, none or a number"
                    ) from None
        parsed[key] = literal
    if not parsed:
        raise argparse.ArgumentTypeError(f"--ddp-kwargs {text!r} names no keyword; write e.g. find_unused_parameters=true")
    return parsed


def _ddp_kwargs(args: argparse.Namespace, *, backends: tuple[str, ...]) -> dict[str, Any] | None:
    """``--ddp-kwargs`` checked against ``DistributedDataParallel``'s signature, or None.

    Raises:
        InvalidArgument: the option is given for a backend without DDP, or names a keyword
            DDP does not take (or one each rank sets itself).
    """
    kwargs: dict[str, Any] | None = args.ddp_kwargs
    if kwargs is None:
        return None
    if args.backend not in backends:
        raise InvalidArgument(
            f"--ddp-kwargs goes to DistributedDataParallel, which --backend {args.backend} does not run; "
            f"pass --backend {' or '.join(backends)}, or leave --ddp-kwargs out"
        )
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    accepted = [name for name in inspect.signature(DistributedDataParallel.__init__).parameters if name not in _RANK_SET_DDP_KWARGS]
    for key in kwargs:
        if key in _RANK_SET_DDP_KWARGS:
            raise InvalidArgument(f"--ddp-kwargs {key}=...: each rank sets {key!r} itself (its module, device and process group, batch along dim 0); leave it out")
        if key not in accepted:
            raise InvalidArgument(f"--ddp-kwargs {key}=...: DistributedDataParallel takes no keyword {key!r}; choose from {', '.join(accepted)}")
    return kwargs


def _require_ddp(backend: str) -> None:
    from dpverify.ddp import checks_if_available

    if backend != "dp" and checks_if_available() is None:
        raise InvalidArgument(f"--backend {backend}: the DDP backend is not available in this build; use --backend dp")


def _load_model(args: argparse.Namespace, *, default: str | None) -> UserModel:
    if args.factory:
        if args.model:
            raise InvalidArgument("give either MODULE:FACTORY or --model NAME, not both")
        return user_model(args.factory, inputs_spec=args.inputs, loss=args.loss, seed=args.seed, output_key=args.output_key)
    if args.inputs or args.loss or args.output_key is not None:
        raise InvalidArgument("--inputs, --loss and --output-key apply to MODULE:FACTORY; the built-in models bring their own")
    name = args.model or default
    if name is None:
        raise InvalidArgument("give MODULE:FACTORY (a function returning your nn.Module), or --model NAME for a built-in model")
    return builtin_model(name, seed=args.seed)


def _figure_target(args: argparse.Namespace) -> Path | None:
    """``--figure FILE`` checked before the command runs (its suffix, its folder, and
    matplotlib), so that minutes of checks do not end in a typo."""
    if args.figure is None:
        return None
    from dpverify.figures.base import figure_path

    return figure_path(args.figure, "--figure")


def _write_figure(draw: Callable[[], Any], target: Path | None) -> None:
    """Draws the figure and writes it to ``target``; says where on stderr (stdout stays the
    report, or the JSON)."""
    if target is None:
        return
    from dpverify.figures.base import save_figure

    save_figure(draw(), target)
    print(f"wrote {target}", file=sys.stderr)


# --------------------------------------------------------------------------- fuzz


def _fuzz(args: argparse.Namespace) -> int:
    from dpverify.cli.fuzz import FuzzConfig, default_workers, devices_text
    from dpverify.cli.fuzz_view import FuzzProgress
    from dpverify.cli.fuzz_workers import fuzz_in_workers
    from dpverify.figures.fuzz import fuzz_figure

    _require_ddp(args.backend)
    if args.parallel:
        # the DataParallel spelling of --target, as in verify and check
        if args.target:
            raise InvalidArgument("give either --parallel (a DataParallel-like wrapper) or --target, not both")
        if args.backend != "dp":
            raise InvalidArgument(f"--parallel is a DataParallel-like wrapper, for --backend dp; for --backend {args.backend} pass a DDP step as --target")
        args.target = args.parallel
    if args.target and args.backend == "all":
        raise InvalidArgument(
            "--target fuzzes one backend: pass --backend dp (a DataParallel-like wrapper), ddp or fsdp (a per-rank "
            "step), tp (a plan builder, plan(layout, module)) or pp (a pipeline schedule class)"
        )
    if args.parallel_loss and args.backend != "dp":
        raise InvalidArgument(
            f"--parallel-loss is a DataParallel criterion wrapper, for --backend dp; --backend {args.backend} "
            "fuzzes ranks that compute their own loss"
        )
    if args.profile:
        from hypothesis import settings

        import dpverify.profiles  # noqa: F401  (registers the dpverify-* profiles)

        try:
            settings.get_profile(args.profile)
        except Exception:
            raise InvalidArgument(f"--profile {args.profile!r} is not a Hypothesis profile; try dpverify-dev, dpverify-ci or dpverify-fuzz") from None
    ddp_kwargs = _ddp_kwargs(args, backends=("ddp", "all"))
    _fuzz_exact_options(args)
    loss = _fuzz_loss(args)
    target = _load_callable(args.target or None, "--target")
    figure = _figure_target(args)
    config = FuzzConfig(
        backend=args.backend, devices=args.devices, max_examples=args.max_examples,
        time_budget=args.time_budget, seed=args.seed, profile=args.profile, target=args.target,
        target_object=target, parallel_loss=args.parallel_loss, parallel_loss_object=_load_callable(args.parallel_loss, "--parallel-loss"),
        ddp_kwargs=tuple(sorted((ddp_kwargs or {}).items())), loss=args.loss, loss_object=loss, exact=args.exact,
        workers=args.workers or default_workers(args.backend),
    ).with_defaults()
    console = _console(args)
    _fuzz_header(console, config, devices_text(config))
    with FuzzProgress(console, config) as progress:
        report = fuzz_in_workers(config, on_example=progress.update)
    status = _fuzz_summary(console, config, report)
    _write_figure(lambda: fuzz_figure(report), figure)
    return status


def _fuzz_exact_options(args: argparse.Namespace) -> None:
    """``fuzz --exact`` on ranks (every backend but ``dp``) needs a power of two of them: DDP
    and FSDP2 average the gradients over the ranks, tensor parallelism shards over them,
    pipelines' stages are cut along them.

    Raises:
        InvalidArgument: ``--exact`` on ranks with ``--devices`` not a power of two.
    """
    devices = int(args.devices)
    if args.exact and args.backend != "dp" and devices & (devices - 1):
        raise InvalidArgument(
            f"--exact --backend {args.backend} --devices {devices}: the ranks' gradients are averaged over {devices} ranks, "
            "dividing by a number that is not a power of two, which rounds; pass --devices 2, 4 or 8"
        )


def _fuzz_loss(args: argparse.Namespace) -> Any:
    """``fuzz --loss``: None for a built-in name (the scenarios draw it) or none, else the
    user's ``FN``, tried on a drawn model's output and target before the session starts.

    Raises:
        InvalidArgument: a sharded backend (its scenarios bring their losses), a loss that
            cannot be loaded, or one that cannot be applied to a tensor output and a float
            target shaped like it.
    """
    if args.loss is None:
        return None
    if args.backend not in ("dp", "ddp", "all"):
        raise InvalidArgument(f"--loss applies to --backend dp, ddp or all; the {args.backend} scenarios bring their own losses")
    from dpverify.cli.user_model import load_loss

    loss = load_loss(args.loss)
    if loss is None:
        return None
    from dpverify.cli.fuzz import with_user_loss
    from dpverify.models.specs import Scenario
    from dpverify.registry import Case

    case = with_user_loss(Case.from_scenario(Scenario(batch_size=4)), loss)
    assert case.loss_fn is not None
    with torch.no_grad():
        output = case.module(*case.inputs)
        try:
            value = case.loss_fn(output, case.target)
        except Exception as error:
            raise InvalidArgument(
                f"--loss {args.loss} cannot be applied to a drawn model's output, a tensor of shape "
                f"{tuple(output.shape)}, and its target, a float tensor of the same shape: "
                f"{describe_exception(error)}. fuzz --loss MODULE:FN takes a loss(output, target) for "
                "such a pair (the scenarios draw MSE's target, which it replaces)"
            ) from error
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise InvalidArgument(f"--loss {args.loss} returned {type(value).__name__} of {getattr(value, 'numel', lambda: '?')()} values; loss(output, target) must return one value")
    return loss


def _fuzz_header(console: Console, config: FuzzConfig, where: str) -> None:
    from dpverify.cli.fuzz import TRAINING_CHECKS, describe_training

    under_test = {
        "dp": "torch.nn.DataParallel",
        "ddp": "torch DistributedDataParallel",
        "fsdp": "torch FSDP2 (fully_shard)",
        "tp": "torch tensor parallelism (parallelize_module)",
        "pp": "torch pipeline parallelism (ScheduleGPipe, Schedule1F1B)",
        "all": "torch.nn.DataParallel and DistributedDataParallel",
    }[config.backend]
    if config.target:
        kind = {"dp": "DataParallel-like wrapper", "ddp": "DDP step", "fsdp": "FSDP2 step", "tp": "plan builder", "pp": "pipeline schedule"}
        under_test = f"{config.target} ({kind[config.backend]})"
    if config.parallel_loss:
        under_test += f" with criterion wrapper {config.parallel_loss}"
    if config.loss:
        under_test += f" with loss {config.loss}"
    if config.ddp_kwargs:
        under_test += f" with DDP keywords {', '.join(f'{k}={v}' for k, v in config.ddp_kwargs)}"
    limits = [plural(config.max_examples, "example")] if config.max_examples is not None else []
    limits += [f"time budget {config.time_budget:g}s"] if config.time_budget is not None else []
    limit = " or ".join(limits) or plural(config.examples, "example")
    if config.seed is None:
        replay = f"random seed; failures kept in {config.state_dir}/examples and replayed first"
    else:
        replay = f"seed {config.seed} (a seeded session does not use the example database)"
    training = f"; training runs: {describe_training(config.backend, exact=config.exact)}" if config.backend in TRAINING_CHECKS else ""
    exact = "; exact mode (dyadic float64 copies, every operation shown exact): tolerance none" if config.exact else ""
    console.print(f"[bold]dpverify fuzz[/]: {under_test} on {where}; {limit}; {replay}{training}{exact}", soft_wrap=True)


def _fuzz_summary(console: Console, config: FuzzConfig, report: FuzzReport) -> int:
    from rich.table import Table

    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_row("examples", f"{report.examples} in {report.elapsed:.1f} s ({report.examples / max(report.elapsed, 1e-9):.1f}/s)")
    table.add_row("passed", str(report.passed))
    if report.serial:
        table.add_row("nothing parallel", f"{report.serial} (one device or one row: every check skipped, none counted as passed)")
    for name, count in report.diverged:
        table.add_row(f"expected divergence: {name}", f"{count} (classified, and exact in eval mode)")
    table.add_row("failed", "1" if report.failure else "0")
    console.print(table)
    rerun = "pass --seed S for a repeatable session" if config.seed is None else f"seed {config.seed}"
    if report.failure is not None:
        failure = report.failure
        # "replayed" only when the failing example was a saved one: a seeded session reads
        # no database, and an unseeded one with nothing saved generates its first example
        if failure.replayed:
            where = "replayed from the example database"
        elif config.seed is not None:
            where = f"found at example {failure.first_found_at} of a seeded session (the example database is not used)"
        else:
            where = f"found at example {failure.first_found_at}"
        console.print(f"\n[bold red]Counterexample[/] (check {failure.check!r}, {where}, shrunk):", soft_wrap=True)
        console.print(repr(failure.scenario), markup=False, soft_wrap=True)
        console.print("\nFull report:", markup=False)
        console.print(failure.report, markup=False, soft_wrap=True)
        console.print(f"\nReproduce with: python {failure.repro}", markup=False)
        console.print(f"[bold red]FAILED[/]: a failure after {plural(report.examples, 'example')} ({rerun})", soft_wrap=True)
        return EXIT_FAILED
    if report.stopped_by == "interrupt":
        console.print(f"INTERRUPTED after {plural(report.examples, 'example')}, no failure so far ({rerun})", soft_wrap=True)
        return EXIT_INTERRUPTED
    stop = "time budget reached" if report.stopped_by == "time-budget" else "all examples run"
    if report.examples and report.serial == report.examples:
        console.print(
            f"[bold yellow]NOTHING CHECKED[/]: {plural(report.examples, 'example')}, none ran in parallel "
            f"(one device or one row each); pass --devices 2 or more; {stop} ({rerun})",
            soft_wrap=True,
        )
        return EXIT_NOTHING_CHECKED
    console.print(f"[bold green]OK[/]: {plural(report.examples, 'example')}, no failure; {stop} ({rerun})", soft_wrap=True)
    return EXIT_OK


# --------------------------------------------------------------------------- check


def _check_dim(args: argparse.Namespace) -> None:
    """``--dim`` other than 0 needs batches made along it: an inferred batch, or a built-in
    model's, has its rows along dim 0.

    Raises:
        InvalidArgument: ``--dim`` is not 0 without ``--inputs``.
    """
    if args.dim == 0:
        return
    if args.model:
        raise InvalidArgument(f"--dim {args.dim}: the built-in models batch along dim 0; --dim applies to MODULE:FACTORY with --inputs")
    if not args.inputs:
        raise InvalidArgument(
            f"--dim {args.dim}: the batch inferred from the first layer has its rows along dim 0; pass "
            f"--inputs MODULE:FN where FN(batch_size) returns inputs with batch_size rows along dim {args.dim}"
        )


def _check_command(args: argparse.Namespace) -> int:
    """``dpverify check``: on torchrun's ranks when torchrun started this process
    (``dpverify.cli.torchrun``), else here, with pools of ranks for the ranked checks."""
    from dpverify.ddp.torchrun import under_torchrun
    from dpverify.planner import DEFAULT_DEVICE_COUNTS

    if under_torchrun():
        from dpverify.cli.torchrun import check_under_torchrun

        return check_under_torchrun(args, _check, _ranked_checks)
    if args.hf_config is not None:
        return _check_hf(args)
    _refuse_hf_options(args)
    args.backend = args.backend or "dp"
    args.devices = args.devices or list(DEFAULT_DEVICE_COUNTS)
    return _check(args)


#: ``check``'s options that only ``--hf-config`` reads, and their defaults
_HF_ONLY = {"tp_plan": None, "tp": None, "pp": None, "max_params": None}


def _refuse_hf_options(args: argparse.Namespace) -> None:
    given = [f"--{name.replace('_', '-')}" for name, default in _HF_ONLY.items() if getattr(args, name) != default]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise InvalidArgument(f"{', '.join(given)} {verb} to --hf-config only (a Hugging Face configuration's checks)")


def _check_hf(args: argparse.Namespace) -> int:
    """``dpverify check --hf-config``: the configuration shrunk, its model checked under
    each backend (``dpverify.hf.check_hf_config``), a row per backend and every failure's
    message."""
    from dpverify.cli.hf_view import render_hf_check
    from dpverify.hf.check import check_hf_config

    ignored = [
        option for option, value in (
            ("MODULE:FACTORY", args.factory), ("--model", args.model), ("--inputs", args.inputs), ("--loss", args.loss),
            ("--parallel", args.parallel), ("--exact", args.exact or None), ("--checks", args.checks),
        ) if value is not None
    ]
    if ignored:
        raise InvalidArgument(
            f"--hf-config builds the model, its token batch and its loss itself: leave out {', '.join(ignored)}"
        )
    if args.devices is not None and len(args.devices) != 1:
        raise InvalidArgument(f"--devices {' '.join(map(str, args.devices))}: with --hf-config give one count, the DataParallel devices and DDP/FSDP2 ranks")
    console = _console(args)
    console.print(f"dpverify check --hf-config {args.hf_config}: shrinking, then checking under {args.backend or 'all'} ...", markup=False)
    report = check_hf_config(
        args.hf_config, backend=args.backend or "all", tp_plan=args.tp_plan or "hf", tp=args.tp or 2, pp=args.pp or 2,
        world_size=args.devices[0] if args.devices else 2, seed=args.seed,
        **({"max_params": args.max_params} if args.max_params is not None else {}),
    )
    render_hf_check(console, report)
    return EXIT_OK if report.ok else EXIT_FAILED


def _ranked_checks(names: list[str]) -> list[str]:
    """The checks among ``names`` (``all``: every one) that run on ranks, not DataParallel's."""
    from dpverify.registry import CHECKS

    return [name for name in (list(CHECKS) if "all" in names else names) if CHECKS[name].backend != "dp"]


def _check(args: argparse.Namespace) -> int:
    from dpverify.cli.check_view import CheckProgress, render_model_check, render_model_check_header
    from dpverify.figures.check import check_figure
    from dpverify.planner import check_model, plan_checks
    from dpverify.registry import CHECKS, Target

    _require_ddp(args.backend)
    _check_dim(args)
    _exact_options(args)
    figure = _figure_target(args)
    if args.parallel_loss and args.backend not in ("dp", "all"):
        raise InvalidArgument(f"--parallel-loss is a DataParallel criterion wrapper, for --backend dp or all; the {args.backend} checks compute the loss on each rank")
    ddp_kwargs = _ddp_kwargs(args, backends=("ddp", "all"))
    checks = _check_names(args)
    model = _load_model(args, default=None)
    training = _training(args, model)
    # planning makes every batch: a batch that cannot be made is a usage error before any output
    target = Target(
        parallel=_load_callable(args.parallel, "--parallel"), parallel_loss=_load_callable(args.parallel_loss, "--parallel-loss"),
        ddp_kwargs=ddp_kwargs, after_backward=training.hook,
    )
    plan = plan_checks(
        model, batch_sizes=args.batch_sizes, device_counts=args.devices, backend=args.backend,
        checks=checks, target=target, dim=args.dim, training=training.options, exact=args.exact,
    )
    _require_training_check(args, plan)
    if not plan:
        every = plan_checks(model, batch_sizes=args.batch_sizes, device_counts=args.devices, backend="all", checks=list(CHECKS), dim=args.dim)
        fitting = sorted({planned.spec.name for planned in every if planned.spec.why_not(planned.case) is None})
        raise InvalidArgument(f"--checks {' '.join(checks)} --backend {args.backend}: none of these applies to this model; these do: {', '.join(fitting)}")
    metrics = _metric_checks(args, model, target)
    batch = model.make_batch(max(args.batch_sizes))
    if args.parallel_loss and batch.loss_fn is None:
        raise InvalidArgument(
            f"--parallel-loss {args.parallel_loss}: this model's forward returns its loss, so there is no "
            "criterion to wrap; leave --parallel-loss out (the loss-in-forward checks run instead)"
        )
    console = _console(args)
    # the header first: a run of minutes says at once what it is checking, on what
    render_model_check_header(
        console, model, loss=batch.loss_name, backend=args.backend, device_counts=args.devices,
        wrapper=args.parallel, criterion=args.parallel_loss, dim=args.dim,
        training=training.describe(model, max(args.batch_sizes)) if any(planned.spec.training for planned in plan) else None,
        exact=args.exact,
    )
    if metrics is not None:
        console.print(metrics[0].describe(args.eval), markup=False)
    planned_metrics = metrics[1] if metrics is not None else []
    with CheckProgress(console, len(plan) + len(planned_metrics)) as progress:
        report = check_model(
            model, batch_sizes=args.batch_sizes, device_counts=args.devices, backend=args.backend,
            checks=checks, target=target, on_start=progress.start, on_result=progress.finished, plan=plan,
            dim=args.dim, training=training.options, exact=args.exact,
        )
        rows: list[CheckResult] = []
        for metric in planned_metrics:
            progress.start(metric.title, metric.split)
            rows.append(metric.result())
            progress.finished(rows[-1])
    if rows:
        report = replace(report, results=report.results + tuple(rows))
    render_model_check(console, report)
    _write_figure(lambda: check_figure(report), figure)
    if report.failed:
        return EXIT_FAILED
    # a run that compared nothing is no pass: the skip reasons are printed above
    return EXIT_NOTHING_CHECKED if report.checked_nothing else EXIT_OK


#: ``check --exact``'s optimizer where ``--optimizer`` is not given: the default's SGD with
#: momentum, with a learning rate and a momentum of one significant bit each (0.1 and 0.9
#: have 53, and every product with them would round).
EXACT_OPTIMIZER = "sgd:lr=0.125,momentum=0.5"
#: ``check --exact``'s optimizer steps where ``--steps`` is not given: a step writes
#: ``lr * grad`` into the weights, whose digits reach far below their grid, so each step
#: roughly doubles the bits the next one needs; a second step fits only a single Linear
#: layer (benchmarks/exact_bounds.py, docs/exact.md).
EXACT_STEPS = 1


def _exact_options(args: argparse.Namespace) -> None:
    """``--exact``'s defaults, and the options it cannot go with: batch sizes that are
    powers of two (``EXACT_BATCH_SIZES``) unless ``--batch-sizes`` is given, and no metric
    checks (``--eval`` compares a metric to a tolerance and has no exact mode).

    Raises:
        InvalidArgument: ``--exact`` with ``--eval``.
    """
    from dpverify.planner import DEFAULT_BATCH_SIZES, EXACT_BATCH_SIZES

    if args.batch_sizes is None:
        args.batch_sizes = list(EXACT_BATCH_SIZES if args.exact else DEFAULT_BATCH_SIZES)
    if args.exact and args.eval is not None:
        raise InvalidArgument(
            "--exact with --eval: the metric checks of --eval have no exact mode (a metric is compared "
            "to a tolerance); run them without --exact, in a second command"
        )


def _metric_checks(args: argparse.Namespace, model: UserModel, target: Any) -> tuple[Any, list[Any]] | None:
    """``--eval``'s setup and metric rows (``dpverify.cli.data``), loaded before any output;
    None without ``--eval``.

    Raises:
        InvalidArgument: ``--dataset`` or ``--loader`` without ``--eval``, or an option of
            them that cannot be used.
    """
    if args.eval is None:
        given = [option for option, value in (("--dataset", args.dataset), ("--loader", args.loader)) if value is not None]
        if given:
            raise InvalidArgument(f"{' and '.join(given)} go{'es' if len(given) == 1 else ''} to the metric checks of --eval MODULE:FN; pass --eval, or leave {' and '.join(given)} out")
        return None
    from dpverify.cli.data import eval_setup, plan_metric_checks
    from dpverify.ddp.torchrun import under_torchrun

    setup = eval_setup(args, model)
    return setup, plan_metric_checks(args, model, setup, parallel=target.parallel, on_ranks_only=under_torchrun())


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "evaluation metric checks",
        "Your evaluation loop, run through DataParallel (--backend dp) and on DDP ranks (ddp), against the same loop on "
        "one device over every sample once: rows dp-metric and ddp-metric, on each of --devices, at the largest batch size.",
    )
    group.add_argument(
        "--eval", metavar="MODULE:FN",
        help="your evaluation loop, FN(model, loader) returning the metric (a number, a tensor, or a dict of them); on the "
        "ranks it may synchronise with torch.distributed on the default group",
    )
    group.add_argument(
        "--dataset", metavar="MODULE:DATASET",
        help="the evaluation set: a map-style dataset, or a function returning one (default: a TensorDataset of rows of the "
        "example batch, inputs and target, as many as the smallest prime above twice the largest device count and the "
        "largest batch size, so that DistributedSampler pads)",
    )
    group.add_argument(
        "--loader", metavar="MODULE:FACTORY",
        help="FACTORY(dataset, rank, world_size, epoch) returning a rank's DataLoader (DataParallel: rank 0 of 1) "
        "(default: DataLoader of the largest batch size over DistributedSampler(shuffle=False); in dataset order for DataParallel)",
    )


# --------------------------------------------------------------------------- check-data


def _check_data_command(args: argparse.Namespace) -> int:
    """``dpverify check-data``: on torchrun's ranks when torchrun started this process
    (rank 0 prints, every rank exits with the verdict), else here with a pool of ranks."""
    from dpverify.cli.data import check_data, data_world_size
    from dpverify.ddp.torchrun import under_torchrun

    if under_torchrun():
        from dpverify.cli.torchrun import on_torchrun_ranks, quiet_usage_exit

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        try:
            data_world_size(args)
        except InvalidArgument:
            # the same options on every rank: rank 0 says it once, before the group is joined
            if rank == 0:
                raise
            return quiet_usage_exit()
        on_torchrun_ranks("check-data", lambda: check_data(args, _console(args)), rank, world)
    return check_data(args, _console(args))


def _add_check_data(commands: Any, common: argparse.ArgumentParser) -> None:
    from dpverify.cli.data import allow_text

    data = commands.add_parser(
        "check-data", parents=[common],
        help="check which samples each rank's loader delivers, epoch by epoch, against one device",
        description="Runs your loader factory on every rank (a pool of --world-size processes, or torchrun's ranks) for "
        "each epoch and compares the samples the ranks saw together with one device's epoch: samples seen twice "
        "(DistributedSampler's padding), never seen (drop_last), shared between ranks, an order repeated although the "
        "sampler shuffles (no set_epoch), the same order on every rank; each with the sample ids, the cause and the fix. "
        "Exit status 1 when an epoch differs, 0 when none does.",
    )
    data.add_argument("dataset", metavar="MODULE:DATASET", help="your dataset: a map-style dataset object, or a function returning one (the current directory is importable)")
    data.add_argument("--loader", metavar="MODULE:FACTORY", required=True, help="FACTORY(dataset, rank, world_size, epoch) returning the rank's DataLoader for that epoch (or a sampler)")
    data.add_argument("--world-size", type=_positive("--world-size"), metavar="N", help="the ranks (needed; under torchrun, its world size)")
    data.add_argument("--epochs", type=_positive("--epochs"), default=2, metavar="E", help="epochs to run (default 2: whether each epoch reshuffles)")
    data.add_argument(
        "--allow", type=allow_text, metavar="COST[,COST]",
        help="costs to report rather than fail on: padding (samples seen twice in an epoch, as in training with "
        "DistributedSampler), dropped (samples left out of an epoch; one left out of every epoch still fails)",
    )
    data.set_defaults(run=_check_data_command)


# --------------------------------------------------------------------------- check: training


#: The options of the training checks (``CheckSpec.training``), as ``check`` spells them.
_TRAINING_OPTIONS = ("--step", "--optimizer", "--steps")


def _training_arguments(parser: argparse.ArgumentParser) -> None:
    from dpverify.registry import TRAINING_STEPS

    group = parser.add_argument_group(
        "training checks",
        f"Options of the checks that train for several optimizer steps ({', '.join(_training_checks())}); "
        "giving one adds those of --backend to the default --checks.",
    )
    group.add_argument(
        "--step", "--after-backward", dest="step", metavar="MODULE:FN",
        help="your code between backward and the optimizer step, FN(ctx): gradient clipping, loss scaling, custom "
        "all-reduces (pass group=ctx.group to collectives); it runs on every rank and in the single-device reference",
    )
    group.add_argument(
        "--optimizer", metavar="NAME[:KEY=VALUE,...]|MODULE:FACTORY",
        help="the optimizer: sgd, adam or adamw with lr, momentum (sgd) and weight_decay, e.g. sgd:lr=0.1,momentum=0.9 "
        "or adam:lr=1e-3; or your FACTORY(params) returning a torch.optim.Optimizer (default sgd:lr=0.1,momentum=0.9)",
    )
    group.add_argument(
        "--steps", type=_positive("--steps"), metavar="N",
        help=f"optimizer steps (default {TRAINING_STEPS}), each on a batch of its own: --inputs FN(batch_size) called "
        "again with torch seeded --seed + step (a FN that ignores torch's seed gives the same batch every step), a fresh "
        "inferred batch, or a built-in model's batch of that seed",
    )


def _training_checks(backend: str = "all") -> list[str]:
    """The registry's training checks of ``backend`` (every one for ``"all"``)."""
    from dpverify.registry import CHECKS

    return [name for name, spec in CHECKS.items() if spec.training and backend in (spec.backend, "all")]


def _training_given(args: argparse.Namespace) -> list[str]:
    """The training options given, as ``check`` spells them."""
    return [option for option in _TRAINING_OPTIONS if getattr(args, option.removeprefix("--")) is not None]


def _check_names(args: argparse.Namespace) -> list[str]:
    """``--checks`` (every check for ``all``); by default ``DEFAULT_CHECKS``, and the
    training checks of ``--backend`` where a training option is given."""
    from dpverify.planner import DEFAULT_CHECKS
    from dpverify.registry import CHECKS

    if args.checks is not None:
        return list(CHECKS) if "all" in args.checks else list(args.checks)
    added = _training_checks(args.backend) if _training_given(args) else []
    return [*DEFAULT_CHECKS, *(name for name in added if name not in DEFAULT_CHECKS)]


@dataclass(frozen=True)
class _Training:
    """``check``'s training options, loaded: what the planner gets, the hook under test
    (``Target.after_backward``), and the names the header shows."""

    options: TrainingOptions
    hook: Any
    hook_name: str | None
    optimizer_name: str

    def describe(self, model: UserModel, batch_size: int) -> str:
        """The header's line: the steps, their batches (as made: a batch function that
        ignores torch's seed gives the same one every step), the optimizer and the hook."""
        batches = "a batch of its own" if _distinct_step_batches(model, batch_size) else "the same batch"
        if batches == "the same batch" and model.make_step_batch is not None:
            batches += f" ({model.batch_source} gave the same batch for two steps)"
        hook = f"after backward: {self.hook_name}" if self.hook_name else "nothing after backward (--step MODULE:FN)"
        return f"training checks: {plural(self.options.steps, 'optimizer step')} of {self.optimizer_name}, each on {batches}; {hook}"


def _distinct_step_batches(model: UserModel, batch_size: int) -> bool:
    """Whether the first two training steps' batches differ, as made."""
    from dpverify.core.tree import tensor_leaves

    def tensors(batch: Any) -> list[torch.Tensor]:
        return [tensor for _, _, tensor in tensor_leaves((batch.inputs, dict(batch.kwargs), batch.target))]

    first, second = (tensors(batch) for batch in model.step_batches(batch_size, 2))
    return len(first) != len(second) or any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(first, second, strict=False))


def _training(args: argparse.Namespace, model: UserModel) -> _Training:
    """``--step``, ``--optimizer`` and ``--steps`` loaded (each checked before any check runs).

    Raises:
        InvalidArgument: a hook or optimizer that cannot be used; the message names the option.
    """
    from dpverify.cli.user_model import load_hook, load_optimizer
    from dpverify.planner import TrainingOptions
    from dpverify.ranked.check import callable_name
    from dpverify.registry import DEFAULT_OPTIMIZER, TRAINING_STEPS

    hook = load_hook(args.step, "--step")
    if args.optimizer:
        factory, name = load_optimizer(args.optimizer, model.module)
    elif getattr(args, "exact", False):
        factory, name = load_optimizer(EXACT_OPTIMIZER, model.module)
        name += " (the default of --exact)"
    else:
        factory, name = None, f"{callable_name(DEFAULT_OPTIMIZER)} (the default)"
    steps = args.steps or (EXACT_STEPS if getattr(args, "exact", False) else TRAINING_STEPS)
    return _Training(TrainingOptions(steps, factory), hook, args.step, name)


def _require_training_check(args: argparse.Namespace, plan: Sequence[Any]) -> None:
    """A training option goes to a training check that is planned: never a silent no-op.

    Raises:
        InvalidArgument: a training option is given and no planned check trains; the message
            names the options and what to pass instead.
    """
    from dpverify.registry import CHECKS

    given = _training_given(args)
    if not given or any(planned.spec.training for planned in plan):
        return
    options = " and ".join(given)
    chosen = f" --checks {' '.join(args.checks)}" if args.checks is not None else ""
    everywhere = _training_checks()
    here = _training_checks(args.backend)
    if here:
        advice = f"add {' '.join(here)} to --checks (or pass --checks all)"
    else:
        backends = list(dict.fromkeys(CHECKS[name].backend for name in everywhere))
        advice = f"--backend {args.backend} has none; pass --backend {' or '.join(backends)} (or all)"
    raise InvalidArgument(
        f"{options} {'go' if len(given) > 1 else 'goes'} to the training checks ({', '.join(everywhere)}), and none of them runs "
        f"with --backend {args.backend}{chosen}: {advice}, or leave {options} out"
    )


# --------------------------------------------------------------------------- explain


def _explain(args: argparse.Namespace) -> int:
    from dpverify.cli.explain_view import explanation_json, render_explanation
    from dpverify.ddp import checks_if_available
    from dpverify.explain.measure import explain
    from dpverify.figures.explain import explain_figure

    figure = _figure_target(args)
    if args.dim != 0 and args.factory is None and args.model is None:
        raise InvalidArgument(f"--dim {args.dim}: the built-in model {DEFAULT_EXPLAIN_MODEL} batches along dim 0; --dim applies to MODULE:FACTORY with --inputs")
    _check_dim(args)
    model = _load_model(args, default=DEFAULT_EXPLAIN_MODEL)
    ids = list(range(args.devices))
    if args.output_device is not None and args.output_device not in ids:
        raise InvalidArgument(f"--output-device {args.output_device} is not one of the devices {ids}; pick one of them")
    if args.ddp and checks_if_available() is None:
        raise InvalidArgument("--ddp: the DDP backend is not available in this build; leave --ddp out for the simulated answer")
    parallel = _load_callable(args.parallel, "--parallel")
    explanation = explain(
        model, batch_size=args.batch, device_ids=ids, output_device=args.output_device, real_ddp=args.ddp,
        parallel=parallel, parallel_name=args.parallel, dim=args.dim,
    )
    if args.json:
        print(explanation_json(explanation))
    else:
        console = _console(args, record=args.svg is not None)
        render_explanation(console, explanation)
        if args.svg is not None:
            console.save_svg(str(args.svg), title=f"dpverify explain {explanation.model}")
            print(f"wrote {args.svg}", file=sys.stderr)
    _write_figure(lambda: explain_figure(explanation), figure)
    return EXIT_OK


# --------------------------------------------------------------------------- parser


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "factory", nargs="?", metavar="MODULE:FACTORY",
        help="your model: FACTORY() returns the nn.Module (the current directory is importable)",
    )
    parser.add_argument("--inputs", metavar="MODULE:FN", help="FN(batch_size) returns (inputs, target), target None if forward returns the loss; or keyword arguments: a dict, (kwargs, target), (args, kwargs) or (args, kwargs, target) (default: inferred from the first layer)")
    parser.add_argument(
        "--loss", metavar="NAME|MODULE:FN",
        help="mse, l1, smooth_l1, cross_entropy, nll or bce_with_logits, or your own FN(output, target) returning "
        "the scalar loss (default: cross_entropy for integer targets, else mse)",
    )
    parser.add_argument(
        "--output-key", metavar="KEY",
        help="the output the loss applies to: a dict's key, a namedtuple's field or a tuple's index (default: "
        "the whole output for --loss MODULE:FN; for a built-in loss the tensor, a tuple's first element, or "
        "a dict's 'logits')",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")


def _ddp_kwargs_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ddp-kwargs", type=_ddp_kwargs_text, metavar="KEY=VALUE,...",
        help="keyword arguments for DistributedDataParallel (--backend ddp or all), values true, false, none or "
        "a number: e.g. find_unused_parameters=true,broadcast_buffers=false",
    )


def _add_fuzz(commands: Any, common: argparse.ArgumentParser) -> None:
    fuzz = commands.add_parser(
        "fuzz", parents=[common],
        help="run the property suite's checks on random scenarios",
        description="Runs the property suite's checks on random scenarios drawn by Hypothesis, with "
        "a live progress bar. Failing examples are kept in .dpverify/examples and replayed first "
        "next time; a failure is shrunk, printed as a spec with its full report, and written as a "
        "standalone script .dpverify/repro_<id>.py. Exit status 1 on failure, 0 when all passed.",
    )
    fuzz.add_argument(
        "--backend", choices=("dp", "ddp", "fsdp", "tp", "pp", "all"), default="dp",
        help="DataParallel (default), DistributedDataParallel, FSDP2, tensor parallel, pipeline parallel, or DataParallel and DDP (all)",
    )
    fuzz.add_argument("--devices", type=_positive("--devices"), default=4, metavar="N", help="DataParallel: 1 to N devices per example (virtual on CPU, real on GPUs); DDP, fsdp, tp, pp: N ranks (default 4)")
    fuzz.add_argument("--max-examples", type=_positive("--max-examples"), metavar="N", help="examples to run (default: 1000, or one minute, whichever comes first)")
    fuzz.add_argument("--time-budget", type=_duration, metavar="DURATION", help="start no new example after this long: 90s, 10m, 1h (with --max-examples, whichever comes first)")
    fuzz.add_argument("--seed", type=int, help="Hypothesis seed for a repeatable session (default: random; a seeded session does not use the example database)")
    fuzz.add_argument("--profile", metavar="NAME", help="start from this Hypothesis settings profile (dpverify-dev, dpverify-ci, dpverify-fuzz)")
    fuzz.add_argument("--parallel", metavar="MODULE:CALLABLE", help="fuzz your own DataParallel-like wrapper, CALLABLE(module, device_ids=..., output_device=...) (--backend dp)")
    fuzz.add_argument(
        "--target", metavar="MODULE:CALLABLE",
        help="fuzz your own code: --backend dp, a DataParallel-like CALLABLE(module, device_ids=..., output_device=...); "
        "--backend ddp or fsdp, a per-rank step CALLABLE(ctx); --backend tp, a plan builder CALLABLE(layout, module) returning "
        "parallelize_module's plan; --backend pp, a pipeline schedule class",
    )
    fuzz.add_argument(
        "--parallel-loss", metavar="MODULE:CALLABLE",
        help="fuzz a model/criterion pair (--backend dp): the criterion wrapper CALLABLE(criterion, device_ids=..., "
        "output_device=...) returns loss(outputs, target) from what the --parallel wrapper returns; the repro script imports it too",
    )
    fuzz.add_argument("--figure", type=Path, metavar="FILE.{png,svg,pdf}", help="also draw the session as a figure: examples over time by outcome, and how close the checks came to their tolerance (needs matplotlib: pip install 'dpverify[plot]')")
    fuzz.add_argument(
        "--loss", metavar="NAME|MODULE:FN",
        help="--backend dp, ddp or all: draw only this built-in loss, or use your own FN(output, target) in place "
        "of the drawn one, on models with a tensor output and a float target shaped like it",
    )
    fuzz.add_argument(
        "--exact", action="store_true",
        help="draw exact scenarios (models, batches and optimizers of the exact set, docs/exact.md) and check them in "
        "exact mode: the parallel step must be bit-identical to the single-device step, no tolerance",
    )
    fuzz.add_argument(
        "--workers", type=_positive("--workers"), metavar="N",
        help="processes that check examples side by side, each shrinking and saving its own failures (default: --backend dp, "
        "2 where 2 CPUs are free to this process, else 1; the ranked backends 1: each worker would start its own ranks)",
    )
    _ddp_kwargs_argument(fuzz)
    fuzz.set_defaults(run=_fuzz)


def _add_check(commands: Any, common: argparse.ArgumentParser) -> None:
    from dpverify.planner import BACKENDS as CHECK_BACKENDS
    from dpverify.planner import (
        DEFAULT_BATCH_SIZES,
        DEFAULT_CHECKS,
        DEFAULT_DEVICE_COUNTS,
        EXACT_BATCH_SIZES,
    )
    from dpverify.registry import CHECKS

    model_checks = [name for name, spec in CHECKS.items() if not spec.data]  # the data checks run with --eval
    check = commands.add_parser(
        "check", parents=[common],
        help="run every applicable check on your model",
        description="Imports your model factory and runs every applicable check for several batch "
        "sizes and device counts: DataParallel gradients, replica gradient sum, loss-in-forward "
        "averaging when the model returns its loss, DDP with --backend ddp. BatchNorm in train "
        "mode and Dropout are explained (the module and the fix), not failed, and the model is "
        "checked again in eval mode.",
    )
    _model_arguments(check)
    check.add_argument("--model", choices=sorted(BUILTIN_MODELS), help="a built-in model instead of MODULE:FACTORY")
    check.add_argument(
        "--hf-config", metavar="FILE|MODEL_TYPE",
        help="a Hugging Face model family instead of MODULE:FACTORY: a config.json or a model_type (llama, mixtral, "
        "...), shrunk to CPU size keeping its structure, built with from_config (nothing downloaded) and checked "
        "under --backend (default all) on a padded token batch (needs pip install 'dpverify[hf]')",
    )
    check.add_argument(
        "--tp-plan", metavar="hf|MODULE:FN",
        help="with --hf-config: the tensor-parallel plan, the configuration's own (hf, default) or FN(model) "
        "returning a plan for parallelize_module (torch's styles, or transformers' style names)",
    )
    check.add_argument("--tp", type=_positive("--tp"), default=None, metavar="N", help="with --hf-config: tensor-parallel ranks (default 2)")
    check.add_argument("--pp", type=_positive("--pp"), default=None, metavar="N", help="with --hf-config: pipeline stages (default 2)")
    check.add_argument(
        "--max-params", type=_positive("--max-params"), default=None, metavar="N",
        help="with --hf-config: the shrunk model's most parameters (default 2000000)",
    )
    check.add_argument(
        "--backend", choices=(*CHECK_BACKENDS, "all"), default=None,
        help="DataParallel (default; ddp under torchrun), DDP, FSDP2 (fsdp), tensor parallel (tp), pipeline parallel (pp), or all of them",
    )
    check.add_argument(
        "--batch-sizes", type=_positive("--batch-sizes"), nargs="+", default=None, metavar="B",
        help=f"batch sizes (default {' '.join(map(str, DEFAULT_BATCH_SIZES))}; with --exact {' '.join(map(str, EXACT_BATCH_SIZES))})",
    )
    check.add_argument("--devices", type=_positive("--devices"), nargs="+", default=None, metavar="N", help=f"device counts or DDP world sizes (default {' '.join(map(str, DEFAULT_DEVICE_COUNTS))}; under torchrun, its world size)")
    check.add_argument(
        "--parallel", metavar="MODULE:CALLABLE",
        help="check your own DataParallel-like wrapper, called as CALLABLE(module, device_ids=..., output_device=...) (plus dim=D with --dim), instead of torch's",
    )
    check.add_argument(
        "--parallel-loss", metavar="MODULE:CALLABLE",
        help="the criterion half of a model/criterion pair, called as CALLABLE(criterion, device_ids=..., "
        "output_device=...) with the loss as the criterion module; it returns loss(outputs, target), "
        "where outputs is what the --parallel wrapper returns (one output per replica, or torch's gathered output)",
    )
    check.add_argument(
        "--dim", type=int, default=0, metavar="D",
        help="the dimension DataParallel splits and gathers the batch along (default 0); batch sizes "
        "are rows along it, so with D other than 0 pass --inputs returning the batch that way",
    )
    check.add_argument(
        "--checks", nargs="+", choices=[*model_checks, "all"], metavar="NAME",
        help=f"the checks to run where they apply, or all of them (default {' '.join(DEFAULT_CHECKS)}, and the training checks "
        f"with --step, --optimizer or --steps; all: {' '.join(model_checks)}; the metric checks run with --eval)",
    )
    check.add_argument(
        "--exact", action="store_true",
        help="exact mode (docs/exact.md): the gradient and training checks run on float64 copies of the model, inputs "
        "and target on a dyadic grid, every operation is shown exact, and the parallel step must be bit-identical: no "
        f"tolerance. A model outside the exact set is refused (exit status 2) naming the operation and its module; "
        f"default --batch-sizes {' '.join(map(str, EXACT_BATCH_SIZES))}, --optimizer {EXACT_OPTIMIZER} and --steps {EXACT_STEPS}",
    )
    _training_arguments(check)
    _eval_arguments(check)
    _ddp_kwargs_argument(check)
    check.add_argument("--figure", type=Path, metavar="FILE.{png,svg,pdf}", help="also draw every check's error/allowed per tensor, worst first, as a figure (needs matplotlib: pip install 'dpverify[plot]')")
    check.set_defaults(run=_check_command)


def _add_explain(commands: Any, common: argparse.ArgumentParser) -> None:
    explain = commands.add_parser(
        "explain", parents=[common],
        help="answer the common DataParallel questions for a model, by measurement",
        description="Runs one DataParallel step of your model (or a built-in one) on virtual "
        "devices with hooks, and answers the questions people ask about DataParallel with the "
        "values measured: a diagram of the step, views and copies, the loss-averaging table, "
        "gradient sum vs average, lost state, bytes per device, and more.",
    )
    _model_arguments(explain)
    explain.add_argument("--model", choices=sorted(BUILTIN_MODELS), help=f"a built-in model instead of MODULE:FACTORY (default {DEFAULT_EXPLAIN_MODEL})")
    explain.add_argument("--batch", type=_positive("--batch"), default=5, metavar="B", help="rows in the batch (default 5)")
    explain.add_argument("--devices", type=_positive("--devices"), default=4, metavar="N", help="virtual devices (default 4)")
    explain.add_argument("--output-device", type=int, metavar="D", help="where outputs are gathered and the loss computed (default the first device)")
    explain.add_argument("--ddp", action="store_true", help="also run real DDP ranks for question 11 (a few seconds to start)")
    explain.add_argument(
        "--parallel", metavar="MODULE:CALLABLE",
        help="explain your own DataParallel-like wrapper, CALLABLE(module, device_ids=..., output_device=...), run "
        "inside dpverify.virtual_devices: the chunks are the rows its replicas really received; a question it "
        "cannot be measured for says so",
    )
    explain.add_argument(
        "--dim", type=int, default=0, metavar="D",
        help="the dimension DataParallel splits and gathers the batch along (default 0), as in check: --batch counts "
        "entries along it, so with D other than 0 pass --inputs returning the batch that way (T x B x F for a "
        "sequence-first LSTM: --dim 1)",
    )
    explain.add_argument("--svg", type=Path, metavar="FILE", help="also write the explanation as an SVG picture")
    explain.add_argument("--json", action="store_true", help="print every measured value as JSON instead")
    explain.add_argument("--figure", type=Path, metavar="FILE.{png,svg,pdf}", help="also draw the step as a figure: a lane per device, bytes held per device, loss weights and gradient ratios (needs matplotlib: pip install 'dpverify[plot]')")
    explain.set_defaults(run=_explain)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpverify",
        description="Checks PyTorch data parallelism against the single-device step, by execution.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-color", action="store_true", help="plain output (so does the NO_COLOR environment variable)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    verify = commands.add_parser(
        "verify",
        help="verify DataParallel on the built-in models and print the verdict",
        description="Runs every check on the built-in models for even chunks, uneven chunks "
        "and a batch smaller than the device count.",
    )
    verify.add_argument("--models", nargs="+", metavar="NAME", help=f"subset of {', '.join(VERIFY_MODELS)}")
    verify.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")
    verify.add_argument(
        "--loss", metavar="NAME|MODULE:FN",
        help="the loss of the built-in models that compute it outside the forward: a built-in name or your own "
        "FN(output, target) (default: their own, mse or cross_entropy); pick the models it fits with --models",
    )
    verify.add_argument(
        "--parallel",
        metavar="MODULE:CALLABLE",
        help="verify your own DataParallel implementation, called as "
        "CALLABLE(module, device_ids=..., output_device=...)",
    )
    verify.set_defaults(run=_verify)
    _add_fuzz(commands, common)
    _add_check(commands, common)
    _add_check_data(commands, common)
    _add_explain(commands, common)
    # Listed for --help only: main() hands its arguments to the self-test's own parser.
    commands.add_parser(
        "ddp-selftest",
        help="run the DDP checks inside torchrun's process group "
        "(torchrun --standalone --nproc-per-node 2 -m dpverify ddp-selftest), or through a "
        "local pool (--world-size N)",
        add_help=False,
    )
    return parser


def _closed_pipe() -> int:
    # Nothing more can be said to a reader that left; point stdout at /dev/null so that the
    # interpreter's final flush does not raise again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dpverify`` and ``python -m dpverify``; returns the exit code.

    Where errors become exit codes: an ``InvalidArgument`` from any command is a usage
    error (``EXIT_USAGE``, the message and the user's frames on stderr), and a ``SystemExit``
    that the code under test raised outside a check (a model's forward under ``explain``, a
    ``fuzz`` target) is ``EXIT_FAILED``, never the status it carried.
    argparse's own errors exit 2 through ``SystemExit`` as usual.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["ddp-selftest"]:
        # Dispatched before argparse: a subparser taking the remaining arguments mishandles a
        # leading --option on Python 3.11.
        from dpverify.cli.selftest import selftest_command

        return selftest_command(arguments[1:])
    parser = _parser()
    args = parser.parse_args(arguments)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        code: int = args.run(args)
    except InvalidArgument as error:
        return usage_error(args.command, error)
    except BrokenPipeError:
        return _closed_pipe()
    except SystemExit as error:
        if isinstance(error.__context__, BrokenPipeError):
            # rich turns a closed stdout into SystemExit(1): not the code under test exiting.
            return _closed_pipe()
        print(f"dpverify {args.command}: {describe_exception(error)}; nothing after it ran", file=sys.stderr)
        frames = user_traceback(error)
        if frames:
            print(frames, file=sys.stderr)
        return EXIT_FAILED
    return code
