"""Every check dpverify runs, by name, with one result type and one verdict.

A check is a ``CheckSpec``: a name, whether it applies to a ``Case`` (a module, one batch,
how its loss is computed, the devices or ranks), and how it runs on a ``Target`` (the
wrapper, reduction or per-rank DDP step under test; torch's own when empty). Every front
end reads ``CHECKS``:

- ``dpverify check`` runs the checks that apply to a user's model on several splits;
- ``dpverify verify`` is ``check`` on the built-in models;
- ``dpverify ddp-selftest`` runs the DDP checks on ranks (torchrun or a local pool);
- ``dpverify fuzz``, the mutant catalogue and the property suite run them on drawn
  scenarios, and a fuzz failure's repro script imports its check from here by name.

``CheckSpec.run`` never raises for what the code under test does: a mismatch, an exception
or a ``sys.exit()`` is a ``FAIL`` with its report; a train-mode BatchNorm or Dropout that
makes the parallel step differ is ``EXPLAINED``, with the modules; a match where one
replica forward (or one rank) ran is a ``SKIP``, since nothing ran in parallel; only an
``InvalidArgument`` (the case itself cannot be checked) propagates. ``CheckSpec.check``
is the same check raising the original error, for tests and repro scripts.
"""

from __future__ import annotations

import copy
import enum
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpverify.checks.buffers import buffers_match
from dpverify.checks.dp import Check, SharedSteps, grad_sum_matches, grads_match, raise_unless_ok
from dpverify.checks.loss_average import (
    LossAverageReport,
    chunk_weighted_loss,
    loss_average_of,
    reduction_matches,
)
from dpverify.checks.training import assert_dp_training_matches
from dpverify.core.comparison import StepComparison, TensorComparison
from dpverify.core.devices import cuda_device_count
from dpverify.core.divergence import ONE_ROW_BATCHNORM, SourceGroup, group_sources
from dpverify.core.errors import InvalidArgument, ParallelMismatch
from dpverify.core.scatter import chunk_sizes
from dpverify.core.step import LossFn, batch_size_of
from dpverify.core.text import and_list
from dpverify.core.tracebacks import describe_exception, failure_detail
from dpverify.core.tree import map_tensors
from dpverify.ddp import checks_if_available
from dpverify.models.data import DataScenario
from dpverify.models.layouts import (
    FSDPLayout,
    Layout,
    PipelineLayout,
    ShardedScenario,
    TPLayout,
    default_layout,
    layout_of,
)
from dpverify.models.specs import AttributeCounter, BufferCounter, Scenario
from dpverify.models.training import TrainingScenario

__all__ = [
    "CHECKS",
    "DEFAULT_OPTIMIZER",
    "MICRO_BATCHES",
    "TRAINING_STEPS",
    "Case",
    "CheckResult",
    "CheckSpec",
    "Split",
    "Target",
    "Verdict",
]

#: Micro-batches per rank in the DDP accumulation check.
MICRO_BATCHES = 2
#: Optimizer steps in the DDP training check.
TRAINING_STEPS = 3
#: The training checks' optimizer where a case names none (``Case.optimizer``).
#: The epochs of the data-path check on a case that does not say.
DATA_EPOCHS = 2

DEFAULT_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


