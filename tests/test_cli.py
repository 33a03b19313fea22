"""The command line, run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpverify.cli.main import main

#: User code that misbehaves: wrappers that leave or raise during a check, a factory and
#: batch functions that raise, a module that cannot be imported.
USER_CODE = textwrap.dedent(
    """
    import sys

    import torch
    from torch import nn


    class Quitting(nn.DataParallel):
        def forward(self, *inputs, **kwargs):
            quit()


    class Exiting(nn.DataParallel):
        def forward(self, *inputs, **kwargs):
            sys.exit(0)


    class Raising(nn.DataParallel):
        def forward(self, *inputs, **kwargs):
            raise RuntimeError("the wrapper broke")


    def broken_factory():
        raise RuntimeError("no weights file")


    def linear():
        return nn.Linear(3, 2)


    def broken_inputs(batch_size):
        raise ValueError("no data here")


    def even_inputs(batch_size):
        if batch_size % 2:
            raise ValueError(f"only even batches, not {batch_size}")
        return torch.randn(batch_size, 3), torch.randn(batch_size, 2)
    """
)


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpverify", *args], capture_output=True, text=True, timeout=240, check=False, cwd=cwd)


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "user_code.py").write_text(USER_CODE)
    (tmp_path / "import_fails.py").write_text("import torch\n\nraise RuntimeError('cannot load at import')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_exit_codes_are_the_documented_ones() -> None:
    from dpverify.cli import main as _cli

    codes = (_cli.EXIT_OK, _cli.EXIT_FAILED, _cli.EXIT_USAGE, _cli.EXIT_NOTHING_CHECKED)
    assert codes == (0, 1, 2, 3)
    page = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    for code in codes:
        assert f"| {code} |" in page, f"exit status {code} is not in docs/cli.md's table"


@pytest.mark.timeout(240)
@pytest.mark.deep
def test_verify_prints_a_verdict_and_exits_zero() -> None:
    result = _run("verify")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("dpverify verify: DataParallel on ")
    # nine models, three splits, two checks each: verify is `check` on the built-in models
    assert sum(line.lstrip().startswith("PASS") for line in lines) == 77
    # the loss-in-forward model's loss.mean() on chunks [2, 2, 1] is the trap, as predicted
    warned = [line for line in lines if line.lstrip().startswith("WARN")]
    assert len(warned) == 1
    assert "loss-in-forward  B=5 on 4   loss.mean() of replica losses      biased by +0.133 (chunks [2, 2, 1])" in warned[0]
    assert lines[-1].startswith("OK: 77 passed, 0 failed, 1 warned in ")
    assert result.stderr == ""


@pytest.mark.deep
def test_verify_subset_and_unknown_model() -> None:
    ok = _run("verify", "--models", "conv")
    assert ok.returncode == 0
    assert ok.stdout.splitlines()[-1].startswith("OK: 9 passed, 0 failed")
    bad = _run("verify", "--models", "resnet")
    assert bad.returncode == 2
    assert "unknown --models ['resnet']" in bad.stderr


def test_no_command_prints_help_and_exits_two() -> None:
    result = _run()
    assert result.returncode == 2
    for command in ("verify", "fuzz", "check", "explain"):
        assert command in result.stdout


@pytest.mark.deep
def test_the_console_script_is_python_m_dpverify() -> None:
    import os
    from pathlib import Path

    script = Path(sys.executable).with_name("dpverify")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable}")
    env = {**os.environ, "COLUMNS": "100"}
    by_script = subprocess.run([str(script), "fuzz", "--help"], capture_output=True, text=True, timeout=120, check=False, env=env)
    by_module = subprocess.run([sys.executable, "-m", "dpverify", "fuzz", "--help"], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert by_script.returncode == by_module.returncode == 0
    assert by_script.stdout == by_module.stdout
    assert "--time-budget DURATION" in by_module.stdout


@pytest.mark.deep
def test_verify_a_wrong_wrapper_fails_with_the_reason() -> None:
    result = _run("verify", "--models", "mlp", "--parallel", "dpverify.mutants:AveragingDataParallel")
    assert result.returncode == 1
    assert "FAIL  mlp" in result.stdout
    assert "the replica gradients were averaged" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("FAILED: ")


@pytest.mark.deep
def test_verify_bad_parallel_option() -> None:
    result = _run("verify", "--parallel", "no_such_module:X")
    assert result.returncode == 2
    assert "--parallel 'no_such_module:X': cannot import 'no_such_module'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("import_fails:X", "importing 'import_fails' raised RuntimeError: cannot load at import"),
        ("user_code:USER_CODE_MISSING", "'user_code' has no attribute 'USER_CODE_MISSING'"),
        ("user_code:sys", "--parallel 'user_code:sys' is module, not callable"),
    ],
)
def test_verify_unusable_parallel_is_a_usage_error(user_code: Path, spec: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--models", "mlp", "--parallel", spec]) == 2
    err = capsys.readouterr().err
    assert message in err
    if spec.startswith("import_fails"):
        # the user's own line, not the import machinery or dpverify's frames
        assert "import_fails.py\", line 3" in err
        assert "raise RuntimeError('cannot load at import')" in err
        assert "importlib" not in err
        assert "dpverify/" not in err


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("wrapper", "message"),
    [
        ("Quitting", "SystemExit(None): the code under test called sys.exit(), exit() or quit()"),
        ("Exiting", "SystemExit(0): the code under test called sys.exit(), exit() or quit()"),
        ("Raising", "RuntimeError: the wrapper broke"),
    ],
)
@pytest.mark.deep
def test_a_wrapper_that_leaves_or_raises_fails_its_checks(user_code: Path, wrapper: str, message: str) -> None:
    result = _run("verify", "--models", "mlp", "--parallel", f"user_code:{wrapper}", cwd=user_code)
    assert result.returncode == 1, result.stdout + result.stderr
    failures = [line.rstrip() for line in result.stdout.splitlines() if line.lstrip().startswith("FAIL  mlp")]
    assert len(failures) == 9
    assert all(line.endswith(message) for line in failures), failures
    # the report names the check and shows the user's frame
    assert "--- mlp, B=8 on 2: DP grads match one device" in result.stdout
    assert "user_code.py\", line" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("FAILED: 0 passed, 9 failed")


def test_a_factory_that_raises_is_a_usage_error_with_its_frames(user_code: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "user_code:broken_factory"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpverify check: MODULE:FACTORY 'user_code:broken_factory' raised RuntimeError: no weights file")
    assert 'raise RuntimeError("no weights file")' in err
    assert "user_code.py\", line" in err
    assert "dpverify/" not in err


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ("user_code:broken_inputs", "--inputs 'user_code:broken_inputs' raised ValueError: no data here (called with batch_size=2)"),
        ("user_code:even_inputs", "--inputs 'user_code:even_inputs' raised ValueError: only even batches, not 5 (called with batch_size=5)"),
    ],
)
@pytest.mark.deep
def test_an_inputs_function_that_raises_is_a_usage_error(user_code: Path, inputs: str, message: str) -> None:
    result = _run("check", "user_code:linear", "--inputs", inputs, "--batch-sizes", "4", "5", "--devices", "2", cwd=user_code)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"dpverify check: {message}")
    assert "raise ValueError(" in result.stderr
    assert "dpverify/" not in result.stderr


def test_a_check_that_checked_nothing_exits_three_with_the_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--model", "mlp", "--backend", "ddp", "--batch-sizes", "1", "--devices", "2", "4", "--no-color"])
    out = capsys.readouterr().out
    assert code == 3
    assert "fewer rows than ranks (1 < 2)" in out
    assert "fewer rows than ranks (1 < 4)" in out
    assert out.splitlines()[-1] == "NOTHING CHECKED: 0 passed, 0 failed, 4 skipped"


@pytest.mark.timeout(240)
@pytest.mark.deep
def test_ddp_selftest_subcommand_runs_a_local_pool() -> None:
    result = _run("ddp-selftest", "--world-size", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK, 12 of 12 checks passed on 2 ranks (gloo)" in result.stdout
    assert "ddp-selftest" in _run("--help").stdout


@pytest.mark.deep
def test_ddp_selftest_bad_world_size() -> None:
    result = _run("ddp-selftest", "--world-size", "0")
    assert result.returncode == 2
    assert "--world-size=0 must be at least 1" in result.stderr


def test_the_selftest_module_reports_a_usage_error_as_the_command_line_does(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m dpverify.cli.selftest`` (torchrun's way in) and ``dpverify ddp-selftest``
    end through the same ``usage_error``: message on stderr, exit 2."""
    from dpverify.cli.exits import EXIT_USAGE
    from dpverify.cli.selftest import selftest_command

    assert selftest_command(["--world-size", "0"]) == EXIT_USAGE
    assert capsys.readouterr().err == "dpverify ddp-selftest: --world-size=0 must be at least 1\n"
    assert main(["ddp-selftest", "--world-size", "0"]) == EXIT_USAGE
    assert capsys.readouterr().err == "dpverify ddp-selftest: --world-size=0 must be at least 1\n"


