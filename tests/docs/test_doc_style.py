"""The pages read as a manual, not as a development log: short pages, short sentences, no history.

What is checked, for README.md, CONTRIBUTING.md and every page under docs/ (CHANGELOG.md is the one
place for what changed and when, so only its length is checked):

* size: README.md at most 200 lines and 12,000 characters (a front door); every other page at most
  500 lines;
* no development-log phrases outside fenced blocks: "session", "CI" followed by a number, "load
  average", "issue N", "superseded", "(was ...)", "no longer", "previously", "until now";
* sentences short: on each page the mean sentence of prose (outside fences, tables, headings and
  HTML; a list item is a paragraph of its own; inline code counts as one word) is at most 22 words,
  and no sentence is over 55;
* docs/README.md links every page of docs/ (an index that leaves a page out hides it).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest
from test_doc_links import prose_lines as prose
from test_doc_shell_examples import REPO

DOCS = sorted((REPO / "docs").rglob("*.md"))
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *DOCS]
CHANGELOG = REPO / "CHANGELOG.md"

MAX_LINES = 500
README_MAX_LINES, README_MAX_CHARS = 200, 12_000
MEAN_WORDS, MAX_WORDS = 22, 55

LOG_PHRASES = re.compile(
    r"\bsessions?\b|\bCI ?\d+\b|\bload average\b|\bissues? #?\d+|\bsuperseded\b|\(was\b[^)]*\)"
    r"|\bno longer\b|\bpreviously\b|\buntil now\b", re.I)
ITEM = re.compile(r"^(?:[-*]|\d+\.)\s+")
NOT_PROSE = ("#", "|", "<", "![")


def name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def paragraphs(page: Path) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph of prose; a list item starts a paragraph of its own."""
    found: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for number, line in prose(page):
        text = line.strip()
        item = ITEM.match(text)
        if not text or text.startswith(NOT_PROSE) or item:
            if current:
                found.append((start, " ".join(current)))
            current, start = ([ITEM.sub("", text)], number) if item else ([], 0)
            continue
        if not current:
            start = number
        current.append(text)
    if current:
        found.append((start, " ".join(current)))
    return found


def sentences(page: Path) -> list[tuple[int, int, str]]:
    """(line, words, text) of each sentence of ``page``'s prose."""
    found = []
    for line, text in paragraphs(page):
        text = re.sub(r"`[^`]*`", "X", text)
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        text = re.sub(r"\b(e\.g|i\.e|etc|vs|cf|al|approx)\.", r"\1", text)
        for sentence in re.split(r"(?<=[.!?])\s+(?=[^a-z])", text):
            if words := sentence.split():
                found.append((line, len(words), sentence))
    return found


def test_the_pages_are_found():
    names = {name(page) for page in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "docs/README.md", "docs/serve.md"} <= names
    assert all(page.exists() for page in PAGES)


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES and len(text) <= README_MAX_CHARS, (
        f"README.md has {lines} lines and {len(text):,} characters "
        f"(at most {README_MAX_LINES} and {README_MAX_CHARS:,}): move detail to docs/")


@pytest.mark.parametrize("page", [*PAGES, CHANGELOG], ids=name)
def test_a_page_is_at_most_500_lines(page: Path):
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{name(page)} has {lines} lines (at most {MAX_LINES}): split it or cut history"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_no_development_log(page: Path):
    found = [f"{name(page)}:{number}: {match.group(0)!r}" for number, line in prose(page)
             for match in LOG_PHRASES.finditer(line)]
    assert not found, "a user page says what is true now; history goes to CHANGELOG.md:\n" + "\n".join(found)


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_sentences_are_short(page: Path):
    counted = sentences(page)
    if not counted:
        return
    mean = statistics.mean(words for _, words, _ in counted)
    long = [f"{name(page)}:{line}: {words} words: {text[:80]}..." for line, words, text in counted if words > MAX_WORDS]
    assert mean <= MEAN_WORDS, f"{name(page)}: sentences average {mean:.1f} words (at most {MEAN_WORDS})"
    assert not long, f"sentences over {MAX_WORDS} words:\n" + "\n".join(long)


def test_the_docs_index_links_every_page():
    index = REPO / "docs" / "README.md"
    linked = {(index.parent / target).resolve() for target in re.findall(r"\]\(([^)#\s]+)", index.read_text())}
    pages = {page.resolve() for page in (REPO / "docs").glob("*.md") if page != index}
    missing = sorted(name(page) for page in pages - linked)
    assert not missing, f"docs/README.md does not link: {missing}"


def test_every_benchmark_table_has_its_command_and_date():
    """docs/benchmarks.md: a section with a results table names the command that makes it and the
    date it was measured; the page says which machine, unless a section names its own."""
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert re.search(r"\*\*The machine\*\*", text), "docs/benchmarks.md does not say which machine it measured on"
    missing = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0]
        if not re.search(r"^\|", section, re.M):
            continue
        if not re.search(r"python -m benchmarks", section):
            missing.append(f"{title}: no `python -m benchmarks...` command")
        if not re.search(r"\b20\d\d-\d\d-\d\d\b", section):
            missing.append(f"{title}: no date")
    assert not missing, "\n".join(missing)