class Verdict(enum.StrEnum):
    """What a check concluded."""

    PASS = "PASS"
    FAIL = "FAIL"
    #: differs because of BatchNorm or Dropout in train mode: expected, not a bug
    EXPLAINED = "EXPLAINED"
    #: the parallel code is right, but the training loop falls into a trap (loss.mean())
    WARN = "WARN"
    #: could not run on this split (the reason is the summary)
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
class Case:
    """What a check runs on.

    Attributes:
        module: the model (left unchanged: checks run on copies).
        inputs: positional forward arguments (``()`` for a keyword-only forward).
        target: the loss target (None when the forward returns its loss).
        loss_fn: ``loss_fn(output, target)``; None when the forward returns its loss.
        device_ids: DataParallel's devices; their count is the DDP world size.
        output_device: DataParallel's output device (None: ``device_ids[0]``).
        forward_kwargs: keyword arguments of the forward, scattered (DataParallel) or
            sharded (DDP) with the batch; with ``inputs=()``, a keyword-only call.
        per_row_mean_loss: the forward's loss is known to be each chunk's per-row mean (the
            built-in and generated models), so ``loss.mean()`` of replica losses must be
            biased exactly when the chunks are uneven; False for a user's model, whose bias
            is a warning either way.
        batches: the batches of the training checks, one ``(inputs, target)`` pair or
            ``(inputs, kwargs, target)`` triple per optimizer step (default: this batch,
            ``TRAINING_STEPS`` times).
        optimizer: the training checks' optimizer factory (default: SGD with momentum).
        dim: the dimension DataParallel splits the batch along (DataParallel checks only).
        layout: how the sharded checks lay the model out (``FSDPLayout``, ``TPLayout``,
            ``PipelineLayout``); a check whose backend has no layout here derives one
            (``dpverify.models.layouts.default_layout``), or skips saying why.
        steps: the ``SharedSteps`` of the DataParallel gradient checks of this module,
            batch and loss (``dpverify.planner.plan_checks`` gives one per batch); None:
            each check runs its own.
        dataset: the data checks' map-style dataset (they run only on a case that has one).
        loader: the data checks' ``loader_factory(dataset, rank, world_size, epoch)`` where
            the code under test (``Target.loader``) brings none: a generated scenario's
            torch construction.
        epochs: the epochs the data-path check runs.
        exact: run the gradient and training checks in exact mode (``exact=True`` of the
            assertion helpers: dyadic float64 copies, every operation shown exact, no
            tolerance); a check that has no exact mode skips, saying so.
    """

    module: nn.Module
    inputs: tuple[Any, ...]
    target: Any = None
    loss_fn: LossFn | None = None
    device_ids: tuple[int, ...] = (0, 1)
    output_device: int | None = None
    forward_kwargs: Mapping[str, Any] | None = None
    per_row_mean_loss: bool = False
    batches: tuple[tuple[Any, ...], ...] = ()
    optimizer: Callable[..., torch.optim.Optimizer] | None = None
    dim: int = 0
    layout: Layout | None = None
    steps: SharedSteps | None = field(default=None, repr=False, compare=False)
    dataset: Any = None
    loader: Any = None
    epochs: int = DATA_EPOCHS
    exact: bool = False

    @classmethod
    def from_scenario(cls, scenario: Scenario | ShardedScenario | TrainingScenario | DataScenario) -> Case:
        """A generated scenario, built (its models' losses are per-row means); a sharded
        scenario brings its layout, a training scenario its batches and optimizer (its hook
        and step are code under test: ``TrainingScenario.code``, ``Target.with_defaults``);
        a data scenario its classifier, dataset (whose rows are the batch), torch's loader
        for it and its epochs, on its ranks."""
        if isinstance(scenario, DataScenario):
            data = scenario.dataset()
            features, labels = data.tensors
            return cls(
                scenario.model(), (features,), labels, torch.nn.functional.cross_entropy, tuple(range(scenario.world_size)),
                dataset=data, loader=scenario.loader_factory(), epochs=scenario.epochs,
            )
        if isinstance(scenario, TrainingScenario):
            first = cls.from_scenario(scenario.scenario)
            return replace(first, batches=scenario.batches(), optimizer=scenario.optimizer.factory())
        plain, layout = (scenario.scenario, scenario.layout) if isinstance(scenario, ShardedScenario) else (scenario, None)
        s = plain.build()
        return cls(
            s.module, s.inputs, s.target, None if plain.model.returns_loss else s.loss_fn,
            tuple(s.device_ids), s.output_device, s.kwargs or None, per_row_mean_loss=True, layout=layout,
        )

    def layout_for(self, backend: str) -> Layout | str:
        """This case's layout for a sharded ``backend``, the default one when it has none
        of that backend (``default_layout``), or why the backend cannot lay the model out."""
        return layout_of(self.layout, backend) or default_layout(backend, self.module, self.world_size, self.batch_size)

    @property
    def returns_loss(self) -> bool:
        return self.loss_fn is None

    @property
    def training_steps(self) -> int:
        """The optimizer steps of the training checks: one per batch of ``batches``."""
        return len(self.batches) or TRAINING_STEPS

    @property
    def world_size(self) -> int:
        return len(self.device_ids)

    @property
    def batch_size(self) -> int:
        """The batch's rows; a data case without a batch, its dataset's samples."""
        if not self.inputs and not self.forward_kwargs and self.dataset is not None:
            return len(self.dataset)
        return batch_size_of(self.inputs, dim=self.dim, kwargs=self.forward_kwargs)

    @property
    def chunk_sizes(self) -> list[int]:
        return chunk_sizes(self.batch_size, len(self.device_ids))

    @property
    def split(self) -> Split:
        return Split(self.batch_size, len(self.device_ids))

    def sources(self) -> tuple[SourceGroup, ...]:
        """The modules that make train mode differ, grouped (empty in eval mode)."""
        return group_sources(self.module)

    def in_eval_mode(self) -> Case:
        """This case with an eval-mode copy of its module: what must match exactly when
        train mode is explained."""
        return replace(self, module=copy.deepcopy(self.module).eval(), steps=None)


@dataclass(frozen=True)
class Target:
    """The code under test; each field None means torch's own.

    Attributes:
        parallel: a DataParallel-like wrapper, ``parallel(module, device_ids=...,
            output_device=...)``.
        parallel_loss: the criterion wrapper of a model/criterion pair,
            ``parallel_loss(criterion, device_ids=..., output_device=...)`` returning
            ``loss(outputs, target)`` (the ``parallel_loss_fn`` of the helpers).
        reduce: a reduction of per-replica losses, ``reduce(losses, chunk_sizes)`` or
            ``reduce(losses, chunk_sizes, item_counts)`` (default: the exact weighting by
            item counts, ``chunk_weighted_loss(losses, item_counts)``).
        step: a per-rank step, ``step(ctx)``: DDP's (a ``ShardContext``) for the DDP
            checks, FSDP2's (an ``FSDPContext``) for the FSDP checks.
        pool: the ranks the DDP and sharded checks run on (default: a pool of the world size).
        ddp_kwargs: keyword arguments for ``DistributedDataParallel``.
        plan: the tensor-parallel plan under test, ``plan(layout, module)`` given the
            case's ``TPLayout`` and module returns what ``parallelize_module`` takes
            (default: ``layout.plan()``, torch's ColwiseParallel and RowwiseParallel).
        schedule: the pipeline schedule under test, a ``PipelineScheduleSingle`` subclass
            (default: the layout's, torch's ``ScheduleGPipe`` or ``Schedule1F1B``).
        after_backward: the user's code between backward and the optimizer step,
            ``hook(ctx)``, for the training checks: it runs on every rank and in the
            single-device reference.
        model: the model under test, ``model(module) -> nn.Module`` given the case's module
            (a user's module with its own forward, wrapping or replacing it); every check
            then runs on what it returns.
        loader: the data checks' loader construction, ``loader_factory(dataset, rank,
            world_size, epoch)`` (default: the case's ``loader``, else torch's
            ``DistributedSampler`` in a ``DataLoader``).
        evaluate: the evaluation loop of the metric checks, ``eval_fn(model, loader) ->
            metric`` (they need one).
    """

    parallel: Any = None
    parallel_loss: Any = None
    reduce: Any = None
    step: Any = None
    pool: Any = None
    ddp_kwargs: Mapping[str, Any] | None = None
    plan: Any = None
    schedule: Any = None
    after_backward: Any = None
    model: Any = None
    loader: Any = None
    evaluate: Any = None

    def on(self, case: Case) -> Case:
        """``case`` with the model under test (``model``) in place of its module."""
        return case if self.model is None else replace(case, module=self.model(case.module), steps=None)

    def with_defaults(self, **fields: Any) -> Target:
        """This target with ``fields`` where it has None: a training scenario's own code
        (``TrainingScenario.code``) under the code the caller gives."""
        return replace(self, **{name: value for name, value in fields.items() if getattr(self, name) is None})


