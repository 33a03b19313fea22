"""Tests of the dpverify pytest plugin, run in nested pytest sessions with ``pytester``.

The nested sessions run in this process (``runpytest_inprocess``), so the plugin module they
load is the one imported here: patching its ``_real_cuda_count`` decides how many CUDA
devices they see, on any machine, and patching its ``_imported_torch`` makes them behave as
in a fresh process, where torch is not imported yet. The tests of what a session imports
run pytest in a subprocess (``runpytest_subprocess``), whose ``sys.modules`` is its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points

import pytest
import torch  # imported before any nested session: see below
from hypothesis import core, settings

import pytest_dpverify

pytest_plugins = ["pytester"]

# torch is imported here, before any nested session: pytester restores sys.modules after
# each in-process run, and a torch imported inside one would be dropped and imported again
# by the next (its C extension cannot be initialised twice: SystemError, then a segfault).

REAL_CUDA_COUNT = pytest_dpverify._real_cuda_count

# A subprocess session loads the plugin through its pytest11 entry point when dpverify is
# installed, as a user's session does; from a source tree, through -p. Passing -p as well as
# the entry point would register the module twice, which pluggy refuses.
_ENTRY_POINT = any(ep.value == pytest_dpverify.__name__ for ep in entry_points(group="pytest11"))
PLUGIN_ARGS: tuple[str, ...] = (
    ()
    if _ENTRY_POINT and not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    else ("-p", pytest_dpverify.__name__)
)

MARKED_TESTS = """
import pytest

@pytest.mark.multigpu
def test_default():
    pass

@pytest.mark.multigpu(4)
def test_positional():
    pass

@pytest.mark.multigpu(n=3)
def test_keyword():
    pass

def test_plain():
    pass
"""

SETTINGS_PROBE = """
from hypothesis import settings

def test_probe():
    current = settings()
    print(
        f"PROBE profile={settings.get_current_profile_name()} "
        f"max_examples={current.max_examples} derandomize={current.derandomize} "
        f"deadline={current.deadline} print_blob={current.print_blob}"
    )
"""


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No CUDA devices, no dpverify or Hypothesis variables, Hypothesis' default profile.

    Hypothesis keeps its profile and ``--hypothesis-seed`` in globals that a nested session
    changes; they are put back after each test.
    """
    for name in ("CUDA_VISIBLE_DEVICES", "DPVERIFY_GPUS", "HYPOTHESIS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pytest_dpverify, "_real_cuda_count", lambda: 0)
    profile, seed = settings.get_current_profile_name(), core.global_force_seed
    settings.load_profile("default")
    yield
    settings.load_profile(profile)
    core.global_force_seed = seed


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Sets how many CUDA devices nested sessions see."""

    def fake(count: int) -> None:
        monkeypatch.setattr(pytest_dpverify, "_real_cuda_count", lambda: count)

    return fake


@pytest.fixture
def torch_not_imported(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Nested sessions behave as if torch were not imported; returns the counts they compute.

    Each time a nested session asks for the real device count (which imports torch in a
    fresh process), 0 is appended to the list.
    """
    counts: list[int] = []

    def count() -> int:
        counts.append(0)
        return 0

    monkeypatch.setattr(pytest_dpverify, "_imported_torch", lambda: None)
    monkeypatch.setattr(pytest_dpverify, "_real_cuda_count", count)
    return counts


# The multigpu marker


def test_marker_skips_at_collection_with_needed_and_found(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest_inprocess("-rs", "--strict-markers", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["*4 tests collected*"])
    result = pytester.runpytest_inprocess("-rs", "--strict-markers")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] *: needs 2 CUDA devices, found 0",
            "SKIPPED [[]1[]] *: needs 4 CUDA devices, found 0",
            "SKIPPED [[]1[]] *: needs 3 CUDA devices, found 0",
        ]
    )


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.multigpu(n=2): the test needs n distinct CUDA*"])


def test_dash_m_multigpu_selects_exactly_the_marked_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest_inprocess("-m", "multigpu", "--strict-markers", "-v")
    result.assert_outcomes(skipped=3, deselected=1)
    assert "test_plain" not in result.stdout.str()
    result = pytester.runpytest_inprocess("-m", "not multigpu", "--strict-markers")
    result.assert_outcomes(passed=1, deselected=3)


