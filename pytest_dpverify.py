"""pytest plugin for dpverify, registered through the ``pytest11`` entry point.

A top-level module beside the package: pytest imports every installed plugin in every
session, so this module imports from dpverify only its Hypothesis profiles
(``dpverify.profiles``, which with the lazy ``dpverify/__init__.py`` imports no torch), and
the rest inside the fixtures that need it.

What it adds to a pytest run:

- the marker ``multigpu(n=2)``: the test needs ``n`` distinct CUDA devices. Tests with too few
  devices are skipped at collection with the reason ``needs N CUDA devices, found M``;
- the option ``--dpverify-gpus N`` and the environment variable ``DPVERIFY_GPUS``: use at
  most ``N`` of the CUDA devices torch sees (after ``CUDA_VISIBLE_DEVICES``), in the
  plugin's skips and fixtures and in dpverify itself (the option sets the variable);
- the fixtures ``gpu_count``, ``cuda_device_ids``, ``dp_devices``, ``ddp_pool`` and
  ``ddp_pools``;
- the Hypothesis profiles ``dpverify-dev``, ``dpverify-ci`` and ``dpverify-fuzz``, selected
  with ``--hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE=NAME``;
- a report header line with the devices, the Hypothesis profile and the seed of the run.

Importing this module imports neither torch nor CUDA, and a session imports torch for this
plugin only when a test that will run uses dpverify: it carries the ``multigpu`` marker or
requests one of the plugin's fixtures. Such tests are found at collection, which is when the
device count is first needed (to skip ``multigpu`` tests); the report header shows the
devices when torch was imported before the session started, else after collection, and not
at all when no test uses dpverify and nothing imported torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings
from hypothesis.errors import InvalidArgument

from dpverify.profiles import PROFILES

if TYPE_CHECKING:
    from types import ModuleType

    from pluggy import Result

    from dpverify.ddp.pool import DDPWorkerPool

__all__ = ["PROFILES", "cuda_device_ids", "ddp_pool", "ddp_pools", "dp_devices", "gpu_count"]

GPUS_OPTION = "--dpverify-gpus"
GPUS_ENV = "DPVERIFY_GPUS"
PROFILE_ENV = "HYPOTHESIS_PROFILE"
# Hypothesis' own pytest plugin owns these options (_hypothesis_pytestplugin.py).
_PROFILE_OPTION = "--hypothesis-profile"
_SEED_OPTION = "--hypothesis-seed"
MARKER = "multigpu"
#: Devices a ``multigpu`` test needs when the marker gives no ``n``.
DEFAULT_DEVICES = 2
#: The fixtures this plugin defines: a test that requests one, directly or through another
#: fixture, uses dpverify, and makes the session import torch at collection.
FIXTURES = frozenset({"gpu_count", "cuda_device_ids", "dp_devices", "ddp_pool", "ddp_pools"})



def _real_cuda_count() -> int:
    """Number of CUDA devices torch sees, after ``CUDA_VISIBLE_DEVICES``.

    ``torch.cuda.device_count`` asks NVML before the CUDA runtime, so it neither initialises
    CUDA nor poisons a later fork (torch/cuda/__init__.py, ``device_count``), which the DDP
    worker pools rely on; ``torch.cuda.is_available`` would call ``cudaGetDeviceCount``.
    """
    import torch

    return torch.cuda.device_count()


def _imported_torch() -> ModuleType | None:
    """torch if this process has imported it already, else None; never imports it.

    A session that has torch already pays nothing to show the devices in the report header.
    """
    return sys.modules.get("torch")


def _visible_devices_text() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"


def _plural(count: int) -> str:
    return f"{count} CUDA device" + ("" if count == 1 else "s")


@dataclass
class _Devices:
    """The CUDA devices of one pytest run: what torch sees, and the user's cap on it.

    Attributes:
        override: The ``--dpverify-gpus`` / ``DPVERIFY_GPUS`` value, or None.
        source: Where ``override`` came from, as the user typed it, for messages.
        real: The count torch reports; None until first needed.
    """

    override: int | None = None
    source: str = ""
    real: int | None = None

    def real_count(self) -> int:
        """The count torch reports, computed (and torch imported) on first use."""
        if self.real is None:
            self.real = _real_cuda_count()
        return self.real

    def count(self) -> int:
        """The number of devices tests may use: the override if given, else the real count.

        Raises:
            pytest.UsageError: The override asks for more devices than are visible.
        """
        real = self.real_count()
        if self.override is None:
            return real
        if self.override > real:
            raise pytest.UsageError(
                f"{self.source} asks for {_plural(self.override)} but only {real} "
                f"{'is' if real == 1 else 'are'} visible ({_visible_devices_text()}); "
                f"pass at most {real}"
            )
        return self.override


_DEVICES = pytest.StashKey[_Devices]()
# True while the report header has been shown without the devices (torch was not imported
# yet): the collection report then shows them if a collected test uses dpverify.
_DEVICES_PENDING = pytest.StashKey[bool]()
_RESTORE_PROFILE = pytest.StashKey[str]()
_RESTORE_GPUS_ENV = pytest.StashKey[str | None]()


def _devices(config: pytest.Config) -> _Devices:
    return config.stash[_DEVICES]


def _parse_override(text: str, source: str) -> int:
    """Parses a ``--dpverify-gpus`` / ``DPVERIFY_GPUS`` value.

    Raises:
        pytest.UsageError: ``text`` is not a non-negative integer.
    """
    try:
        value = int(text)
    except ValueError:
        raise pytest.UsageError(
            f"{source}={text!r} is not an integer; pass the number of CUDA devices to use, "
            "such as 0 or 2"
        ) from None
    if value < 0:
        raise pytest.UsageError(
            f"{source}={value} is negative; pass the number of CUDA devices to use, such as 0 or 2"
        )
    return value


def _read_devices(config: pytest.Config) -> _Devices:
    """The override from the command line, else from the environment, else none."""
    option = config.getoption("dpverify_gpus")
    if option is not None:
        return _Devices(_parse_override(option, GPUS_OPTION), f"{GPUS_OPTION} {option}")
    env = os.environ.get(GPUS_ENV, "")
    if env.strip():
        return _Devices(_parse_override(env, GPUS_ENV), f"{GPUS_ENV}={env}")
    return _Devices()


def _positive_devices(n: object) -> int:
    """Checks a number of devices a test asks for.

    Raises:
        ValueError: ``n`` is not a positive int.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}; pass a positive int, the number of CUDA devices the test needs")
    return n


