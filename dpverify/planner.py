"""``dpverify check``'s planner: the registry's checks on a user's model, over several splits.

For each split (a batch size on a number of devices or ranks) it runs every check of
``dpverify.registry.CHECKS`` that applies to the model and the backend: gradients
against one device and the replica gradient sum, the loss-in-forward checks when the model
returns its loss, buffer updates in train mode, the DDP checks with ``backend="ddp"``, and
FSDP2, tensor and pipeline parallelism with ``"fsdp"``, ``"tp"`` and ``"pp"``.
A model with BatchNorm in train mode or Dropout cannot match exactly: its mismatches are
explained (the modules and the fix) rather than failed, and the same checks then run on an
eval-mode copy, which must match.

Each verdict is ``CheckSpec.run``'s: only an ``InvalidArgument`` stops the run, as the
command line's usage error. A run whose every check was skipped checked nothing, and says
so (``ModelCheckReport.checked_nothing``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dpverify.checks.dp import SharedSteps
from dpverify.core.comparison import TensorId
from dpverify.core.divergence import (
    DivergenceSource,
    SourceGroup,
    divergence_sources,
    group_sources,
)
from dpverify.core.errors import InvalidArgument
from dpverify.core.step import batch_size_of
from dpverify.core.tree import first_batched
from dpverify.models.layouts import BACKENDS as SHARDED_BACKENDS
from dpverify.models.user import Batch, UserModel
from dpverify.registry import (
    CHECKS,
    TRAINING_STEPS,
    Case,
    CheckResult,
    CheckSpec,
    Split,
    Target,
    Verdict,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_CHECKS",
    "DEFAULT_DEVICE_COUNTS",
    "EXACT_BATCH_SIZES",
    "ModelCheckReport",
    "ParameterError",
    "PlannedCheck",
    "TrainingOptions",
    "check_model",
    "parameter_errors",
    "plan_checks",
    "require_batch_dim",
    "require_rows_along",
]

#: Even chunks, uneven chunks, one-row chunks and fewer rows than devices, on 2 and 4 devices.
DEFAULT_BATCH_SIZES: tuple[int, ...] = (8, 5, 2)
DEFAULT_DEVICE_COUNTS: tuple[int, ...] = (2, 4)
#: The batch sizes of exact mode where none are given: a mean over a batch divides by its
#: rows, which rounds unless they are a power of two (8 on 2 and 4 devices: even chunks; 2 on
#: 4: fewer rows than devices).
EXACT_BATCH_SIZES: tuple[int, ...] = (8, 4, 2)

#: The checks ``dpverify check`` runs by default, where they apply: what a user's model and
#: training step can get wrong, one gradient step and a few optimizer steps (state kept
#: across forwards, buffers updated in forward, the user's ``--step``). The others (buffers,
#: accumulation, SyncBatchNorm, ...) test the parallel wrapper itself, torch's unless one is
#: given: ``--checks`` adds them.
DEFAULT_CHECKS: tuple[str, ...] = (
    "dp-grads", "dp-grad-sum", "dp-loss-average", "dp-weighted-loss", "dp-training", "ddp-grads", "ddp-training",
    "fsdp-grads", "fsdp-training", "tp-grads", "tp-training", "pp-grads", "pp-training",
)


@dataclass(frozen=True)
class ModelCheckReport:
    """Everything ``dpverify check`` found.

    Attributes:
        model: the model's name.
        loss: the loss, in words.
        results: every check on every split, in the order they ran.
        divergence: the modules that make train mode differ (BatchNorm, Dropout).
        groups: the same, one group per shared explanation.
        exact: the checks ran in exact mode (``Case.exact``): no tolerance.
    """

    model: str
    loss: str
    results: tuple[CheckResult, ...]
    divergence: tuple[DivergenceSource, ...]
    groups: tuple[SourceGroup, ...] = ()
    exact: bool = False

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.verdict is Verdict.FAIL)

    @property
    def checked_nothing(self) -> bool:
        """Whether no check ran: every one was skipped (or none was planned), those that
        ran one replica forward included (nothing ran in parallel there)."""
        return all(r.verdict is Verdict.SKIP for r in self.results)

    def count(self, verdict: Verdict) -> int:
        return sum(r.verdict is verdict for r in self.results)

    def counts(self) -> str:
        """The verdicts counted in words, passed and failed always, e.g. ``3 passed, 0 failed, 1 skipped``."""
        words = {Verdict.PASS: "passed", Verdict.FAIL: "failed", Verdict.EXPLAINED: "explained", Verdict.WARN: "warned", Verdict.SKIP: "skipped"}
        return ", ".join(f"{self.count(v)} {word}" for v, word in words.items() if self.count(v) or v in (Verdict.PASS, Verdict.FAIL))


@dataclass(frozen=True)
class PlannedCheck:
    """One check to run on one case."""

    spec: CheckSpec
    case: Case
    target: Target | None = None
    eval_copy: bool = False

    def run(self) -> CheckResult:
        return self.spec.run(self.case, self.target, eval_copy=self.eval_copy)


@dataclass(frozen=True)
class TrainingOptions:
    """What the training checks (``CheckSpec.training``) train with: ``dpverify check``'s
    ``--steps`` and ``--optimizer`` (its ``--step`` is the code under test,
    ``Target.after_backward``).

    Attributes:
        steps: optimizer steps, each on a batch of its own where the model makes one per
            step (``UserModel.step_batches``).
        optimizer: ``params -> Optimizer``, picklable; None for the checks' default (SGD
            with momentum).
    """

    steps: int = TRAINING_STEPS
    optimizer: Callable[..., torch.optim.Optimizer] | None = None


def _training_batches(model: UserModel, batch_size: int, steps: int) -> tuple[tuple[Any, ...], ...]:
    """The training checks' batches of one batch size: an ``(inputs, target)`` pair, or an
    ``(inputs, kwargs, target)`` triple, per optimizer step."""
    return tuple(
        (batch.inputs, dict(batch.kwargs), batch.target) if batch.kwargs else (batch.inputs, batch.target)
        for batch in model.step_batches(batch_size, steps)
    )


#: Every backend ``check`` runs, by name: DataParallel, DDP, then the sharded ones.
BACKENDS: tuple[str, ...] = ("dp", "ddp", *SHARDED_BACKENDS)


def _specs(checks: Sequence[str], backend: str) -> list[CheckSpec]:
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise InvalidArgument(f"checks={unknown} are not checks; choose from {sorted(CHECKS)}")
    if backend not in (*BACKENDS, "all"):
        raise InvalidArgument(f"backend={backend!r} must be one of {', '.join(map(repr, BACKENDS))} or 'all'")
    backends = BACKENDS if backend == "all" else (backend,)
    # a data check needs a loader or an evaluation loop, which a model alone does not bring
    return [CHECKS[name] for name in checks if CHECKS[name].backend in backends and not CHECKS[name].data]


def plan_checks(
    model: UserModel,
    *,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    device_counts: Sequence[int] = DEFAULT_DEVICE_COUNTS,
    backend: str = "dp",
    checks: Sequence[str] = DEFAULT_CHECKS,
    splits: Sequence[tuple[int, int]] | None = None,
    target: Target | None = None,
    dim: int = 0,
    training: TrainingOptions | None = None,
    exact: bool = False,
) -> list[PlannedCheck]:
    """Every check to run, in order; a model with divergence sources is checked as given
    (mismatches explained) and then as an eval-mode copy (mismatches fail). The checks of
    one module and batch share its steps (``Case.steps``, one ``SharedSteps`` per batch
    and mode): the single-device references, on every device count, and the parallel
    step of a split, which the gradient check leaves for the replica-sum check.

    Args:
        model: the model and its batches.
        batch_sizes: the batch sizes to check.
        device_counts: the device counts (DataParallel) or world sizes (DDP).
        backend: one of ``BACKENDS`` (``"dp"``, ``"ddp"``, ``"fsdp"``, ``"tp"``, ``"pp"``) or
            ``"all"``.
        checks: names from ``CHECKS`` to run where they apply.
        splits: ``(batch size, devices)`` pairs to check instead of every batch size on
            every device count.
        target: the code under test (default: torch's DataParallel and DDP).
        dim: the dimension the DataParallel checks split the batch along (``Case.dim``);
            a batch size is the rows along it, and every batch must have that many there
            (the DDP checks skip a case that is not split along dim 0).
        training: the training checks' optimizer steps and optimizer (default:
            ``TrainingOptions()``, ``TRAINING_STEPS`` steps of SGD with momentum); each step
            trains on the model's batch for that step.
        exact: run the checks in exact mode (``Case.exact``: dyadic float64 copies, every
            operation shown exact, no tolerance); a model outside the exact set is refused
            when its first check runs.

    Raises:
        InvalidArgument: an unknown check or backend, a batch the model cannot take, or
            (with ``dim`` other than 0) a batch without ``batch size`` rows along ``dim``.
    """
    specs = _specs(checks, backend)
    pairs = list(splits) if splits is not None else [(b, d) for b in batch_sizes for d in device_counts]
    modules = [(model.module, False)]
    if divergence_sources(model.module):
        modules.append((copy.deepcopy(model.module).eval(), True))
    # one batch per batch size, shared by its device counts and both modes
    batches = {size: model.make_batch(size) for size in dict.fromkeys(size for size, _ in pairs)}
    for size, batch in batches.items():
        require_rows_along(batch.inputs, size, dim, model.batch_source, dict(batch.kwargs))
    largest = max(batches)
    require_batch_dim(model, largest, dim, batches[largest])
    options = training or TrainingOptions()
    # the training checks' batches, one per optimizer step, made only where one runs
    trains = any(spec.training for spec in specs)
    steps_of = {size: _training_batches(model, size, options.steps) if trains else () for size in batches}
    planned: list[PlannedCheck] = []
    for module, eval_copy in modules:
        # the checks of one module and batch share its steps, on every device count
        steps = {size: SharedSteps() for size in batches}
        for batch_size, devices in pairs:
            batch = batches[batch_size]
            case = Case(
                module, batch.inputs, batch.target, batch.loss_fn, tuple(range(devices)),
                forward_kwargs=dict(batch.kwargs) or None, per_row_mean_loss=batch.per_row_mean_loss, dim=dim,
                steps=steps[batch_size], batches=steps_of[batch_size], optimizer=options.optimizer, exact=exact,
            )
            planned += [PlannedCheck(spec, case, target, eval_copy) for spec in specs if spec.applies(case)]
    return planned


def require_rows_along(inputs: tuple[object, ...], size: int, dim: int, source: str, kwargs: dict[str, object] | None = None) -> None:
    """A batch made for a batch size has that many rows along the dimension it is split
    along: a batch that ignores the size (a fixed one) would be checked, and reported, as a
    batch of another size; one made with its rows along dim 0 would be split along another
    dimension (time, features).

    Raises:
        InvalidArgument: the batch's first tensor has another size along ``dim``, or no such
            dimension.
    """
    rows = batch_size_of(inputs, argument=f"the batch from {source}", dim=dim, kwargs=kwargs)
    if rows == size:
        return
    if dim == 0:
        raise InvalidArgument(
            f"{source} returned a batch of {rows} rows when asked for batch_size={size}: FN(batch_size) "
            "must return batch_size rows (the checks split, and report, the batch by that size)"
        )
    raise InvalidArgument(
        f"dim={dim}: the batch of size {size} from {source} has {rows} rows along dim {dim}; "
        f"the batch is split along dim {dim}, so its batch_size rows must be there (FN(batch_size) "
        f"returns inputs with batch_size along dim {dim})"
    )


def require_batch_dim(model: UserModel, size: int, dim: int, batch: Batch | None = None) -> None:
    """The batch grows along ``dim`` with the batch size: a batch of ``size + 1`` has one
    more entry there. A batch whose ``size`` happens to equal another dimension (five time
    steps of a sequence-first LSTM at batch size 5) passes ``require_rows_along``, and would
    be split along that dimension (time) and reported as a wrong DataParallel; the batch of
    another size shows where its rows are. A batch of ``size + 1`` that cannot be made is no
    evidence either way (a batch function that takes only some sizes).

    Raises:
        InvalidArgument: the batch grows along another dimension and not along ``dim``.
    """
    made = batch if batch is not None else model.make_batch(size)
    first = first_batched((made.inputs, dict(made.kwargs)))
    try:
        probe = model.make_batch(size + 1)
    except Exception:  # the batch function's: nothing to learn from it
        return
    grown = first_batched((probe.inputs, dict(probe.kwargs)))
    if first is None or grown is None or first.dim() != grown.dim() or not -first.dim() <= dim < first.dim():
        return
    growing = [d for d in range(first.dim()) if first.shape[d] == size and grown.shape[d] == size + 1]
    if dim % first.dim() in growing or not growing:
        return
    other = growing[0]
    raise InvalidArgument(
        f"{model.batch_source}: the batch grows along dim {other}, not along dim {dim} where it is split (batch_size "
        f"{size} gives shape {tuple(first.shape)}, {size + 1} gives {tuple(grown.shape)}): dim {dim} is another "
        f"dimension (time, features) of the same size. Pass dim={other} (--dim {other}) to split the batch along its rows"
    )


def check_model(
    model: UserModel,
    *,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    device_counts: Sequence[int] = DEFAULT_DEVICE_COUNTS,
    backend: str = "dp",
    checks: Sequence[str] = DEFAULT_CHECKS,
    splits: Sequence[tuple[int, int]] | None = None,
    target: Target | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    on_start: Callable[[str, Split], None] | None = None,
    plan: Sequence[PlannedCheck] | None = None,
    dim: int = 0,
    training: TrainingOptions | None = None,
    exact: bool = False,
) -> ModelCheckReport:
    """Runs every planned check; ``on_start`` sees each check's title and split before it
    runs, and ``on_result`` its result as it comes.

    Args:
        model, batch_sizes, device_counts, backend, checks, splits, target, dim, training, exact:
            what to check, as in ``plan_checks``.
        on_result: called with each result.
        on_start: called before each check.
        plan: the checks ``plan_checks`` returned for these arguments, when the caller has
            them already (planning makes every batch).

    Raises:
        InvalidArgument: the model, its batches or the arguments cannot be checked (the
            message says why); anything else a check raises is that check's failure.
    """
    if plan is None:
        plan = plan_checks(
            model, batch_sizes=batch_sizes, device_counts=device_counts, backend=backend, checks=checks,
            splits=splits, target=target, dim=dim, training=training, exact=exact,
        )
    results: list[CheckResult] = []
    # a batch's shared steps are released after the last check that uses them, so that no
    # more than the batches still to come hold steps, and what one split's checks alone use
    # after the last of them (peak memory)
    last = {id(planned.case.steps): i for i, planned in enumerate(plan) if planned.case.steps is not None}
    last_of_split = {id(planned.case): i for i, planned in enumerate(plan)}
    for i, planned in enumerate(plan):
        if on_start is not None:
            on_start(planned.spec.title_for(planned.eval_copy, planned.case), planned.case.split)
        result = planned.run()
        results.append(result)
        if on_result is not None:
            on_result(result)
        steps = planned.case.steps
        if steps is not None and last[id(steps)] == i:
            steps.release()
        elif steps is not None and last_of_split[id(planned.case)] == i:
            steps.forget_split()
    loss = model.make_batch(max(b for b, _ in splits) if splits else max(batch_sizes)).loss_name
    # a given plan says itself whether it is exact
    exact = exact or any(planned.case.exact for planned in plan)
    return ModelCheckReport(model.name, loss, tuple(results), divergence_sources(model.module), group_sources(model.module), exact=exact)


@dataclass(frozen=True)
class ParameterError:
    """The worst gradient error of one parameter over every check and split.

    Attributes:
        name: the parameter.
        shape: its shape.
        ratio: greatest difference as a fraction of the allowed difference (> 1 fails).
        max_abs: the greatest absolute difference there.
        allowed: the allowed difference there.
        where: the check (its name, as ``--checks`` takes it; ``(eval)`` on the eval-mode
            copy) and split it came from.
        absent: the parameter had no gradient in any of them (``TensorComparison.absent``):
            there is no error, and ``ratio``, ``max_abs`` and ``allowed`` are 0.
    """

    name: str
    shape: tuple[int, ...]
    ratio: float
    max_abs: float
    allowed: float
    where: str
    absent: bool = False


def _parameter_of(which: TensorId | str) -> str | None:
    """The parameter whose gradient, as a step made it, ``which`` is: the single-device
    comparison's (``grad 'w'``) or a rank's (``rank 1 plain ddp_step grad 'w'``); None for
    anything else, the accumulated ``.grad``, replica sums and averages included (the same
    check compares the parameter's gradient itself)."""
    if not isinstance(which, TensorId) or which.kind != "grad" or not which.name or which.detail:
        return None
    return which.name if not which.variant or which.rank is not None else None


def parameter_errors(report: ModelCheckReport) -> list[ParameterError]:
    """Per parameter, the worst gradient error among checks that passed or failed
    (explained divergences are left out: they are not errors)."""
    worst: dict[str, ParameterError] = {}
    for result in report.results:
        if result.verdict not in (Verdict.PASS, Verdict.FAIL):
            continue
        for tensor in result.tensors:
            name = _parameter_of(tensor.id)
            if name is None or tensor.problem is not None:
                continue
            current = worst.get(name)
            # a comparison made beats none (a gradient absent on some splits only)
            if current is None or (current.absent and not tensor.absent) or (tensor.ratio > current.ratio and not tensor.absent):
                where = f"{result.check}{' (eval)' if result.eval_copy else ''}, {result.split.label}"
                worst[name] = ParameterError(name, tensor.shape, tensor.ratio, tensor.max_abs, tensor.allowed, where, tensor.absent)
    return list(worst.values())
