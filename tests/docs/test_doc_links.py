"""Every link between the pages of README.md and docs/ (and the READMEs of results/, recipes/sweeps/
and aiayn/pretrained/), and every repository path or test their prose names, exists.

What is checked, outside fenced blocks (a block's paths are the reader's: ``runs/...``):

* a markdown link or image (``[text](target)``, ``<img src=...>``) to a file of the repository
  resolves from its page, and a ``#fragment`` into a markdown page names one of its headings (by
  GitHub's rule: lower case, punctuation dropped, spaces to hyphens);
* a path in backticks under one of the repository's own folders (``aiayn/``, ``tests/``,
  ``benchmarks/``, ``docs/``, ``recipes/``, ``scripts/``, ``results/``) exists, from the root or the
  page's folder; a glob (``test_hf_*.py``) matches something; a placeholder (``NAME``, ``XX-YY``,
  ``<name>``, ``...``) is not a path and is skipped;
* ``file.py::name`` names a function of that file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_doc_shell_examples import PAGES, REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:aiayn|tests|benchmarks|docs|recipes|scripts|results)/[\w./*\-]*[\w*])")
TEST_REFERENCE = re.compile(r"((?:tests|benchmarks)/[\w/]+\.py)::(\w+)")
PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b(?!\.md)|\.\.\.|…|<")  # NAME, XX-YY, ...; not README.md
FENCE = re.compile(r"^\s*```")


# The folders' own READMEs, which a reader reaches from the pages (results/experiments/*/results.md
# are written by the experiments' code and checked by tests/integration/test_experiments.py).
FOLDER_READMES = [REPO / "results" / "README.md", REPO / "recipes" / "sweeps" / "README.md",
                  REPO / "aiayn" / "pretrained" / "README.md"]
CHECKED = [*PAGES, *FOLDER_READMES]


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of ``page``'s lines outside fenced blocks."""
    lines, inside = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append((number, line))
    return lines


def anchors(page: Path) -> set[str]:
    """The ``#fragment``s GitHub gives ``page``'s headings."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for _, line in prose_lines(page) if line.startswith("#")}


def where(page: Path, number: int) -> str:
    return f"{page.relative_to(REPO)}:{number}"


def test_the_pages_are_found():
    names = {page.relative_to(REPO).as_posix() for page in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/serve.md", "docs/explain/README.md"} <= names
    assert all(page.is_file() for page in FOLDER_READMES)


@pytest.mark.parametrize("page", CHECKED, ids=lambda page: page.relative_to(REPO).as_posix())
def test_links_resolve(page: Path) -> None:
    broken = []
    for number, line in prose_lines(page):
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{where(page, number)}: {target} does not exist")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{where(page, number)}: {target}: no heading #{fragment} in {file.name}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", CHECKED, ids=lambda page: page.relative_to(REPO).as_posix())
def test_named_repository_paths_exist(page: Path) -> None:
    missing = []
    for number, line in prose_lines(page):
        for match in REPO_PATH.finditer(line):
            path = match.group(1)
            if PLACEHOLDER.search(path.split("/", 1)[1]):
                continue
            if "*" in path:
                found = any(REPO.glob(path)) or any(page.parent.glob(path))
            else:
                found = (REPO / path).exists() or (page.parent / path).exists()
            if not found:
                missing.append(f"{where(page, number)}: {path}")
    assert not missing, "paths named in the prose that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", CHECKED, ids=lambda page: page.relative_to(REPO).as_posix())
def test_named_tests_exist(page: Path) -> None:
    missing = []
    for number, line in prose_lines(page):
        for match in TEST_REFERENCE.finditer(line):
            file, name = REPO / match.group(1), match.group(2)
            if not file.is_file() or not re.search(rf"^\s*def {name}\(", file.read_text(encoding="utf-8"), re.M):
                missing.append(f"{where(page, number)}: {match.group(0)}")
    assert not missing, "tests named in the prose that do not exist:\n" + "\n".join(missing)