@dataclass(frozen=True)
class CheckResult:
    """One check on one case.

    Attributes:
        check: the check's name, a key of ``CHECKS``.
        title: what was checked, short (a table row), with `` (eval mode)`` when the case
            was an eval-mode copy of the model.
        split: the batch size and device count.
        verdict: the conclusion.
        summary: one line for a table.
        detail: the full report of a failure, the explanation of a divergence, or the
            report of the loss-average check.
        tensors: the compared tensors; of an ``EXPLAINED`` verdict, their summaries
            (``TensorComparison.summary``: the verdict's figures, without the per-element
            statistics of a failure report).
        scale: the uniform factor between parallel and expected gradients, when one
            factor explains a failure (a structured diagnosis, e.g. ``1 / world_size``).
        bias: ``loss.mean()``'s bias, for the loss-average check.
        chunks: the rows per replica or rank.
        groups: the modules that explain an ``EXPLAINED`` verdict.
        error: what the check raised (a ``ParallelMismatch`` or the code's exception).
        eval_copy: the case was an eval-mode copy of the model (the title says so too).
        replicas: the replica forwards (DataParallel) or ranks the parallel step was seen
            to run, where counted; a check that ran one is a ``SKIP``: nothing ran in
            parallel, so a match there is no pass.
    """

    check: str
    title: str
    split: Split
    verdict: Verdict
    summary: str
    detail: str = ""
    tensors: tuple[TensorComparison, ...] = ()
    scale: float | None = None
    bias: float | None = None
    chunks: tuple[int, ...] = ()
    groups: tuple[SourceGroup, ...] = ()
    error: BaseException | None = field(default=None, compare=False)
    eval_copy: bool = False
    replicas: int | None = None

    @property
    def serial(self) -> bool:
        """Skipped because one replica or rank ran: nothing ran in parallel."""
        return self.verdict is Verdict.SKIP and self.replicas is not None and self.replicas < 2

    @property
    def ok(self) -> bool:
        """Not a failure: passed, explained, warned or skipped."""
        return self.verdict is not Verdict.FAIL

    @property
    def worst(self) -> TensorComparison | None:
        """The worst failing tensor, if any."""
        return _worst(self.tensors)

    @property
    def worst_ratio(self) -> float | None:
        """The greatest error/allowed of the compared tensors (those with a ``problem``, a
        shape or a missing gradient, have no ratio), or None when none was compared."""
        return max((t.ratio for t in self.tensors if t.problem is None), default=None)


def _worst(tensors: Sequence[TensorComparison]) -> TensorComparison | None:
    return max((t for t in tensors if not t.ok), key=lambda t: t.ratio, default=None)


@runtime_checkable
class SummaryReport(Protocol):
    """What a data check returns (``DataReport``, ``MetricReport``): no tensors to compare,
    a line for a table, and the ranks or replicas that ran (the evidence)."""

    @property
    def summary(self) -> str: ...

    @property
    def replicas(self) -> int | None: ...


#: What a check's body returns: the comparison, the loss-average report, or a data check's.
Report = StepComparison | LossAverageReport | SummaryReport
Body = Callable[[Case, Target], Report]