def test_marked_tests_run_when_the_devices_are_visible(
    pytester: pytest.Pytester, fake_gpus: Callable[[int], None]
) -> None:
    fake_gpus(3)
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest_inprocess("-rs", "--strict-markers")
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * needs 4 CUDA devices, found 3"])


@pytest.mark.parametrize(
    ("marker", "problem"),
    [
        ("multigpu(0)", "n=0; pass a positive int*"),
        ("multigpu(n=-1)", "n=-1; pass a positive int*"),
        ("multigpu('2')", "n='2'; pass a positive int*"),
        ("multigpu(True)", "n=True; pass a positive int*"),
        ("multigpu(2, 3)", "takes one argument, n,*"),
        ("multigpu(m=2)", "takes one argument, n,*"),
    ],
)
def test_bad_marker_arguments_are_a_collection_error(
    pytester: pytest.Pytester, marker: str, problem: str
) -> None:
    pytester.makepyfile(
        test_bad=f"""
        import pytest

        @pytest.mark.{marker}
        def test_needs_gpus():
            pass
        """
    )
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR collecting test_bad.py*",
            f"test_bad.py::test_needs_gpus: @pytest.mark.{marker}: {problem}",
        ]
    )


def test_ctrl_c_while_collecting_is_pytest_s_to_report(pytester: pytest.Pytester) -> None:
    # The collection wrapper used to re-raise it from its teardown, and pluggy then warned
    # that "Plugin: dpverify" raised (a Ctrl-C while hypothesis fuzz collects, too).
    pytester.makepyfile(test_stopped="raise KeyboardInterrupt")
    # no_reraise_ctrlc: pytester would raise the nested run's Ctrl-C in this session
    result = pytester.runpytest_inprocess(
        "-W", "error::pluggy.PluggyTeardownRaisedWarning", no_reraise_ctrlc=True
    )
    assert result.ret == pytest.ExitCode.INTERRUPTED
    output = result.stdout.str() + result.stderr.str()
    assert "PluggyTeardownRaisedWarning" not in output
    assert "Plugin: dpverify" not in output


# --dpverify-gpus and DPVERIFY_GPUS


def test_option_caps_the_devices_used(
    pytester: pytest.Pytester, fake_gpus: Callable[[int], None]
) -> None:
    fake_gpus(4)
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest_inprocess("-rs", "--dpverify-gpus", "2")
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines_random(
        ["SKIPPED * needs 4 CUDA devices, found 2", "SKIPPED * needs 3 CUDA devices, found 2"]
    )


def test_env_var_caps_the_devices_used(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, fake_gpus: Callable[[int], None]
) -> None:
    fake_gpus(4)
    monkeypatch.setenv("DPVERIFY_GPUS", "0")
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest_inprocess("-rs")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(["SKIPPED * needs 2 CUDA devices, found 0"])


def test_option_wins_over_env_var(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, fake_gpus: Callable[[int], None]
) -> None:
    fake_gpus(4)
    monkeypatch.setenv("DPVERIFY_GPUS", "0")
    pytester.makepyfile("def test_count(gpu_count):\n    assert gpu_count == 3\n")
    pytester.runpytest_inprocess("--dpverify-gpus=3").assert_outcomes(passed=1)


