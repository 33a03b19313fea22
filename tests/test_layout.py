"""The engine (dpverify/core, models, checks, ddp) stands alone: no Hypothesis, no rich, no
matplotlib, no CLI.

The assertion helpers and the DDP checks are a library for test suites. What only the
command line (rich, dpverify.cli), property-based testing (Hypothesis, dpverify.strategies,
dpverify.mutants) or figures (matplotlib, an optional extra) need must not be imported by
them, or every ``import dpverify`` pays for, and depends on, all of it. The figures are a
front end over the engine's results (``dpverify.figures.comparison_figure(report)``): the
engine imports no ``dpverify.figures``, not even inside a function.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Below the registry and the planner, which import every backend.
BACKENDS = ("core", "models", "checks", "ranked", "ddp", "sharded", "data")
#: The library: the backends, and the explain engine above the registry.
ENGINE = (*BACKENDS, "explain")
FORBIDDEN = ("rich", "hypothesis", "matplotlib", "dpverify.cli", "dpverify.strategies", "dpverify.mutants")

#: Allowed inside a function only: drawing loads matplotlib, so only drawing may load it.
LAZY = ("dpverify.figures",)

#: The one sanctioned exception: InvalidArgument subclasses Hypothesis's, so that the
#: strategies raise it too, through an import that falls back when Hypothesis is absent.
GUARDED_FILE, GUARDED_MODULE = Path("dpverify/core/errors.py"), "hypothesis.errors"


def _package_of(path: Path) -> list[str]:
    """The package a module's relative imports start from."""
    return list(path.with_suffix("").parts[:-1])


def _imported(node: ast.AST, path: Path) -> set[str]:
    """The modules a statement or call may load (``from a import b`` may load ``a.b``)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = _package_of(path)[: len(_package_of(path)) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        return {base} | {f"{base}.{alias.name}" for alias in node.names}
    # importlib.import_module("x") and __import__("x") with a literal name
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return {node.args[0].value}
    return set()


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` is a statement of a ``try`` body that handles ImportError."""
    parent = parents.get(node)
    if not isinstance(parent, ast.Try) or node not in parent.body:
        return False
    caught = {
        name.id
        for handler in parent.handlers
        if handler.type is not None
        for name in ast.walk(handler.type)
        if isinstance(name, ast.Name)
    }
    return bool(caught & {"ImportError", "ModuleNotFoundError"})


