"""``dpverify fuzz``: the registry's checks on random scenarios, counted for a live display.

Each example is a ``Scenario`` drawn by Hypothesis (``scenario_strategy``), made a ``Case``
(``Case.from_scenario``) and checked by the checks of ``dpverify.registry.CHECKS`` that
apply to it (``DP_CHECKS``, ``DDP_CHECKS``, ``SHARDED_CHECKS``), as the property suite
checks (``tests/test_properties.py``). On every backend each example is a
``TrainingScenario`` (``training_scenarios``): the backend's one-step checks run on its
scenario, then its training checks (``CheckSpec.training``, ``TRAINING_CHECKS``) train it for
a few steps with its optimizer, clip and accumulation (``--backend all``: DataParallel's,
and DDP's where DDP's contract holds). A check that comes back ``EXPLAINED`` (BatchNorm or
Dropout in train mode) counts as an expected divergence, and must pass on the eval-mode
copy (``_run_check``).

Failing examples are kept in a Hypothesis example database under ``.dpverify/examples``
and replayed first next time. A failure is shrunk, printed as a pasteable spec with the
full report, and written as a standalone script, ``.dpverify/repro_<id>.py``, that runs
the same registry check by name. The live display is ``fuzz_view.py``; a session in
several processes, ``fuzz_workers.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.strategies import SearchStrategy

from dpverify.core.comparison import TensorComparison
from dpverify.core.devices import cuda_device_count
from dpverify.core.errors import ParallelMismatch
from dpverify.core.text import plural
from dpverify.models.layouts import BACKENDS as SHARDED_BACKENDS
from dpverify.models.layouts import ShardedScenario
from dpverify.models.specs import KINDS
from dpverify.models.training import OptimizerSpec, TrainingScenario
from dpverify.ranked.rank import one_rank_group_held
from dpverify.registry import CHECKS, Case, CheckResult, Target, Verdict
from dpverify.strategies import (
    EXACT_BACKEND_KINDS,
    DeviceList,
    LossSpec,
    Scenario,
    device_lists,
    exact_scenarios,
    loss_specs,
    model_specs,
    scenarios,
    training_scenarios,
)

__all__ = [
    "DDP_CHECKS",
    "DEFAULT_MAX_EXAMPLES",
    "DEFAULT_TIME_BUDGET",
    "DEFAULT_WORKERS",
    "DP_CHECKS",
    "SHARDED_CHECKS",
    "TARGET_FIELDS",
    "TRAINING_CHECKS",
    "FuzzConfig",
    "FuzzExample",
    "FuzzFailure",
    "FuzzReport",
    "Tally",
    "default_workers",
    "describe_training",
    "fuzz",
    "parse_duration",
    "repro_script",
    "with_user_loss",
]

#: The default session: this many examples or ``DEFAULT_TIME_BUDGET`` seconds, whichever
#: comes first. Examples cost from a few milliseconds (a Linear layer) to a few hundred (an
#: LSTM on four devices): on a loaded 2-core CPU 500 take 25 s to 90 s, so the budget
#: keeps the session at about a minute wherever it runs.
DEFAULT_MAX_EXAMPLES = 1000
DEFAULT_TIME_BUDGET = 60.0

#: Worker processes of a default DataParallel session (``default_workers``): a 2-core machine's.
DEFAULT_WORKERS = 2

#: Where the example database and repro scripts live, relative to the working directory.
STATE_DIR = Path(".dpverify")

#: The registry checks a DataParallel example runs, in this order, where they apply.
DP_CHECKS: tuple[str, ...] = ("dp-grads", "dp-grad-sum", "dp-loss-average", "dp-weighted-loss", "dp-buffers", "dp-state")
#: The registry checks a DDP example runs: each costs a pool of rank processes, so the
#: session keeps to the gradients (``dpverify check --backend ddp`` runs the others).
DDP_CHECKS: tuple[str, ...] = ("ddp-grads",)
#: The registry checks a sharded example runs, by backend.
SHARDED_CHECKS: dict[str, tuple[str, ...]] = {"fsdp": ("fsdp-grads",), "tp": ("tp-grads",), "pp": ("pp-grads",)}
#: The registry's training checks (``CheckSpec.training``) a session's examples run, by
#: ``--backend``: the backend's own (``--backend all``: DataParallel's and DDP's).
TRAINING_CHECKS: dict[str, tuple[str, ...]] = {
    backend: tuple(name for name, spec in CHECKS.items() if spec.training and spec.backend in (backend,) + (("dp", "ddp") if backend == "all" else ()))
    for backend in ("dp", "ddp", "fsdp", "tp", "pp", "all")
}
#: The global clip norms the training scenarios draw (None: no clip): one that rarely
#: engages and one that engages on every step.
_CLIP_NORMS: tuple[float | None, ...] = (None, 0.05, 1.0)
#: What each backend's training runs accumulate over, in words (the session's header).
_ACCUMULATION = {
    "ddp": "no_sync() accumulation over 1 or 2 micro-batches",
    "pp": "the schedule's microbatches, half the models with a weight tied across stages",
}




def describe_training(backend: str, *, exact: bool = False) -> str:
    """What the training runs of a session of ``--backend`` draw, in words (its header);
    ``exact``: those of ``exact_strategy``."""
    if exact:
        return f"SGD with and without momentum and weight decay, short dyadic numbers, {plural(EXACT_MAX_STEPS, 'optimizer step')}, no clip ({', '.join(TRAINING_CHECKS[backend])})"
    clip = "a global clip over every stage" if backend == "pp" else "a global clip"
    parts = ["SGD, SGD with momentum, Adam, AdamW", "1 to 3 optimizer steps", clip]
    parts += [_ACCUMULATION[backend]] if backend in _ACCUMULATION else []
    return f"{', '.join(parts)} ({', '.join(TRAINING_CHECKS[backend])})"


#: The ``Target`` field ``--target`` fills, by backend: DataParallel's wrapper, a per-rank
#: step (DDP, FSDP2), a tensor-parallel plan builder, a pipeline schedule class.
TARGET_FIELDS: dict[str, str] = {"dp": "parallel", "ddp": "step", "fsdp": "step", "tp": "plan", "pp": "schedule"}

#: Model kinds the DDP check takes: it has no forward keyword arguments, and a loss computed
#: in forward is DataParallel's trap (DDP's is the uneven-shard average, checked anyway).
DDP_KINDS: tuple[str, ...] = tuple(k for k in KINDS if k not in ("kwargs", "loss-head"))

_DIVERGENT_KINDS = ("batchnorm", "dropout")
#: Model kinds DataParallel's training check is not run on: the counters lose their state
#: under DataParallel by design (``dp-state`` checks torch does so, and ``dp-training``
#: rightly reports it), and a forward that returns its loss has no loss to train with.
_DP_UNTRAINED = ("buffer-counter", "attribute-counter", "loss-head")

#: What a session draws: a scenario of one step, a sharded one, or a training run of either.
AnyScenario = Scenario | ShardedScenario | TrainingScenario
_DURATION = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>s|m|h)?\s*$")


def default_workers(backend: str) -> int:
    """A session's worker processes unless ``--workers`` says (``FuzzConfig.workers``):
    ``DEFAULT_WORKERS`` for ``dp`` on every machine, so that a seeded session draws the same
    examples wherever it runs (on one CPU the workers take turns); 1 for the ranked
    backends, whose examples start rank processes of their own."""
    return DEFAULT_WORKERS if backend == "dp" else 1


def parse_duration(text: str) -> float:
    """Seconds in ``"90s"``, ``"10m"``, ``"1h"`` or ``"45"`` (seconds).

    Raises:
        ValueError: anything else; the message shows the accepted forms.
    """
    match = _DURATION.match(text)
    if match is None or float(match.group("value")) <= 0:
        raise ValueError(f"{text!r} is not a duration; write a positive number with s, m or h, e.g. 90s, 10m, 1h")
    unit = {"s": 1, "m": 60, "h": 3600}[match.group("unit") or "s"]
    return float(match.group("value")) * unit


# --------------------------------------------------------------------------- one example


@dataclass(frozen=True)
class Outcome:
    """One example's (or one check's) outcome: passed, or an expected divergence by module
    class; and how close its comparisons came to their tolerance.

    Attributes:
        diverged: the module classes of an expected divergence; empty when it passed.
        worst_ratio: the greatest error/allowed (``TensorComparison.ratio``) over the
            tensors compared (the eval-mode copy's for a divergence: the train-mode
            difference is expected to be large), or None when no tensor was compared.
        parallel: a check ran in parallel and gave a verdict; False when every check was
            skipped (one device or one row: one replica ran, nothing parallel to compare).
    """

    diverged: tuple[str, ...] = ()
    worst_ratio: float | None = None
    parallel: bool = False

    def __or__(self, other: Outcome) -> Outcome:
        """Both outcomes of one example: their divergences, the worse ratio, and whether
        anything ran in parallel."""
        ratios = [r for r in (self.worst_ratio, other.worst_ratio) if r is not None]
        return Outcome(tuple(sorted({*self.diverged, *other.diverged})), max(ratios, default=None), self.parallel or other.parallel)


class _CheckFailed(Exception):
    """A check failed on an example; carries what the report and the repro script need.

    Attributes:
        check: the registry name of the failing check.
        scenario: the scenario its ``Case`` was made from.
        result: the failing result (its ``detail`` is the full report).
        error: what the check raised; ``CHECKS[check].check`` raises it again.
        eval_mode: the failure is on the eval-mode copy (``Case.in_eval_mode``) of a model
            whose train-mode run diverged as expected.
    """

    def __init__(self, scenario: AnyScenario, result: CheckResult, *, eval_mode: bool = False) -> None:
        super().__init__(result.summary)
        self.check = result.check
        self.scenario = scenario
        self.result = result
        # a FAIL always carries its error; the fallback keeps the type honest
        self.error: BaseException = result.error or ParallelMismatch(result.detail or result.summary)
        self.eval_mode = eval_mode

    @property
    def worst_ratio(self) -> float | None:
        """The failing result's greatest error/allowed (above 1 for a mismatch), or None
        when it compared no tensor (the code under test raised)."""
        return self.result.worst_ratio


def _bucket(name: str) -> str:
    """A divergence's module class by family: BatchNorm1d and BatchNorm2d count together."""
    for family in ("BatchNorm", "Dropout"):
        if name.startswith(family):
            return family
    return name


