"""Repository-level pytest configuration: this suite's Hypothesis profile."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

import pytest_dpverify  # noqa: F401  (registers the dpverify-* profiles)

# The suite runs under the derandomized CI profile unless a profile is asked for.
if "HYPOTHESIS_PROFILE" not in os.environ:
    settings.load_profile("dpverify-ci")


def under_hypofuzz(config: pytest.Config) -> bool:
    """Whether ``hypothesis fuzz`` (HypoFuzz 25.11) is collecting the suite.

    Two signals, either enough. HypoFuzz's documented one, ``in_hypofuzz_run()``
    (hypofuzz/detection.py), is set by the CLI before it collects (hypofuzz/entrypoint.py,
    ``fuzz``: ``detection._in_hypofuzz_run = True``) and by each worker
    (hypofuzz/hypofuzz.py, ``_start_worker``), but not by the dashboard's process, which
    collects too and inherits the flag only when multiprocessing forks. Every collection
    passes HypoFuzz's own plugin to pytest (hypofuzz/collection.py, ``collect_tests``:
    ``pytest.main([..., "--collect-only", "-m=hypothesis", ...], plugins=[collector])``,
    an ``_ItemsCollector``). The module is looked up, not imported: HypoFuzz imports it
    before it collects, and a plain run must not need HypoFuzz installed.
    """
    detection = sys.modules.get("hypofuzz.detection")
    if detection is not None and detection.in_hypofuzz_run():
        return True
    plugins = config.pluginmanager.get_plugins()
    return any(type(plugin).__module__.startswith("hypofuzz.") for plugin in plugins)


def pytest_configure(config: pytest.Config) -> None:
    # HypoFuzz skips derandomized tests ("sets_derandomize", hypofuzz/collection.py,
    # _ItemsCollector.pytest_collection_finish) and says "No property-based tests were
    # collected": a fuzzing session gets the random dpverify-fuzz profile, a plain run keeps
    # dpverify-ci. HYPOTHESIS_PROFILE and --hypothesis-profile still choose.
    if (
        "HYPOTHESIS_PROFILE" not in os.environ
        and not config.getoption("--hypothesis-profile", default=None)
        and under_hypofuzz(config)
    ):
        settings.load_profile("dpverify-fuzz")


@pytest.fixture(autouse=True)
def _cpu_tier_sees_no_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test but the ``multigpu`` ones runs as on a machine without CUDA.

    The CPU tier's assertions are about the CPU model (virtual devices, sparse virtual ids,
    gloo ranks); on a GPU machine dpverify would put the same checks on the real devices,
    refuse ids beyond them and choose nccl. ``DPVERIFY_GPUS=0`` (read by
    ``dpverify.core.devices.cuda_device_count``, and inherited by the subprocesses a test
    starts) keeps the tier the same on every machine; the ``multigpu`` tests see the GPUs.
    """
    if request.node.get_closest_marker("multigpu") is None:
        monkeypatch.setenv("DPVERIFY_GPUS", "0")
