"""``dpverify fuzz``: the property suite's checks on random scenarios, with a live display.

Each example is a ``Scenario`` drawn by Hypothesis and checked by the properties it calls
for, as in the property suite (``tests/test_properties.py``):

- models DataParallel must reproduce exactly: ``assert_dp_grads_match`` and
  ``assert_grad_sum_equals_mean_loss_grad``;
- buffers updated in forward (a counter, BatchNorm): ``assert_dp_buffers_match``, the module
  keeps replica 0's update; for torch's own DataParallel, attributes set in forward are lost;
- BatchNorm or Dropout in train mode: the mismatch is classified (the module is named), not
  failed, and the same model in eval mode must match;
- a loss computed in forward: ``loss.mean()`` of the replica losses is biased exactly when the
  chunks are uneven, and the n_i/B-weighted reduction is exact;
- ``--backend ddp``: ``assert_ddp_grads_match`` on ``--devices`` ranks, for mean losses.

Failing examples are kept in a Hypothesis example database under ``.dpverify/examples``
and replayed first next time. A failure is shrunk, printed as a pasteable spec with the
full mismatch report, and written as a standalone script, ``.dpverify/repro_<id>.py``,
that calls the same assertion.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
import traceback
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

from dpverify.checks.loss_average import (
    assert_loss_reduction_matches_full_batch,
    check_forward_loss_average,
    chunk_weighted_loss,
)
from dpverify.checks.scenario import dp_buffers, dp_grad_sum, dp_grads
from dpverify.core.comparison import StepComparison
from dpverify.core.devices import cuda_device_count
from dpverify.core.divergence import ONE_ROW_BATCHNORM, divergence_sources
from dpverify.core.errors import ParallelMismatch
from dpverify.core.text import plural
from dpverify.core.virtual import data_parallel
from dpverify.ddp import checks_if_available
from dpverify.models.specs import KINDS
from dpverify.strategies import (
    DeviceList,
    Scenario,
    device_lists,
    loss_specs,
    model_specs,
    scenarios,
)

__all__ = [
    "CHECKS",
    "DEFAULT_MAX_EXAMPLES",
    "DEFAULT_TIME_BUDGET",
    "FuzzConfig",
    "FuzzFailure",
    "FuzzReport",
    "Tally",
    "fuzz",
    "parse_duration",
    "repro_script",
]

#: The default session: this many examples or ``DEFAULT_TIME_BUDGET`` seconds, whichever
#: comes first. Examples cost from a few milliseconds (a Linear layer) to a few hundred (an
#: LSTM on four devices): on a loaded 2-core CPU 500 take 25 s to 90 s, so the budget
#: keeps the session at about a minute wherever it runs.
DEFAULT_MAX_EXAMPLES = 1000
DEFAULT_TIME_BUDGET = 60.0

#: Where the example database and repro scripts live, relative to the working directory.
STATE_DIR = Path(".dpverify")

#: Model kinds the DDP check takes: it has no forward keyword arguments, and a loss computed
#: in forward is DataParallel's trap (DDP's is the uneven-shard average, checked anyway).
DDP_KINDS: tuple[str, ...] = tuple(k for k in KINDS if k not in ("kwargs", "loss-head"))

_STATE_KINDS = ("buffer-counter", "attribute-counter")
_DIVERGENT_KINDS = ("batchnorm", "dropout")
#: Kinds whose buffers change in forward: only replica 0's update may reach the module.
_BUFFER_KINDS = ("buffer-counter", "batchnorm")
_DURATION = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>s|m|h)?\s*$")


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


# --------------------------------------------------------------------------- the checks


@dataclass(frozen=True)
class _Run:
    """What a check needs besides the scenario: the wrapper or DDP step under test."""

    target: Any = None
    world_size: int = 2


def _dp_grads(scenario: Scenario, run: _Run) -> None:
    dp_grads(scenario, run.target)


def _dp_grad_sum(scenario: Scenario, run: _Run) -> None:
    dp_grad_sum(scenario, run.target)


def _dp_loss_average(scenario: Scenario, run: _Run) -> None:
    s = scenario.build()
    report = check_forward_loss_average(s.module, s.inputs, device_ids=s.device_ids, parallel=run.target)
    uneven = len(set(report.chunk_sizes)) > 1
    if report.is_biased != uneven:
        raise ParallelMismatch(
            f"loss.mean() of replica losses must be biased exactly when chunks are uneven; "
            f"chunks {list(report.chunk_sizes)}, is_biased={report.is_biased}\n{report}",
            report,
        )
    assert_loss_reduction_matches_full_batch(
        s.module, s.inputs, device_ids=s.device_ids, reduce=chunk_weighted_loss, parallel=run.target
    )


def _dp_buffers(scenario: Scenario, run: _Run) -> None:
    dp_buffers(scenario, run.target)


def _dp_state(scenario: Scenario, run: _Run) -> None:
    del run  # state semantics are torch's DataParallel's; a user's wrapper may differ
    s = scenario.build()
    device = torch.device("cuda", s.device_ids[0]) if scenario.devices.real else torch.device("cpu")
    s.module.to(device)
    data_parallel(s.module, s.device_ids, output_device=s.output_device)(*[x.to(device) for x in s.inputs])
    one_device = len(s.device_ids) == 1  # DataParallel then runs the module itself
    if scenario.model.kind == "buffer-counter":
        expected = scenario.batch_size if one_device else scenario.chunk_sizes[0]
        seen = int(s.module.get_buffer("rows_seen"))
        what = "rows_seen (a buffer updated in place) must keep replica 0's update only"
    else:
        expected, seen = (1 if one_device else 0), int(vars(s.module)["calls"])
        what = "calls (an attribute set in forward) must be lost on every replica"
    if seen != expected:
        raise ParallelMismatch(f"{what}: expected {expected}, found {seen}; chunks {scenario.chunk_sizes}")


def _ddp_grads(scenario: Scenario, run: _Run) -> None:
    s = scenario.build()
    checks = checks_if_available()
    if checks is None:
        raise RuntimeError("the DDP backend is not available in this build")
    checks.assert_ddp_grads_match(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, world_size=run.world_size, step=run.target
    )


#: Every check, by name: the function, and the statement a repro script runs (``s`` is the
#: built scenario, ``target`` the wrapper or DDP step under test, None for torch's).
CHECKS: dict[str, tuple[Callable[[Scenario, _Run], None], str]] = {
    "dp-grads": (_dp_grads, """\
    dpverify.assert_dp_grads_match(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids,
        output_device=s.output_device, forward_kwargs=s.kwargs, parallel=target,
    )"""),
    "dp-grad-sum": (_dp_grad_sum, """\
    dpverify.assert_grad_sum_equals_mean_loss_grad(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, device_ids=s.device_ids,
        forward_kwargs=s.kwargs, parallel=target,
    )"""),
    "dp-loss-average": (_dp_loss_average, """\
    report = dpverify.check_forward_loss_average(s.module, s.inputs, device_ids=s.device_ids, parallel=target)
    uneven = len(set(report.chunk_sizes)) > 1
    if report.is_biased != uneven:
        raise dpverify.ParallelMismatch(
            f"loss.mean() of replica losses must be biased exactly when chunks are uneven; "
            f"chunks {list(report.chunk_sizes)}, is_biased={report.is_biased}\\n{report}",
            report,
        )

    def weighted_loss(losses: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return (losses * torch.tensor(sizes, dtype=losses.dtype, device=losses.device)).sum() / sum(sizes)

    dpverify.assert_loss_reduction_matches_full_batch(
        s.module, s.inputs, device_ids=s.device_ids, reduce=weighted_loss, parallel=target
    )"""),
    "dp-buffers": (_dp_buffers, """\
    dpverify.assert_dp_buffers_match(
        s.module, s.inputs, device_ids=s.device_ids, output_device=s.output_device,
        forward_kwargs=s.kwargs, parallel=target,
    )"""),
    "dp-state": (_dp_state, """\
    device = torch.device("cuda", s.device_ids[0]) if scenario.devices.real else torch.device("cpu")
    s.module.to(device)
    dpverify.data_parallel(s.module, s.device_ids, output_device=s.output_device)(*[x.to(device) for x in s.inputs])
    one_device = len(s.device_ids) == 1  # DataParallel then runs the module itself
    if scenario.model.kind == "buffer-counter":
        expected = scenario.batch_size if one_device else scenario.chunk_sizes[0]
        seen = int(s.module.get_buffer("rows_seen"))
        what = "rows_seen (a buffer updated in place) must keep replica 0's update only"
    else:
        expected, seen = (1 if one_device else 0), int(vars(s.module)["calls"])
        what = "calls (an attribute set in forward) must be lost on every replica"
    if seen != expected:
        raise dpverify.ParallelMismatch(f"{what}: expected {expected}, found {seen}; chunks {scenario.chunk_sizes}")"""),
    "ddp-grads": (_ddp_grads, """\
    dpverify.assert_ddp_grads_match(
        s.module, s.inputs, s.target, loss_fn=s.loss_fn, world_size={world_size}, step=target
    )"""),
}


# --------------------------------------------------------------------------- one example


@dataclass(frozen=True)
class Outcome:
    """One example's outcome: passed, or an expected divergence by module class."""

    diverged: tuple[str, ...] = ()


class _CheckFailed(Exception):
    """A check failed on an example; carries what a repro script needs."""

    def __init__(self, check: str, scenario: Scenario, error: BaseException) -> None:
        super().__init__(str(error))
        self.check = check
        self.scenario = scenario
        self.error = error


def _run_check(check: str, scenario: Scenario, run: _Run) -> None:
    try:
        CHECKS[check][0](scenario, run)
    except Exception as error:
        raise _CheckFailed(check, scenario, error) from error


def _divergence_classes(scenario: Scenario, error: BaseException) -> tuple[str, ...] | None:
    """Module classes that explain ``error`` (None: the error is a real failure)."""
    module = scenario.model.build(scenario.seed)
    sources = divergence_sources(module)
    if isinstance(error, ParallelMismatch):
        report = error.report
        if not isinstance(report, StepComparison) or not report.divergence:
            return None
    elif not (sources and ONE_ROW_BATCHNORM in str(error)):
        return None
    classes = {_bucket(type(module.get_submodule(s.module)).__name__) for s in sources}
    return tuple(sorted(classes))


def _bucket(name: str) -> str:
    for family in ("BatchNorm", "Dropout"):
        if name.startswith(family):
            return family
    return name


def _divergent(check: str, scenario: Scenario, run: _Run) -> Outcome:
    """A train-mode BatchNorm/Dropout model: classify its mismatch, then the same model in
    eval mode must match."""
    diverged: tuple[str, ...] = ()
    try:
        CHECKS[check][0](scenario, run)
    except Exception as error:
        classes = _divergence_classes(scenario, error)
        if classes is None:
            raise _CheckFailed(check, scenario, error) from error
        diverged = classes
    exact = dataclasses.replace(scenario, model=dataclasses.replace(scenario.model, train=False))
    _run_check(check, exact, run)
    return Outcome(diverged)


def _buffers_usable(scenario: Scenario) -> bool:
    """A buffer check needs every chunk normalisable: BatchNorm in train mode raises on a
    chunk of one row."""
    model = scenario.model
    return model.kind in _BUFFER_KINDS and not (model.kind == "batchnorm" and model.train and min(scenario.chunk_sizes) < 2)


def _dp_example(scenario: Scenario, run: _Run, *, torch_wrapper: bool) -> Outcome:
    model = scenario.model
    if model.returns_loss:
        _run_check("dp-loss-average", scenario, run)
        return Outcome()
    if model.exact:
        _run_check("dp-grads", scenario, run)
        _run_check("dp-grad-sum", scenario, run)
        outcome = Outcome()
    else:
        outcome = _divergent("dp-grads", scenario, run)
    if _buffers_usable(scenario):
        _run_check("dp-buffers", scenario, run)
    if model.kind in _STATE_KINDS and torch_wrapper:
        _run_check("dp-state", scenario, run)
    return outcome


def _ddp_applies(scenario: Scenario, world_size: int) -> bool:
    """DDP's contract: a mean loss, a row for every rank, no forward keyword arguments."""
    return (
        scenario.model.kind in DDP_KINDS
        and scenario.loss.reduction == "mean"
        and scenario.batch_size >= world_size
    )


def _ddp_example(scenario: Scenario, run: _Run) -> Outcome:
    if not scenario.model.exact:
        return _divergent("ddp-grads", scenario, run)
    _run_check("ddp-grads", scenario, run)
    return Outcome()


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
        state_dir: the example database and repro scripts live here.
    """

    backend: str = "dp"
    devices: int = 4
    max_examples: int | None = None
    time_budget: float | None = None
    seed: int | None = None
    profile: str | None = None
    target: str | None = None
    target_object: Any = None
    state_dir: Path = STATE_DIR

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
        """Separates the saved examples of different sessions (backend, devices, target)."""
        return f"dpverify fuzz {self.backend} {self.devices} {self.target}".encode()


@dataclass
class Tally:
    """Running counts, updated after every example (read by the progress display)."""

    started: float = field(default_factory=time.perf_counter)
    run: int = 0
    passed: int = 0
    diverged: Counter[str] = field(default_factory=Counter)
    failed: int = 0
    first_failure_at: int | None = None
    shrink_runs: int = 0
    last_failure: _CheckFailed | None = None

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def rate(self) -> float:
        return self.run / self.elapsed if self.elapsed > 0 else 0.0

    def record(self, outcome: Outcome | _CheckFailed) -> None:
        if self.first_failure_at is not None:
            self.shrink_runs += 1
            if isinstance(outcome, _CheckFailed):
                self.last_failure = outcome
            return
        self.run += 1
        if isinstance(outcome, _CheckFailed):
            self.failed, self.first_failure_at, self.last_failure = 1, self.run, outcome
        elif outcome.diverged:
            self.diverged.update(outcome.diverged)
        else:
            self.passed += 1

    def describe_divergence(self) -> str:
        if not self.diverged:
            return "expected divergences 0"
        parts = ", ".join(f"{name} {count}" for name, count in sorted(self.diverged.items()))
        return f"expected divergences {sum(self.diverged.values())} ({parts})"


@dataclass(frozen=True)
class FuzzFailure:
    """The shrunk counterexample.

    Attributes:
        check: the failing check's name (a key of ``CHECKS``).
        scenario: the scenario, as it prints (pasteable).
        report: the full mismatch report (or the traceback of another error).
        repro: the standalone script that reproduces it.
        first_found_at: which example first failed.
        replayed: whether that example was one saved in the example database (replayed
            first) rather than a new one; never for a seeded session, which reads no
            database.
    """

    check: str
    scenario: Scenario
    report: str
    repro: Path
    first_found_at: int
    replayed: bool = False


@dataclass(frozen=True)
class FuzzReport:
    """What a session found.

    Attributes:
        examples: examples run (shrinking attempts not counted).
        passed: examples whose checks all passed.
        diverged: expected divergences by module class.
        failure: the failure found, or None.
        elapsed: seconds.
        stopped_by: ``"max-examples"``, ``"time-budget"``, ``"failure"`` or ``"interrupt"``.
    """

    examples: int
    passed: int
    diverged: tuple[tuple[str, int], ...]
    failure: FuzzFailure | None
    elapsed: float
    stopped_by: str

    @property
    def ok(self) -> bool:
        return self.failure is None and self.stopped_by != "interrupt"


class _TimeUp(BaseException):
    """Ends a session at its time budget (a BaseException, so Hypothesis lets it through
    instead of treating it as a failure to shrink)."""


def scenario_strategy(config: FuzzConfig) -> SearchStrategy[Scenario]:
    """The scenarios a session draws: DataParallel device lists of 1 to ``devices``
    devices, or, for the DDP backend alone, ``devices`` ranks and at least one row each."""
    if config.backend == "ddp":
        ranks = DeviceList(tuple(range(config.devices)))
        # DDP averages gradients over ranks: it matches the full batch for mean losses only
        # (a summed loss gives 1/world_size of the gradient, by design).
        drawn = scenarios(
            models=model_specs(kinds=DDP_KINDS), devices=ranks, losses=loss_specs(reductions=("mean",)),
            max_batch=max(12, 2 * config.devices),
        )
        return drawn.map(lambda s: dataclasses.replace(s, batch_size=max(s.batch_size, config.devices)))
    visible = cuda_device_count()
    # A single visible GPU would give single-device lists only: use virtual ids then.
    least = 2 if visible == 1 and config.devices >= 2 else 1
    devices = device_lists(min_devices=least, max_devices=config.devices)
    # One draw in four from the BatchNorm/Dropout kinds, so that a short session meets the
    # expected divergences too; shrinking still ends on the general draw (the first).
    general = scenarios(devices=devices)
    return st.one_of(general, general, general, scenarios(models=model_specs(kinds=_DIVERGENT_KINDS), devices=devices))


def devices_text(config: FuzzConfig) -> str:
    """Where the session runs, in words: DataParallel's devices, virtual or CUDA, and
    DDP's ranks, which are real processes."""
    visible = cuda_device_count()
    ranks = f"{plural(config.devices, 'DDP rank')} ({'nccl' if visible >= config.devices else 'gloo'})"
    if config.backend == "ddp":
        return ranks
    if visible >= 2:
        last = min(visible, config.devices) - 1
        where = f"CUDA devices 0-{last}" if last else "CUDA device 0"
    else:
        where = f"virtual devices 0-{config.devices - 1}" if config.devices > 1 else "virtual device 0"
        where += "" if visible else " (no CUDA here)"
    # under "all" the DDP examples run on real ranks, not on DataParallel's virtual devices
    return f"{where}, and {ranks}" if config.backend == "all" else where


def _example_runner(config: FuzzConfig) -> Callable[[Scenario], Outcome]:
    run = _Run(target=config.target_object, world_size=config.devices)
    torch_wrapper = config.target is None

    def example(scenario: Scenario) -> Outcome:
        outcomes: list[Outcome] = []
        if config.backend in ("dp", "all"):
            outcomes.append(_dp_example(scenario, run, torch_wrapper=torch_wrapper))
        if config.backend == "ddp" or (config.backend == "all" and _ddp_applies(scenario, config.devices)):
            outcomes.append(_ddp_example(scenario, run))
        return Outcome(tuple(sorted({c for o in outcomes for c in o.diverged})))

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


def fuzz(config: FuzzConfig, *, on_example: Callable[[Tally], None] | None = None) -> FuzzReport:
    """Runs a session; ``on_example`` sees the tally after every example.

    Returns:
        The report; ``report.failure`` holds the shrunk counterexample and its repro script.
    """
    tally = Tally()
    example = _example_runner(config)
    database = _CountingDatabase(str(config.state_dir / "examples"))
    # Hypothesis reads every saved example before it runs the first one, and replays them
    # first: this many of the first examples (if any) came from the database
    saved: list[int] = []

    def check(scenario: Scenario) -> None:
        if not saved:
            saved.append(database.fetched)
        if config.time_budget is not None and tally.first_failure_at is None and tally.elapsed > config.time_budget:
            raise _TimeUp
        try:
            outcome: Outcome | _CheckFailed = example(scenario)
        except _CheckFailed as failure:
            outcome = failure
        tally.record(outcome)
        if on_example is not None:
            on_example(tally)
        if isinstance(outcome, _CheckFailed):
            raise outcome.error

    check.__name__ = "dpverify_fuzz"
    check._hypothesis_internal_add_digest = config.database_key  # type: ignore[attr-defined]
    session = _settings(config, database)(given(scenario_strategy(config))(check))
    if config.seed is not None:
        session = seed(config.seed)(session)
    stopped_by = "max-examples"
    try:
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
        diverged=tuple(sorted(tally.diverged.items())),
        failure=failure,
        elapsed=tally.elapsed,
        stopped_by=stopped_by,
    )