def test_the_option_reaches_dpverify_itself_and_is_put_back(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, fake_gpus: Callable[[int], None]
) -> None:
    """``--dpverify-gpus 0`` caps dpverify's own device count too (virtual devices, gloo
    ranks), not only the plugin's skips and fixtures; the variable is restored after."""
    fake_gpus(2)
    monkeypatch.setenv("DPVERIFY_GPUS", "1")
    pytester.makepyfile(
        "import os\n"
        "from dpverify.core.devices import cuda_device_count\n"
        "def test_cap():\n"
        "    assert os.environ['DPVERIFY_GPUS'] == '0'\n"
        "    assert cuda_device_count() == 0\n"
    )
    pytester.runpytest_inprocess("--dpverify-gpus", "0").assert_outcomes(passed=1)
    assert os.environ["DPVERIFY_GPUS"] == "1"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["--dpverify-gpus", "2"],
            None,
            "--dpverify-gpus 2 asks for 2 CUDA devices but only 1 is*",
        ),
        ([], "3", "DPVERIFY_GPUS=3 asks for 3 CUDA devices but only 1 is visible*pass at most 1"),
        (["--dpverify-gpus", "-1"], None, "--dpverify-gpus=-1 is negative; pass the number*"),
        (["--dpverify-gpus", "two"], None, "--dpverify-gpus='two' is not an integer; pass*"),
        ([], "x", "DPVERIFY_GPUS='x' is not an integer; pass*"),
    ],
)
def test_bad_override_is_a_usage_error(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    torch_not_imported: list[int],
    fake_gpus: Callable[[int], None],
    args: list[str],
    env: str | None,
    message: str,
) -> None:
    fake_gpus(1)
    if env is not None:
        monkeypatch.setenv("DPVERIFY_GPUS", env)
    pytester.makepyfile("def test_count(gpu_count):\n    pass\n")
    result = pytester.runpytest_inprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])


def test_impossible_override_is_not_checked_when_no_test_uses_dpverify(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, torch_not_imported: list[int]
) -> None:
    # Checking it needs torch, which such a session must not import.
    monkeypatch.setenv("DPVERIFY_GPUS", "3")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.runpytest_inprocess().assert_outcomes(passed=1)
    assert torch_not_imported == []


def test_impossible_override_with_torch_imported_is_a_usage_error_at_the_header(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPVERIFY_GPUS", "3")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: DPVERIFY_GPUS=3 asks for 3 CUDA devices but only 0*"])


# Fixtures


def test_fixtures_without_devices(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        def test_gpu_count(gpu_count):
            assert gpu_count == 0

        def test_dp_devices_are_virtual(dp_devices):
            assert dp_devices == [0, 1]

        @pytest.mark.parametrize("dp_devices", [1, 3], indirect=True)
        def test_dp_devices_indirect(dp_devices):
            assert dp_devices == list(range(len(dp_devices)))
            assert len(dp_devices) in (1, 3)

        def test_cuda_device_ids(cuda_device_ids):
            raise AssertionError("ran without CUDA devices")
        """
    )
    result = pytester.runpytest_inprocess("-rs")
    result.assert_outcomes(passed=4, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * needs 2 CUDA devices, found 0"])


def test_fixtures_with_devices(pytester: pytest.Pytester, fake_gpus: Callable[[int], None]) -> None:
    fake_gpus(3)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.multigpu(3)
        def test_ids(gpu_count, cuda_device_ids, dp_devices):
            assert gpu_count == 3
            assert cuda_device_ids == dp_devices == [0, 1, 2]

        def test_default_ids(cuda_device_ids, dp_devices):
            assert cuda_device_ids == dp_devices == [0, 1]
        """
    )
    pytester.runpytest_inprocess().assert_outcomes(passed=2)


def test_dp_devices_avoid_devices_hidden_by_the_option(
    pytester: pytest.Pytester, fake_gpus: Callable[[int], None]
) -> None:
    # data_parallel would run [0, 1] on the real devices the option hides.
    fake_gpus(4)
    pytester.makepyfile("def test_ids(dp_devices):\n    assert dp_devices == [4, 5]\n")
    pytester.runpytest_inprocess("--dpverify-gpus", "1").assert_outcomes(passed=1)