@dataclass(frozen=True)
class CheckSpec:
    """One check, as data.

    Attributes:
        name: the registry key (``"dp-grads"``).
        title: a table row's label.
        backend: ``"dp"``, ``"ddp"``, or a sharded backend: ``"fsdp"``, ``"tp"``, ``"pp"``.
        statement: what passing means, in one sentence.
        body: runs the check; raises ``ParallelMismatch`` on a mismatch.
        wanted: whether the check means anything for a case (a loss-in-forward model has
            no ``loss_fn`` to check gradients with); cases it does not want are not run.
        skip: why a wanted check cannot run on this case's split, or None.
        explains_divergence: a mismatch on a model with train-mode BatchNorm or Dropout is
            ``EXPLAINED`` (the same check on an eval-mode copy must pass).
        training: the check trains for several optimizer steps (``Case.batches``,
            ``Case.optimizer``) and runs ``Target.after_backward``.
        data: the check runs a data path or an evaluation loop (``Target.loader``,
            ``Target.evaluate``) over ``Case.dataset``: ``check --eval``, ``check-data`` and
            the catalogue run it where they have that code; the planner, which has a model
            alone, does not.
        inexact: why the check has no exact mode (``Case.exact``), which it then skips
            saying so; None: it runs in exact mode too.
    """

    name: str
    title: str
    backend: str
    statement: str
    body: Body
    wanted: Callable[[Case], bool] = lambda case: True
    skip: Callable[[Case], str | None] = lambda case: None
    explains_divergence: bool = True
    training: bool = False
    data: bool = False
    inexact: str | None = None

    def title_for(self, eval_copy: bool, case: Case | None = None) -> str:
        """The table row's label, marked when the case is an eval-mode copy of the model; a
        training check's names the case's optimizer steps where they are not
        ``TRAINING_STEPS`` (the count its title is written with)."""
        title = self.title
        if self.training and case is not None and case.training_steps != TRAINING_STEPS:
            title = title.replace(f"{TRAINING_STEPS} ", f"{case.training_steps} ", 1)
            if case.training_steps == 1:  # check --exact trains one step: "1 step", not "1 steps"
                title = title.replace(" steps", " step", 1)
        return title + (" (eval mode)" if eval_copy else "")

    def applies(self, case: Case) -> bool:
        """Whether the check is meant for ``case`` (it may still be skipped on its split)."""
        return self.wanted(case)

    def why_not(self, case: Case) -> str | None:
        """Why the check cannot run on ``case`` (not meant for it, or its split cannot be
        checked), or None when it runs."""
        if not self.wanted(case):
            return f"{self.name} does not apply to this case"
        return self.skip_on(case)

    def skip_on(self, case: Case) -> str | None:
        """Why a wanted check cannot run on ``case``: its split, or exact mode where it has
        none (``inexact``)."""
        if case.exact and self.inexact is not None:
            return f"no exact mode: {self.inexact}"
        return self.skip(case)

    def check(self, case: Case, target: Target | None = None) -> Report:
        """Runs the check, raising what it raises (``ParallelMismatch`` on a mismatch).

        Raises:
            InvalidArgument: the check does not apply to ``case``, or cannot run on it.
        """
        __tracebackhide__ = True
        target = target or Target()
        case = target.on(case)
        reason = self.why_not(case)
        if reason is not None:
            raise InvalidArgument(f"check {self.name!r} cannot run here: {reason}")
        return self.body(case, target)

    def run(self, case: Case, target: Target | None = None, *, eval_copy: bool = False) -> CheckResult:
        """Runs the check and returns its verdict; whatever the code under test raises is
        the verdict's evidence, never an exception here.

        Args:
            case: what to check.
            target: the code under test (default: torch's own).
            eval_copy: ``case.module`` is an eval-mode copy of the user's model (the title
                says so).

        Raises:
            InvalidArgument: ``case`` cannot be checked at all (for example a module without
                trainable parameters); the message names the argument.
        """
        title = self.title_for(eval_copy, case)
        target = target or Target()
        case = target.on(case)
        split = case.split

        def result(verdict: Verdict, summary: str, **fields: Any) -> CheckResult:
            return CheckResult(self.name, title, split, verdict, summary, **fields, eval_copy=eval_copy)

        reason = self.skip_on(case)
        if reason is not None:
            return result(Verdict.SKIP, reason)
        groups = case.sources() if self.explains_divergence else ()
        try:
            report = self.body(case, target)
        except InvalidArgument:
            raise
        except ParallelMismatch as failure:
            comparison = failure.report if isinstance(failure.report, StepComparison) else None
            tensors = comparison.tensors if comparison is not None else ()
            if groups and comparison is not None and comparison.replayed:
                # a Dropout whose masks the reference replayed explains nothing any more
                groups = tuple(group for group in groups if not set(group.modules) <= set(comparison.replayed))
            if groups:
                return _explained(result, groups, tensors)
            worst = _worst(tensors)
            if worst is not None:
                summary = f"{worst.name}: {worst.max_abs:.3g} > {worst.allowed:.3g} allowed"
            elif comparison is not None and comparison.failures:
                summary = _first_sentence(comparison.failures[0])
            elif isinstance(failure.report, SummaryReport):
                summary = failure.report.summary
            else:
                summary = str(failure).splitlines()[0]
            loss = failure.report if isinstance(failure.report, LossAverageReport) else None
            return result(
                Verdict.FAIL, summary, detail=str(failure), tensors=tensors, error=failure,
                scale=comparison.scale if comparison is not None else None,
                **_loss_fields(loss),
            )
        except (Exception, SystemExit) as error:  # the code under test's, not KeyboardInterrupt
            if groups and ONE_ROW_BATCHNORM in str(error):
                return _explained(result, groups, ())
            return result(Verdict.FAIL, describe_exception(error), detail=failure_detail(error), error=error)
        if report.replicas is not None and report.replicas < 2:
            # the evidence, not the plan: a match of one replica's forward checked nothing parallel
            return result(
                Verdict.SKIP,
                f"{report.replicas} replica forward ran (chunks {list(case.chunk_sizes)}): nothing ran in parallel",
                replicas=report.replicas,
            )
        if isinstance(report, LossAverageReport):
            return _loss_verdict(result, report, replicas=report.replicas)
        if not isinstance(report, StepComparison):
            return result(Verdict.PASS, report.summary, replicas=report.replicas)
        # exact mode allows no difference at all: a pass is bit-identity, not a ratio of 0
        summary = "bit-identical (exact mode, tolerance none)" if case.exact else f"worst at {report.worst_ratio:.2g} of tolerance"
        return result(Verdict.PASS, summary, tensors=report.tensors, replicas=report.replicas)


def _first_sentence(text: str) -> str:
    head, dot, _rest = text.partition(". ")
    return head + dot.strip()


def _explained(result: Callable[..., CheckResult], groups: Sequence[SourceGroup], tensors: tuple[TensorComparison, ...]) -> CheckResult:
    # one explanation per group, not per module: 34 BatchNorm layers share one
    summary = "differs because of " + and_list([group.cause() for group in groups])
    detail = "\n".join(group.describe() for group in groups)
    # summaries: a row whose report was never read would hold its gradient and reference
    return result(Verdict.EXPLAINED, summary, detail=detail, tensors=tuple(t.summary() for t in tensors), groups=tuple(groups))


def _loss_fields(report: LossAverageReport | None) -> dict[str, Any]:
    return {} if report is None else {"bias": report.loss_bias, "chunks": tuple(report.chunk_sizes)}


def _loss_verdict(result: Callable[..., CheckResult], report: LossAverageReport, **extra: Any) -> CheckResult:
    chunks = str(list(report.chunk_sizes))
    fields = _loss_fields(report) | {"detail": str(report)} | extra
    if not report.is_biased:
        return result(Verdict.PASS, f"exact here (chunks {chunks})", **fields)
    if report.empty_replicas:
        empty = ", ".join(map(str, report.empty_replicas))
        return result(Verdict.WARN, f"loss.mean() is NaN (chunks {chunks}): replica {empty} averaged over no items", **fields)
    if report.by_tokens:
        how = "weight by t_i/T, tokens" if report.weighted_is_exact else "the replica losses are not means over their tokens"
        chunks = f"{chunks}, {report.items} {list(report.counts)}"
    else:
        how = "weight by n_i/B" if report.weighted_is_exact else "the replica losses are not per-row means"
    return result(Verdict.WARN, f"biased by {report.loss_bias:+.3g} (chunks {chunks}): {how}", **fields)