def _failure(config: FuzzConfig, tally: Tally, *, replayable: int) -> FuzzFailure:
    last = tally.last_failure
    assert last is not None
    assert tally.first_failure_at is not None
    error = last.error
    report = str(error) if isinstance(error, ParallelMismatch) else _traceback_from(CHECKS[last.check][0], error)
    key = f"{last.check} {last.scenario!r} {config.target} {config.devices}"
    path = config.state_dir / f"repro_{hashlib.sha1(key.encode()).hexdigest()[:8]}.py"
    expected = f"{type(error).__module__}.{type(error).__qualname__}: {report.splitlines()[0]}"
    script = repro_script(last.check, last.scenario, target=config.target, world_size=config.devices, path=path, expected=expected)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    replayed = tally.first_failure_at <= replayable
    return FuzzFailure(last.check, last.scenario, report, path, tally.first_failure_at, replayed)


def _traceback_from(check: Callable[..., Any], error: BaseException) -> str:
    """The error's traceback from the check function on (Hypothesis' and the session's own
    frames say nothing about the failure)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code is not check.__code__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb or error.__traceback__)).rstrip()


def _target_import(target: str | None) -> list[str]:
    if target is None:
        return ["target = None  # torch's own DataParallel / DistributedDataParallel"]
    module, _, attribute = target.partition(":")
    return [
        "# --target: the wrapper or DDP step under test, imported from the directory that",
        "# `dpverify fuzz` ran in (this script lives in its .dpverify/ folder)",
        "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))",
        f"from {module} import {attribute} as target  # noqa: E402",
    ]


def repro_script(
    check: str,
    scenario: Scenario,
    *,
    target: str | None,
    world_size: int = 2,
    path: Path | None = None,
    expected: str = "",
) -> str:
    """A standalone script that runs ``check`` on ``scenario`` (with ``target``) and raises
    the same error; it needs only torch and dpverify.

    Args:
        check: a key of ``CHECKS``.
        scenario: the (shrunk) scenario.
        target: ``MODULE:CALLABLE`` under test, or None for torch's own.
        world_size: DDP ranks, for ``ddp-grads``.
        path: where the script will live (named in its docstring).
        expected: the error it should raise, for its docstring.
    """
    statement = CHECKS[check][1].replace("{world_size}", str(world_size))
    run = f"python {path.as_posix()}" if path is not None else "python <this file>"
    raises = _docstring_safe(expected) if expected else "the error the fuzz session reported."
    lines = [
        f'"""Reproduces a failure found by `dpverify fuzz`: check {check!r} on its shrunk scenario.',
        "",
        f"Run: {run}. It needs only torch and dpverify, and raises",
        raises,
        '"""',
        "",
        *(["import sys", "from pathlib import Path", ""] if target else []),
        "import torch",
        "",
        "import dpverify",
        "from dpverify.strategies import DeviceList, LossSpec, ModelSpec, Scenario",
        "",
        *_target_import(target),
        "",
        f"scenario = {scenario!r}",
        "",
        "",
        "def main() -> None:",
        "    s = scenario.build()",
        statement,
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


