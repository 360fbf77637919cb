"""The house rules of aiayn/ that a reader can check by counting: no function over 80 lines, no file
over 500 lines, and comments and docstrings that say what and why, not the project's history or a
frozen figure (figures live in docs/benchmarks.md beside the command that makes them).

Counted with ``ast`` and ``tokenize``; scripts/design_metrics.py prints the same counts for a table.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "aiayn"
FILES = sorted(PACKAGE.rglob("*.py"))
LONG_FUNCTION, LONG_FILE = 80, 500
# History and frozen measurements: sessions, CI runs, issue numbers, "as before", dates, timings.
HISTORY = re.compile(
    r"\bsessions? \d|\bCI ?\d+\b|\bissue[ -]#?\d|load average|\bas before\b|superseded|"
    r"kept for the benchmark|\b20\d\d-\d\d-\d\d\b|\bwas \d|measured[^.]{0,40}\d|\d ?ms\b|"
    r"\d(\.\d+)?x (faster|slower)", re.IGNORECASE)


def name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the end, the docstring not counted."""
    first = node.body[0]
    docstring = (first.end_lineno - first.lineno + 1 if isinstance(first, ast.Expr)  # type: ignore[operator]
                 and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str) else 0)
    return node.end_lineno - node.lineno + 1 - docstring  # type: ignore[operator]


def test_no_function_over_80_lines() -> None:
    long = [f"{name(path)}:{node.lineno} {node.name} ({function_lines(node)} lines)"
            for path in FILES for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and function_lines(node) > LONG_FUNCTION]
    assert not long, f"functions over {LONG_FUNCTION} lines (split them into named steps): {long}"


def test_no_file_over_500_lines() -> None:
    long = [f"{name(p)} ({n})" for p in FILES if (n := len(p.read_text(encoding="utf-8").splitlines())) > LONG_FILE]
    assert not long, f"files over {LONG_FILE} lines (split them by what they own): {long}"


def history(path: Path) -> list[str]:
    """Comments and docstrings of ``path`` that narrate history or freeze a figure."""
    text = path.read_text(encoding="utf-8")
    found = [f"{name(path)}:{tok.start[0]}: {tok.string.strip()}"
             for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT and HISTORY.search(tok.string)]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False) or ""
            for match in HISTORY.finditer(doc):
                line = node.body[0].lineno + doc[: match.start()].count("\n")
                found.append(f"{name(path)}:{line}: ...{doc[max(0, match.start() - 40): match.end() + 20]!r}")
    return found


@pytest.mark.parametrize("folder", sorted({p.parent for p in FILES}), ids=lambda p: name(p))
def test_comments_say_what_and_why_not_history(folder: Path) -> None:
    found = [hit for path in FILES if path.parent == folder for hit in history(path)]
    assert not found, ("comments or docstrings narrate history or freeze a figure (say what and why; "
                       f"figures go to docs/benchmarks.md with their command): {found}")


# Outside the package, tests, scripts, benchmarks and recipes may quote figures, but never point
# at the project's tracker or its working days: a reader has neither.
TRACKER = re.compile(r"\bsessions? \d|\ba session with\b|\bCI ?\d+\b|\bissue[ -]#?\d", re.IGNORECASE)
REPO = PACKAGE.parent
OTHER_FILES = sorted(path for folder in ("tests", "scripts", "benchmarks", "recipes", ".ci")
                     for path in (REPO / folder).rglob("*") if path.suffix in {".py", ".sh", ".yaml", ""}
                     and path.is_file() and path.name not in {"test_design_rules.py", "test_doc_style.py"})


def test_no_tracker_references_outside_the_package() -> None:
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}" for path in OTHER_FILES
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if TRACKER.search(line)]
    assert not found, "say what a test or script checks, not which issue or session asked for it:\n" + "\n".join(found)
