"""``assert_ddp_metric_matches`` and ``assert_dp_metric_matches``: what an evaluation loop
reports under DDP ranks or DataParallel, against the same loop on one device over the whole
dataset.

The user's ``eval_fn(model, loader)`` is the evaluation loop as written for training: it
iterates the loader, calls the model, and may synchronise with ``torch.distributed``
(``all_reduce``, ``all_gather``, a sync-style mean, a gather-for-metrics-style
de-duplication) on the default group. On the ranks it runs in the real group; the
single-device metric is the same loop in a process group of one rank over a loader that
visits every sample once. When they differ, the cause is named from evidence: the samples
the ranks really evaluated (counted twice, left out: the metric recomputed on one device over
exactly those samples), the collectives' dtypes (an integer accumulator floors), each rank's
metric on one device over its own samples (a mean of per-rank means, ranks that never
synchronised).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from dpverify.core.comparison import Msg, render
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.core.text import plural
from dpverify.core.tree import first_batched
from dpverify.core.validation import require_callable, require_instance, require_int_at_least
from dpverify.data.loaders import batch_loader, distributed_loader
from dpverify.data.samples import (
    LoaderFactory,
    LoaderFacts,
    SampleLog,
    collectives_seen,
    ids_text,
    in_process,
    loader_facts,
    one_rank_world,
    raise_refused,
    require_dataset,
)
from dpverify.ddp.runner import RankRunner, require_picklable
from dpverify.ranked.check import callable_name, runner
from dpverify.ranked.rank import RankInfo

__all__ = ["EvalFn", "MetricReport", "assert_ddp_metric_matches", "assert_dp_metric_matches", "metric_values"]

#: ``eval_fn(model, loader) -> metric``: a number, a tensor, or a mapping or sequence of them.
EvalFn = Callable[[Any, Any], Any]

#: Default tolerance of a metric against one device's: the summation order differs.
RTOL = 1e-5
ATOL = 1e-8


def metric_values(metric: Any, name: str = "metric") -> dict[str, float]:
    """``metric`` flattened to named floats: a number or 0-dim tensor is ``metric``, a
    tensor's elements ``metric[i]``, a mapping's entries ``metric.key``, a sequence's
    ``metric[i]``.

    Raises:
        InvalidArgument: something that is not a number (a string, None, an object).
    """
    if isinstance(metric, bool):
        return {name: float(metric)}
    if isinstance(metric, (int, float)):
        return {name: float(metric)}
    if isinstance(metric, torch.Tensor):
        flat = metric.detach().to("cpu", torch.float64).reshape(-1)
        if metric.dim() == 0:
            return {name: float(flat[0])}
        return {f"{name}[{i}]": float(v) for i, v in enumerate(flat.tolist())}
    if isinstance(metric, Mapping):
        out: dict[str, float] = {}
        for key, value in metric.items():
            out.update(metric_values(value, f"{name}.{key}" if name != "metric" else str(key)))
        return out
    if isinstance(metric, (list, tuple)):
        out = {}
        for i, value in enumerate(metric):
            out.update(metric_values(value, f"{name}[{i}]"))
        return out
    raise InvalidArgument(
        f"eval_fn returned {type(metric).__name__} ({metric!r:.60}) for {name}; return a number, a tensor, or a dict, "
        "list or tuple of them"
    )


def _integral(metric: Any) -> bool:
    """Whether ``metric`` holds only integer values of integer type (an int, an integer tensor)."""
    if isinstance(metric, torch.Tensor):
        return not metric.is_floating_point() and not metric.is_complex()
    if isinstance(metric, Mapping):
        return all(_integral(v) for v in metric.values())
    if isinstance(metric, (list, tuple)):
        return all(_integral(v) for v in metric)
    return isinstance(metric, int)


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class MetricRun:
    """One run of ``eval_fn``: the values it returned, whether they were of integer type,
    the samples it fetched, the loader's settings, and the collectives it called."""

    values: dict[str, float]
    integral: bool
    ids: tuple[int, ...]
    facts: LoaderFacts | None = None
    collectives: tuple[tuple[str, str], ...] = ()
    refused: str = ""  # why eval_fn's result could not be read (an InvalidArgument's message)


