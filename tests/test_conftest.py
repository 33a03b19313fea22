"""The repository's ``conftest.py``, run in nested pytest sessions: ``DPVERIFY_TEST_THREADS``
sets torch's thread count in every process of a run (xdist workers too), no test sees the
terminal's colour and width variables, and a test that leaves process-wide state changed
fails, so that no test passes only on one machine or in the order it ran.

Each session runs in a subprocess (``runpytest_subprocess``): the conftest sets torch's
thread count, which must not leak into this process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

# 5 threads: no machine's default that a test run is likely to meet, so the count seen is
# the variable's and not the machine's
THREADS_SEEN = """
import os

import torch


def test_first():
    assert torch.get_num_threads() == 5, os.environ.get("PYTEST_XDIST_WORKER")


def test_second():
    assert torch.get_num_threads() == 5, os.environ.get("PYTEST_XDIST_WORKER")
"""

LEAKS = """
import os

import torch
from hypothesis import settings


def test_leaves_the_default_dtype_changed():
    torch.set_default_dtype(torch.float64)


def test_leaves_the_thread_count_changed():
    torch.set_num_threads(torch.get_num_threads() + 1)


def test_leaves_the_directory_changed(tmp_path):
    os.chdir(tmp_path)


def test_leaves_the_profile_changed():
    settings.load_profile("dpverify-dev")


def test_restores_what_it_changes(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.set_default_dtype(saved)
"""

TERMINAL_SEEN = """
import os
import subprocess
import sys


def test_no_terminal_variable_reaches_a_test_or_its_processes():
    names = ("FORCE_COLOR", "NO_COLOR", "COLUMNS")
    assert not [name for name in names if name in os.environ]
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.environ))"], capture_output=True, text=True, check=True)
    assert not [name for name in names if repr(name) in child.stdout]


def test_a_test_may_set_one(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert os.environ["COLUMNS"] == "80"
"""


@pytest.fixture
def repo_conftest(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    return pytester


@pytest.mark.deep
def test_the_thread_variable_sets_every_xdist_worker(repo_conftest: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPVERIFY_TEST_THREADS", "5")
    repo_conftest.makepyfile(THREADS_SEEN)
    result = repo_conftest.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["torch threads: 5 (DPVERIFY_TEST_THREADS)"])


def test_the_terminal_of_the_run_reaches_no_test(repo_conftest: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("NO_COLOR", "1")
    repo_conftest.makepyfile(TERMINAL_SEEN)
    repo_conftest.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


@pytest.mark.parametrize("value", ["0", "many", "-2"])
def test_a_bad_thread_count_is_a_usage_error_that_says_what_to_give(repo_conftest: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DPVERIFY_TEST_THREADS", value)
    repo_conftest.makepyfile("def test_nothing():\n    pass\n")
    result = repo_conftest.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*DPVERIFY_TEST_THREADS='{value}': give a positive number of torch threads*"])


@pytest.mark.deep
def test_a_test_that_leaves_process_state_changed_fails(repo_conftest: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DPVERIFY_TEST_THREADS", "HYPOTHESIS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    repo_conftest.makepyfile(LEAKS)
    result = repo_conftest.runpytest_subprocess("-p", "no:cacheprovider", "-rE")
    # each leak is an error at its teardown, after the test itself passed; restoring passes
    result.assert_outcomes(passed=5, errors=4)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaves_the_default_dtype_changed*",
            "the test left process-wide state changed (torch.get_default_dtype() is torch.float64, was torch.float32)*",
            "*ERROR at teardown of test_leaves_the_thread_count_changed*",
            "the test left process-wide state changed (torch.get_num_threads() is *, was *)*",
            "*ERROR at teardown of test_leaves_the_directory_changed*",
            "the test left process-wide state changed (os.getcwd() is *, was *)*",
            "*ERROR at teardown of test_leaves_the_profile_changed*",
            "the test left process-wide state changed (the Hypothesis profile is 'dpverify-dev', was 'dpverify-ci')*",
        ]
    )


def test_a_derandomized_test_draws_the_same_examples_whatever_its_process_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Hypothesis draws some choices from the literals of the local modules loaded at the
    # time; the conftest empties that pool, so that an xdist worker's earlier tests (and
    # what they imported) do not change a later test's examples
    import importlib

    from hypothesis import given, settings
    from hypothesis import strategies as st

    drawn: list[int] = []

    @settings(derandomize=True, database=None, max_examples=300)
    @given(st.integers(0, 10**9))
    def record(value: int) -> None:
        drawn.append(value)

    record()
    first = list(drawn)
    drawn.clear()
    (tmp_path / "module_of_literals.py").write_text("VALUES = [" + ", ".join(str(7919 * i + 13) for i in range(1, 400)) + "]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "module_of_literals", raising=False)
    importlib.import_module("module_of_literals")
    record()
    assert drawn == first
    assert not {7919 * i + 13 for i in range(1, 400)} & set(drawn)