def test_dp_devices_rejects_a_bad_indirect_parameter(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("dp_devices", [0], indirect=True)
        def test_ids(dp_devices):
            pass
        """
    )
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*ValueError: n=0; pass a positive int*"])


def test_dp_devices_work_with_data_parallel_on_this_machine(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pytest_dpverify, "_real_cuda_count", REAL_CUDA_COUNT)
    pytester.makepyfile(
        """
        import torch
        import dpverify

        def test_step(dp_devices, gpu_count):
            module = torch.nn.Linear(3, 2)
            real = gpu_count >= len(dp_devices)
            if real:
                module = module.cuda(dp_devices[0])
            model = dpverify.data_parallel(module, dp_devices)
            assert isinstance(model, dpverify.VirtualDataParallel) is not real
            batch = torch.randn(4, 3, device=next(module.parameters()).device)
            assert model(batch).shape == (4, 2)
        """
    )
    pytester.runpytest_inprocess().assert_outcomes(passed=1)


# Report header. In this process torch is imported, so the header shows the devices; the
# torch_not_imported tests show what a fresh process does.


def test_header_shows_devices_profile_and_seed_when_torch_is_imported(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest_inprocess()
    result.stdout.fnmatch_lines(
        [
            f"dpverify: torch {torch.__version__}, CUDA devices 0 (CUDA_VISIBLE_DEVICES unset), "
            "hypothesis profile default, seed random"
        ]
    )


def test_header_shows_the_override_and_visible_devices(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, fake_gpus: Callable[[int], None]
) -> None:
    fake_gpus(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    result = pytester.runpytest_inprocess(
        "--dpverify-gpus", "1", "--hypothesis-profile", "dpverify-ci"
    )
    result.stdout.fnmatch_lines(
        [
            "dpverify: torch *, CUDA devices 1 of 4 "
            "(--dpverify-gpus 1, CUDA_VISIBLE_DEVICES='0,1,2,3'), "
            "hypothesis profile dpverify-ci, seed derandomized"
        ]
    )


def test_header_shows_the_hypothesis_seed(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess("--hypothesis-seed", "1234")
    result.stdout.fnmatch_lines(["dpverify: *, hypothesis profile default, seed 1234"])


PLAIN_TEST = "def test_plain():\n    pass\n"


@pytest.mark.parametrize(
    ("source", "args"),
    [
        (MARKED_TESTS, ()),
        ("def test_count(gpu_count):\n    pass\n", ()),
        ("def test_ids(dp_devices):\n    pass\n", ()),
        ("def test_pool(ddp_pool):\n    pass\n", ()),
        ("def test_pools(ddp_pools):\n    pass\n", ()),
        (
            "import pytest\n\n@pytest.fixture\ndef ranks(gpu_count):\n    return gpu_count\n\n"
            "def test_ranks(ranks):\n    pass\n",
            (),
        ),
        (MARKED_TESTS, ("-m", "multigpu")),
    ],
    ids=["marker", "gpu_count", "dp_devices", "ddp_pool", "ddp_pools", "indirect", "-m multigpu"],
)
def test_a_test_that_uses_dpverify_shows_the_devices_after_collection(
    pytester: pytest.Pytester,
    torch_not_imported: list[int],
    source: str,
    args: tuple[str, ...],
) -> None:
    pytester.makepyfile(source)
    result = pytester.runpytest_inprocess("--collect-only", *args)
    result.stdout.fnmatch_lines(
        [
            "dpverify: torch not imported, hypothesis profile default, seed random",
            "collected *",
            f"dpverify: torch {torch.__version__}, CUDA devices 0 (CUDA_VISIBLE_DEVICES unset)",
        ]
    )
    assert torch_not_imported == [0]


@pytest.mark.parametrize(
    ("source", "args"),
    [
        (PLAIN_TEST, ()),
        (MARKED_TESTS, ("-m", "not multigpu")),
        (MARKED_TESTS, ("-k", "plain")),
    ],
    ids=["plain", "-m not multigpu", "-k plain"],
)
def test_a_session_that_does_not_use_dpverify_computes_no_devices(
    pytester: pytest.Pytester,
    torch_not_imported: list[int],
    source: str,
    args: tuple[str, ...],
) -> None:
    pytester.makepyfile(source)
    result = pytester.runpytest_inprocess(*args)
    result.assert_outcomes(passed=1, deselected=0 if source == PLAIN_TEST else 3)
    result.stdout.fnmatch_lines(["dpverify: torch not imported, hypothesis profile default, *"])
    result.stdout.no_fnmatch_line("*CUDA devices*")
    assert torch_not_imported == []


def test_devices_after_collection_only_with_the_header(
    pytester: pytest.Pytester, torch_not_imported: list[int]
) -> None:
    pytester.makepyfile(MARKED_TESTS)
    for args in (["-q"], ["--no-header"]):
        result = pytester.runpytest_inprocess("-rs", *args)
        result.assert_outcomes(passed=1, skipped=3)
        result.stdout.no_fnmatch_line("dpverify: *")


def test_fixtures_are_the_plugins_fixtures(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess("--fixtures", "-p", "no:hypothesispytest")
    listed = set(result.stdout.str().split())
    assert pytest_dpverify.FIXTURES.issubset(listed)
    defined = {
        name
        for name, value in vars(pytest_dpverify).items()
        if type(value).__name__ == "FixtureFunctionDefinition"
    }
    assert defined == pytest_dpverify.FIXTURES


# What a session imports, in a fresh process


def test_a_session_that_does_not_use_dpverify_imports_no_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import sys

        def test_plain():
            assert "torch" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS)
    result.assert_outcomes(passed=1)
    # The plugin was loaded and its header hook ran (pytest calls it unless -q).
    result.stdout.fnmatch_lines(["dpverify: torch not imported, hypothesis profile *"])
    result.stdout.no_fnmatch_line("*CUDA devices*")


def test_a_session_with_a_multigpu_test_shows_the_devices_after_collection(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # 0 devices, on any machine
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-rs")
    result.stdout.fnmatch_lines(
        [
            "dpverify: torch not imported, hypothesis profile *",
            "collected 4 items",
            f"dpverify: torch {torch.__version__}, CUDA devices 0 (CUDA_VISIBLE_DEVICES='')",
        ]
    )
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(["SKIPPED * needs 2 CUDA devices, found 0"])


# Hypothesis profiles


def test_profiles_are_registered_at_import() -> None:
    dev = settings.get_profile("dpverify-dev")
    ci = settings.get_profile("dpverify-ci")
    fuzz = settings.get_profile("dpverify-fuzz")
    assert (dev.max_examples, dev.deadline) == (10, None)
    assert (ci.derandomize, ci.deadline, ci.print_blob, ci.database) == (True, None, True, None)
    assert (fuzz.max_examples, fuzz.deadline, fuzz.print_blob) == (10_000, None, True)


def test_hypothesis_profile_option_selects_a_dpverify_profile(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SETTINGS_PROBE)
    result = pytester.runpytest_inprocess("-s", "--hypothesis-profile", "dpverify-ci")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*PROBE profile=dpverify-ci max_examples=25 derandomize=True deadline=None "
            "print_blob=True*"
        ]
    )


def test_hypothesis_profile_env_var_selects_a_profile_for_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "dpverify-fuzz")
    pytester.makepyfile(SETTINGS_PROBE)
    result = pytester.runpytest_inprocess("-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*PROBE profile=dpverify-fuzz max_examples=10000 derandomize=False deadline=None*"]
    )
    assert settings.get_current_profile_name() == "default"  # put back at unconfigure


def test_hypothesis_profile_option_wins_over_env_var(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "dpverify-fuzz")
    pytester.makepyfile(SETTINGS_PROBE)
    result = pytester.runpytest_inprocess("-s", "--hypothesis-profile", "dpverify-dev")
    result.stdout.fnmatch_lines(["*PROBE profile=dpverify-dev max_examples=10 *"])


def test_unknown_hypothesis_profile_env_var_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "dpverify-nightly")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: HYPOTHESIS_PROFILE='dpverify-nightly': *; dpverify registers dpverify-dev, *"]
    )


# Importing the plugin


def _modules_after(code: str) -> set[str]:
    """Imports in a fresh interpreter, then returns the names in its ``sys.modules``."""
    probe = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return set(run.stdout.split())


def test_importing_the_plugin_imports_neither_torch_nor_dpverify() -> None:
    # pytest imports the plugin in every session of the environment: it imports no torch,
    # and of dpverify only the lazy package __init__ and the Hypothesis profiles.
    modules = _modules_after("import pytest_dpverify")
    assert "pytest_dpverify" in modules
    assert "torch" not in modules
    assert {name for name in modules if name == "dpverify" or name.startswith("dpverify.")} == {"dpverify", "dpverify.profiles"}
