"""Fuzzing the property suite with HypoFuzz works as docs/fuzzing.md says (``hypothesis fuzz --
tests/test_properties.py``, no environment variable), while a plain pytest run of the suite
stays derandomized; and HypoFuzz 25.11.01 itself misbehaves as docs/fuzzing.md warns (these
checks are skipped with any other version)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings
from process_tree import ctrl_c_and_reap

import conftest

if TYPE_CHECKING:
    import psutil  # type: ignore[import-untyped]

pytestmark = pytest.mark.deep

ROOT = Path(__file__).resolve().parent.parent
PROPERTIES = ROOT / "tests" / "test_properties.py"
#: Seconds ``hypothesis fuzz`` may take to collect the suite and report a fuzzed test; it
#: takes about five on two cores (most of it importing torch, twice).
REPORT_DEADLINE_S = 60
#: Seconds its processes may take to end after Ctrl-C. A DDP rank that a property test was
#: still starting (importing torch) when Ctrl-C came has no parent watchdog yet: it exits as
#: soon as its start-up ends and it sees its parent gone, which on two loaded cores (the
#: rest of the suite running beside this test) took more than 20 seconds once.
STOP_DEADLINE_S = 60
#: The HypoFuzz release whose own misbehaviour docs/fuzzing.md describes.
DOCUMENTED_HYPOFUZZ = "25.11.01"


def _config(*plugins: object, profile_option: str | None = None) -> pytest.Config:
    """What ``under_hypofuzz`` and ``pytest_configure`` read of a pytest config."""
    config = SimpleNamespace(
        pluginmanager=SimpleNamespace(get_plugins=lambda: set(plugins)),
        getoption=lambda name, default=None: (
            profile_option if name == "--hypothesis-profile" else default
        ),
    )
    return config  # type: ignore[return-value]


def _hypofuzz_collector() -> object:
    """A stand-in for the plugin HypoFuzz passes to pytest when it collects
    (``hypofuzz.collection._ItemsCollector``)."""
    return type("_ItemsCollector", (), {"__module__": "hypofuzz.collection"})()


def _fuzz_flag(monkeypatch: pytest.MonkeyPatch, *, value: bool) -> None:
    """Sets what ``hypofuzz.detection.in_hypofuzz_run()`` returns, HypoFuzz installed or not."""
    detection = SimpleNamespace(in_hypofuzz_run=lambda: value)
    monkeypatch.setitem(sys.modules, "hypofuzz.detection", detection)


@pytest.fixture
def restore_profile() -> Iterator[None]:
    name = settings.get_current_profile_name()
    yield
    settings.load_profile(name)


def test_the_suite_runs_derandomized(pytestconfig: pytest.Config) -> None:
    if "HYPOTHESIS_PROFILE" in os.environ or pytestconfig.getoption("--hypothesis-profile"):
        pytest.skip("a Hypothesis profile was asked for, so the suite's default does not apply")
    assert settings().derandomize
    # "dpverify-ci", or "dpverify-ci-with-verbose-verbosity" under --hypothesis-verbosity
    assert settings.get_current_profile_name().startswith("dpverify-ci")


def test_hypofuzz_is_recognised_by_its_documented_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    _fuzz_flag(monkeypatch, value=True)
    assert conftest.under_hypofuzz(_config(object()))
    _fuzz_flag(monkeypatch, value=False)
    assert not conftest.under_hypofuzz(_config(object(), sys.modules[__name__]))


def test_hypofuzz_is_recognised_by_its_collector_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    # the dashboard's process, when multiprocessing spawns it, collects without the flag
    _fuzz_flag(monkeypatch, value=False)
    assert conftest.under_hypofuzz(_config(object(), _hypofuzz_collector()))
    monkeypatch.delitem(sys.modules, "hypofuzz.detection", raising=False)
    assert conftest.under_hypofuzz(_config(_hypofuzz_collector()))
    assert not conftest.under_hypofuzz(_config(object()))


@pytest.mark.usefixtures("restore_profile")
@pytest.mark.parametrize(
    ("fuzzing", "env", "option", "expected"),
    [
        (True, None, None, "dpverify-fuzz"),
        (False, None, None, "dpverify-ci"),
        # an explicit choice wins (pytest_dpverify or Hypothesis' own plugin loads it)
        (True, "dpverify-dev", None, "dpverify-ci"),
        (True, None, "dpverify-dev", "dpverify-ci"),
    ],
)
def test_a_fuzzing_session_gets_the_random_profile(
    monkeypatch: pytest.MonkeyPatch,
    fuzzing: bool,
    env: str | None,
    option: str | None,
    expected: str,
) -> None:
    _fuzz_flag(monkeypatch, value=fuzzing)
    if env is None:
        monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    else:
        monkeypatch.setenv("HYPOTHESIS_PROFILE", env)
    settings.load_profile("dpverify-ci")
    conftest.pytest_configure(_config(profile_option=option))
    assert settings.get_current_profile_name() == expected
    assert settings().derandomize == (expected == "dpverify-ci")


def _fuzzed_tests(database: Path) -> dict[str, int]:
    """Valid test cases run per fuzzed test, by node id, from HypoFuzz's example database.

    HypoFuzz saves a ``Report`` (JSON: node id, counts by status) whenever a test finds new
    behaviour (hypofuzz/database/models.py), and a DirectoryBasedExampleDatabase keeps each
    value as a file.
    """
    from hypofuzz.database.models import Report
    from hypothesis.internal.conjecture.data import Status

    fuzzed: dict[str, int] = {}
    for path in database.rglob("*"):
        with suppress(OSError):  # a value deleted as it is read
            report = Report.from_json(path.read_bytes()) if path.is_file() else None
            if report is not None:
                valid = report.status_counts[Status.VALID]
                fuzzed[report.nodeid] = max(valid, fuzzed.get(report.nodeid, 0))
    return fuzzed


def _stop(fuzz: subprocess.Popen[Any]) -> list[psutil.Process]:
    """Stops ``hypothesis fuzz`` as a user does, with Ctrl-C, and returns the processes it
    started that outlived it (killed, then returned so the test fails on them)."""
    import psutil

    started: list[psutil.Process] = []
    with suppress(psutil.NoSuchProcess):
        started = psutil.Process(fuzz.pid).children(recursive=True)  # workers, manager
    # They share its process group (start_new_session): Ctrl-C reaches all, as in a terminal.
    return ctrl_c_and_reap(fuzz, started, STOP_DEADLINE_S)[1]


def _readme_hypofuzz() -> bool:
    """Whether the installed HypoFuzz is the release docs/fuzzing.md's warnings are about."""
    import hypofuzz

    return bool(hypofuzz.__version__ == DOCUMENTED_HYPOFUZZ)