# --------------------------------------------------------------------------- bodies


def _dp_check(case: Case, target: Target, *, output_device: bool = True, parallel_loss: bool = True, exact: bool = False) -> Check:
    """The DataParallel check of ``case`` through ``target``'s wrappers, as the
    DataParallel helpers build it from their arguments (those without an
    ``output_device`` or ``parallel_loss_fn`` gather on ``device_ids[0]`` through the
    loss alone; ``exact``: the gradient helpers' exact mode)."""
    return Check.create(
        case.module, case.inputs, device_ids=case.device_ids, output_device=case.output_device if output_device else None,
        parallel=target.parallel, forward_kwargs=case.forward_kwargs, dim=case.dim,
        parallel_loss_fn=target.parallel_loss if parallel_loss else None, exact=exact,
    )


def _dp_grads(case: Case, target: Target) -> Report:
    assert case.loss_fn is not None
    return raise_unless_ok(grads_match(_dp_check(case, target, exact=case.exact), case.loss_fn, case.target, case.steps), None)


def _dp_grad_sum(case: Case, target: Target) -> Report:
    assert case.loss_fn is not None
    check = _dp_check(case, target, output_device=False, exact=case.exact)
    return raise_unless_ok(grad_sum_matches(check, case.loss_fn, case.target, case.steps), None)


def _dp_buffers(case: Case, target: Target) -> Report:
    return raise_unless_ok(buffers_match(_dp_check(case, target, parallel_loss=False)), None)


def _dp_loss_average(case: Case, target: Target) -> Report:
    report = loss_average_of(_dp_check(case, target, output_device=False, parallel_loss=False))
    uneven = report.unequal_items
    if report.is_biased and not uneven and report.weighted_is_exact:
        # equal items, exact means, yet loss.mean() is off: the gathered losses are wrong
        raise ParallelMismatch(f"loss.mean() of replica losses is off although the replicas hold equal numbers of {report.items}\n{report}", report)
    if case.per_row_mean_loss and report.is_biased != uneven:
        raise ParallelMismatch(
            "loss.mean() of per-row-mean replica losses must be biased exactly when the chunks "
            f"are uneven; chunks {list(report.chunk_sizes)}, biased: {report.is_biased}\n{report}",
            report,
        )
    return report


def _item_weighted_loss(losses: torch.Tensor, sizes: list[int], counts: list[int]) -> torch.Tensor:
    """The exact reduction of per-replica mean losses: each weighted by its share of the
    items its loss averages over (rows, or tokens for a token-mean loss)."""
    return chunk_weighted_loss(losses, counts)


def _dp_weighted_loss(case: Case, target: Target) -> Report:
    check = _dp_check(case, target, output_device=False, parallel_loss=False)
    return raise_unless_ok(reduction_matches(check, target.reduce or _item_weighted_loss), None)


def _dp_state(case: Case, target: Target) -> Report:
    """torch's DataParallel keeps replica 0's in-place buffer updates and loses attributes
    set in forward; with one device it runs the module itself."""
    from dpverify.core.virtual import data_parallel

    del target  # torch's semantics; a user's wrapper may differ
    real = cuda_device_count() > max(case.device_ids)  # torch's own DataParallel needs them there
    device = torch.device("cuda", case.device_ids[0]) if real else torch.device("cpu")
    module = copy.deepcopy(case.module).to(device)
    inputs = map_tensors(case.inputs, lambda tensor: tensor.to(device))
    along = {"dim": case.dim} if case.dim else {}
    data_parallel(module, list(case.device_ids), output_device=case.output_device, **along)(*inputs)
    one_device = len(case.device_ids) == 1
    if isinstance(module, BufferCounter):
        expected = case.batch_size if one_device else case.chunk_sizes[0]
        seen = int(module.rows_seen)
        what = "rows_seen (a buffer updated in place) must keep replica 0's update only"
    else:
        expected, seen = (1 if one_device else 0), int(vars(module)["calls"])
        what = "calls (an attribute set in forward) must be lost on every replica"
    if seen != expected:
        raise ParallelMismatch(f"{what}: expected {expected}, found {seen}; chunks {case.chunk_sizes}")
    # torch's own DataParallel: one replica per chunk
    return StepComparison(check=what, scenario=f"chunks {case.chunk_sizes}", tolerance="exact", tensors=(), replicas=len(case.chunk_sizes))


def _training_batches(case: Case) -> list[tuple[Any, Any]]:
    """The training checks' batches: the case's own, else its batch ``TRAINING_STEPS`` times."""
    return list(case.batches or ((case.inputs, case.target),) * TRAINING_STEPS)


def _training_optimizer(case: Case) -> Callable[..., torch.optim.Optimizer]:
    """The training checks' optimizer factory: the case's own, else ``DEFAULT_OPTIMIZER``."""
    return case.optimizer or DEFAULT_OPTIMIZER


def _dp_training(case: Case, target: Target) -> Report:
    """DataParallel training through the target's wrapper, with its ``after_backward``."""
    assert case.loss_fn is not None
    return assert_dp_training_matches(
        case.module, _training_batches(case), loss_fn=case.loss_fn, optimizer=_training_optimizer(case),
        device_ids=case.device_ids, output_device=case.output_device, parallel=target.parallel,
        parallel_loss_fn=target.parallel_loss, after_backward=target.after_backward, forward_kwargs=case.forward_kwargs, dim=case.dim,
        exact=case.exact,
    )


def _ddp() -> Any:
    checks = checks_if_available()
    if checks is None:
        raise RuntimeError("the DDP backend is not available in this build of torch")
    return checks


