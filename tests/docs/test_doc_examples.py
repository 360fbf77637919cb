"""Every Python example in README.md and docs/ runs (and prints what the page shows), or says why not.

The conventions, for whoever writes a page:

* A ``pycon`` block is a Python session (``>>>`` lines and their output, as ``python -i`` shows
  them), run by the standard library's ``doctest`` with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``.
  So a model output quoted in a ``pycon`` block is the one the code printed: change the code and
  the page fails here. Use it where the output matters.
* A ``python`` block is a program without its output: it is executed, and must finish without an
  exception.
* A page's ``pycon`` and ``python`` blocks run in order in one namespace, as a reader typing them
  would; a block may use what an earlier one on the page defined.
* A block that cannot run in a test (a server that keeps running, hours of training, a download,
  a path the reader supplies) has ``<!-- not run: WHY -->`` as the nearest non-blank line above its
  fence, the reason said; any other Python fence (``py``, ``python3``, ...) fails here.

Loading SmolLM2 takes most of this file's time, so, while its tests run, ``load_text_model`` and
``aiayn.interop.load_gguf`` keep what they loaded and hand the same object to a later call with the
same arguments (one load where pages repeat it; the examples only read the models they load);
``load_text_model``'s loads are the whole session's (tests/conftest.py, ``shared_text_models``).

The shell examples (``console`` blocks, and the not-run markers of ``bash`` ones) are
test_doc_shell_examples.py's, whose block reader this file shares.
"""

from __future__ import annotations

import doctest
import functools
import inspect
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_doc_shell_examples import PAGES, REPO, Block, page_blocks

RUN_LANGUAGES = ("pycon", "python")


def python_blocks(page: Path) -> list[Block]:
    """The ``pycon`` and ``python`` blocks of ``page``, in page order, marked ones included."""
    return [block for block in page_blocks(page) if block.language in RUN_LANGUAGES]


PAGES_WITH_EXAMPLES = [page for page in PAGES if any(b.not_run is None for b in python_blocks(page))]
MARKED = [block for page in PAGES for block in python_blocks(page) if block.not_run is not None]
OTHER_PYTHON_FENCES = [block for page in PAGES for block in page_blocks(page)
                       if block.language.lower().startswith("py") and block.language not in RUN_LANGUAGES]


def test_the_examples_are_found():
    """The runner sees the pages that have examples of each kind (a renamed fence would silently
    test nothing)."""
    languages = {(page.name, block.language) for page in PAGES_WITH_EXAMPLES for block in python_blocks(page)}
    assert ("python-api.md", "pycon") in languages and ("python-api.md", "python") in languages
    assert ("reading-guide.md", "python") in languages


@pytest.mark.parametrize("block", MARKED, ids=lambda b: b.where)
def test_a_block_not_run_says_why(block: Block) -> None:
    assert len(block.not_run or "") >= 10, f"{block.where}: say why the block is not run (got {block.not_run!r})"


def test_python_fences_are_python_or_pycon():
    """A ```py or ```python3 block would be neither run nor checked: name it python or pycon."""
    assert not OTHER_PYTHON_FENCES, "\n".join(
        f"{b.where}: a ```{b.language} block; use ```python (run) or ```pycon (run, output compared)"
        for b in OTHER_PYTHON_FENCES)


def remembering(load: Callable[..., Any]) -> Callable[..., Any]:
    """``load`` that returns the object of an earlier call with the same arguments (defaults filled)."""
    signature = inspect.signature(load)
    loaded: dict[str, Any] = {}

    @functools.wraps(load)
    def cached(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = repr(sorted((name, str(value)) for name, value in bound.arguments.items()))
        if key not in loaded:
            loaded[key] = load(*args, **kwargs)
        return loaded[key]

    return cached


@pytest.fixture(scope="module", autouse=True)
def _one_load_per_model(shared_text_models: Callable[..., Any]) -> Iterator[None]:
    """This module's tests share the models they load (the module docstring); other modules never
    see the patch. ``load_text_model`` is the session's (tests/conftest.py's ``shared_text_models``:
    a 4-bit SmolLM2 that tests/consistency or tests/serve loaded is not loaded again, and
    ``aiayn.load``'s device "auto" shares the load of device None). Both are looked up at call
    time (``aiayn.load``, ``read_text_model`` and the pages import them inside functions or
    blocks), so patching the attributes reaches every caller."""
    import aiayn.interop
    import aiayn.tasks.runs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aiayn.tasks.runs, "load_text_model", shared_text_models)
        patch.setattr(aiayn.interop, "load_gguf", remembering(aiayn.interop.load_gguf))
        yield


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_page_examples(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # what an example writes (export_hf's "out-dir") lands in a scratch folder
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    for block in python_blocks(page):
        if block.not_run is not None:
            continue
        source = "\n".join(block.lines) + "\n"
        if block.language == "pycon":
            # block.line is the fence's 1-based line: the body starts on 0-based line block.line
            test = parser.get_doctest(source, namespace, block.where, str(page), block.line)
            runner.run(test, out=report.append, clear_globs=False)
            namespace = test.globs  # a DocTest runs in a copy: the next block goes on from this one's
            continue
        code = compile("\n" * block.line + source, str(page), "exec")  # tracebacks give the page's lines
        try:
            exec(code, namespace)
        except Exception:
            pytest.fail(f"{block.where}: the python block raised\n{traceback.format_exc(limit=-3)}", pytrace=False)
    summary = runner.summarize(verbose=False)
    assert summary.failed == 0, "".join(report)