# --------------------------------------------------------------------------- display


class FuzzProgress:
    """The live display: a progress bar with examples per second, and below it the
    outcomes (passed, expected divergences by class, failures).

    On a terminal it redraws in place; elsewhere (a CI log, a pipe) it prints one plain
    status line every ``log_every`` seconds and none in between, so logs stay readable.
    """

    def __init__(self, console: Any, config: FuzzConfig, *, log_every: float = 10.0) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        self.console = console
        self.config = config
        self.log_every = log_every
        self.logged_at = time.perf_counter()
        self.outcomes = Text("starting")
        outcomes = self.outcomes

        class _Progress(Progress):
            def get_renderables(self) -> Iterator[Any]:
                yield self.make_tasks_table(self.tasks)
                yield outcomes

        self.progress = _Progress(
            SpinnerColumn(),
            TextColumn("[bold]fuzz"),
            BarColumn(bar_width=30),
            TextColumn("{task.fields[count]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=console,
            refresh_per_second=4,
            transient=True,
            disable=not console.is_terminal,
        )
        total = config.time_budget if config.max_examples is None and config.time_budget is not None else config.examples
        self.task = self.progress.add_task("fuzz", total=total, count="", rate="")

    def __enter__(self) -> FuzzProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.stop()

    def update(self, tally: Tally) -> None:
        budget = self.config.time_budget
        if self.config.max_examples is None and budget is not None:
            completed: float = min(tally.elapsed, budget)
            count = f"{tally.run} examples, budget {budget:g}s"
        else:
            completed = tally.run
            count = f"{tally.run}/{self.config.examples} examples"
            if budget is not None:
                count += f" or {budget:g}s"
        status = outcome_line(tally)
        self.outcomes.plain = status
        self.progress.update(self.task, completed=completed, count=count, rate=f"{tally.rate:.1f}/s")
        now = time.perf_counter()
        if not self.console.is_terminal and now - self.logged_at >= self.log_every:
            self.logged_at = now
            self.console.print(f"fuzz: {count}, {tally.rate:.1f}/s; {status}", markup=False, soft_wrap=True)


def outcome_line(tally: Tally) -> str:
    """``passed 38 · expected divergences 2 (BatchNorm 1, Dropout 1) · failed 0``."""
    text = f"passed {tally.passed} · {tally.describe_divergence()} · failed {tally.failed}"
    if tally.first_failure_at is not None:
        text += f" · shrinking the failure ({tally.shrink_runs} tried)"
    return text
