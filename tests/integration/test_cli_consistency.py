"""Options that mean the same on every verb: ``-`` reads standard input, ``--threads`` sets torch's
CPU threads (training, translation, evaluation too), and an impossible thread count is one line."""

from __future__ import annotations

import subprocess
import sys

SENTENCE = "A man is riding a bike."


def aiayn(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_translate_dash_reads_standard_input_and_threads_change_nothing():
    direct = aiayn("translate", SENTENCE)
    assert direct.returncode == 0, direct.stderr
    piped = aiayn("translate", "-", "--threads", "1", stdin=SENTENCE + "\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout and piped.stdout.strip() not in ("", "-")


def test_train_takes_threads(tmp_path):
    result = aiayn("train", "--max-steps", "2", "--threads", "1", "--no-progress", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "summary.json").is_file()


def test_too_many_threads_is_one_line():
    for args in (["train"], ["translate", SENTENCE], ["evaluate", "--src", "x", "--ref", "y"]):
        result = aiayn(*args, "--threads", "100000")
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
        assert "more than 4 per CPU" in result.stderr


def test_every_option_of_every_command_has_help_text():
    import click

    from aiayn.cli import cli

    def commands(command: click.Command, path: str):
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from commands(sub, f"{path} {name}")
        else:
            yield path, command

    missing = [f"{path} {param.opts[0]}" for path, command in commands(cli, "aiayn") for param in command.params
               if isinstance(param, click.Option) and not param.hidden and not param.help]
    assert not missing, missing