def _run_check(name: str, scenario: AnyScenario, target: Target, loss: Any = None, *, exact: bool = False) -> Outcome:
    """Runs one registry check on a fresh ``Case`` of ``scenario`` (a check may change its
    module, as ``dp-state`` does, and a repro script starts from a fresh one too), in exact
    mode with ``exact`` (``Case.exact``); a training scenario's own code (its clip, its
    accumulation step) goes where ``target`` has none (``Target.with_defaults``).

    Returns:
        The module classes of an expected divergence (empty when the check passed), and
        the worst error/allowed of the run that had to match: the eval-mode copy's for a
        divergence.

    Raises:
        _CheckFailed: the check failed, in train mode or on the eval-mode copy.
    """
    spec = CHECKS[name]
    case = with_user_loss(Case.from_scenario(scenario), loss)
    if exact:
        case = dataclasses.replace(case, exact=True)
    if isinstance(scenario, TrainingScenario):
        target = target.with_defaults(**scenario.code())
    result = spec.run(case, target)
    if result.verdict is Verdict.FAIL:
        raise _CheckFailed(scenario, result)
    if result.verdict is not Verdict.EXPLAINED:
        return Outcome(worst_ratio=result.worst_ratio, parallel=result.verdict is not Verdict.SKIP)
    # train-mode BatchNorm/Dropout explain the difference; without them it must vanish (an
    # eval-mode copy has no divergence source, so it is PASS or FAIL, never EXPLAINED)
    in_eval = spec.run(case.in_eval_mode(), target, eval_copy=True)
    if in_eval.verdict is Verdict.FAIL:
        raise _CheckFailed(scenario, in_eval, eval_mode=True)
    return Outcome(tuple(sorted({_bucket(group.module_type) for group in result.groups})), in_eval.worst_ratio, parallel=True)


