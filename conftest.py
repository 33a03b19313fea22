"""Repository-level pytest configuration: this suite's Hypothesis profile; for checking
that no test depends on it, torch's intra-op thread count; and what keeps tests from
depending on the machine, the terminal or each other (no terminal variables, and process
state left as found)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

import dpverify.profiles  # noqa: F401  (registers the dpverify-* profiles)

# The suite runs under the derandomized CI profile unless a profile is asked for.
if "HYPOTHESIS_PROFILE" not in os.environ:
    settings.load_profile("dpverify-ci")


def _no_source_constants() -> None:
    """Makes a derandomized test draw the same examples whatever its process imported.

    Hypothesis (6.13x and later) draws about one choice in twenty from the number and string
    literals of the *local* modules loaded at that moment (``_get_local_constants`` in
    ``hypothesis/internal/conjecture/providers.py``: every loaded module outside the
    standard library and site-packages, dpverify and the modules a test writes into its
    temporary directory among them). Which of those an xdist worker has loaded depends on
    the tests it ran before, so the same test drew other examples from run to run (a
    pipeline Adam example failed after three other test files and passed alone). The pool
    is emptied here; the global constants Hypothesis ships stay. Fuzzing sessions keep it.
    """
    from hypothesis.internal.conjecture import providers

    empty = vars(providers).get("Constants")  # the pool's class: called bare, an empty pool
    if empty is not None and hasattr(providers, "_get_local_constants"):
        providers._get_local_constants = empty


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


#: Runs the suite with this many torch intra-op threads in every process (xdist workers
#: read it too): a test must not depend on the bits one thread count produces.
THREADS_VARIABLE = "DPVERIFY_TEST_THREADS"


def requested_threads() -> int | None:
    """The thread count ``DPVERIFY_TEST_THREADS`` asks for, or None when it is unset.

    Raises:
        pytest.UsageError: The value is not a positive integer.
    """
    value = os.environ.get(THREADS_VARIABLE, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise pytest.UsageError(f"{THREADS_VARIABLE}={value!r}: give a positive number of torch threads, e.g. {THREADS_VARIABLE}=1")
    return int(value)


#: What the user's terminal tells rich (the command line's colour and width). A test that
#: reads the CLI's output must not pass or fail by them; one that tests them sets them.
TERMINAL_VARIABLES = (
    "FORCE_COLOR",
    "NO_COLOR",
    "TTY_COMPATIBLE",
    "TTY_INTERACTIVE",
    "COLUMNS",
    "LINES",
    "JUPYTER_COLUMNS",
    "JUPYTER_LINES",
)


@pytest.fixture(autouse=True)
def _plain_terminal() -> Iterator[None]:
    """Every test, and every process it starts, sees none of ``TERMINAL_VARIABLES``: the
    CLI writes plain text 100 columns wide, whatever the terminal of the run (FORCE_COLOR=1
    in a shell's profile made every test that reads the CLI's output fail).

    A MonkeyPatch of its own, not the ``monkeypatch`` fixture: requesting that here would set
    it up before ``_process_state_left_as_found`` and undo a test's ``monkeypatch.chdir``
    only after the guard has looked.
    """
    with pytest.MonkeyPatch.context() as patch:
        for name in TERMINAL_VARIABLES:
            patch.delenv(name, raising=False)
        yield


def _process_state() -> dict[str, Any]:
    """What a test could change for every later test of its process: the current directory,
    the Hypothesis profile and, once torch is imported, its process-wide settings."""
    state: dict[str, Any] = {"os.getcwd()": os.getcwd(), "the Hypothesis profile": settings.get_current_profile_name()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state |= {
            "torch.get_num_threads()": torch.get_num_threads(),
            "torch.get_default_dtype()": torch.get_default_dtype(),
            "torch.is_grad_enabled()": torch.is_grad_enabled(),
            "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
            "torch.is_anomaly_enabled()": torch.is_anomaly_enabled(),
            "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        }
    return state


@pytest.fixture(autouse=True)
def _process_state_left_as_found() -> Iterator[None]:
    """Fails a test that leaves the current directory, the Hypothesis profile or torch's
    thread count, default dtype, grad mode or determinism changed: the tests after it in
    the same process (an xdist worker runs many) would pass or fail by the order they run
    in."""
    before = _process_state()
    yield
    after = _process_state()
    changed = [f"{name} is {after[name]!r}, was {value!r}" for name, value in before.items() if after[name] != value]
    if changed:
        pytest.fail(f"the test left process-wide state changed ({'; '.join(changed)}): restore it in a finally or with monkeypatch", pytrace=False)


def pytest_report_header(config: pytest.Config) -> str | None:
    threads = requested_threads()
    return None if threads is None else f"torch threads: {threads} ({THREADS_VARIABLE})"


def pytest_configure(config: pytest.Config) -> None:
    threads = requested_threads()
    if threads is not None:
        import torch  # only when asked: a plain run imports torch when a test does

        torch.set_num_threads(threads)
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
    if settings.get_current_profile_name() == "dpverify-ci":
        _no_source_constants()


@pytest.fixture(autouse=True)
def _cpu_tier_sees_no_cuda(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test but the ``multigpu`` ones runs as on a machine without CUDA.

    The CPU tier's assertions are about the CPU model (virtual devices, sparse virtual ids,
    gloo ranks); on a GPU machine dpverify would put the same checks on the real devices,
    refuse ids beyond them and choose nccl. ``DPVERIFY_GPUS=0`` (read by
    ``dpverify.core.devices.cuda_device_count``, and inherited by the processes a test
    starts) keeps the tier the same on every machine; the ``multigpu`` tests see the GPUs.
    A MonkeyPatch of its own, as ``_plain_terminal`` has.
    """
    with pytest.MonkeyPatch.context() as patch:
        if request.node.get_closest_marker("multigpu") is None:
            patch.setenv("DPVERIFY_GPUS", "0")
        yield
