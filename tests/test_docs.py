"""The repository stands alone: its documentation is the README and docs/, and nothing
points outside it.

Every file cites docs/semantics.md and docs/questions.md for the background, never documents
outside the checkout. The README links every docs/ page; every link of the README and the
pages reaches a file and, with an anchor, a heading of it; and the pages describe dpverify as
it is, with no account of how it came to be.
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
        if not path.is_file():
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


DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = (README, *sorted(DOCS.glob("*.md")))
LINK = re.compile(r"\]\((?!https?://)([^)#\s]*)(?:#([^)\s]*))?\)")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (heading := re.match(r"#{1,6} (.+)", line)):
            slug = _slug(heading.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_the_slugs_are_github_s() -> None:
    assert _slug("What `explain` prints") == "what-explain-prints"
    assert _slug("FSDP2, tensor and pipeline parallelism") == "fsdp2-tensor-and-pipeline-parallelism"
    assert _slug("Your loss, your outputs, DDP's options") == "your-loss-your-outputs-ddps-options"


def test_the_docs_exist_and_the_readme_links_every_page() -> None:
    readme = README.read_text(encoding="utf-8")
    for page in ("docs/semantics.md", "docs/questions.md"):
        assert (ROOT / page).is_file(), page
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_every_link_reaches_a_file_and_its_heading() -> None:
    broken = []
    for page in PAGES:
        for target, anchor in LINK.findall(page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken


#: Words that tell how dpverify came to be rather than what it is. Built from pieces so that
#: this file does not match its own patterns.
NARRATION = re.compile(
    "|".join((
        r"\bsession[- ]\d", r"end of (the )?" + "session", r"the " + "session that", r"during the " + "session",
        r"\bused " + r"to\b(?! (compute|judge|build|run|check|make|draw|pick))", r"\bprevious" + r"ly\b",
        r"\bno " + r"longer\b", r"\bwas " + r"fixed\b", r"\bnew " + r"in\b", r"before (this|that) (change|" + r"fix)",
        r"the figures " + "before", r"rows added " + "later",
    )),
    re.IGNORECASE,
)


def test_the_docs_tell_no_history() -> None:
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if NARRATION.search(line)
    ]
    assert not found, "describe dpverify as it is:\n" + "\n".join(found)


def test_the_history_pattern_catches_what_it_must() -> None:
    for line in ("end of the " + "session that added", "the " + "session-3 table", "it " + "used to sum", "was " + "fixed in"):
        assert NARRATION.search(line), line
    for line in ("a fuzz session", "the tolerance used to judge it", "one pool per test session"):
        assert not NARRATION.search(line), line


def test_the_figures_page_shows_one_figure_of_each_kind_kept_in_docs() -> None:
    from figure_files import read_png

    page = (DOCS / "figures.md").read_text(encoding="utf-8")
    images = re.findall(r"!\[[^\]]*\]\((figures/[\w.]+)\)", page)
    assert images == ["figures/explain.png", "figures/check.png", "figures/fuzz.png"]
    for image in images:
        # each made by a command the page shows
        assert f"--figure docs/{image}" in page, image
        png = read_png(DOCS / image)
        assert (png.format, png.width) == ("PNG", 1200), image
        assert png.inked > 0.05, f"{image} is nearly blank"
    shown = re.findall(r"!\[[^\]]*\]\(docs/(figures/[\w.]+)\)", README.read_text(encoding="utf-8"))
    assert shown
    assert set(shown) <= set(images), shown


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