def with_user_loss(case: Case, loss: Any) -> Case:
    """``case`` with ``fuzz --loss MODULE:FN``'s loss in place of the drawn one (a forward
    that returns its loss keeps it); ``case`` itself for None."""
    if loss is None or case.loss_fn is None:
        return case
    return dataclasses.replace(case, loss_fn=loss)


def _dp_checks(case: Case, *, torch_wrapper: bool) -> list[str]:
    """The DataParallel checks for ``case``: those of ``DP_CHECKS`` that apply, except
    ``dp-grad-sum`` on train-mode BatchNorm/Dropout (``dp-grads`` already classifies that
    divergence and checks the eval-mode copy) and ``dp-state`` under ``--target`` (it checks
    torch's own DataParallel, whatever the target)."""
    left_out = {"dp-grad-sum"} if case.sources() else set()
    if not torch_wrapper:
        left_out.add("dp-state")
    return [name for name in DP_CHECKS if name not in left_out and CHECKS[name].applies(case)]


def _ddp_applies(scenario: Scenario, world_size: int) -> bool:
    """DDP's contract: a mean loss, a row for every rank, no forward keyword arguments."""
    return (
        scenario.model.kind in DDP_KINDS
        and scenario.loss.reduction == "mean"
        and scenario.batch_size >= world_size
    )


def _on_ranks(scenario: Scenario, world_size: int) -> Scenario:
    """``scenario`` with one device per DDP rank: a ``Case``'s device count is its world
    size, so the session's DDP case and the repro script's both have ``world_size`` ranks
    (under ``--backend all`` the drawn device list is DataParallel's, 1 to N devices)."""
    ranks = DeviceList(tuple(range(world_size)))
    return scenario if scenario.devices == ranks else dataclasses.replace(scenario, devices=ranks)


# --------------------------------------------------------------------------- the session


@dataclass(frozen=True)
class FuzzConfig:
    """One ``dpverify fuzz`` session.

    Attributes:
        backend: ``"dp"``, ``"ddp"`` or ``"all"``.
        devices: most DataParallel devices per example, and the DDP world size.
        max_examples: examples to generate (None: the profile's, or unlimited under a
            time budget).
        time_budget: seconds after which no new example starts (None: no limit). With
            both, whichever comes first ends the session; ``with_defaults`` fills in the
            default session's.
        seed: Hypothesis seed for a repeatable session, or None for a random one. As with
            Hypothesis' ``@seed``, a seeded session neither reads nor writes the example
            database (replayed examples would make it depend on more than the seed).
        profile: a Hypothesis settings profile to start from (``dpverify-fuzz``, ...).
        target: ``MODULE:CALLABLE`` under test, or None for torch's DataParallel / DDP.
        target_object: the imported target.
        parallel_loss: ``MODULE:CALLABLE``, the criterion wrapper of a model/criterion pair
            under test with the DataParallel checks (``Target.parallel_loss``), or None.
        parallel_loss_object: the imported criterion wrapper.
        ddp_kwargs: keyword arguments for DistributedDataParallel in the DDP checks
            (``Target.ddp_kwargs``), as sorted pairs; empty for none.
        loss: ``--loss``: a name from ``LOSSES`` (every scenario draws that loss), or
            ``MODULE:FN``, the user's ``FN(output, target)`` in place of the drawn loss, on
            models with a tensor output and a float target shaped like it (``_loss_scenarios``);
            None for the drawn losses.
        loss_object: the imported ``FN``.
        state_dir: the example database and repro scripts live here.
        exact: draw exact scenarios (``exact_strategy``) and run every check in exact mode
            (``Case.exact``): bit-identity, no tolerance.
        workers: processes that run examples side by side (``fuzz_workers.py``), each a
            Hypothesis session of its share of the examples with its own seed, shrinking
            and saving its failures; 1 runs the session in this process.
    """

    backend: str = "dp"
    devices: int = 4
    max_examples: int | None = None
    time_budget: float | None = None
    seed: int | None = None
    profile: str | None = None
    target: str | None = None
    target_object: Any = None
    parallel_loss: str | None = None
    parallel_loss_object: Any = None
    ddp_kwargs: tuple[tuple[str, Any], ...] = ()
    loss: str | None = None
    loss_object: Any = None
    state_dir: Path = STATE_DIR
    exact: bool = False
    workers: int = 1

    def with_defaults(self) -> FuzzConfig:
        """The default session's limits where neither a limit nor a profile was given."""
        if self.max_examples is None and self.time_budget is None and self.profile is None:
            return dataclasses.replace(self, max_examples=DEFAULT_MAX_EXAMPLES, time_budget=DEFAULT_TIME_BUDGET)
        return self

    @property
    def examples(self) -> int:
        if self.max_examples is not None:
            return self.max_examples
        if self.profile is not None:
            return int(settings.get_profile(self.profile).max_examples)
        if self.time_budget is not None:
            return 10**9  # the budget ends the session
        return DEFAULT_MAX_EXAMPLES

    @property
    def database_key(self) -> bytes:
        """Separates the saved examples of different sessions (backend, devices, target and
        criterion wrapper)."""
        key = f"dpverify fuzz {self.backend} {self.devices} {self.target}"
        # unchanged without a criterion wrapper or DDP keywords: the examples saved before they existed still replay
        key += f" {self.parallel_loss}" if self.parallel_loss else ""
        key += f" {self.ddp_kwargs}" if self.ddp_kwargs else ""
        key += " exact" if self.exact else ""
        return (key + (f" loss {self.loss}" if self.loss else "")).encode()


