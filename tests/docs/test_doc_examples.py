"""Every ``pycon`` example in README.md and docs/ runs, and prints what the page shows.

A page's ``pycon`` blocks are Python sessions (``>>>`` lines and their output, as ``python -i``
shows them), run in order in one namespace per page, as a reader typing them would, by the standard
library's ``doctest`` with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``. So a model output quoted in
a ``pycon`` block is the one the code printed: change the code and the page fails here. The shell
examples (``console`` blocks, and the not-run markers of the rest) are test_doc_shell_examples.py's.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```pycon\n(.*?)^```", re.MULTILINE | re.DOTALL)


def page_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, source) of each ``pycon`` block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, match.start()) + 2, match.group(1)) for match in BLOCK.finditer(text)]


PAGES_WITH_EXAMPLES = [page for page in PAGES if page_blocks(page)]


def test_the_examples_are_found():
    """The runner sees the pages that have examples (a renamed fence would silently test nothing)."""
    assert REPO / "docs" / "python-api.md" in PAGES_WITH_EXAMPLES


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_page_examples(page: Path) -> None:
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    for line, source in page_blocks(page):
        name = f"{page.relative_to(REPO)}:{line}"
        test = parser.get_doctest(source, namespace, name, str(page), line - 1)
        runner.run(test, out=report.append, clear_globs=False)
        namespace = test.globs  # a DocTest runs in a copy: the next block goes on from this one's
    summary = runner.summarize(verbose=False)
    assert summary.attempted > 0
    assert summary.failed == 0, "".join(report)
