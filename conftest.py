"""Repository-level pytest configuration: this suite's Hypothesis profile."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

import pytest_dpverify  # noqa: F401  (registers the dpverify-* profiles)

# The suite runs under the derandomized CI profile unless a profile is asked for.
if "HYPOTHESIS_PROFILE" not in os.environ:
    settings.load_profile("dpverify-ci")


def under_hypofuzz(config: pytest.Config) -> bool:
    """Whether HypoFuzz is collecting the suite: ``hypothesis fuzz`` runs
    ``pytest --collect-only -m=hypothesis`` with its own collector plugin
    (hypofuzz/collection.py, ``collect_tests`` and ``_ItemsCollector``)."""
    return any(type(plugin).__module__.startswith("hypofuzz") for plugin in config.pluginmanager.get_plugins())


def pytest_configure(config: pytest.Config) -> None:
    # HypoFuzz refuses derandomized tests ("sets_derandomize", hypofuzz/collection.py): a
    # fuzzing session gets the random dpverify-fuzz profile, the suite keeps dpverify-ci.
    if "HYPOTHESIS_PROFILE" not in os.environ and under_hypofuzz(config):
        settings.load_profile("dpverify-fuzz")