@dataclass(frozen=True)
class FuzzExample:
    """One example of a session, for its figure (shrinking attempts are not examples).

    Attributes:
        index: the example's number, from 1.
        elapsed: seconds since the session started, when the example ended.
        outcome: ``"pass"``; for an expected divergence its module classes, ``"BatchNorm"``,
            ``"Dropout"`` or ``"BatchNorm + Dropout"``; or ``"failure"``.
        worst_ratio: the greatest error/allowed over the tensors its checks compared (the
            eval-mode copy's for a divergence; the failing check's for a failure, above 1
            for a mismatch), or None when it compared none (for a failure: the code raised).
    """

    index: int
    elapsed: float
    outcome: str
    worst_ratio: float | None


def _outcome_class(outcome: Outcome | _CheckFailed) -> str:
    """A ``FuzzExample.outcome``: the divergence's module classes joined, in order."""
    if isinstance(outcome, _CheckFailed):
        return "failure"
    if outcome.diverged:
        return " + ".join(outcome.diverged)
    return "pass" if outcome.parallel else NOTHING_PARALLEL


#: The outcome of an example whose every check was skipped because one replica or rank ran.
NOTHING_PARALLEL = "nothing parallel"


@dataclass
class Tally:
    """Running counts, updated after every example (read by the progress display), and the
    examples one by one (``history``, for the session's figure)."""

    started: float = field(default_factory=time.perf_counter)
    run: int = 0
    passed: int = 0
    serial: int = 0
    diverged: Counter[str] = field(default_factory=Counter)
    failed: int = 0
    first_failure_at: int | None = None
    shrink_runs: int = 0
    last_failure: _CheckFailed | None = None
    history: list[FuzzExample] = field(default_factory=list)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def rate(self) -> float:
        return self.run / self.elapsed if self.elapsed > 0 else 0.0

    def record(self, outcome: Outcome | _CheckFailed) -> None:
        """One run of the session's test: an example, or once a failure was found, an
        attempt to shrink it."""
        if self.first_failure_at is not None:
            self.shrink_runs += 1
            if isinstance(outcome, _CheckFailed):
                self.last_failure = outcome
            return
        if isinstance(outcome, _CheckFailed):
            self.last_failure = outcome
            self.count(None, outcome.worst_ratio)
        else:
            self.count(outcome, outcome.worst_ratio)

    def count(self, outcome: Outcome | None, worst_ratio: float | None) -> None:
        """One example: its ``outcome``, or None for a failure (the first one found is the
        session's), and its worst error/allowed."""
        self.run += 1
        self.history.append(FuzzExample(self.run, self.elapsed, "failure" if outcome is None else _outcome_class(outcome), worst_ratio))
        if outcome is None:
            if self.first_failure_at is None:
                self.failed, self.first_failure_at = 1, self.run
        elif outcome.diverged:
            self.diverged.update(outcome.diverged)
        elif outcome.parallel:
            self.passed += 1
        else:
            self.serial += 1

    def describe_divergence(self) -> str:
        if not self.diverged:
            return "expected divergences 0"
        parts = ", ".join(f"{name} {count}" for name, count in sorted(self.diverged.items()))
        return f"expected divergences {sum(self.diverged.values())} ({parts})"


@dataclass(frozen=True)
class FuzzFailure:
    """The shrunk counterexample.

    Attributes:
        check: the failing check's name (a key of the registry's ``CHECKS``).
        scenario: the scenario, as it prints (pasteable); for a DDP check, one device per
            rank.
        report: the failing result's full report (the mismatch, or the error and the
            frames of the code under test), said to be the eval-mode copy's if it is.
        repro: the standalone script that reproduces it.
        first_found_at: which example first failed.
        replayed: whether that example was one saved in the example database (replayed
            first) rather than a new one; never for a seeded session, which reads no
            database.
        tensors: the failing result's compared tensors (none when the code raised), for
            the session's figure.
        eval_mode: the failure is on the eval-mode copy of the model.
    """

    check: str
    scenario: AnyScenario
    report: str
    repro: Path
    first_found_at: int
    replayed: bool = False
    tensors: tuple[TensorComparison, ...] = ()
    eval_mode: bool = False


@dataclass(frozen=True)
class FuzzReport:
    """What a session found.

    Attributes:
        examples: examples run (shrinking attempts not counted).
        passed: examples whose checks all passed, in parallel.
        serial: examples where nothing ran in parallel (one device or one row): every
            check was skipped, and none is counted as passed.
        diverged: expected divergences by module class.
        failure: the failure found, or None.
        elapsed: seconds.
        stopped_by: ``"max-examples"``, ``"time-budget"``, ``"failure"`` or ``"interrupt"``.
        history: the examples in the order they ran (``examples`` of them), for the
            session's figure (``dpverify.figures.fuzz``).
    """

    examples: int
    passed: int
    diverged: tuple[tuple[str, int], ...]
    failure: FuzzFailure | None
    elapsed: float
    stopped_by: str
    history: tuple[FuzzExample, ...] = ()
    serial: int = 0

    @property
    def ok(self) -> bool:
        return self.failure is None and self.stopped_by != "interrupt"


class _TimeUp(BaseException):
    """Ends a session at its time budget (a BaseException, so Hypothesis lets it through
    instead of treating it as a failure to shrink)."""


