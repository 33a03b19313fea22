"""pytest plugin for dpverify (registered through the ``pytest11`` entry point)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multigpu(n=2): the test needs n distinct CUDA devices")