def _on_ranks(
    helper: Callable[..., StepComparison], case: Case, target: Target, *, training: bool = False, **options: Any,
) -> Report:
    """``helper``, a DDP or sharded assertion, on the case's model over its world size and
    the target's ranks: on the case's batch and target, or, ``training``, on the training
    checks' batches (the case's batch ``TRAINING_STEPS`` times unless it has its own) with
    its optimizer factory (SGD with momentum unless it has its own)."""
    assert case.loss_fn is not None
    data: tuple[Any, ...] = (case.inputs, case.target)
    if training:
        data = (_training_batches(case),)
        options["optimizer"] = _training_optimizer(case)
        if target.after_backward is not None:
            options["after_backward"] = target.after_backward
    if case.exact:
        options["exact"] = True
    return helper(case.module, *data, loss_fn=case.loss_fn, world_size=case.world_size, pool=target.pool, **options)


def _ddp_helper(name: str, *, takes_step: bool = True, training: bool = False, **options: Any) -> Body:
    """A body calling ``dpverify.ddp.checks.<name>`` (``_on_ranks``) with the target's DDP
    options, the case's keyword forward arguments (sharded with the batch; in training, given
    to every batch's forward) and the target's per-rank step, where the helper takes one."""

    def body(case: Case, target: Target) -> Report:
        step = {"step": target.step} if takes_step else {}
        return _on_ranks(
            getattr(_ddp(), name), case, target, training=training, ddp_kwargs=target.ddp_kwargs,
            forward_kwargs=case.forward_kwargs, **step, **options,
        )

    return body


def _sharded(module: str) -> Any:
    """``dpverify.sharded.<module>``, imported when a sharded check first runs (it imports
    torch.distributed's FSDP, DTensor or pipelining)."""
    import importlib

    return importlib.import_module(f"dpverify.sharded.{module}")


def _fsdp_options(case: Case, target: Target) -> dict[str, Any]:
    """The FSDP2 helpers' layout of the case, and the target's per-rank step."""
    layout = case.layout_for("fsdp")
    assert isinstance(layout, FSDPLayout)  # the skip said why otherwise
    return {"step": target.step, "shard_modules": layout.shard_modules, "reshard_after_forward": layout.reshard_after_forward}


def _fsdp_grads(case: Case, target: Target) -> Report:
    options = _fsdp_options(case, target)
    return _on_ranks(_sharded("fsdp").assert_fsdp_grads_match, case, target, forward_kwargs=case.forward_kwargs, **options)


def _fsdp_training(case: Case, target: Target) -> Report:
    options = _fsdp_options(case, target)
    return _on_ranks(_sharded("fsdp").assert_fsdp_training_matches, case, target, training=True, **options)


def _tp_grads(case: Case, target: Target) -> Report:
    layout = case.layout_for("tp")
    assert isinstance(layout, TPLayout)
    plan = target.plan(layout, case.module) if target.plan is not None else layout.plan()
    return _on_ranks(
        _sharded("tensor_parallel").assert_tensor_parallel_grads_match, case, target,
        plan=plan, data_parallel=layout.data_parallel, forward_kwargs=case.forward_kwargs,
    )


def _tp_training(case: Case, target: Target) -> Report:
    layout = case.layout_for("tp")
    assert isinstance(layout, TPLayout)
    plan = target.plan(layout, case.module) if target.plan is not None else layout.plan()
    return _on_ranks(
        _sharded("tensor_parallel").assert_tensor_parallel_training_matches, case, target, training=True,
        plan=plan, data_parallel=layout.data_parallel, forward_kwargs=case.forward_kwargs,
    )


def _pp_grads(case: Case, target: Target) -> Report:
    layout = case.layout_for("pp")
    assert isinstance(layout, PipelineLayout)
    return _on_ranks(
        _sharded("pipeline").assert_pipeline_grads_match, case, target,
        n_microbatches=layout.n_microbatches, split_points=layout.split_points, schedule=target.schedule or layout.schedule,
    )


def _pp_training(case: Case, target: Target) -> Report:
    """The pipeline training check on the case's layout. A model that ties weights across
    the layout's stages needs their gradients summed between backward and the optimizer
    step: the target's ``after_backward`` does it, by default dpverify's correct
    ``sync_tied_grads``."""
    layout = case.layout_for("pp")
    assert isinstance(layout, PipelineLayout)
    pipeline = _sharded("pipeline")
    options: dict[str, Any] = {}
    if target.after_backward is None:
        stages = pipeline.stage_children(case.module, case.world_size, layout.split_points)
        rank_side = _sharded("pipeline_rank")
        if rank_side.tied_across_stages(case.module, stages):
            options["after_backward"] = rank_side.sync_tied_grads
    return _on_ranks(
        pipeline.assert_pipeline_training_matches, case, target, training=True,
        n_microbatches=layout.n_microbatches, split_points=layout.split_points, schedule=target.schedule or layout.schedule,
        **options,
    )


def _sharded_skip(backend: str, case: Case) -> str | None:
    """Why a sharded check cannot run on ``case``: no loss function, another dimension,
    too few rows for the ranks that split the batch, or no layout of ``backend`` for the
    model (``Case.layout_for`` says why)."""
    # FSDP2 shards the batch over every rank, as DDP does
    reason = _ddp_skip(case, rows_per_rank=int(backend == "fsdp"), checks="the sharded checks cut")
    if reason is not None or backend == "fsdp":
        return reason
    if backend == "pp" and case.forward_kwargs:
        return "the pipeline checks feed the first stage positional inputs; this forward takes keyword arguments"
    layout = case.layout_for(backend)
    if isinstance(layout, str):
        return layout
    if isinstance(layout, TPLayout) and case.batch_size < layout.data_parallel:
        return f"fewer rows than data-parallel groups ({case.batch_size} < {layout.data_parallel})"
    if isinstance(layout, PipelineLayout) and case.batch_size % layout.n_microbatches:
        return f"{case.batch_size} rows do not cut into {layout.n_microbatches} equal microbatches"
    return None