#: Hugging Face-like parameter names: the head says which model part, the tail which layer
#: and tensor; they differ only in the middle (the layer number) or at the very end.
HF_NAMES = [
    f"bert.encoder.layer.{layer}.attention.{part}.{leaf}"
    for layer in (0, 1, 11)
    for part in ("self.query", "self.key", "output.dense", "output.LayerNorm")
    for leaf in ("weight", "bias")
]


def test_shorten_middle_keeps_the_head_and_the_tail_of_long_names() -> None:
    from dpverify.core.text import shorten_middle

    name = "bert.encoder.layer.0.attention.self.key.bias"
    assert shorten_middle(name, len(name)) == name
    # cut at dots: the head's whole components, then the distinctive tail
    assert shorten_middle(name, 40) == "bert.encoder…0.attention.self.key.bias"
    for width in range(5, len(name)):
        short = shorten_middle(name, width)
        assert len(short) <= width, (width, short)
        head, tail = short.split("…")
        assert head, (width, short)
        assert tail, (width, short)
        assert name.startswith(head), (width, short)
        assert name.endswith(tail), (width, short)


def test_shortened_names_stay_distinct() -> None:
    from dpverify.core.text import shorten_names

    for width in (12, 20, 28, 36, 44):
        shortened = shorten_names(HF_NAMES, width)
        assert len(set(shortened)) == len(HF_NAMES), (width, shortened)
        for name, short in zip(HF_NAMES, shortened, strict=True):
            head, cut, tail = short.partition("…")
            assert name.startswith(head), (name, short)
            assert name.endswith(tail), (name, short)
            assert short == name if not cut else bool(tail), short  # never cut off at the end


