"""The layering rules of the package, measured by benchmarks/architecture.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from architecture import Structure, measure

PACKAGE = Path(__file__).resolve().parent.parent / "dpverify"


@pytest.fixture(scope="module")
def structure() -> Structure:
    return measure(PACKAGE)


def test_no_import_cycles_counting_lazy_imports(structure: Structure) -> None:
    assert structure.cycles == []


def test_no_private_name_is_imported_across_subpackages(structure: Structure) -> None:
    assert structure.private == ()


def test_the_engine_never_imports_a_front_end(structure: Structure) -> None:
    assert structure.engine_to_front_ends == []


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_measure_sees_a_cycle_through_a_lazy_import_and_a_private_crossing(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "from pkg.ddp.b import _helper\n",
            "ddp/__init__.py": "",
            "ddp/b.py": "def _helper():\n    from pkg.core import a\n",
            "cli/__init__.py": "",
            "cli/view.py": "",
            "checks/__init__.py": "",
            "checks/c.py": "def f():\n    from pkg.cli.view import x\n",
        },
    )
    found = measure(root)
    assert found.cycles == [["pkg.core.a", "pkg.ddp.b"]]
    assert found.private == (("pkg.core.a", "pkg.ddp.b", "_helper"),)
    assert found.engine_to_front_ends == [("pkg.checks.c", "pkg.cli.view")]
