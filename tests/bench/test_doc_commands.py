"""Every benchmark command the docs quote still takes its options: each is parsed by its
benchmark's own parser (the run stops right after parsing; nothing is measured)."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# ``python -m benchmarks`` hands its options to each of these (benchmarks/__main__.py).
PEER_SUITE = ("benchmarks.train", "benchmarks.decode", "benchmarks.attention", "benchmarks.kv_cache")


def quoted_commands() -> list[tuple[str, str]]:
    """(module, options) of every ``python -m benchmarks...`` in README.md and docs/, a command
    in inline code read across its line breaks, one in a code block across its backslashes."""
    found = set()
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        parts = page.read_text().replace("\\\n", " ").split("```")  # prose, block, prose, ...
        prose = [re.sub(r"`[^`]*`", lambda m: m[0].replace("\n", " "), p) for p in parts[::2]]
        for module, options in re.findall(r"python -m (benchmarks(?:\.\w+)?)([^`#|\n]*)", "\n".join(prose + parts[1::2])):
            if "..." not in options:
                found.add((module, options.strip()))
    return sorted(found)


class Parsed(Exception):
    """Raised by the patched parser once the options are parsed."""


@pytest.mark.parametrize(("module", "options"), quoted_commands())
def test_a_quoted_command_parses(module, options, monkeypatch):
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)  # a wrong option exits here, status 2
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for name in PEER_SUITE if module == "benchmarks" else (module,):
        with pytest.raises(Parsed):
            importlib.import_module(name).main(shlex.split(options))


def test_the_docs_quote_commands():
    modules = {module for module, _ in quoted_commands()}
    assert {"benchmarks", "benchmarks.train", "benchmarks.gpu", "benchmarks.serve", "benchmarks.fast"} <= modules
