"""The README and the docs/ pages are executable: every fenced block is run here, or says why not.

Python blocks run through pytest-examples (pydantic's maintained runner for code in
Markdown): each block runs as its own module, with pytest's assertion rewriting, and the
output of a ``print`` must equal the ``#>`` lines under it (``pytest --update-examples
tests/test_readme.py`` rewrites them after a deliberate change). Bash blocks run in a
fresh working directory with ``bash -e``. A block that is not run starts with the comment
``# not run by the tests: <reason>``, which the reader sees too. Output blocks are
``text``: the deterministic ones are compared with a fresh run (the ``explain`` excerpt,
line by line, in order), the others checked for what they show (the fuzz session's labels,
a scenario that evaluates to itself). The README's Layout table names paths that exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest_examples = pytest.importorskip("pytest_examples")

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: Background pages with nothing to run (questions.md shows a command's synopsis, not a command).
BACKGROUND = ("semantics.md", "questions.md")
#: The README and the docs/ pages whose blocks run here.
PAGES = (README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in BACKGROUND))
NOT_RUN = "# not run by the tests: "
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^\n]*)\n(?P<body>.*?)^(?P=indent)```$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    """One fenced block of the README or a docs/ page."""

    page: Path
    lang: str
    body: str
    line: int

    @property
    def not_run(self) -> str | None:
        """The reason the block is not run, or None when it runs."""
        first = self.body.lstrip().splitlines()[0] if self.body.strip() else ""
        return first.removeprefix(NOT_RUN) if first.startswith(NOT_RUN) else None

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang})"


def _blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, m.group("lang").strip(), m.group("body"), text[: m.start()].count("\n") + 1)
        for m in FENCE.finditer(text)
    ]


BLOCKS = [block for page in PAGES for block in _blocks(page)]


def _run(command: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "PYTHONPATH": str(cwd)}
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_every_block_names_its_language() -> None:
    assert BLOCKS
    assert README in {block.page for block in BLOCKS}
    assert {block.lang for block in BLOCKS} <= {"python", "bash", "text"}, [str(b) for b in BLOCKS if b.lang not in ("python", "bash", "text")]


def test_blocks_that_are_not_run_say_why_and_only_code_may_be_left_out() -> None:
    for block in BLOCKS:
        if block.not_run is not None:
            assert block.lang == "bash", f"{block}: only shell commands are left out; make Python blocks runnable"
            assert len(block.not_run) >= 20, f"{block}: give the reason in words"


def _python_examples() -> list[object]:
    return [
        example
        for example in pytest_examples.find_examples(*(str(page) for page in PAGES))
        if example.prefix.strip() == "python"
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("example", _python_examples(), ids=str)
def test_python_block_runs(example: object, eval_example: object) -> None:
    eval_example.set_config(line_length=120)  # type: ignore[attr-defined]
    failure = ""
    try:
        if eval_example.update_examples:  # type: ignore[attr-defined]
            eval_example.run_print_update(example)  # type: ignore[attr-defined]
        else:
            eval_example.run_print_check(example)  # type: ignore[attr-defined]
    except Exception as error:
        # pytest-examples points the traceback at the page's lines with frames pytest 9
        # cannot render (an INTERNALERROR, here or as a chained context): report the frames
        # and the error ourselves, outside the except block
        failure = f"{example} raised:\n{_frames(error)}{''.join(traceback.format_exception_only(error))}"
    if failure:
        pytest.fail(failure, pytrace=False)


def _frames(error: BaseException) -> str:
    lines, tb = [], error.__traceback__
    while tb is not None:
        lines.append(f"  {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}\n")
        tb = tb.tb_next
    return "".join(lines)


def test_every_python_block_is_found_by_pytest_examples() -> None:
    assert len(_python_examples()) == sum(block.lang == "python" for block in BLOCKS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash" and b.not_run is None], ids=str)
def test_bash_block_runs(block: Block, tmp_path: Path) -> None:
    result = _run(block.body, tmp_path)
    assert result.returncode == 0, f"{block} failed:\n{result.stdout}\n{result.stderr}"


def _text_block(first_line: str) -> Block:
    found = [b for b in BLOCKS if b.lang == "text" and b.body.startswith(first_line)]
    assert len(found) == 1, first_line
    return found[0]


def test_the_explain_excerpt_is_what_explain_prints(tmp_path: Path) -> None:
    block = _text_block("dpverify explain: embedding")
    result = _run("dpverify explain --no-color", tmp_path)
    assert result.returncode == 0, result.stderr
    printed = [line.rstrip() for line in result.stdout.splitlines()]
    at = 0
    for line in (line.rstrip() for line in block.body.splitlines()):
        if not line or line.strip() == "...":
            continue
        assert line in printed[at:], f"{block}: {line!r} is not printed (in this order) by dpverify explain"
        at = printed.index(line, at) + 1


@pytest.mark.deep
def test_the_fuzz_session_shown_has_the_labels_a_session_prints(tmp_path: Path) -> None:
    block = _text_block("dpverify fuzz:")
    result = _run("dpverify fuzz --max-examples 12 --seed 0 --no-color", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = block.body.splitlines()
    assert result.stdout.startswith(shown[0].split(";")[0] + ";")
    labels = [line.split("  ")[0].strip() for line in shown[2:-1] if not line.strip().startswith("expected divergence")]
    for label in labels:
        assert re.search(rf"^\s*{re.escape(label)}\s", result.stdout, flags=re.MULTILINE), label
    assert result.stdout.rstrip().splitlines()[-1].startswith("OK: 12 examples, no failure")
    assert shown[-1].startswith("OK: 1000 examples, no failure")


def test_the_shrunk_scenario_shown_evaluates_to_itself() -> None:
    import torch

    from dpverify.strategies import DeviceList, LossSpec, ModelSpec, Scenario

    block = _text_block("Scenario(")
    names = {"Scenario": Scenario, "ModelSpec": ModelSpec, "DeviceList": DeviceList, "LossSpec": LossSpec, "torch": torch}
    scenario = eval(block.body.strip(), names)
    assert repr(scenario) == block.body.strip()


def _layout_paths() -> list[str]:
    section = README.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([\w./]+)` \|", section, flags=re.MULTILINE)


def test_the_layout_table_names_paths_in_the_package() -> None:
    paths = _layout_paths()
    assert "dpverify/__init__.py" in paths
    assert "pytest_dpverify.py" in paths
    assert all(path.startswith("dpverify/") or path == "pytest_dpverify.py" for path in paths), paths


def test_the_layout_names_every_subpackage_and_top_level_module() -> None:
    paths = set(_layout_paths())
    package = ROOT / "dpverify"
    parts = [p for p in package.iterdir() if (p / "__init__.py").exists() or (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))]
    missing = [p.relative_to(ROOT).as_posix() + ("/" if p.is_dir() else "") for p in parts]
    assert [path for path in missing if path not in paths] == []


def test_the_layout_names_paths_that_exist() -> None:
    missing = [path for path in _layout_paths() if not (ROOT / path).exists()]
    assert not missing, f"README.md's Layout names paths that are not in the repository: {missing}"


def test_the_quickstart_verify_prints_what_the_readme_says(tmp_path: Path) -> None:
    result = _run(f"{sys.executable} -m dpverify verify", tmp_path)
    assert result.returncode == 0, result.stdout
    verdict = result.stdout.rstrip().splitlines()[-1]
    said = re.search(r"`(OK: \d+ passed, \d+ failed, \d+ warned)`", README.read_text())
    assert said is not None
    assert verdict.startswith(said.group(1) + " in ")


def test_ci_runs_the_readmes_test_command() -> None:
    quickstart = next(b for b in BLOCKS if b.lang == "bash" and "'.[test]'" in b.body)
    command = next(line for line in quickstart.body.splitlines() if "'.[test]'" in line)
    ci = (ROOT / ".ci" / "run").read_text()
    assert command.replace("pip install -c", "pip install -q -c") in ci.splitlines()
