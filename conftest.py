"""Repository-level pytest configuration: this suite's Hypothesis profile."""

from __future__ import annotations

import os

from hypothesis import settings

import pytest_dpverify  # noqa: F401  (registers the dpverify-* profiles)

# The suite runs under the derandomized CI profile unless a profile is asked for.
if "HYPOTHESIS_PROFILE" not in os.environ:
    settings.load_profile("dpverify-ci")
