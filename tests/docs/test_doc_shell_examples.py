"""Every shell example in README.md, CONTRIBUTING.md and docs/ runs and prints what the page shows, or says why not.

The conventions, for whoever writes a page:

* A ```` ```console ```` block is a terminal session: a line ``$ COMMAND`` (a trailing ``\\``
  continues it on the next line), then the lines the command printed, stdout and stderr as a
  terminal interleaves them. Each command runs here through ``bash``, in order, in a scratch folder
  that mirrors the repository root (its entries and ``../shared`` linked, so relative paths work as
  from the root and a file a command writes lands in the scratch folder), with the virtualenv's
  ``bin`` first on ``PATH`` (``aiayn``, ``python``), ``AIAYN_DATA_DIR`` set to the data the tests
  use and a timeout. It must exit with status 0 and print the quoted lines: line for line, each
  line whole, except that ``...`` within a line stands for any text (timings, tokens/s, long
  vectors), as in doctest. A command with no lines after it must print nothing. Trailing spaces and
  trailing empty lines are not compared (a page cannot show them). An identical command (its
  trailing comment aside) is run once per session.
* A block that cannot run in a test (a server that keeps running, hours of training, a GPU, a
  download, a path the reader supplies) has ``<!-- not run: WHY -->`` as the nearest non-blank line
  above its fence, the reason said.
* A ```` ```bash ```` (or ``sh``/``shell``) block is a recipe of commands without their output: it
  must carry that marker. An example a test should run is a ``console`` block with its output.

``pycon`` blocks (Python sessions) are test_doc_examples.py's.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.*?)\s*-->\s*$")
RECIPE_LANGUAGES = {"bash", "sh", "shell"}
TIMEOUT_S = 600  # per command; the slowest (SmolLM2 in 4-bit) takes about 1.5 min on 2 busy cores


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    lines: tuple[str, ...]  # the body, dedented by the fence's indentation
    not_run: str | None  # the marker's reason, None when unmarked

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` (indented ones too, as in a list item)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        body = tuple(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end])
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(above)
        blocks.append(Block(page, i + 1, language, body, marker.group(1) if marker else None))
        i = end + 1
    return blocks


def shell_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)
            if block.language == "console" or block.language in RECIPE_LANGUAGES]


SHELL_BLOCKS = shell_blocks()
RUN_BLOCKS = [block for block in SHELL_BLOCKS if block.language == "console" and block.not_run is None]


@dataclass(frozen=True)
class Command:
    line: int  # on the page
    text: str
    output: tuple[str, ...]


def commands(block: Block) -> list[Command]:
    """The ``$`` commands of a console block, each with the lines quoted as its output."""
    found: list[Command] = []
    i = 0
    while i < len(block.lines):
        line = block.lines[i]
        assert line.startswith("$ "), f"{block.page.relative_to(REPO)}:{block.line + 1 + i}: a console block " \
                                      f"starts with a '$ ' command; found {line!r}"
        start, text = i, line[2:]
        while text.endswith("\\") and i + 1 < len(block.lines):
            i += 1
            text += "\n" + block.lines[i]
        i += 1
        output_start = i
        while i < len(block.lines) and not block.lines[i].startswith("$ "):
            i += 1
        found.append(Command(block.line + 1 + start, text, block.lines[output_start:i]))
    return found


def trimmed(lines) -> list[str]:
    """Trailing spaces of each line and trailing empty lines dropped: what a page can show."""
    out = [line.rstrip() for line in lines]
    while out and not out[-1]:
        out.pop()
    return out


def line_matches(expected: str, actual: str) -> bool:
    """``expected`` equals ``actual``, with each ``...`` standing for any text within the line."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual) is not None


def mismatch(expected: list[str], actual: list[str]) -> str | None:
    """Where ``actual`` departs from ``expected`` (None when it does not)."""
    for n, (want, got) in enumerate(zip(expected, actual, strict=False), 1):
        if not line_matches(want, got):
            return f"output line {n}: expected {want!r}, got {got!r}"
    if len(expected) != len(actual):
        return f"expected {len(expected)} lines of output, got {len(actual)}"
    return None


def environment() -> dict[str, str]:
    from aiayn.data import data_dir

    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["AIAYN_DATA_DIR"] = str(data_dir().resolve())
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleaved in the order written, as on a terminal
    return env


@pytest.fixture(scope="session")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that mirrors the repository root: its entries linked, and ``../shared`` beside it."""
    base = tmp_path_factory.mktemp("doc-shell")
    root = base / REPO.name
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name != ".git":
            (root / entry.name).symlink_to(entry)
    if (REPO.parent / "shared").exists():
        (base / "shared").symlink_to(REPO.parent / "shared")
    return root


def without_comment(text: str) -> str:
    """``text`` less a trailing ``# comment`` that holds no quote (bash ignores it), so that the same
    command with another comment runs once."""
    return re.sub(r"\s+#[^\"'`$\\]*$", "", text)


@functools.cache
def run(text: str, cwd: Path) -> tuple[int, str]:
    """Exit status and output (stdout and stderr interleaved) of one command, run once per session."""
    try:
        done = subprocess.run(["bash", "-c", text], cwd=cwd, env=environment(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return -1, f"(timed out after {TIMEOUT_S} s)\n{exc.output or ''}"
    return done.returncode, done.stdout


def test_the_blocks_are_found():
    """The runner sees the pages' shell examples (a renamed fence would silently test nothing)."""
    where = {block.where for block in RUN_BLOCKS}
    assert any(w.startswith("README.md:") for w in where) and any(w.startswith("docs/pretrained.md:") for w in where)


@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if b.not_run is not None or b.language != "console"],
                         ids=lambda b: b.where)
def test_a_block_not_run_says_why(block: Block) -> None:
    """A bash block is a recipe: it carries the not-run marker, with a reason (else it is a console
    block with its output, and runs)."""
    assert block.not_run is not None, (
        f"{block.where}: a ```{block.language} block is not run; mark it with '<!-- not run: WHY -->' right "
        "above its fence, or make it a ```console block with the output its commands print")
    assert len(block.not_run) >= 10, f"{block.where}: say why the block is not run (got {block.not_run!r})"


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.where)
def test_console_block(block: Block, scratch: Path) -> None:
    for command in commands(block):
        where = f"{block.page.relative_to(REPO)}:{command.line}"
        status, output = run(without_comment(command.text), scratch)
        assert status == 0, f"{where}: `{command.text}` exited with status {status}:\n{output}"
        problem = mismatch(trimmed(command.output), trimmed(output.splitlines()))
        assert problem is None, (f"{where}: `{command.text}` printed what the page does not show ({problem}).\n"
                                 f"--- the page:\n" + "\n".join(command.output) + f"\n--- printed:\n{output}")