def _hypothesis_fuzz(*args: str) -> list[str]:
    """The ``hypothesis fuzz`` command line, with this interpreter."""
    return [sys.executable, "-c", "from hypothesis.extra.cli import main; main()", "fuzz", *args]


@pytest.mark.timeout(REPORT_DEADLINE_S + 3 * STOP_DEADLINE_S)
def test_hypothesis_fuzz_collects_and_fuzzes_the_property_suite(tmp_path: Path) -> None:
    pytest.importorskip("hypofuzz", reason="hypofuzz is a test extra: pip install -e '.[test]'")
    # docs/fuzzing.md's command with one worker and no dashboard (no port), stopped once a
    # property has been fuzzed: it fuzzes until stopped and has no time limit.
    command = _hypothesis_fuzz("-n", "1", "--no-dashboard", "--", str(PROPERTIES))
    # As docs/fuzzing.md has it: no profile asked for (and no pytest options from outside).
    env = {k: v for k, v in os.environ.items() if k not in ("HYPOTHESIS_PROFILE", "PYTEST_ADDOPTS")}
    log = tmp_path / "fuzz.log"
    # Hypothesis keeps its example database in .hypothesis/ of the working directory
    # (hypothesis/configuration.py), so the repository's is left alone.
    database = tmp_path / ".hypothesis" / "examples"
    with log.open("w") as out:
        fuzz = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + REPORT_DEADLINE_S
        fuzzed: dict[str, int] = {}
        while fuzz.poll() is None and time.monotonic() < deadline:
            fuzzed = {k: n for k, n in _fuzzed_tests(database).items() if n > 0}
            if fuzzed:
                break
            time.sleep(0.25)
        shown = log.read_text()  # before Ctrl-C
    finally:
        orphans = _stop(fuzz)
    output = log.read_text()
    assert "No property-based tests were collected" not in output, output[-3000:]
    collected = re.search(r"using 1 process to fuzz (\d+) tests?", output)
    assert collected is not None, output[-3000:]
    assert int(collected.group(1)) >= 5, output[-3000:]  # the property suite's @given tests
    assert fuzzed, f"no test reported fuzzed within {REPORT_DEADLINE_S}s:\n{output[-3000:]}"
    assert all(nodeid.startswith("tests/test_properties.py::test_") for nodeid in fuzzed), fuzzed
    assert not orphans, f"processes outlived hypothesis fuzz by {STOP_DEADLINE_S}s: {orphans}"
    if _readme_hypofuzz():
        # docs/fuzzing.md's account of HypoFuzz itself: nothing shows how fuzzing goes without the
        # dashboard, and its worker dies of the Ctrl-C with a traceback.
        assert "::test_" not in shown[collected.end() :], shown[-3000:]
        assert "KeyboardInterrupt" in output[len(shown) :], output[-3000:]