def _evaluate(model: nn.Module, loader: Any, log: SampleLog, eval_fn: EvalFn, facts: LoaderFacts | None = None) -> MetricRun:
    seen: list[tuple[str, str]] = []
    with collectives_seen(seen):
        metric = eval_fn(model, loader)
    return MetricRun(metric_values(metric), _integral(metric), _one_pass(log.fetched), facts, tuple(seen))


def _one_pass(fetched: Sequence[int]) -> tuple[int, ...]:
    """The samples an evaluation visited: one pass of ``fetched`` where the loop went over
    its loader several times the same way (a second pass for per-class counts), else all."""
    for passes in range(len(fetched) // 2, 1, -1):  # the most passes first: the shortest period
        size, rest = divmod(len(fetched), passes)
        if not rest and all(fetched[i] == fetched[i % size] for i in range(size, len(fetched))):
            return tuple(fetched[:size])
    return tuple(fetched)


@dataclass(frozen=True)
class MetricTask:
    module: nn.Module  # named so: under torchrun, the group compares every rank's weights (_weights_digest)
    dataset: Any
    eval_fn: EvalFn
    loader_factory: LoaderFactory


def run_metric_task(info: RankInfo, task: MetricTask) -> MetricRun:
    """The rank's evaluation: its loader from the user's factory (epoch 0), then ``eval_fn``."""
    log = SampleLog(task.dataset)
    loader = task.loader_factory(log, info.rank, info.world_size, 0)
    facts = loader_facts(loader)
    try:
        return _evaluate(task.module, in_process(loader), log, task.eval_fn, facts)
    except InvalidArgument as error:  # a usage error, raised by the caller: the pool keeps its ranks
        return MetricRun({}, False, (), facts, refused=str(error))


def _single_device(model: nn.Module, dataset: Any, eval_fn: EvalFn, factory: LoaderFactory, ids: Sequence[int] | None = None) -> MetricRun:
    """``eval_fn`` on one device, in a process group of one rank, over ``ids`` (default:
    every sample once): the user's loader at world size 1, or, for a DataLoader, one with
    its batch size and collate function over exactly those samples in order."""
    view = dataset if ids is None else Subset(dataset, list(ids))
    log = SampleLog(view)
    with one_rank_world():
        loader = in_process(factory(log, 0, 1, 0))
        if isinstance(loader, DataLoader):
            loader = DataLoader(log, batch_size=loader.batch_size or 1, collate_fn=loader.collate_fn, shuffle=False)
        run = _evaluate(copy.deepcopy(model), loader, log, eval_fn)
    if ids is None and sorted(run.ids) != list(range(len(dataset))):
        counts = Counter(run.ids)
        raise InvalidArgument(
            f"loader_factory at world size 1 visited {len(counts)} of {len(dataset)} samples ({sum(counts.values())} "
            "fetches): the single-device metric must see every sample once; return a DataLoader (dpverify then reads "
            "every sample once with its batch size and collate_fn) or a loader over the whole dataset"
        )
    return run


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class MetricReport:
    """What the evaluation reported in parallel, against one device.

    Attributes:
        title: what was checked.
        scenario: the dataset, ranks or devices, and loader.
        parallel: per rank (DDP) or the one DataParallel run, the values returned.
        single: the single-device values over the whole dataset.
        rtol: relative tolerance of a value against one device's.
        atol: absolute tolerance.
        failures: what differs, with its cause; empty when the metric matches.
        notes: what the reader should know either way.
        replicas: the ranks that evaluated a sample, or the replicas DataParallel ran on a
            batch (at most): the evidence that the evaluation ran in parallel.
    """

    title: str
    scenario: str
    parallel: tuple[dict[str, float], ...]
    single: dict[str, float]
    rtol: float
    atol: float
    failures: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    replicas: int | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def summary(self) -> str:
        """One line for a table: the first cause, or the values that agreed."""
        if self.failures:
            head, dot, _rest = self.failures[0].partition(". ")
            return head + dot.strip()
        return "; ".join(f"{key} {_number(value)}" for key, value in list(self.single.items())[:3]) + " on every rank and one device"

    def message(self) -> str:
        lines = [self.title + ("" if self.ok else ": it does not."), f"Scenario: {self.scenario}."]
        for key, expected in self.single.items():
            got = ", ".join(_number(v.get(key, math.nan)) for v in self.parallel)
            lines.append(f"  {key}: one device {_number(expected)}; parallel {got}")
        lines += [f"- {text}" for text in self.failures]
        lines += [f"Note: {text}" for text in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.message() if not self.ok else f"{self.title}: it does ({self.scenario})."


def _number(value: float) -> str:
    return f"{value:.10g}"


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(b)


def _all_close(a: Mapping[str, float], b: Mapping[str, float], rtol: float, atol: float) -> bool:
    return a.keys() == b.keys() and all(_close(a[k], b[k], rtol, atol) for k in b)


def _tolerance(rtol: float | None, atol: float | None) -> tuple[float, float]:
    for value, name in ((rtol, "rtol"), (atol, "atol")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise InvalidArgument(f"{name}={value!r} must be a non-negative number")
    return (RTOL if rtol is None else float(rtol)), (ATOL if atol is None else float(atol))


class _Diagnosis:
    """Why the ranks' metric differs from one device's, from the runs' evidence and from
    counterfactual single-device runs (made only here, on failure)."""

    def __init__(self, model: nn.Module, dataset: Any, eval_fn: EvalFn, factory: LoaderFactory, runs: Sequence[MetricRun],
                 single: MetricRun, rtol: float, atol: float) -> None:
        self.model, self.dataset, self.eval_fn, self.factory = model, dataset, eval_fn, factory
        self.runs, self.single, self.rtol, self.atol = runs, single, rtol, atol

    def on(self, ids: Sequence[int]) -> dict[str, float]:
        return _single_device(self.model, self.dataset, self.eval_fn, self.factory, ids).values

    def close(self, a: Mapping[str, float], b: Mapping[str, float]) -> bool:
        return _all_close(a, b, self.rtol, self.atol)

    def failures(self) -> list[str]:
        runs, n = self.runs, len(self.dataset)
        if any(run.values.keys() != self.single.values.keys() for run in runs):
            keys = [sorted(run.values) for run in runs]
            return [f"The ranks return {keys} where one device returns {sorted(self.single.values)}."]
        found: list[str] = []
        disagree = not all(self.close(run.values, runs[0].values) for run in runs)
        value = runs[0].values
        if not disagree and self.close(value, self.single.values):
            return found  # a pass: no counterfactual run
        own = [self.on(run.ids) if run.ids else {} for run in runs] if len(runs) > 1 else []
        if disagree:
            text = "The ranks disagree: each returns a different value, so the metric depends on which rank reports it."
            if own and all(o and self.close(run.values, o) for run, o in zip(runs, own, strict=True)):
                text += (
                    " Each rank returned the metric of its own samples alone (recomputed on one device over each rank's "
                    "samples): the value was never synchronised. all_reduce the sums and counts over the ranks, then divide."
                )
            found.append(text)
        if self.close(value, self.single.values):
            return found
        counts = Counter(i for run in runs for i in run.ids)
        twice = sorted(i for i, c in counts.items() if c > 1)
        never = sorted(set(range(n)) - set(counts))
        explained = False
        if twice or never:
            seen = self.on([i for run in runs for i in run.ids])
            if self.close(value, seen):
                explained = True
                parts = []
                if twice:
                    facts = runs[0].facts
                    pad = " (DistributedSampler pads the dataset to a multiple of the world size with repeated samples)" if facts is not None and facts.distributed and not facts.sampler_drop_last else ""
                    parts.append(f"samples {ids_text(twice)} were counted twice{pad}")
                if never:
                    facts = runs[0].facts
                    why = ""
                    if facts is not None and (facts.drop_last or facts.sampler_drop_last):
                        why = " (drop_last=True" + (" in the DataLoader" if facts.drop_last else " in the DistributedSampler") + ")"
                    parts.append(f"samples {ids_text(never)} were never evaluated{why}")
                found.append(
                    "The metric is the single-device metric over the samples the ranks evaluated, not the dataset: "
                    + " and ".join(parts) + ". Fix: evaluate every sample once: drop_last=False, and de-duplicate the "
                    "padding (gather per-sample results, then keep the first len(dataset) in sample order)."
                )
        if not explained and len(runs) > 1 and all(own):
            sizes = [len(run.ids) for run in runs]
            mean_of_means = {k: sum(o[k] for o in own) / len(own) for k in value}
            if self.close(value, mean_of_means) and len(set(sizes)) > 1:
                explained = True
                found.append(
                    f"A mean of per-rank means: the ranks evaluated {sizes} samples, and their metrics were averaged with "
                    "equal weight (an all_reduce of each rank's mean divided by the world size). Weight each rank by its "
                    "count: all_reduce the sum and the count, then divide."
                )
        integers = sorted({dtype for run in runs for _name, dtype in run.collectives if _is_integer(dtype)})
        if not explained and (integers or _floors(value, self.single.values)):
            explained = True
            synced = f" The ranks synchronised integer tensors ({', '.join(integers)})." if integers else ""
            whole = " They return whole numbers where one device computes a fraction." if _floors(value, self.single.values) else ""
            found.append(
                f"Integer flooring:{whole}{synced} A mean computed in an integer dtype floors (t // world_size, a "
                "sync-style mean of an integer state). Accumulate and synchronise in floating "
                "point (torch.float64), and divide as floats after the reduction."
            )
        empty = [r for r, run in enumerate(runs) if not run.ids]
        if not explained and empty and any(math.isnan(v) for v in value.values()):
            explained = True
            found.append(
                f"Rank{'s' if len(empty) > 1 else ''} {empty} evaluated no sample (fewer samples than ranks, and a loader "
                "that does not pad), and a mean over none is 0/0: the NaN spread to every rank through the reduction. "
                "Reduce sums and counts (a rank without samples adds 0 and 0), then divide once."
            )
        if not explained and not (disagree and len(found) == 1 and "never synchronised" in found[0]):
            found.append(
                "The parallel metric differs from one device's; neither samples counted twice or left out, integer "
                "flooring, nor a mean of per-rank means explains it."
            )
        return found


def _is_integer(name: str) -> bool:
    """Whether a dtype's name (``"torch.int64"``) is an integer dtype."""
    value = getattr(torch, name.removeprefix("torch."), None)
    return isinstance(value, torch.dtype) and not value.is_floating_point and not value.is_complex and value != torch.bool


def _floors(value: Mapping[str, float], single: Mapping[str, float]) -> bool:
    """Whether the parallel values are whole numbers where one device's are not."""
    keys = [k for k in single if not float(single[k]).is_integer()]
    return bool(keys) and all(float(value[k]).is_integer() for k in keys)


# --------------------------------------------------------------------------- public


def _validated(model: Any, dataset: Any, eval_fn: Any, loader_factory: Any, default: LoaderFactory) -> LoaderFactory:
    require_instance(model, "model", nn.Module)
    require_dataset(dataset)
    require_callable(eval_fn, "eval_fn", "eval_fn(model, loader) -> metric (a number, a tensor or a dict of them)")
    if loader_factory is None:
        return default
    factory: LoaderFactory = require_callable(loader_factory, "loader_factory", "loader_factory(dataset, rank, world_size, epoch)")
    return factory


def _require_read(runs: Sequence[MetricRun], where: str) -> None:
    raise_refused([run.refused for run in runs])
    if not any(run.ids for run in runs):
        raise InvalidArgument(
            f"eval_fn read no sample from the loader it was given on {where}: nothing was evaluated in parallel, so a "
            "pass would test nothing; iterate the loader eval_fn(model, loader) receives"
        )


def assert_ddp_metric_matches(
    model: nn.Module,
    dataset: Any,
    eval_fn: EvalFn,
    *,
    world_size: int,
    loader_factory: LoaderFactory | None = None,
    pool: RankRunner | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
) -> MetricReport:
    """Asserts that your distributed evaluation returns, on every rank, the metric one device
    computes over the whole dataset.

    ``eval_fn(model, loader)`` is your evaluation loop: it iterates ``loader``, calls
    ``model`` (the plain module, in the mode your loop sets), and synchronises over the ranks
    as you wrote it (``torch.distributed`` on the default group). It runs on every rank of
    the pool (or of torchrun's group) with that rank's loader, ``loader_factory(dataset,
    rank, world_size, 0)``; then in a process group of one rank over a loader that visits
    every sample once (a DataLoader with your batch size and collate function, or your
    factory at world size 1). Named causes: samples counted twice (padding) or never
    evaluated (``drop_last``), integer flooring, a mean of per-rank means, ranks that
    disagree.

    Args:
        model: the model to evaluate (copied for every run).
        dataset: a map-style dataset, picklable.
        eval_fn: ``eval_fn(model, loader) -> metric``: a number, a tensor, or a dict, list or
            tuple of them; a top-level function.
        world_size: the number of ranks.
        loader_factory: ``loader_factory(dataset, rank, world_size, epoch)``; default: a
            DataLoader of batch size 8 over ``DistributedSampler(shuffle=False)``, which pads.
        pool: the ranks (default: the shared pool of ``world_size``, or torchrun's group).
        rtol: relative tolerance of each value (default 1e-5: the sums run in another order).
        atol: absolute tolerance (default 1e-8).
        msg: replaces the failure message, or a callable that rewrites it.

    Returns:
        The report (``str()`` summarises it).

    Raises:
        ParallelMismatch: a rank's metric differs from one device's, or the ranks disagree.
        InvalidArgument: an argument cannot be used, or eval_fn evaluated nothing.
    """
    __tracebackhide__ = True
    factory = _validated(model, dataset, eval_fn, loader_factory, distributed_loader())
    world = require_int_at_least(world_size, "world_size", 1)
    tolerance = _tolerance(rtol, atol)
    for value, name in ((model, "model"), (dataset, "dataset"), (eval_fn, "eval_fn"), (factory, "loader_factory")):
        require_picklable(value, name)
    ranks = runner(pool, world)
    runs: tuple[MetricRun, ...] = ranks.run(run_metric_task, MetricTask(model, dataset, eval_fn, factory))
    _require_read(runs, "any rank")
    single = _single_device(model, dataset, eval_fn, factory)
    failures = _Diagnosis(model, dataset, eval_fn, factory, runs, single, *tolerance).failures()
    facts = runs[0].facts
    scenario = (
        f"dataset of {plural(len(dataset), 'sample')} on {world} ranks ({ranks.backend}); eval_fn {callable_name(eval_fn)}; "
        f"loader_factory {callable_name(factory)}" + (f", rank 0: {facts.describe()}" if facts is not None else "")
        + f"; the ranks evaluated {[len(run.ids) for run in runs]} samples"
    )
    report = MetricReport(
        "The metric every rank reports must be the single-device metric over the whole dataset", scenario,
        tuple(run.values for run in runs), single.values, *tolerance, tuple(failures),
        replicas=sum(1 for run in runs if run.ids),
    )
    if not report.ok:
        raise ParallelMismatch(render(report.message(), msg), report)
    return report


def assert_dp_metric_matches(
    model: nn.Module,
    dataset: Any,
    eval_fn: EvalFn,
    *,
    device_ids: Sequence[int],
    output_device: int | None = None,
    loader_factory: LoaderFactory | None = None,
    parallel: Callable[..., nn.Module] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: Msg = None,
) -> MetricReport:
    """Asserts that your evaluation loop reports through DataParallel what it reports on one
    device.

    ``eval_fn(model, loader)`` runs twice over the same loader (``loader_factory(dataset, 0,
    1, 0)``; default ``DataLoader(dataset, batch_size=8)``): with ``parallel(model, device_ids=...,
    output_device=...)`` (default ``dpverify.data_parallel``: torch's DataParallel, on
    virtual devices where CUDA devices are missing) and with the model alone. A forward
    that returns a reduced value (a 0-dim mean or count) makes DataParallel gather one per
    replica: averaging those weights uneven chunks alike, which the report names.

    Args:
        model: the model to evaluate (copied for each run).
        dataset: a map-style dataset.
        eval_fn: ``eval_fn(model, loader) -> metric``.
        device_ids: DataParallel's devices (virtual ids when CUDA devices are missing).
        output_device: where outputs are gathered (default ``device_ids[0]``).
        loader_factory: ``loader_factory(dataset, rank, world_size, epoch)``, called with
            rank 0 of world size 1.
        parallel: the DataParallel implementation under test.
        rtol: relative tolerance of each value (default 1e-5).
        atol: absolute tolerance (default 1e-8).
        msg: replaces the failure message, or a callable that rewrites it.

    Raises:
        ParallelMismatch: the metric differs from one device's, or no replica ran.
        InvalidArgument: an argument cannot be used, or eval_fn evaluated nothing.
    """
    __tracebackhide__ = True
    from dpverify.core.devices import normalize_device_ids
    from dpverify.core.virtual import data_parallel, virtual_devices

    factory = _validated(model, dataset, eval_fn, loader_factory, batch_loader)
    ids = normalize_device_ids(device_ids)
    tolerance = _tolerance(rtol, atol)
    wrapper = data_parallel if parallel is None else require_callable(parallel, "parallel", "parallel(module, device_ids=..., output_device=...)")
    module = copy.deepcopy(model)
    replicas: list[int] = []
    reduced: list[bool] = []

    def forwarded(_module: nn.Module, _args: Any, output: Any) -> None:
        replicas.append(1)
        reduced.append(isinstance(output, torch.Tensor) and output.dim() == 0)

    handle = module.register_forward_hook(forwarded)
    log = SampleLog(dataset)
    # a wrapper of the user's around a host module runs on virtual devices, as in the
    # DataParallel checks (Check.devices); torch's own picks real or virtual itself
    on_host = next((p.device.type == "cpu" for p in module.parameters()), True)
    devices = virtual_devices(max(ids) + 1) if parallel is not None and on_host else contextlib.nullcontext()
    with devices, warnings.catch_warnings():
        # a forward returning a 0-dim value: torch warns at the gather; the report says it
        warnings.filterwarnings("ignore", message="Was asked to gather along dimension 0")
        wrapped = wrapper(module, device_ids=ids, output_device=output_device)
        calls: list[tuple[int, int]] = []  # each call of the wrapper: the batch's rows, the replica forwards
        started: list[int] = []

        def called(_module: nn.Module, args: Any, kwargs: Any) -> None:
            started.append(len(replicas))
            first = first_batched((args, kwargs))
            calls.append((first.shape[0] if first is not None and first.dim() else 1, 0))

        def returned(_module: nn.Module, _args: Any, _output: Any) -> None:
            calls[-1] = (calls[-1][0], len(replicas) - started.pop())

        wrapped.register_forward_pre_hook(called, with_kwargs=True)
        wrapped.register_forward_hook(returned)
        loader = factory(log, 0, 1, 0)
        facts = loader_facts(loader)
        run = _evaluate(wrapped, in_process(loader), log, eval_fn, facts)
    handle.remove()
    _require_read([run], "DataParallel")
    single = _single_device(model, dataset, eval_fn, factory)
    failures: list[str] = []
    splittable = [ran for rows, ran in calls if rows > 1]  # a batch of one row runs one replica, as torch's does
    if len(ids) > 1 and not splittable:
        raise InvalidArgument(
            f"every batch the loader gave had one row, so DataParallel on devices {ids} ran one replica a batch: nothing "
            "ran in parallel, and a pass would test nothing; use a loader with a batch size of at least 2 (and a dataset "
            "of at least 2 samples)"
        )
    if len(ids) > 1 and max(splittable) < 2:
        failures.append(
            f"No replica ran: the model's forward ran once for each of {plural(len(splittable), 'call')} of the wrapper on "
            f"batches of two or more rows on {len(ids)} devices; the wrapper must split each batch over the devices."
        )
    if not _all_close(run.values, single.values, *tolerance):
        text = "The metric through DataParallel differs from one device's."
        if any(reduced):
            text += (
                " The model's forward returns a reduced value (a 0-dim tensor, a mean or count of its batch): DataParallel "
                f"gathers one per replica, a vector of {len(ids)} where one device returns a scalar, and a mean of that vector "
                "weights the replicas' chunks alike, uneven ones included. Return per-sample values (reduction='none') "
                "or the sum and count from forward, and reduce after the gather."
            )
        failures.append(text)
    scenario = (
        f"dataset of {plural(len(dataset), 'sample')}; DataParallel on devices {ids}; eval_fn {callable_name(eval_fn)}; "
        f"loader {run.facts.describe() if run.facts is not None else callable_name(factory)}"
    )
    report = MetricReport(
        "The metric through DataParallel must be the single-device metric", scenario, (run.values,), single.values,
        *tolerance, tuple(failures), replicas=max(splittable, default=1),
    )
    if not report.ok:
        raise ParallelMismatch(render(report.message(), msg), report)
    return report