# --------------------------------------------------------------------------- applicability


def _has_loss_fn(case: Case) -> bool:
    return case.loss_fn is not None


def _returns_loss(case: Case) -> bool:
    return case.loss_fn is None


def _buffers(case: Case) -> bool:
    """Buffers a forward may update (BatchNorm's running statistics in train mode, a counter
    in any mode): which replica's update the module keeps is the question."""
    return any(b.dtype != torch.bool for b in case.module.buffers())


def _train_buffers(case: Case) -> bool:
    """Buffers DDP broadcasts from rank 0 before a train-mode forward."""
    return case.module.training and _buffers(case)


def _one_row_chunk_batchnorm(case: Case) -> str | None:
    training_bn = any(isinstance(m, _BatchNorm) and m.training for m in case.module.modules())
    if training_bn and min(case.chunk_sizes, default=0) < 2:
        return f"BatchNorm in train mode cannot normalise a one-row chunk (chunks {case.chunk_sizes})"
    return None


def _ddp_skip(case: Case, *, rows_per_rank: int = 1, checks: str = "the DDP checks shard") -> str | None:
    if case.world_size < 2:
        return "nothing runs in parallel on one rank; pass at least 2 devices"
    if case.loss_fn is None:
        return "needs loss_fn(output, target); this forward returns its loss"
    if case.dim != 0:
        return f"{checks} the batch along dim 0 (this case splits along dim {case.dim})"
    if case.batch_size < rows_per_rank * case.world_size:
        need = "rows than ranks" if rows_per_rank == 1 else f"rows than {rows_per_rank} per rank"
        return f"fewer {need} ({case.batch_size} < {rows_per_rank * case.world_size})"
    return None


#: why the buffer checks have no exact mode
_RUNNING_STATISTICS = "the running statistics it compares round (BatchNorm's momentum and square root)"


def _has_batchnorm(case: Case) -> bool:
    """A BatchNorm in train mode: SyncBatchNorm synchronises only there (an eval-mode copy
    of the model has nothing to synchronise)."""
    return any(isinstance(m, _BatchNorm) and m.training for m in case.module.modules())


def _counter(case: Case) -> bool:
    return isinstance(case.module, (BufferCounter, AttributeCounter))


def _has_dataset(case: Case) -> bool:
    return case.dataset is not None


def _one_rank(case: Case) -> str | None:
    return "one rank or device: nothing ran in parallel" if case.world_size < 2 else None


def _needs(code: Any, check: str, argument: str, option: str) -> Any:
    if code is None:
        raise InvalidArgument(f"check {check!r} checks your {argument}: pass Target({argument}=...) (on the command line {option})")
    return code


def _ddp_data(case: Case, target: Target) -> Report:
    """The samples each rank's loader delivers per epoch; padding is a training loader's
    cost, reported and allowed (``dpverify check-data`` decides with ``--allow``)."""
    from dpverify.data.path import assert_ddp_data_matches

    factory = _needs(target.loader or case.loader, "ddp-data", "loader", "dpverify check-data --loader MODULE:FACTORY")
    return assert_ddp_data_matches(case.dataset, factory, world_size=case.world_size, epochs=case.epochs, allow=("padding",), pool=target.pool)


def _ddp_metric(case: Case, target: Target) -> Report:
    from dpverify.data.metrics import assert_ddp_metric_matches

    evaluate = _needs(target.evaluate, "ddp-metric", "evaluate", "--eval MODULE:FN")
    return assert_ddp_metric_matches(
        case.module, case.dataset, evaluate, world_size=case.world_size, loader_factory=target.loader or case.loader, pool=target.pool,
    )


def _dp_metric(case: Case, target: Target) -> Report:
    from dpverify.data.metrics import assert_dp_metric_matches

    evaluate = _needs(target.evaluate, "dp-metric", "evaluate", "--eval MODULE:FN")
    return assert_dp_metric_matches(
        case.module, case.dataset, evaluate, device_ids=case.device_ids, output_device=case.output_device,
        loader_factory=target.loader or case.loader, parallel=target.parallel,
    )