#: A property that fails at once, and a profile HypoFuzz accepts wherever it runs (Hypothesis
#: loads its derandomized "ci" profile, which HypoFuzz refuses, when it detects CI).
FAILING_SUITE = {
    "conftest.py": """
from hypothesis import settings

settings.register_profile("random", settings.get_profile("default"), derandomize=False)
settings.load_profile("random")
""",
    "test_failing.py": """
from hypothesis import given, strategies as st


@given(st.integers())
def test_fails(x):
    assert x < 10
""",
}


@pytest.mark.timeout(REPORT_DEADLINE_S + 3 * STOP_DEADLINE_S)
def test_hypofuzz_25_11_01_crashes_on_a_failure_instead_of_reporting_it(tmp_path: Path) -> None:
    pytest.importorskip("hypofuzz", reason="hypofuzz is a test extra: pip install -e '.[test]'")
    from hypothesis.internal.conjecture.data import ConjectureResult

    if not _readme_hypofuzz() or "slice_comments" in getattr(ConjectureResult, "__slots__", ()):
        pytest.skip(f"docs/fuzzing.md describes HypoFuzz {DOCUMENTED_HYPOFUZZ} with a Hypothesis that renamed slice_comments")
    for name, text in FAILING_SUITE.items():
        (tmp_path / name).write_text(text)
    log = tmp_path / "fuzz.log"
    env = {k: v for k, v in os.environ.items() if k not in ("HYPOTHESIS_PROFILE", "PYTEST_ADDOPTS")}
    with log.open("w") as out:
        fuzz = subprocess.Popen(
            _hypothesis_fuzz("-n", "1", "--no-dashboard", "--", "test_failing.py"),
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    crash = "AttributeError: 'ConjectureResult' object has no attribute 'slice_comments'"
    try:
        deadline = time.monotonic() + REPORT_DEADLINE_S
        while crash not in log.read_text() and fuzz.poll() is None and time.monotonic() < deadline:
            time.sleep(0.25)
    finally:
        orphans = _stop(fuzz)
    output = log.read_text()
    assert crash in output, output[-3000:]  # in FuzzTarget.run_one, after shrinking the failure
    assert not orphans, f"processes outlived hypothesis fuzz by {STOP_DEADLINE_S}s: {orphans}"