def scenario_strategy(config: FuzzConfig) -> SearchStrategy[Scenario] | SearchStrategy[ShardedScenario] | SearchStrategy[TrainingScenario]:
    """The scenarios a session draws: DataParallel device lists of 1 to ``devices``
    devices, or, for the DDP backend alone, ``devices`` ranks and at least one row each;
    for a sharded backend, its ``sharded_scenarios`` on ``devices`` ranks (a pipeline's
    models tied or not). Each is the scenario of a ``TrainingScenario`` (``training_scenarios``:
    DataParallel's under ``dp`` and ``all``). A session with a criterion wrapper draws one-step
    scenarios of its own (``_pair_scenarios``): the training check takes no criterion wrapper."""
    if config.exact:
        return exact_strategy(config)
    if config.backend in SHARDED_BACKENDS:
        return training_scenarios(config.backend, world_sizes=(config.devices,), clip_norms=_CLIP_NORMS)
    if config.backend == "ddp":
        ranks = DeviceList(tuple(range(config.devices)))
        # DDP averages gradients over ranks: it matches the full batch for mean losses only
        # (a summed loss gives 1/world_size of the gradient, by design).
        drawn = scenarios(
            models=model_specs(kinds=_loss_kinds(config, DDP_KINDS)), devices=ranks,
            losses=loss_specs(names=_loss_names(config), reductions=("mean",)), max_batch=max(12, 2 * config.devices),
        )
        ranked = drawn.map(lambda s: dataclasses.replace(s, batch_size=max(s.batch_size, config.devices)))
        return training_scenarios("ddp", scenarios=ranked, clip_norms=_CLIP_NORMS)
    # Two devices at least where --devices allows: a one-device example runs one replica,
    # so every check skips it (nothing parallel to compare), and Hypothesis, which draws
    # small values first, spent most of a short session on them. With one GPU visible this
    # also means virtual ids.
    least = 2 if config.devices >= 2 else 1
    devices = device_lists(min_devices=least, max_devices=config.devices)
    if config.parallel_loss is not None:
        return _pair_scenarios(devices, config)
    drawn = _with_divergent(devices, loss_specs(names=_loss_names(config)), _loss_kinds(config, KINDS))
    return training_scenarios("dp", scenarios=drawn, clip_norms=_CLIP_NORMS)


#: The optimizers ``fuzz --exact`` draws: SGD, with and without momentum and weight decay,
#: every number a short dyadic one (0.1 or 0.9 would make every product round).
EXACT_OPTIMIZERS: tuple[OptimizerSpec, ...] = (
    OptimizerSpec("sgd", 0.125), OptimizerSpec("sgd", 0.25, 0.5), OptimizerSpec("sgd", 0.125, 0.5, 0.0625),
)
#: The optimizer steps of ``fuzz --exact``'s training runs: each step roughly doubles the
#: bits the next needs, and a second one fits only a single Linear layer (docs/exact.md).
EXACT_MAX_STEPS = 1


def _two_rows(scenario: Scenario | ShardedScenario) -> bool:
    """Whether a DataParallel scenario has two rows at least: a one-row batch runs one
    replica, and every check skips it."""
    return isinstance(scenario, Scenario) and scenario.batch_size >= 2


def exact_strategy(config: FuzzConfig) -> SearchStrategy[TrainingScenario] | SearchStrategy[Scenario]:
    """The scenarios of ``fuzz --exact``: ``exact_scenarios`` of the backend (DataParallel
    on 2 to ``devices`` devices, the ranked backends on ``devices`` ranks, a power of two),
    each a training run of ``EXACT_MAX_STEPS`` of SGD from ``EXACT_OPTIMIZERS``, without a
    clip (a norm takes a square root). ``--loss NAME`` draws that loss (``mse`` or ``l1``;
    ``exact_scenarios`` refuses another), ``--loss MODULE:FN`` MSE's target for the user's
    loss, on models with one tensor output. With a criterion wrapper, one-step scenarios
    with mean losses, as ``_pair_scenarios``."""
    losses = ("mse",) if config.loss_object is not None else (config.loss,) if config.loss else ("mse", "l1")
    backend = "dp" if config.backend == "all" else config.backend
    kinds = _loss_kinds(config, EXACT_BACKEND_KINDS[backend])
    if backend == "dp":
        least = 2 if config.devices >= 2 else 1
        drawn = exact_scenarios("dp", world_sizes=tuple(range(least, config.devices + 1)), kinds=kinds, losses=losses)
        drawn = drawn.filter(_two_rows)
    else:
        drawn = exact_scenarios(backend, world_sizes=(config.devices,), kinds=kinds, losses=losses)
    if config.parallel_loss is not None:
        # a criterion wrapper cannot tell a mean from a sum (``_pair_scenarios``), and trains nothing
        return drawn.filter(lambda s: isinstance(s, Scenario) and s.loss.reduction == "mean")  # type: ignore[return-value]
    optimizers = st.sampled_from(EXACT_OPTIMIZERS)
    return training_scenarios(
        backend, scenarios=drawn, optimizers=optimizers, max_steps=EXACT_MAX_STEPS, clip_norms=(None,), micro_batches=(1,),
        world_sizes=(config.devices,),
    )


def _with_divergent(devices: SearchStrategy[DeviceList], losses: SearchStrategy[LossSpec], kinds: tuple[str, ...]) -> SearchStrategy[Scenario]:
    """Scenarios of ``kinds``, and one draw in four from the BatchNorm/Dropout kinds, so that
    a short session meets the expected divergences too; shrinking still ends on the general
    draw (the first)."""
    general = scenarios(models=model_specs(kinds=kinds), devices=devices, losses=losses)
    return st.one_of(general, general, general, scenarios(models=model_specs(kinds=_DIVERGENT_KINDS), devices=devices, losses=losses))


#: Model kinds whose forward returns something other than one tensor: ``fuzz --loss
#: MODULE:FN`` gives the user's loss the whole output, so it draws none of them.
_STRUCTURED_KINDS = ("tuple-output", "dict-output", "namedtuple-output", "loss-head")


def _loss_names(config: FuzzConfig) -> tuple[str, ...] | None:
    """The losses drawn: ``--loss NAME``; for ``--loss MODULE:FN``, MSE's, a float target
    shaped like the output (which the user's loss replaces); else every one."""
    if config.loss is None:
        return None
    return (config.loss,) if config.loss_object is None else ("mse",)


