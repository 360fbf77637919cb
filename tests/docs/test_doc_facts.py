"""Facts the pages repeat have one source, the code: each quote of one is checked against it.

* docs/generation.md's table of generation defaults equals the defaults of `aiayn generate`,
  ``generate_text``, ``generate_json`` and the server's request models;
* a shipped model's score, wherever a page quotes it beside the model, is the score `aiayn models`
  reports (aiayn/pretrained/*/release.json), and "missed by" the published goals is their
  difference;
* the limits the pages state: the server's keep-alive, the memory check's margin, the torch
  version the set-up installs.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import click
import pytest
from test_doc_links import prose_lines as prose
from test_doc_shell_examples import REPO
from test_doc_style import PAGES, name

from aiayn.api import generate_text
from aiayn.cli import cli
from aiayn.generate.constrain import generate_json
from aiayn.serve import schemas
from aiayn.train import memory

GENERATION = REPO / "docs" / "generation.md"


def option_default(verb: str, option: str):
    command = cli.commands[verb]
    assert isinstance(command, click.Command)
    return next(p for p in command.params if f"--{option}" in p.opts).default


def table_rows(page: Path):
    """(line number, header cells, cells) of each body row of each markdown table on ``page``."""
    header = None
    for number, line in prose(page):
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            yield number, header, cells


def table(page: Path) -> dict[str, dict[str, str]]:
    """The first markdown table of ``page``: {row name: {column name: cell}}."""
    rows = list(table_rows(page))
    first = rows[0][1]
    return {cells[0]: dict(zip([h.strip("`") for h in first[1:]], cells[1:], strict=True))
            for _, header, cells in rows if header is first}


def shown(value) -> str:
    """How the table writes a default: a number, or "off" for None (or click's unset)."""
    return "off" if value is None or "UNSET" in repr(value) else str(value)


def test_the_generation_defaults_table_is_the_codes():
    text = inspect.signature(generate_text).parameters
    json_ = inspect.signature(generate_json).parameters
    expected = {
        "temperature": [option_default("generate", "temperature"), text["temperature"].default,
                        "greedy" if json_["sampling"].default is None else None,
                        schemas.DEFAULT_TEMPERATURE, schemas.DEFAULT_TEMPERATURE],
        "top-p": [option_default("generate", "top-p"), text["top_p"].default, None,
                  schemas.DEFAULT_TOP_P, schemas.DEFAULT_TOP_P],
        "top-k": [option_default("generate", "top-k"), text["top_k"].default, None,
                  schemas.GenerationRequest.model_fields["top_k"].default,
                  schemas.CompletionRequest.model_fields["top_k"].default],
        "repetition penalty": [option_default("generate", "repetition-penalty"), text["repetition_penalty"].default,
                               None, 1.0, 1.0],
        "tokens to generate": [option_default("generate", "max-new-tokens"), text["max_new_tokens"].default,
                               json_["max_new_tokens"].default, "the rest of the context",
                               schemas.CompletionRequest.model_fields["max_tokens"].default],
        "chat template": ["on" if option_default("generate", "chat") is True else "off",
                          "on" if text["chat"].default else "off", "on" if json_["chat"].default else "off",
                          "on", "off"],
    }
    assert schemas.ChatCompletionRequest.model_fields["max_tokens"].default is None  # the rest of the context
    assert schemas.ResponsesRequest.model_fields["max_output_tokens"].default is None
    page = table(GENERATION)
    for row, values in expected.items():
        assert row in page, f"docs/generation.md has no row {row!r}"
        got = list(page[row].values())
        assert got == [shown(v) for v in values], f"docs/generation.md, {row}: the page says {got}, the code {values}"


SHIPPED = {path.parent.name: json.loads(path.read_text())["scores"]
           for path in (REPO / "aiayn" / "pretrained").glob("*/release.json")}
NUMBER = re.compile(r"(?<![\w.])(\d{2}\.\d{2})(?![\w.])")  # scores are quoted with two decimals


def mentions(line: str, model: str) -> bool:
    """Whether ``line`` names the shipped model (not a recipe or run named after it)."""
    return re.search(rf"(?<![\w/.-]){re.escape(model)}(?![\w.-])", line) is not None


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_a_shipped_score_is_the_released_one(page: Path):
    """A line that names a shipped translation model and quotes a number within 0.1 of one of its
    scores quotes that score (a rounding of another scoring is the contradiction this catches; a
    float32 re-score is said to be one)."""
    wrong = []
    for number, line in prose(page):
        if "float32" in line:
            continue
        for model, scores in SHIPPED.items():
            if not mentions(line, model):
                continue
            released = [round(v, 2) for v in scores.values()]
            for quoted in map(float, NUMBER.findall(line)):
                near = [v for v in released if abs(v - quoted) <= 0.1]
                if near and quoted not in released:
                    wrong.append(f"{name(page)}:{number}: {quoted} beside {model} (released: {near[0]:.2f})")
    assert not wrong, "\n".join(wrong)


def metric(header: str) -> str | None:
    """The release.json score a table column holds, by its header."""
    header = header.lower()
    for words, key in (("val", "val_bleu"), ("lower-cased", "test2016_bleu_lc"), ("chrf", "test2016_chrf"),
                       ("bleu", "test2016_bleu")):
        if words in header:
            return key
    return None


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_a_shipped_models_row_gives_its_released_scores(page: Path):
    """In a table whose row starts with a shipped model's name, each score column (a header such as
    "BLEU", "chrF", "val BLEU", or "BLEU / chrF / lower-cased BLEU" with as many values) gives the
    released score."""
    wrong = []
    for number, header, cells in table_rows(page):
        model = cells[0].strip("`")
        if model not in SHIPPED or len(cells) != len(header):
            continue
        for title, cell in zip(header, cells, strict=True):
            names, values = title.split("/"), cell.replace("*", "").split("/")
            if len(names) != len(values):
                continue
            for title_part, value in zip(names, values, strict=True):
                key = metric(title_part)
                quoted = re.fullmatch(r"\s*(\d+\.\d+)\s*", value)
                if key and quoted and key in SHIPPED[model] and float(quoted.group(1)) != round(SHIPPED[model][key], 2):
                    wrong.append(f"{name(page)}:{number}: {model} {title_part.strip()} {quoted.group(1)}; "
                                 f"released: {SHIPPED[model][key]:.2f}")
    assert not wrong, "\n".join(wrong)


KEEP_ALIVE = re.compile(r"(?:keeps an idle connection|keep-alive default(?: is)?|`--keep-alive S?` \|)\s*(\d+(?:\.\d+)?)"
                        r"|server's (\d+(?:\.\d+)?) s keep-alive")
GOALS = {"multi30k-en-de": 41.0, "multi30k-de-en": 43.0}


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_the_goals_are_missed_by_the_difference(page: Path):
    misses = {f"{goal - SHIPPED[model]['test2016_bleu']:.2f}" for model, goal in GOALS.items()}
    for number, line in prose(page):
        for quoted in re.findall(r"missed[^.]*?\bby (\d\.\d\d)\b", line):
            assert quoted in misses, f"{name(page)}:{number}: missed by {quoted}; the shipped scores miss by {misses}"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_the_stated_limits_are_the_codes(page: Path):
    keep_alive = option_default("serve", "keep-alive")
    installed = re.search(r"torch==([\d.]+)", (REPO / "scripts" / "test.sh").read_text()).group(1)
    text = page.read_text(encoding="utf-8")
    for quoted in (a or b for a, b in KEEP_ALIVE.findall(text)):
        assert float(quoted) == keep_alive, f"{name(page)}: keep-alive {quoted} s; the default is {keep_alive} s"
    for quoted in re.findall(r"(?:estimate|memory check)[^.\n]*?within (\d+) ?%", text):
        assert int(quoted) == round(memory.MARGIN * 100), f"{name(page)}: the estimate within {quoted}%"
    for quoted in re.findall(r"torch==([\d.]+)", text):
        assert quoted == installed, f"{name(page)}: torch=={quoted}; scripts/test.sh installs torch=={installed}"


def test_the_installed_torch_is_in_the_packages_range():
    pyproject = (REPO / "pyproject.toml").read_text()
    installed = re.search(r"torch==([\d.]+)", (REPO / "scripts" / "test.sh").read_text()).group(1)
    low, high = re.search(r'"torch>=([\d.]+),<([\d.]+)"', pyproject).groups()
    version = tuple(map(int, installed.split(".")))
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split(".")))