def _ancestors(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> Iterator[tuple[ast.AST, ast.AST]]:
    """``(parent, child)`` pairs from ``node`` up to the module."""
    while node in parents:
        yield parents[node], node
        node = parents[node]


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` is in the body of an ``if TYPE_CHECKING:`` (never run)."""
    for parent, child in _ancestors(node, parents):
        if isinstance(parent, ast.If) and child in parent.body:
            test = parent.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
            if name == "TYPE_CHECKING":
                return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` runs only when a function is called, not when its module is imported."""
    return any(isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for parent, _ in _ancestors(node, parents))


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in prefixes)


def violations(source: str, path: Path) -> list[str]:
    """``path:line: imports ...`` for every forbidden import in ``source``, at any depth
    (but under ``if TYPE_CHECKING:``), and every import of ``LAZY`` outside a function.

    Args:
        source: the module's text.
        path: its path relative to the repository root (``dpverify/core/x.py``).
    """
    tree = ast.parse(source, str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        names = _imported(node, path)
        if not names or _type_checking_only(node, parents):
            continue
        bad = sorted(name for name in names if _matches(name, FORBIDDEN))
        if not _in_function(node, parents):
            bad += sorted(f"{name} (at import time)" for name in names if _matches(name, LAZY))
        if not bad:
            continue
        sanctioned = (
            path == GUARDED_FILE
            and isinstance(node, ast.ImportFrom)
            and node.module == GUARDED_MODULE
            and _guarded(node, parents)
        )
        if not sanctioned:
            found.append((node.lineno, f"{path}:{node.lineno}: imports {', '.join(bad)}"))
    return [text for _, text in sorted(found)]


def test_the_engine_imports_no_hypothesis_rich_matplotlib_cli_strategies_or_mutants() -> None:
    # the registry and the planner sit above the engine, and stand alone as it does
    above = [ROOT / "dpverify" / "registry.py", ROOT / "dpverify" / "planner.py"]
    files = sorted([*(p for sub in ENGINE for p in (ROOT / "dpverify" / sub).rglob("*.py")), *above])
    assert len(files) > len(ENGINE)
    problems = [
        problem
        for file in files
        for problem in violations(file.read_text(), file.relative_to(ROOT))
    ]
    assert problems == []


def test_the_engine_imports_no_figures_even_when_called() -> None:
    """The figures draw the engine's results; the engine never reaches up to them."""
    files = sorted(p for sub in ENGINE for p in (ROOT / "dpverify" / sub).rglob("*.py"))
    imported = {
        f"{file.relative_to(ROOT)}:{node.lineno}": name
        for file in files
        for node in ast.walk(ast.parse(file.read_text(), str(file)))
        for name in _imported(node, file.relative_to(ROOT))
        if _matches(name, LAZY)
    }
    assert imported == {}


def test_the_import_check_sees_nested_relative_and_dynamic_imports() -> None:
    source = textwrap.dedent(
        """
        import os
        from dpverify.core.errors import InvalidArgument

        def render():
            from rich.console import Console
            import importlib
            return importlib.import_module("dpverify.cli.fuzz")

        from .. import strategies
        try:
            from hypothesis.errors import InvalidArgument
        except ImportError:
            pass
        """
    )
    found = violations(source, Path("dpverify/core/probe.py"))
    assert [text.split(": ", 1)[1] for text in found] == [
        "imports rich.console, rich.console.Console",
        "imports dpverify.cli.fuzz",
        "imports dpverify.strategies",
        # guarded, but only dpverify/core/errors.py may do it
        "imports hypothesis.errors, hypothesis.errors.InvalidArgument",
    ]
    assert violations(source, GUARDED_FILE)[-1].endswith("dpverify.strategies")


def test_figures_are_imported_when_drawn_and_matplotlib_only_for_annotations() -> None:
    source = textwrap.dedent(
        """
        from typing import TYPE_CHECKING
        import typing

        if TYPE_CHECKING:
            from matplotlib.figure import Figure
        if typing.TYPE_CHECKING:
            import matplotlib.axes
        else:
            import matplotlib.pyplot

        import matplotlib
        from dpverify.figures.check import comparison_figure

        def figure():
            from dpverify.figures.check import comparison_figure
            from matplotlib.figure import Figure
            return comparison_figure
        """
    )
    found = violations(source, Path("dpverify/core/probe.py"))
    assert [text.split(": ", 1)[1] for text in found] == [
        "imports matplotlib.pyplot",
        "imports matplotlib",
        "imports dpverify.figures.check (at import time), dpverify.figures.check.comparison_figure (at import time)",
        # lazily, but matplotlib itself: only dpverify.figures draws
        "imports matplotlib.figure, matplotlib.figure.Figure",
    ]


# Run in a fresh interpreter in which importing Hypothesis, rich or matplotlib raises ImportError.
WITHOUT_HYPOTHESIS_AND_RICH = """
import sys
sys.modules["hypothesis"] = None
sys.modules["rich"] = None
sys.modules["matplotlib"] = None

import torch
import dpverify

torch.manual_seed(0)
module = torch.nn.Linear(3, 2)
result = dpverify.assert_dp_grads_match(
    module,
    torch.randn(6, 3),
    torch.randn(6, 2),
    loss_fn=torch.nn.functional.mse_loss,
    device_ids=[0, 1],
)
assert isinstance(result, dpverify.StepComparison), result
assert issubclass(dpverify.InvalidArgument, ValueError)
# the figure modules import without matplotlib; drawing says what to install
import dpverify.figures.check
try:
    dpverify.figures.check.comparison_figure(result)
except ModuleNotFoundError as error:
    assert "pip install 'dpverify[plot]'" in str(error), error
else:
    raise AssertionError("a figure was drawn without matplotlib")
assert not any(name.split(".")[0] in ("hypothesis", "rich", "matplotlib") for name, mod in sys.modules.items() if mod)
print("OK")
"""


@pytest.mark.deep
def test_a_check_runs_without_hypothesis_rich_and_matplotlib() -> None:
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_HYPOTHESIS_AND_RICH],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["OK"]


def test_the_engine_never_imports_the_registry_or_the_planner() -> None:
    # they import every backend (DataParallel, DDP, sharded): the engine is below them
    above = {"dpverify.registry", "dpverify.planner"}
    files = sorted(p for sub in BACKENDS for p in (ROOT / "dpverify" / sub).rglob("*.py"))
    found = [
        f"{file.relative_to(ROOT)}:{node.lineno}"
        for file in files
        for node in ast.walk(ast.parse(file.read_text()))
        if _imported(node, file.relative_to(ROOT)) & above
    ]
    assert found == []