def _loss_kinds(config: FuzzConfig, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """``kinds``, less those without one tensor output under ``--loss MODULE:FN``."""
    if config.loss_object is None:
        return kinds
    return tuple(kind for kind in kinds if kind not in _STRUCTURED_KINDS)


def _pair_scenarios(devices: SearchStrategy[DeviceList], config: FuzzConfig) -> SearchStrategy[Scenario]:
    """The scenarios of a model/criterion pair (``--parallel-loss``): models whose loss the
    criterion computes (not one computed in forward: there is no criterion to wrap), with
    mean losses. The criterion wrapper combines the replicas' losses, each computed on its
    chunk, and cannot tell a mean from a sum (it receives the criterion, not its
    reduction): the exact combination of per-chunk means (weights n_i/B) is wrong for
    per-chunk sums, which add. So, as DDP's average over ranks, it is fuzzed with mean
    losses; a wrapper that averages uneven chunks still fails on them."""
    kinds = _loss_kinds(config, tuple(kind for kind in KINDS if kind != "loss-head"))
    return _with_divergent(devices, loss_specs(names=_loss_names(config), reductions=("mean",)), kinds)


def devices_text(config: FuzzConfig) -> str:
    """Where the session runs, in words: DataParallel's devices, virtual or CUDA, and
    DDP's ranks, which are real processes."""
    visible = cuda_device_count()
    group = "nccl" if visible >= config.devices else "gloo"
    ranks = f"{plural(config.devices, 'DDP rank')} ({group})"
    if config.backend == "ddp":
        return ranks
    if config.backend in SHARDED_BACKENDS:
        return f"{plural(config.devices, 'rank')} ({group})"
    if visible >= 2:
        last = min(visible, config.devices) - 1
        where = f"CUDA devices 0-{last}" if last else "CUDA device 0"
    else:
        where = f"virtual devices 0-{config.devices - 1}" if config.devices > 1 else "virtual device 0"
        where += "" if visible else " (no CUDA here)"
    # under "all" the DDP examples run on real ranks, not on DataParallel's virtual devices
    return f"{where}, and {ranks}" if config.backend == "all" else where


def _training_runs(scenario: TrainingScenario, config: FuzzConfig) -> list[tuple[str, TrainingScenario]]:
    """The training checks an example runs, each with the training scenario it runs on: the
    backend's; for DataParallel (``dp``, ``all``) on models without state of their own and
    with a loss outside the forward (``_DP_UNTRAINED``); under ``all`` also DDP's, on
    ``--devices`` ranks, where DDP's contract holds."""
    if scenario.backend != "dp":
        return [(name, scenario) for name in TRAINING_CHECKS[scenario.backend]]
    runs = [] if scenario.plain.model.kind in _DP_UNTRAINED else [("dp-training", scenario)]
    if config.backend == "all" and _ddp_applies(scenario.plain, config.devices):
        runs.append(("ddp-training", dataclasses.replace(scenario, scenario=_on_ranks(scenario.plain, config.devices), dp=False)))
    return runs


def _one_step_runs(scenario: TrainingScenario) -> bool:
    """Whether the one-step checks run on the training scenario's scenario: not on a model
    tied across pipeline stages, whose gradients no one step makes whole (``pp-grads`` says
    so, and points to the training check, where ``after_backward`` sums the copies)."""
    return not (scenario.backend == "pp" and scenario.plain.model.kind == "tied-sequential")


def _example_runner(config: FuzzConfig) -> Callable[[AnyScenario], Outcome]:
    """One example: the DataParallel checks that apply, then (``ddp``, or ``all`` where DDP's
    contract holds) the DDP checks on ``--devices`` ranks; for a training scenario, its
    scenario's checks and then the training checks (``_training_runs``); raises
    ``_CheckFailed``."""
    torch_wrapper = config.target is None
    dp = Target(parallel=config.target_object, parallel_loss=config.parallel_loss_object)
    ddp = Target(step=config.target_object, ddp_kwargs=dict(config.ddp_kwargs) or None)
    sharded = Target(**{TARGET_FIELDS[config.backend]: config.target_object}) if config.backend in SHARDED_BACKENDS else ddp

    def run(name: str, scenario: AnyScenario, target: Target, loss: Any = None) -> Outcome:
        # the user's loss (--loss MODULE:FN) and exact mode, each where asked
        exact = {"exact": True} if config.exact else {}
        if loss is None:
            return _run_check(name, scenario, target, **exact)
        return _run_check(name, scenario, target, loss, **exact)

    def example(scenario: AnyScenario) -> Outcome:
        if isinstance(scenario, TrainingScenario):
            # the one-step checks on its scenario, then the training checks on all of it
            outcome = example(scenario.scenario) if _one_step_runs(scenario) else Outcome()
            for name, trained in _training_runs(scenario, config):
                if isinstance(trained.scenario, ShardedScenario):
                    outcome |= run(name, trained, sharded)
                else:
                    outcome |= run(name, trained, dp if trained.backend == "dp" else ddp, config.loss_object)
            return outcome
        outcome = Outcome()
        if isinstance(scenario, ShardedScenario):
            for name in SHARDED_CHECKS[scenario.backend]:
                outcome |= run(name, scenario, sharded)
            return outcome
        if config.backend in ("dp", "all"):
            for name in _dp_checks(Case.from_scenario(scenario), torch_wrapper=torch_wrapper):
                outcome |= run(name, scenario, dp, config.loss_object)
        if config.backend == "ddp" or (config.backend == "all" and _ddp_applies(scenario, config.devices)):
            ranks = _on_ranks(scenario, config.devices)
            for name in DDP_CHECKS:
                outcome |= run(name, ranks, ddp, config.loss_object)
        return outcome

    return example


class _CountingDatabase(DirectoryBasedExampleDatabase):
    """The example database, counting the saved examples Hypothesis reads from it: a
    failure is "replayed" only if it was one of them, not because it came first."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fetched = 0

    def fetch(self, key: bytes) -> Iterator[bytes]:
        for value in super().fetch(key):
            self.fetched += 1
            yield value


def _settings(config: FuzzConfig, database: DirectoryBasedExampleDatabase) -> settings:
    parent = settings.get_profile(config.profile) if config.profile else settings.get_profile("default")
    return settings(
        parent,
        max_examples=config.examples,
        deadline=None,
        database=database,
        derandomize=False,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )


@contextlib.contextmanager
def _ctrl_c_noted(came: list[bool]) -> Iterator[None]:
    """Notes a Ctrl-C (SIGINT) in ``came`` as well as raising KeyboardInterrupt, so that the
    next example stops the session even if that KeyboardInterrupt is lost on its way up.
    Python cannot raise out of a garbage-collector callback (Hypothesis times collections
    with one, ``gc_callback`` in hypothesis/internal/conjecture/junkdrawer.py) or a
    finalizer: it hands the exception to ``sys.unraisablehook``, which printed a
    KeyboardInterrupt traceback, and the session ran on for seconds after Ctrl-C, one run in
    three on a terminal with DDP ranks. Such a KeyboardInterrupt is noted here and not
    printed; other unraisable exceptions reach the hook as before. Outside the main thread,
    where no handler can be set, it notes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: Any) -> None:
        came.append(True)
        raise KeyboardInterrupt

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous_hook(unraisable)

    previous = signal.signal(signal.SIGINT, note)
    previous_hook, sys.unraisablehook = sys.unraisablehook, hook
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Runs the session's torch operators on one intra-op thread, as before afterwards. A
    session's models have a few hundred elements: no operator of theirs is worth splitting
    across threads, and on a loaded 2-core CPU torch's worker threads, contending with every
    other process, made each step tens of times slower (a fuzz session 5x slower, 2.4
    examples/s against 13). One thread also gives every run the same order of additions.
    DDP and sharded ranks are processes of their own and keep their settings."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _group_held(config: FuzzConfig) -> contextlib.AbstractContextManager[None]:
    """One process group of this process alone for the whole session's training checks
    (``one_rank_group_held``: a group each cost 10 ms to tear down, a third of an example),
    where nothing the session runs looks at torch.distributed between them: a DataParallel
    session of torch's DataParallel, dpverify's models and the built-in losses. Code of the
    user's (``--target``, ``--parallel-loss``, ``--loss MODULE:FN``) gets a group per check,
    as outside a session."""
    own = config.backend == "dp" and config.target_object is None and config.parallel_loss_object is None and config.loss_object is None
    return one_rank_group_held() if own else contextlib.nullcontext()