def all_options() -> dict[str, list]:
    """Every option of every command, by its long name: the defaults it has across the verbs."""
    found: dict[str, list] = {}

    def visit(group: click.Group) -> None:
        for verb in group.commands.values():
            if isinstance(verb, click.Group):
                visit(verb)
                continue
            for param in verb.params:
                for opt in param.opts:
                    found.setdefault(opt, []).append(param.default)
    visit(cli)
    return found


def same_default(cell: str, default) -> bool | None:
    """Whether a table's default cell states ``default``; None when the cell describes it in words."""
    text = re.sub(r"[`*]", "", cell).strip()
    word = text.split(" ")[0].rstrip(",;")
    if re.fullmatch(r"-?\d[\d,]*(?:\.\d+)?(?: s| seconds)?", text):
        number = float(word.replace(",", ""))  # a bare number (a unit at most)
        return isinstance(default, (int, float)) and not isinstance(default, bool) and float(default) == number
    if re.match(r"-?\d", word):
        return None  # a number with words: described
    if word.lower() in {"none", "off", "-", "—"}:
        return default is None or default is False or "UNSET" in repr(default) or str(default).lower() == word.lower()
    if word.lower() in {"on", "true"}:
        return default is True
    if re.fullmatch(r"[\w.:-]+", word) and word.islower() and isinstance(default, str):
        return word == default
    return None


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_an_options_table_gives_the_codes_defaults(page: Path):
    """In a table with a "default" column, a row that starts with `--option` states a default that
    option has (on at least one verb that takes it), unless the cell describes it in words."""
    options = all_options()
    wrong = []
    for number, header, cells in table_rows(page):
        header = [cell.lower() for cell in header]
        if "default" not in header:
            continue
        option = re.match(r"`(--[\w-]+)", cells[0])
        if not option:
            continue
        assert option.group(1) in options, f"{name(page)}:{number}: {option.group(1)} is no option of aiayn"
        cell = cells[header.index("default")]
        verdicts = [same_default(cell, default) for default in options[option.group(1)]]
        if None not in verdicts and not any(verdicts):
            wrong.append(f"{name(page)}:{number}: {option.group(1)} default {cell!r}; the code: {options[option.group(1)]}")
    assert not wrong, "\n".join(wrong)
