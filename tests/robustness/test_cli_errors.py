"""Every failure of the command line is one line on stderr, with the exit code that says whose it
is (2: the command or its inputs, 1: the work itself, 130: interrupted), and no traceback unless
asked for (AIAYN_DEBUG=1, aiayn --debug). The run-directory and divergence cases are in
test_run_dirs.py and test_divergence.py, the chat templates in test_templates.py."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aiayn.cli as cli_module
from aiayn.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run_main(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return info.value.code, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("Error: ")
    return lines[0]


BAD_OPTIONS = [
    (["generate", "--model", "README.md", "--prompt", "hi", "--threads", "100000"],
     r"--threads.*100000 threads is more than 4 per CPU .* give at most \d+"),
    (["generate", "--model", "README.md", "--prompt", "hi", "--temperature", "nan"],
     r"'nan' is not a finite number"),
    (["generate", "--model", "README.md", "--prompt", "hi", "--top-p", "inf"], r"--top-p.*inf is not in the range"),
    (["generate", "--model", "README.md", "--prompt", "hi", "--seed", str(2**70)], r"--seed.*not in the range"),
    (["generate", "--model", "README.md", "--prompt", "ab\udcff"],
     r"--prompt is not UTF-8 text \(an undecodable byte at byte 2\)"),
    (["translate", "--run", "nowhere", "ein \udcffHund"], r"the text is not UTF-8 text \(an undecodable byte at byte 4\)"),
    (["embed", "--model", "README.md", "ok", "caf\udce9"], r"the text is not UTF-8 text \(an undecodable byte at byte 3\)"),
    (["train", "--task", "reverse", "--lr", "nan"], r"--lr.*'nan' is not a finite number"),
    (["translate", "--run", "nowhere", "--beam", "4", "--length-penalty", "-inf", "hello"], r"--length-penalty"),
    (["demo", "--seed", "-1"], r"--seed.*-1 is not in the range"),
]


@pytest.mark.parametrize(("args", "message"), BAD_OPTIONS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_OPTIONS])
def test_bad_option_is_one_usage_line(args, message, capsys):
    code, err = run_main(args, capsys)
    assert code == 2
    assert __import__("re").search(message, one_line(err)), err


def test_evaluate_inputs_are_checked_before_any_model_is_loaded(tmp_path, capsys):
    src, ref, empty = tmp_path / "src.txt", tmp_path / "ref.txt", tmp_path / "empty.txt"
    src.write_text("ein Hund\n", encoding="utf-8")
    ref.write_text("a dog\n", encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("ein Hund läuft\n".encode("latin-1"))
    two = tmp_path / "two.txt"
    two.write_text("a dog\na cat\n", encoding="utf-8")
    cases = [
        (["--src", str(empty), "--ref", str(ref)], r"empty.txt is empty"),
        (["--src", str(src), "--ref", str(two)], r"misaligned parallel files"),
        (["--src", str(latin1), "--ref", str(ref)], r"line 1: not UTF-8 \(byte 0xe4 at column 11\)"),
        (["--src", str(src), "--ref", str(ref), "--out", str(tmp_path / "no" / "such" / "hyp.txt")],
         r"--out.*there is no folder"),
        (["--src", str(src), "--ref", str(ref), "--out", str(tmp_path)], r"--out.*is a directory"),
        (["--src", str(src), "--ref", str(ref)], r"nowhere"),  # only now: the run that is not there
    ]
    for args, message in cases:
        code, err = run_main(["evaluate", "--run", str(tmp_path / "nowhere"), *args], capsys)
        assert code == 2 and __import__("re").search(message, one_line(err)), (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "latin1.txt", "ref.txt", "src.txt", "two.txt"]


@pytest.mark.parametrize(("error", "code", "message"), [
    (RuntimeError("boom"), 1, r"internal error: RuntimeError: boom \(run again with AIAYN_DEBUG=1"),
    (MemoryError(), 1, r"out of memory: the model or batch does not fit"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/run/metrics.csv"), 1,
     r"No space left on device: /data/run/metrics.csv"),
])
def test_failures_of_the_work_are_one_line_exit_1(error, code, message, capsys, monkeypatch):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(cli_module.cli, "main", fail)
    monkeypatch.delenv("AIAYN_DEBUG", raising=False)
    got, err = run_main(["presets"], capsys)
    assert got == code and __import__("re").search(message, one_line(err)), err
    # With AIAYN_DEBUG=1 or --debug the exception itself comes out (its traceback).
    monkeypatch.setenv("AIAYN_DEBUG", "1")
    with pytest.raises(type(error)):
        main(["presets"])
    monkeypatch.delenv("AIAYN_DEBUG")
    with pytest.raises(type(error)):
        main(["--debug", "presets"])


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_rank_0_speaks_at_once_and_a_lone_failing_rank_after_the_grace(rank, capsys, monkeypatch):
    # torchrun stops every worker once one exits: rank 0 says the line at once; a rank > 0 waits
    # (torchrun ends it there when rank 0 failed alike), then says its own line, named, so that a
    # failure of one rank alone (out of memory on one card) does not end the job in silence.
    def fail(*args, **kwargs):
        raise MemoryError

    slept = []
    monkeypatch.setattr(cli_module.cli, "main", fail)
    monkeypatch.setattr(cli_module.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("AIAYN_DEBUG", raising=False)
    code, err = run_main(["presets"], capsys)
    said = "out of memory: the model or batch does not fit; try a smaller model, batch or --max-new-tokens"
    assert code == 1
    if rank == "0":
        assert slept == [] and err == f"Error: {said}\n"
    else:
        assert slept == [cli_module.RANK_REPORT_GRACE_S] and err == f"Error (rank 1): {said}\n"
    assert 1 <= cli_module.RANK_REPORT_GRACE_S <= 10  # far above torchrun's 0.1 s poll; short to wait


def test_interrupt_is_one_word_exit_130(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module.cli, "main", interrupted)
    code, err = run_main(["presets"], capsys)
    assert code == 130 and err.strip() == "Interrupted."


def aiayn(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True, cwd=ROOT, timeout=120,
                          env={**os.environ, **(env or {})}, **kwargs)


def test_a_corrupt_model_file_and_the_debug_switch(tmp_path):
    lying = tmp_path / "lying.gguf"  # a GGUF header that promises 2^63 tensors
    lying.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**63 - 1).to_bytes(8, "little") + bytes(8))
    quiet = aiayn("generate", "--model", str(lying), "--prompt", "hi", env={"AIAYN_DEBUG": "0"})
    assert quiet.returncode == 2, quiet.stderr
    err = quiet.stderr.decode()
    assert "Traceback" not in err and one_line(err).startswith(f"Error: {lying}")
    loud = aiayn("--debug", "generate", "--model", str(lying), "--prompt", "hi")
    assert loud.returncode != 0 and b"Traceback" in loud.stderr


def test_a_closed_pipe_ends_quietly():
    # `aiayn presets | head -c 10`: the reader goes away; no traceback, no "Exception ignored".
    proc = subprocess.Popen([sys.executable, "-m", "aiayn", "presets"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert b"Traceback" not in err and b"Exception ignored" not in err, err


def test_odd_bytes_in_argv_reach_a_message():
    # A shell hands over bytes; Python decodes the undecodable ones to surrogates (os.fsdecode).
    proc = aiayn("generate", "--model", "README.md", "--prompt", os.fsdecode(b"caf\xe9"))
    assert proc.returncode == 2 and b"not UTF-8 text" in proc.stderr and b"Traceback" not in proc.stderr


def test_a_prompt_with_no_known_characters_is_named_not_a_dtype_error():
    from torch import nn

    from aiayn.textgen import TextModel

    vocabulary = {"a": 0, "b": 1}
    lm = TextModel(model=nn.Identity(), encode=lambda text: [vocabulary[c] for c in text if c in vocabulary],
                   decode=lambda ids: "", context=16)
    with pytest.raises(ValueError, match=r"the prompt is empty after tokenisation"):
        lm.prompt_ids("§§§")
    assert lm.prompt_ids("ab").tolist() == [[0, 1]]