def fuzz(
    config: FuzzConfig,
    *,
    on_example: Callable[[Tally], None] | None = None,
    on_run: Callable[[Outcome | _CheckFailed, bool], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> FuzzReport:
    """Runs a session in this process (``fuzz_workers.fuzz_in_workers`` runs one in
    ``config.workers`` processes, each of them this).

    Args:
        config: the session; one worker.
        on_example: sees the tally after every example.
        on_run: sees every run's outcome (``Outcome``, or the failure) before the tally
            records it, and whether it was an attempt to shrink a failure found before.
        stop: ends the session before the next example when it returns True (another
            worker's failure), as the time budget does; never while shrinking.

    Returns:
        The report; ``report.failure`` holds the shrunk counterexample and its repro script.

    Raises:
        ValueError: ``config.workers`` above 1.
    """
    if config.workers > 1:
        raise ValueError(f"FuzzConfig.workers is {config.workers}: run it with dpverify.cli.fuzz_workers.fuzz_in_workers, fuzz runs one")
    tally = Tally()
    example = _example_runner(config)
    database = _CountingDatabase(str(config.state_dir / "examples"))
    # Hypothesis reads every saved example before it runs the first one, and replays them
    # first: this many of the first examples (if any) came from the database
    saved: list[int] = []

    ctrl_c: list[bool] = []

    def check(scenario: AnyScenario) -> None:
        if ctrl_c:
            raise KeyboardInterrupt  # a Ctrl-C whose KeyboardInterrupt a finalizer lost
        if not saved:
            saved.append(database.fetched)
        if tally.first_failure_at is None and (
            (config.time_budget is not None and tally.elapsed > config.time_budget) or (stop is not None and stop())
        ):
            raise _TimeUp
        try:
            outcome: Outcome | _CheckFailed = example(scenario)
        except _CheckFailed as failure:
            outcome = failure
        if on_run is not None:
            on_run(outcome, tally.first_failure_at is not None)
        tally.record(outcome)
        if on_example is not None:
            on_example(tally)
        if isinstance(outcome, _CheckFailed):
            # the failure itself, not its error: a SystemExit of the code under test must
            # be shrunk like any failure, not end the session
            raise outcome

    check.__name__ = "dpverify_fuzz"
    check._hypothesis_internal_add_digest = config.database_key  # type: ignore[attr-defined]
    session = _settings(config, database)(given(scenario_strategy(config))(check))
    if config.seed is not None:
        session = seed(config.seed)(session)
    stopped_by = "max-examples"
    try:
        with _ctrl_c_noted(ctrl_c), _one_intra_op_thread(), _group_held(config):
            session()
    except _TimeUp:
        stopped_by = "time-budget"
    except KeyboardInterrupt:
        stopped_by = "interrupt"
    except Exception:
        if tally.last_failure is None:
            raise
        stopped_by = "failure"
    failure = _failure(config, tally, replayable=saved[0] if saved else 0) if stopped_by == "failure" else None
    return FuzzReport(
        examples=tally.run,
        passed=tally.passed,
        serial=tally.serial,
        diverged=tuple(sorted(tally.diverged.items())),
        failure=failure,
        elapsed=tally.elapsed,
        stopped_by=stopped_by,
        history=tuple(tally.history),
    )


def _failure(config: FuzzConfig, tally: Tally, *, replayable: int) -> FuzzFailure:
    last = tally.last_failure
    assert last is not None
    assert tally.first_failure_at is not None
    report = last.result.detail or last.result.summary
    if last.eval_mode:
        report = f"On the eval-mode copy (train mode diverges as expected; eval mode must match):\n{report}"
    key = f"{last.check} {last.scenario!r} {last.eval_mode} {config.target} {config.devices}"
    key += f" {config.parallel_loss}" if config.parallel_loss else ""
    key += f" {config.ddp_kwargs}" if config.ddp_kwargs else ""
    key += f" loss {config.loss}" if config.loss_object is not None else ""
    key += " exact" if config.exact else ""
    path = config.state_dir / f"repro_{hashlib.sha1(key.encode()).hexdigest()[:8]}.py"
    # the criterion wrapper goes with the DataParallel checks only (a DDP check's target is its step)
    pair = config.parallel_loss if CHECKS[last.check].backend == "dp" else None
    ddp_kwargs = dict(config.ddp_kwargs) if CHECKS[last.check].backend == "ddp" else None
    script = repro_script(
        last.check, last.scenario, target=config.target, eval_mode=last.eval_mode, path=path,
        expected=_error_line(last.error), parallel_loss=pair, ddp_kwargs=ddp_kwargs or None,
        loss=config.loss if config.loss_object is not None else None, exact=config.exact,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    # a seeded session reads no database, whatever the counts say
    replayed = config.seed is None and tally.first_failure_at <= replayable
    return FuzzFailure(last.check, last.scenario, report, path, tally.first_failure_at, replayed, last.result.tensors, last.eval_mode)


def _error_line(error: BaseException) -> str:
    """``error``'s line in a traceback, as Python prints it (``Type: first line of the
    message``): what the repro script's docstring says it raises."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    text = str(error).strip()
    return f"{name}: {text.splitlines()[0]}" if text else name


def _target_import(target: str | None, parallel_loss: str | None = None, loss: str | None = None) -> list[str]:
    lines = [] if target is not None else ["target = None  # torch's own DataParallel / DistributedDataParallel"]
    if target is None and parallel_loss is None and loss is None:
        return lines
    lines += [
        "# the code under test (--target or --parallel, --parallel-loss) and --loss, imported from the",
        "# directory that `dpverify fuzz` ran in (this script lives in its .dpverify/ folder)",
        "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))",
    ]
    for spec, name in ((target, "target"), (parallel_loss, "parallel_loss"), (loss, "loss")):
        if spec is not None:
            module, _, attribute = spec.partition(":")
            lines.append(f"from {module} import {attribute} as {name}  # noqa: E402")
    return lines


def repro_script(
    check: str,
    scenario: AnyScenario,
    *,
    target: str | None,
    eval_mode: bool = False,
    path: Path | None = None,
    expected: str = "",
    parallel_loss: str | None = None,
    ddp_kwargs: dict[str, Any] | None = None,
    loss: str | None = None,
    exact: bool = False,
) -> str:
    """A standalone script that runs registry check ``check`` on ``scenario`` (with
    ``target``, and ``parallel_loss``) and raises the same error; it needs only torch and
    dpverify.

    Args:
        check: a key of ``CHECKS``.
        scenario: the (shrunk) scenario; a DDP check's world size is its device count. A
            training scenario's clip and accumulation step go where the target has none.
        target: ``MODULE:CALLABLE`` under test, or None for torch's own.
        eval_mode: run the check on the eval-mode copy of the model.
        path: where the script will live (named in its docstring).
        expected: the error it should raise, for its docstring.
        parallel_loss: ``MODULE:CALLABLE``, the criterion wrapper of a model/criterion pair
            (a DataParallel check's ``Target.parallel_loss``), or None.
        ddp_kwargs: keyword arguments for DistributedDataParallel (a DDP check's
            ``Target.ddp_kwargs``, ``--ddp-kwargs``), or None.
        loss: ``MODULE:FN``, the user's loss in place of the scenario's (``--loss``), or None.
        exact: run the check in exact mode (``fuzz --exact``, ``Case.exact``).
    """
    field_name = TARGET_FIELDS[CHECKS[check].backend]
    fields = f"{field_name}=target" + (", parallel_loss=parallel_loss" if parallel_loss else "")
    fields += f", ddp_kwargs={ddp_kwargs!r}" if ddp_kwargs else ""
    imports = target is not None or parallel_loss is not None or loss is not None
    training = isinstance(scenario, TrainingScenario)
    layout = scenario.scenario if isinstance(scenario, TrainingScenario) else scenario
    code = f"Target({fields})" + (".with_defaults(**scenario.code())" if training else "")
    case = "Case.from_scenario(scenario)"
    case = f"with_user_loss({case}, loss)" if loss is not None else case
    case = f"dataclasses.replace({case}, exact=True)" if exact else case
    case += ".in_eval_mode()" if eval_mode else ""
    run = f"python {path.as_posix()}" if path is not None else "python <this file>"
    raises = _docstring_safe(expected) if expected else "the error the fuzz session reported."
    where = " on the eval-mode copy of" if eval_mode else " on"
    standard = (["import dataclasses"] if exact else []) + (["import sys", "from pathlib import Path"] if imports else [])
    lines = [
        f'"""Reproduces a failure found by `dpverify fuzz`: check {check!r}{where} its shrunk scenario.',
        "",
        f"Run: {run}. It needs only torch and dpverify, and raises",
        raises,
        '"""',
        "",
        *standard, *([""] if standard else []),
        "import torch",
        "",
        "from dpverify.registry import CHECKS, Case, Target",
        *(["from dpverify.cli.fuzz import with_user_loss"] if loss is not None else []),
        "from dpverify.models.specs import DeviceList, LossSpec, ModelSpec, Scenario",
        *(["from dpverify.models.layouts import FSDPLayout, PipelineLayout, ShardedScenario, TPLayout"] if isinstance(layout, ShardedScenario) else []),
        *(["from dpverify.models.training import OptimizerSpec, TrainingScenario"] if training else []),
        "",
        *_target_import(target, parallel_loss, loss),
        "",
        f"scenario = {scenario!r}",
        "",
        "",
        "def main() -> None:",
        f'    CHECKS["{check}"].check({case}, {code})',
        '    print("passed: the failure does not reproduce")',
        "",
        "",
        'if __name__ == "__main__":  # DDP ranks start by importing this file',
        "    main()",
        "",
    ]
    return "\n".join(lines)


def _docstring_safe(text: str) -> str:
    """``text`` inside a triple-quoted docstring: no escapes, no closing quotes."""
    return text.replace("\\", "\\\\").replace('"' * 3, "'" * 3)