def _marker_devices(marker: pytest.Mark) -> int:
    """The ``n`` of a ``multigpu`` marker: ``multigpu``, ``multigpu(4)`` or ``multigpu(n=4)``.

    Raises:
        ValueError: The marker's arguments are not a single positive int ``n``.
    """
    if set(marker.kwargs) - {"n"} or len(marker.args) + len(marker.kwargs) > 1:
        raise ValueError("takes one argument, n, the number of CUDA devices the test needs")
    return _positive_devices(
        marker.args[0] if marker.args else marker.kwargs.get("n", DEFAULT_DEVICES)
    )


def _needed_devices(node: pytest.Item) -> int:
    """Devices the test needs: its ``multigpu`` marker's ``n``, else ``DEFAULT_DEVICES``."""
    marker = node.get_closest_marker(MARKER)
    return DEFAULT_DEVICES if marker is None else _marker_devices(marker)


def _uses_dpverify(item: pytest.Item) -> bool:
    """Whether the test carries the ``multigpu`` marker or requests a dpverify fixture."""
    if item.get_closest_marker(MARKER) is not None:
        return True
    # fixturenames is the closure: a fixture of the project that requests gpu_count counts.
    return not FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def _skip_reason(needed: int, found: int) -> str:
    return f"needs {needed} CUDA devices, found {found}"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Adds ``--dpverify-gpus``."""
    group = parser.getgroup("dpverify", "dpverify (data-parallel correctness)")
    group.addoption(
        GPUS_OPTION,
        dest="dpverify_gpus",
        metavar="N",
        default=None,
        help=(
            "use at most N of the visible CUDA devices: multigpu tests that need more are "
            f"skipped and dp_devices gives virtual ids (default: all; env: {GPUS_ENV})"
        ),
    )


def _load_profile_from_env(config: pytest.Config) -> None:
    """Loads ``HYPOTHESIS_PROFILE`` unless ``--hypothesis-profile`` was given.

    Raises:
        pytest.UsageError: No Hypothesis profile has that name.
    """
    name = os.environ.get(PROFILE_ENV, "").strip()
    if not name or config.getoption(_PROFILE_OPTION, default=None):
        return
    try:
        settings.get_profile(name)
    except InvalidArgument as error:
        raise pytest.UsageError(
            f"{PROFILE_ENV}={name!r}: {error}; dpverify registers {', '.join(PROFILES)}"
        ) from None
    config.stash[_RESTORE_PROFILE] = settings.get_current_profile_name()
    settings.load_profile(name)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Registers the marker, reads the device override and loads ``HYPOTHESIS_PROFILE``.

    Runs before Hypothesis' own ``pytest_configure``, which derives its
    ``--hypothesis-verbosity`` profile from the profile loaded here.

    An override that is not a non-negative integer is an error here. One that asks for more
    devices than are visible is an error when the count is first needed (at collection, when
    a test uses dpverify): checking it needs torch, which a session that does not use
    dpverify must not import.

    Raises:
        pytest.UsageError: A malformed ``--dpverify-gpus`` or ``DPVERIFY_GPUS`` value, or a
            bad ``HYPOTHESIS_PROFILE`` value.
    """
    config.addinivalue_line(
        "markers",
        f"{MARKER}(n={DEFAULT_DEVICES}): the test needs n distinct CUDA devices; skipped at "
        f"collection when fewer are visible (see {GPUS_OPTION})",
    )
    config.stash[_DEVICES] = devices = _read_devices(config)
    option = config.getoption("dpverify_gpus")
    if option is not None:
        # dpverify's engine reads the cap from the environment (dpverify.core.devices), in
        # this process and in every process a test starts
        config.stash[_RESTORE_GPUS_ENV] = os.environ.get(GPUS_ENV)
        os.environ[GPUS_ENV] = str(devices.override)
    _load_profile_from_env(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Restores the Hypothesis profile replaced for ``HYPOTHESIS_PROFILE`` and the
    ``DPVERIFY_GPUS`` set for ``--dpverify-gpus`` (nested runs)."""
    previous = config.stash.get(_RESTORE_PROFILE, None)
    if previous is not None:
        settings.load_profile(previous)
    if _RESTORE_GPUS_ENV in config.stash:
        env = config.stash[_RESTORE_GPUS_ENV]
        if env is None:
            os.environ.pop(GPUS_ENV, None)
        else:
            os.environ[GPUS_ENV] = env


def _seed_text(config: pytest.Config) -> str:
    seed = config.getoption(_SEED_OPTION, default=None)
    if seed is not None:
        return f"seed {seed}"
    return "seed derandomized" if settings().derandomize else "seed random"


def _devices_text(config: pytest.Config, torch_version: str) -> str:
    """torch's version and the devices of the run, as the report shows them.

    Raises:
        pytest.UsageError: The override asks for more devices than are visible.
    """
    devices = _devices(config)
    count = devices.count()
    if devices.override is None:
        seen = f"CUDA devices {count} ({_visible_devices_text()})"
    else:
        seen = (
            f"CUDA devices {count} of {devices.real_count()} "
            f"({devices.source}, {_visible_devices_text()})"
        )
    return f"torch {torch_version}, {seen}"


def pytest_report_header(config: pytest.Config) -> str:
    """One line with what a run needs to be reproduced: devices, Hypothesis profile, seed.

    The devices only if torch is imported already: importing it here would cost every
    session in the environment seconds. Otherwise the line says so, and the collection
    report adds the devices if a test uses dpverify.

    Raises:
        pytest.UsageError: torch is imported and the override asks for more devices than
            are visible.
    """
    profile = f"hypothesis profile {settings.get_current_profile_name()}, {_seed_text(config)}"
    torch = _imported_torch()
    config.stash[_DEVICES_PENDING] = torch is None
    if torch is None:
        return f"dpverify: torch not imported, {profile}"
    return f"dpverify: {_devices_text(config, torch.__version__)}, {profile}"


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    """The devices the header left out, once collection has imported torch.

    Nothing when the header was not shown (``-q``, ``--no-header``) or already had them,
    or when no collected test uses dpverify and nothing else imported torch.

    Raises:
        pytest.UsageError: The override asks for more devices than are visible.
    """
    if not config.stash.get(_DEVICES_PENDING, False):
        return []
    if _devices(config).real is None and _imported_torch() is None:
        return []
    config.stash[_DEVICES_PENDING] = False
    # Collection computed the count (which imports torch) or imported torch: this is free.
    import torch

    return [f"dpverify: {_devices_text(config, torch.__version__)}"]


def _marker_problem(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    try:
        _marker_devices(marker)
    except ValueError as error:
        return f"{item.nodeid}: @pytest.mark.{MARKER}{_marker_args(marker)}: {error}"
    return None


def _marker_args(marker: pytest.Mark) -> str:
    args = [repr(a) for a in marker.args] + [f"{k}={v!r}" for k, v in marker.kwargs.items()]
    return f"({', '.join(args)})" if args else ""


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, Result[pytest.CollectReport], None]:
    """Turns a malformed ``multigpu`` marker into a collection error of its module.

    A hook wrapper, not ``pytest_collection_modifyitems``: an exception there is an internal
    error, while a failed collect report is shown as ``ERROR collecting <module>``.
    """
    outcome = yield
    if outcome.exception is not None:
        return  # Ctrl-C or an exit while collecting: pytest reports it, not as this hook's
    report = outcome.get_result()
    if not report.passed:
        return
    problems = [
        problem
        for node in report.result
        if isinstance(node, pytest.Item) and (problem := _marker_problem(node)) is not None
    ]
    if problems:
        report.outcome = "failed"
        report.longrepr = "\n".join(problems)
        report.result = []


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips ``multigpu`` tests that need more CUDA devices than the run has.

    The count (and torch) is computed only when a test that will run uses dpverify: the
    hook runs last, after ``-m`` and ``-k`` have deselected tests, so that
    ``-m "not multigpu"`` imports no torch for the marked tests it leaves out. A test that
    only requests a fixture computes it here too, so that an impossible override is a usage
    error before any test runs rather than an error in each fixture.

    Raises:
        pytest.UsageError: The override asks for more devices than are visible.
    """
    if not any(_uses_dpverify(item) for item in items):
        return
    found = _devices(config).count()
    for item in items:
        if item.get_closest_marker(MARKER) is None:
            continue
        needed = _needed_devices(item)
        if needed > found:
            item.add_marker(pytest.mark.skip(reason=_skip_reason(needed, found)))


@pytest.fixture(scope="session")
def gpu_count(pytestconfig: pytest.Config) -> int:
    """The number of CUDA devices tests may use: torch's count, capped by ``--dpverify-gpus``."""
    return _devices(pytestconfig).count()


@pytest.fixture
def cuda_device_ids(request: pytest.FixtureRequest, gpu_count: int) -> list[int]:
    """The first ``n`` CUDA device indices, ``n`` from the test's ``multigpu`` marker (default 2).

    Skips the test, with the marker's reason, when fewer devices are available.
    """
    needed = _needed_devices(request.node)
    if needed > gpu_count:
        pytest.skip(_skip_reason(needed, gpu_count))
    return list(range(needed))


@pytest.fixture
def dp_devices(request: pytest.FixtureRequest, gpu_count: int) -> list[int]:
    """``n`` device ids for ``dpverify.data_parallel``: real CUDA devices if there are enough.

    ``n`` is the fixture's indirect parameter
    (``@pytest.mark.parametrize("dp_devices", [2, 4], indirect=True)``), else the ``n`` of
    the test's ``multigpu`` marker, else 2. The ids are the CUDA indices ``[0, n)`` when the
    run has ``n`` devices, else ids that ``data_parallel`` runs on virtual devices: ``[0, n)``
    too, unless ``--dpverify-gpus`` hides devices that exist. ``data_parallel`` cannot see
    that cap, so the ids then start after the last real device. The ids are real exactly
    when ``gpu_count >= len(dp_devices)``: only then does the module go to CUDA.

    Raises:
        ValueError: The indirect parameter is not a positive int.
    """
    param = getattr(request, "param", None)
    needed = _needed_devices(request.node) if param is None else _positive_devices(param)
    if needed <= gpu_count:
        return list(range(needed))
    real = _devices(request.config).real_count()
    first = real if real >= needed else 0
    return list(range(first, first + needed))


@pytest.fixture(scope="session")
def ddp_pools() -> Iterator[Callable[[int], DDPWorkerPool]]:
    """DDP worker pools by world size, started on first use and shared by the session.

    The DDP checks use the same registry when called with ``pool=None``, so a session has
    one pool per world size, closed (every rank process ended) when the session ends.
    """
    from dpverify.ddp.pool import shared_pools  # torch is imported only when a test asks

    registry = shared_pools()
    yield registry.get
    registry.close()


@pytest.fixture(scope="session")
def ddp_pool(
    request: pytest.FixtureRequest, ddp_pools: Callable[[int], DDPWorkerPool]
) -> DDPWorkerPool:
    """The session's pool of ``request.param`` ranks (default 2); choose the world size with
    ``@pytest.mark.parametrize("ddp_pool", [2, 4], indirect=True)``."""
    return ddp_pools(getattr(request, "param", 2))
