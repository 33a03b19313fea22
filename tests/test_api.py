"""The public surface: what __all__ exports is what the README documents."""

from __future__ import annotations

import re
from pathlib import Path

import dpverify

README = Path(__file__).resolve().parent.parent / "README.md"


def _documented() -> set[str]:
    text = README.read_text()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(?:dpverify\.)?(\w+)", section, flags=re.MULTILINE))


def test_all_matches_the_readme_api_table() -> None:
    assert set(dpverify.__all__) == _documented()


def test_every_public_name_exists_and_has_a_docstring() -> None:
    for name in dpverify.__all__:
        obj = getattr(dpverify, name)
        assert (obj.__doc__ or "").strip(), name


def test_lazy_exports_cover_all() -> None:
    assert set(dpverify.__all__) == set(dpverify._EXPORTS)


def test_readme_first_example_runs() -> None:
    block = README.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md", "exec"), {})
