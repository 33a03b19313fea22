"""Fuzzing the property suite with HypoFuzz works as the README says, while the suite itself
stays derandomized."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import settings

from conftest import under_hypofuzz

ROOT = Path(__file__).resolve().parent.parent


def test_the_suite_runs_derandomized() -> None:
    if "HYPOTHESIS_PROFILE" in os.environ:
        pytest.skip(f"a profile was asked for: HYPOTHESIS_PROFILE={os.environ['HYPOTHESIS_PROFILE']}")
    assert settings.default.derandomize


def test_hypofuzz_s_collection_is_recognised_by_its_collector_plugin() -> None:
    collector = type("_ItemsCollector", (), {"__module__": "hypofuzz.collection"})()

    def config(*plugins: object) -> pytest.Config:
        manager = SimpleNamespace(get_plugins=lambda: set(plugins))
        return SimpleNamespace(pluginmanager=manager)  # type: ignore[return-value]

    assert under_hypofuzz(config(object(), collector))
    assert not under_hypofuzz(config(object(), sys.modules[__name__]))


@pytest.mark.timeout(180)
def test_hypothesis_fuzz_collects_and_fuzzes_the_property_suite(tmp_path: Path) -> None:
    pytest.importorskip("hypofuzz", reason="hypofuzz is a test extra: pip install '.[test]'")
    hypothesis = Path(sys.executable).with_name("hypothesis")
    command = [str(hypothesis), "fuzz", "-n", "1", "--no-dashboard", "--", str(ROOT / "tests" / "test_properties.py")]
    env = {key: value for key, value in os.environ.items() if key != "HYPOTHESIS_PROFILE"}
    # its own directory: the example database and caches go to tmp_path/.hypothesis
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert process.stdout is not None
    lines: list[str] = []
    try:
        for line in process.stdout:  # it fuzzes until stopped: read until it says what it fuzzes
            lines.append(line)
            if re.search(r"to fuzz \d+ tests", line):
                time.sleep(5)  # a few seconds of fuzzing
                break
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
        try:
            rest, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            rest, _ = process.communicate()
    out = "".join(lines) + rest
    assert "No property-based tests were collected" not in out
    assert "sets_derandomize" not in out
    fuzzed = re.search(r"to fuzz (\d+) tests", out)
    assert fuzzed is not None, out[-3000:]
    assert int(fuzzed.group(1)) >= 5  # the property suite's tests, not a stray one
    assert "Traceback" not in "".join(lines)  # nothing failed before it was stopped
