"""Options that mean the same on every verb: ``-`` reads standard input, ``--threads`` sets torch's
CPU threads (training, translation, evaluation too), and an impossible thread count is one line."""

from __future__ import annotations

import subprocess
import sys

SENTENCE = "A man is riding a bike."


def aiayn(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_translate_dash_reads_standard_input_and_threads_change_nothing(run_aiayn):
    """Standard input needs a child process; the direct run is in this process (at its default
    thread count, as a fresh process has it)."""
    code, direct, err = run_aiayn("translate", SENTENCE)
    assert code == 0, err
    piped = aiayn("translate", "-", "--threads", "1", stdin=SENTENCE + "\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct and piped.stdout.strip() not in ("", "-")


def test_train_takes_threads(tmp_path, run_aiayn):
    code, _, err = run_aiayn("train", "--max-steps", "2", "--threads", "1", "--no-progress",
                             "--run-dir", str(tmp_path / "run"))
    assert code == 0, err
    assert (tmp_path / "run" / "summary.json").is_file()


def test_too_many_threads_is_one_line(run_aiayn):
    for args in (["train"], ["translate", SENTENCE], ["evaluate", "--src", "x", "--ref", "y"]):
        code, _, err = run_aiayn(*args, "--threads", "100000")
        assert code == 2, err
        assert err.startswith("Error: ") and err.count("\n") == 1, err
        assert "more than 4 per CPU" in err


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
