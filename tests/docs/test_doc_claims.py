"""Claims of the pages' prose that the code can answer at once: the commands the README lists, the
verbs that take ``--threads``, ``--prompt -`` as standard input, and the packages the layout in
docs/architecture.md names."""

from __future__ import annotations

import io
import re

import click
from test_doc_shell_examples import REPO

from aiayn.cli import cli

README = (REPO / "README.md").read_text(encoding="utf-8")
ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")


def test_the_readme_lists_every_command():
    """'Every command has --help: `aiayn train | tasks | ...`' names the verbs `aiayn --help` shows."""
    listed = re.search(r"Every command has `--help`: `aiayn ([^`]+)`", README)
    assert listed, "the README's list of commands was not found"
    named = {name.strip() for name in listed.group(1).split("|")}
    shown = {name for name, verb in cli.commands.items() if not verb.hidden}
    assert named == shown, f"listed but not a command: {named - shown}; a command not listed: {shown - named}"


def commands(group: click.Group = cli, path: str = "") -> dict[str, click.Command]:
    """Every command of the CLI, subcommands included, by its path (``"plot attention"``)."""
    found: dict[str, click.Command] = {}
    for name, verb in group.commands.items():
        if isinstance(verb, click.Group):
            found.update(commands(verb, f"{path}{name} "))
        else:
            found[f"{path}{name}"] = verb
    return found


def options(verb: click.Command) -> set[str]:
    return {name for param in verb.params for name in param.opts}


def test_every_verb_that_runs_a_model_takes_threads():
    """The docs tie speed and reproducibility to the thread count (training.md, robustness.md), so
    every verb that runs a model (it takes --device) takes --threads."""
    running = {path: verb for path, verb in commands().items() if "--device" in options(verb)}
    assert {"train", "generate", "translate", "evaluate", "embed", "serve", "explore", "explain"} <= set(running)
    without = sorted(path for path, verb in running.items() if "--threads" not in options(verb))
    assert not without, f"verbs with --device but no --threads: {without}"


def test_the_layout_names_every_package():
    """docs/architecture.md's `aiayn/` tree names each subpackage of aiayn/, and each name it gives exists."""
    tree = re.search(r"```\naiayn/\n(.*?)```", ARCHITECTURE, re.S)
    assert tree, "the layout of aiayn/ in docs/architecture.md was not found"
    under = re.split(r"^\S", tree.group(1), maxsplit=1, flags=re.M)[0]  # up to the next top-level folder
    named = set(re.findall(r"^  ([\w.]+/?)\s", under, re.M))
    packages = {f"{p.parent.name}/" for p in (REPO / "aiayn").glob("*/__init__.py")}
    assert packages <= named, f"packages the layout leaves out: {sorted(packages - named)}"
    missing = sorted(name for name in named if not (REPO / "aiayn" / name).exists())
    assert not missing, f"named in the layout but not in aiayn/: {missing}"


def test_a_dash_prompt_reads_standard_input(run_aiayn, monkeypatch):
    """docs/pretrained.md: `--prompt -` reads the prompt from stdin, as `translate -` and `embed -`
    read theirs: the same greedy text as the prompt given as an argument."""
    args = ("generate", "--model", "shakespeare-char", "--temperature", "0", "--max-new-tokens", "8")
    code, given, _ = run_aiayn(*args, "--prompt", "ROMEO:")
    assert code == 0
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ROMEO:\n"), encoding="utf-8"))
    code, read, _ = run_aiayn(*args, "--prompt", "-")
    assert (code, read) == (0, given)
    assert read.startswith("ROMEO:") and len(read) > len("ROMEO:")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe"), encoding="utf-8"))
    code, _, err = run_aiayn(*args, "--prompt", "-")
    assert code == 2 and "not UTF-8" in err
