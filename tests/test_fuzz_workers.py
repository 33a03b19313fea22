"""``dpverify fuzz`` in worker processes (``fuzz_workers.py``): the same examples as sessions
in one process, and failures still shrunk, saved and replayed first."""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_fuzz import PLANTED

from dpverify.cli.fuzz import FuzzConfig, FuzzReport, default_workers, fuzz
from dpverify.cli.fuzz_workers import fuzz_in_workers, worker_configs

#: A DataParallel-like wrapper that averages the replicas' gradients (tests/test_fuzz.py's
#: planted bug), as the source of a file a session imports.
AVERAGING = PLANTED


def test_each_worker_gets_a_share_of_the_examples_and_a_seed_of_its_own() -> None:
    configs = worker_configs(FuzzConfig(max_examples=7, seed=3, workers=2))
    assert [c.max_examples for c in configs] == [4, 3]
    assert [c.seed for c in configs] == [3, 4]
    assert all(c.workers == 1 for c in configs)
    # no more workers than examples; an unseeded session's workers are unseeded
    assert [c.max_examples for c in worker_configs(FuzzConfig(max_examples=1, workers=2))] == [1]
    assert [c.seed for c in worker_configs(FuzzConfig(max_examples=4, workers=2))] == [None, None]
    # under a time budget alone each worker runs until the budget
    budget = worker_configs(FuzzConfig(time_budget=5.0, workers=2))
    assert [(c.max_examples, c.time_budget) for c in budget] == [(None, 5.0), (None, 5.0)]
    # a profile's examples are shared too, not run by every worker
    import dpverify.profiles  # noqa: F401  (registers the dpverify-* profiles)

    profiled = worker_configs(FuzzConfig(profile="dpverify-ci", workers=2))
    assert sum(c.max_examples or 0 for c in profiled) == FuzzConfig(profile="dpverify-ci").examples


def test_fuzz_runs_one_worker_and_says_what_runs_several(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fuzz_in_workers"):
        fuzz(FuzzConfig(max_examples=2, seed=0, workers=2, state_dir=tmp_path))


def test_only_dataparallel_sessions_default_to_several_workers() -> None:
    assert default_workers("dp") == 2  # not the machine's CPUs: a seeded session is the same everywhere
    assert {default_workers(backend) for backend in ("ddp", "fsdp", "tp", "pp", "all")} == {1}


def test_a_session_leaves_no_process_group_behind(tmp_path: Path) -> None:
    import torch.distributed as dist

    # a default session holds one group for its training checks' hooks (one_rank_group_held)
    assert fuzz(FuzzConfig(max_examples=8, seed=5, state_dir=tmp_path)).ok
    assert not dist.is_initialized()


def test_what_a_worker_raises_reaches_the_caller_as_from_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpverify.cli import fuzz as engine
    from dpverify.core.errors import InvalidArgument

    def refusing(config: FuzzConfig) -> Any:
        def example(scenario: Any) -> Any:
            raise InvalidArgument("module has no parameters to train; pass a module with parameters")

        return example

    monkeypatch.setattr(engine, "_example_runner", refusing)  # the workers are forked: they see it
    with pytest.raises(InvalidArgument, match="pass a module with parameters"):
        fuzz_in_workers(FuzzConfig(max_examples=4, seed=0, workers=2, state_dir=tmp_path))


def _outcomes(*reports: FuzzReport) -> Counter[str]:
    return Counter(example.outcome for report in reports for example in report.history)


def test_two_workers_run_the_examples_of_two_seeded_sessions_in_one_process(tmp_path: Path) -> None:
    both = fuzz_in_workers(FuzzConfig(max_examples=12, seed=5, workers=2, state_dir=tmp_path))
    first = fuzz(FuzzConfig(max_examples=6, seed=5, state_dir=tmp_path))
    second = fuzz(FuzzConfig(max_examples=6, seed=6, state_dir=tmp_path))
    assert both.ok
    assert both.stopped_by == "max-examples"
    assert both.examples == 12
    assert [example.index for example in both.history] == list(range(1, 13))
    # the same examples with the same outcomes, counted in the order they came back
    assert _outcomes(both) == _outcomes(first, second)
    assert both.passed == first.passed + second.passed
    assert both.serial == first.serial + second.serial
    assert Counter(dict(both.diverged)) == Counter(dict(first.diverged)) + Counter(dict(second.diverged))


def _averaging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "averaging_wrapper.py").write_text(AVERAGING)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("averaging_wrapper", None)
    return importlib.import_module("averaging_wrapper").AveragingDataParallel


@pytest.mark.timeout(300)
def test_a_worker_s_failure_is_shrunk_saved_and_replayed_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = _averaging(tmp_path, monkeypatch)
    # unseeded, so that the failure is saved to the example database
    config = FuzzConfig(
        target="averaging_wrapper:AveragingDataParallel", target_object=wrapper, max_examples=300, workers=2,
        state_dir=tmp_path / ".dpverify",
    )
    report = fuzz_in_workers(config)
    assert report.stopped_by == "failure"
    failure = report.failure
    assert failure is not None
    assert failure.check == "dp-grads"
    assert "the replica gradients were averaged" in failure.report
    # shrunk in its worker to one Linear layer
    assert repr(failure.scenario).startswith("Scenario(model=ModelSpec(kind='linear', features=1, hidden=1, outputs=1")
    # counted up to the failure, in the whole session's numbering
    assert report.examples == failure.first_found_at
    assert report.history[-1].outcome == "failure"
    assert failure.repro.is_file()
    # the session's repro script alone: another worker's failure is not the session's
    assert sorted((tmp_path / ".dpverify").glob("repro_*.py")) == [failure.repro]
    assert any((tmp_path / ".dpverify" / "examples").iterdir())

    # replayed from the database by the worker that holds it. The other worker may have
    # found and saved a failure of its own before the session stopped (stopped mid-shrink,
    # it keeps its candidates unshrunk: a fresh-clone CI replayed a Dropout model's), and
    # either replay may come back first: the session's count at the failure and which of the
    # saved failures it reports are not fixed; that it replays a failure of the same check,
    # with the same diagnosis, is
    again = fuzz_in_workers(config)
    assert again.failure is not None
    assert again.failure.replayed
    assert again.failure.check == failure.check
    assert "the replica gradients were averaged" in again.failure.report
