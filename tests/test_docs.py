"""The repository stands alone: its documentation is docs/, and nothing points outside it.

The reference documents dpverify was first written against lived next to the checkout, not
in it. Everything that cited them now cites docs/semantics.md and docs/questions.md; this
test keeps it that way, and checks that the README links both pages.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Built from pieces so that this file does not match its own patterns.
OUTSIDE = re.compile(
    "|".join((r"\.\./" + "shared", "SEMANTICS" + r"\.md", "QUESTIONS" + r"\.md"))
)

#: Where the repository's text lives, when git cannot list the tracked files.
WALKED = ("dpverify", "tests", "benchmarks", "docs", "README.md", "pyproject.toml", "tox.ini", "conftest.py")


def _tracked_files() -> Iterator[Path]:
    git = shutil.which("git")
    if git is not None:
        listed = subprocess.run(
            [git, "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False, timeout=60
        )
        if listed.returncode == 0:
            for name in listed.stdout.decode().split("\0"):
                if name:
                    yield ROOT / name
            return
    for top in WALKED:  # not a git checkout (an unpacked sdist)
        path = ROOT / top
        yield from (p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _outside_references() -> list[str]:
    found = []
    for path in _tracked_files():
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("docs/") or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files cite nothing
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_file_points_at_documents_outside_the_repository() -> None:
    found = _outside_references()
    assert not found, "cite docs/semantics.md or docs/questions.md instead:\n" + "\n".join(found)


def test_the_pattern_catches_what_it_must() -> None:
    for line in ("see ../" + "shared/notes", "(SEMANTICS" + ".md 1-8)", "the QUESTIONS" + ".md list"):
        assert OUTSIDE.search(line), line
    for line in ("docs/semantics.md", "docs/questions.md", "QUESTIONS[i - 1]", "shared_pool(2)"):
        assert not OUTSIDE.search(line), line


def test_the_docs_exist_and_the_readme_links_them() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in ("docs/semantics.md", "docs/questions.md"):
        assert (ROOT / page).is_file(), page
        assert f"]({page})" in readme, f"README.md does not link {page}"


def test_the_readme_shows_one_figure_of_each_kind_kept_in_docs() -> None:
    from figure_files import read_png

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    images = re.findall(r"!\[[^\]]*\]\((docs/figures/[\w.]+)\)", readme)
    assert images == ["docs/figures/explain.png", "docs/figures/check.png", "docs/figures/fuzz.png"]
    for image in images:
        # each made by a command the README shows
        assert f"--figure {image}" in readme, image
        png = read_png(ROOT / image)
        assert (png.format, png.width) == ("PNG", 1200), image
        assert png.inked > 0.05, f"{image} is nearly blank"


def test_ci_runs_the_readme_s_test_command_then_the_deep_tier() -> None:
    """CI runs exactly the README's test command, then the end-to-end tier it leaves out;
    tox does the same, and no test is left out of both."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^python -m pip install -c constraints-cpu\.txt '\.\[test\]' && (python -m pytest .*)$", readme, re.M)
    assert command is not None, "the Quickstart's test command"
    assert command.group(1) == 'python -m pytest -n 2 -m "not deep"'
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"'.[test]' && {command.group(1)}\n" in ci
    assert ci.index(command.group(1)) < ci.index("python -m pytest -n 2 -m deep\n")
    tox = (ROOT / "tox.ini").read_text()
    assert 'python -m pytest -n 2 -m "not deep" {posargs}' in tox
    assert "python -m pytest -n 2 -m deep {posargs}" in tox