def test_ddp_selftest_with_one_rank_says_rank(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from dpverify.cli import selftest as _ddp_selftest

    every = _ddp_selftest._checks
    # one check is enough to see the wording; the full self-test is run above
    monkeypatch.setattr(_ddp_selftest, "_checks", lambda world, seed: every(world, seed)[:1])
    # one rank runs nothing in parallel: no pass, and the exit status of a run that checked nothing
    assert main(["ddp-selftest", "--world-size", "1"]) == 3
    out = capsys.readouterr().out
    assert "local pool, 1 rank (gloo)" in out
    assert "SKIP  grads: mlp, even shards" in out
    assert "nothing runs in parallel on one rank" in out
    assert "NOTHING CHECKED, 0 of 1 check passed on 1 rank (gloo)" in out
    assert "1 ranks" not in out
    assert "1 checks" not in out


@pytest.mark.parametrize("command", [["verify", "--models", "mlp"], ["explain", "--no-color"]])
@pytest.mark.deep
def test_a_reader_that_goes_away_ends_the_command_quietly(command: list[str]) -> None:
    # `dpverify ... | head -1`: print (verify) and rich (explain) both meet a closed pipe.
    process = subprocess.Popen(
        [sys.executable, "-m", "dpverify", *command],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "100"},
    )
    assert process.stdout is not None
    assert process.stderr is not None
    assert process.stdout.readline().startswith(b"dpverify ")
    process.stdout.close()
    try:
        stderr = process.stderr.read().decode()
        process.wait(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 141, stderr
    assert "sys.exit" not in stderr
    assert "Traceback" not in stderr