_SPECS = (
    CheckSpec(
        "dp-grads", "DP grads match one device", "dp",
        "The module's gradients after a DataParallel step equal the single-device step's.",
        _dp_grads, wanted=_has_loss_fn,
    ),
    CheckSpec(
        "dp-grad-sum", "replica grads sum to full batch", "dp",
        "The replicas' gradients sum to the full-batch gradient of the loss (DataParallel "
        "sums them; it does not average).",
        _dp_grad_sum, wanted=_has_loss_fn,
    ),
    CheckSpec(
        "dp-loss-average", "loss.mean() of replica losses", "dp",
        "A loss computed in forward and averaged with loss.mean() equals the full-batch loss "
        "only when the chunks are equal; a warning says how far off it is otherwise.",
        _dp_loss_average, wanted=_returns_loss, explains_divergence=False,
        inexact="it measures what averaging the replicas' per-chunk mean losses does, a division by chunk sizes that rounds",
    ),
    CheckSpec(
        "dp-weighted-loss", "item-weighted loss is exact", "dp",
        "Weighting each replica's loss by its share of the items it averages over (rows, or "
        "tokens for a token-mean loss), sum(t_i * loss_i) / T, gives the full-batch loss and "
        "gradients.",
        _dp_weighted_loss, wanted=_returns_loss,
        inexact="it weights the replicas' losses by their item counts, divisions that round",
    ),
    CheckSpec(
        "dp-buffers", "buffers keep replica 0's update", "dp",
        "Buffers updated in forward (BatchNorm's running statistics) keep replica 0's update.",
        _dp_buffers, wanted=_buffers, inexact=_RUNNING_STATISTICS,
        skip=_one_row_chunk_batchnorm, explains_divergence=False,
    ),
    CheckSpec(
        "dp-state", "torch's state semantics", "dp",
        "torch's DataParallel keeps replica 0's in-place buffer update and loses attributes set "
        "in forward.",
        _dp_state, wanted=_counter, explains_divergence=False,
        inexact="it checks which state survives a step (buffers and attributes), not arithmetic",
    ),
    CheckSpec(
        "dp-training", f"DP training, {TRAINING_STEPS} steps", "dp",
        "Outputs, parameters, buffers, optimizer state and the attributes forward sets, after "
        "each of several DataParallel optimizer steps, equal single-device training's.",
        _dp_training, wanted=_has_loss_fn, training=True,
    ),
    CheckSpec(
        "ddp-grads", "DDP grads match one device", "ddp",
        "Every rank's gradients after a DDP step equal the single-device full-batch step's.",
        _ddp_helper("assert_ddp_grads_match"), skip=_ddp_skip,
    ),
    CheckSpec(
        "ddp-accumulation", f"no_sync accumulation, k={MICRO_BATCHES}", "ddp",
        f"Accumulating {MICRO_BATCHES} micro-batches per rank under no_sync() gives the full-batch "
        "gradient, with one synchronisation.",
        _ddp_helper("assert_ddp_accumulation_matches", micro_batches=MICRO_BATCHES), skip=functools.partial(_ddp_skip, rows_per_rank=MICRO_BATCHES),
    ),
    CheckSpec(
        "ddp-training", f"training, {TRAINING_STEPS} optimizer steps", "ddp",
        "Parameters after several DDP optimizer steps equal single-device training's.",
        _ddp_helper("assert_ddp_training_matches", training=True), skip=_ddp_skip, training=True,
    ),
    CheckSpec(
        "ddp-buffers", "DDP buffers come from rank 0", "ddp",
        "DDP broadcasts rank 0's buffers before each forward.",
        _ddp_helper("assert_ddp_buffers_match", takes_step=False), wanted=_train_buffers, skip=_ddp_skip, explains_divergence=False, inexact=_RUNNING_STATISTICS,
    ),
    CheckSpec(
        "ddp-sync-batchnorm", "SyncBatchNorm = full-batch BN", "ddp",
        "SyncBatchNorm over the ranks normalises with the full batch's statistics.",
        _ddp_helper("assert_ddp_sync_batchnorm_matches", takes_step=False), wanted=_has_batchnorm, skip=_ddp_skip, explains_divergence=False, inexact=_RUNNING_STATISTICS,
    ),
    CheckSpec(
        "dp-ddp-agree", "DP = DDP", "ddp",
        "DataParallel and DDP give the same gradients for the same loss code (they do for a "
        "mean loss; a sum loss differs by the world size).",
        _ddp_helper("assert_dp_ddp_agree", takes_step=False), skip=_ddp_skip,
    ),
    CheckSpec(
        "fsdp-grads", "FSDP2 grads match one device", "fsdp",
        "Every rank's full (unsharded) gradients after an FSDP2 step equal the single-device "
        "full-batch step's.",
        _fsdp_grads, skip=functools.partial(_sharded_skip, "fsdp"),
    ),
    CheckSpec(
        "fsdp-training", f"FSDP2 training, {TRAINING_STEPS} steps", "fsdp",
        "Parameters after several FSDP2 optimizer steps (sharded optimizer state) equal "
        "single-device training's.",
        _fsdp_training, skip=functools.partial(_sharded_skip, "fsdp"), training=True,
    ),
    CheckSpec(
        "tp-grads", "TP grads match one device", "tp",
        "A tensor-parallel plan's outputs and full gradients on every rank equal the "
        "single-device step's.",
        _tp_grads, skip=functools.partial(_sharded_skip, "tp"),
    ),
    CheckSpec(
        "tp-training", f"TP training, {TRAINING_STEPS} steps", "tp",
        "Parameters, buffers and optimizer state after several tensor-parallel optimizer steps "
        "equal single-device training's.",
        _tp_training, skip=functools.partial(_sharded_skip, "tp"), training=True,
    ),
    CheckSpec(
        "pp-grads", "pipeline grads match one device", "pp",
        "Every pipeline stage's gradients and the schedule's loss equal the single-device "
        "full-batch step's.",
        _pp_grads, skip=functools.partial(_sharded_skip, "pp"),
    ),
    CheckSpec(
        "pp-training", f"pipeline training, {TRAINING_STEPS} steps", "pp",
        "Every stage's parameters, buffers and optimizer state after several optimizer steps "
        "equal single-device training's (a weight tied across stages summed over them by "
        "after_backward).",
        _pp_training, skip=functools.partial(_sharded_skip, "pp"), training=True,
    ),
    CheckSpec(
        "ddp-data", "DDP loaders: each sample once per epoch", "ddp",
        "Every epoch, the ranks' loaders (Target.loader) together see each sample of the dataset once, as one "
        "device's epoch does (padding reported as a cost), and a shuffle changes order each epoch.",
        _ddp_data, wanted=_has_dataset, skip=_one_rank, explains_divergence=False, data=True,
        inexact="it checks which samples each rank reads and what an evaluation reports, not gradients",
    ),
    CheckSpec(
        "ddp-metric", "DDP eval metric = one device", "ddp",
        "The evaluation loop (Target.evaluate) returns on every rank the metric it returns on one device over the "
        "whole dataset.",
        _ddp_metric, wanted=_has_dataset, skip=_one_rank, explains_divergence=False, data=True,
        inexact="it checks which samples each rank reads and what an evaluation reports, not gradients",
    ),
    CheckSpec(
        "dp-metric", "DP eval metric = one device", "dp",
        "The evaluation loop (Target.evaluate) returns through DataParallel the metric it returns with the model alone.",
        _dp_metric, wanted=_has_dataset, skip=_one_rank, explains_divergence=False, data=True,
        inexact="it checks which samples each rank reads and what an evaluation reports, not gradients",
    ),
)

#: Every check, by name.
CHECKS: dict[str, CheckSpec] = {spec.name: spec for spec in _SPECS}
