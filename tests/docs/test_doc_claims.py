"""Claims of the pages' prose that the code can answer at once: the commands the README lists, the
verbs the docs say take ``--threads``, and the packages the README's layout names."""

from __future__ import annotations

import re

import click
from test_doc_shell_examples import REPO

from aiayn.cli import cli

README = (REPO / "README.md").read_text(encoding="utf-8")
ROBUSTNESS = (REPO / "docs" / "robustness.md").read_text(encoding="utf-8")


def command(path: str) -> click.Command:
    """The click command of ``aiayn PATH`` (``"plot attention"``)."""
    found: click.Command = cli
    for name in path.split():
        assert isinstance(found, click.Group), f"aiayn {path}: {found.name} has no subcommands"
        found = found.commands[name]
    return found


def test_the_readme_lists_every_command():
    """'Every command has --help: `aiayn train | tasks | ...`' names the verbs `aiayn --help` shows."""
    listed = re.search(r"Every command has `--help`: `aiayn ([^`]+)`", README)
    assert listed, "the README's list of commands was not found"
    named = {name.strip() for name in listed.group(1).split("|")}
    shown = {name for name, verb in cli.commands.items() if not verb.hidden}
    assert named == shown, f"listed but not a command: {named - shown}; a command not listed: {shown - named}"


def test_the_verbs_said_to_take_threads_take_it():
    """docs/robustness.md names the verbs that have --threads; each has it."""
    listed = re.search(r"which every verb that runs a model has: ([a-z ,\n]+);", ROBUSTNESS)
    assert listed, "docs/robustness.md's list of the verbs with --threads was not found"
    verbs = [verb.strip() for verb in listed.group(1).replace("\n", " ").split(",")]
    assert len(verbs) >= 6, verbs
    without = [verb for verb in verbs if "--threads" not in {o for p in command(verb).params for o in p.opts}]
    assert not without, f"said to take --threads but do not: {without}"


def test_the_readme_layout_names_every_package():
    """The README's `aiayn/` tree names each subpackage of aiayn/, and each name it gives exists."""
    tree = re.search(r"```\naiayn/\n(.*?)```", README, re.S)
    assert tree, "the README's layout of aiayn/ was not found"
    named = set(re.findall(r"^  ([\w.]+/?)\s", tree.group(1), re.M))
    packages = {f"{p.parent.name}/" for p in (REPO / "aiayn").glob("*/__init__.py")}
    assert packages <= named, f"packages the README's layout leaves out: {sorted(packages - named)}"
    missing = sorted(name for name in named if not (REPO / "aiayn" / name).exists())
    assert not missing, f"named in the README's layout but not in aiayn/: {missing}"
