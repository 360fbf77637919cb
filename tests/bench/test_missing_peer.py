"""A peer whose library is not installed is a row naming the extra that installs it, and the
benchmark goes on with the others (``benchmarks.common.load_peer``); a library the benchmark itself
needs ends it with that row, never a traceback (``benchmarks.common.require``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def hidden(tmp_path: Path, module: str, *command: str) -> subprocess.CompletedProcess:
    """``python -m COMMAND`` with ``module`` made unimportable (a stub that raises on import)."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / f"{module}.py").write_text(f"raise ModuleNotFoundError('hidden by the test', name={module!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), str(REPO)])}
    return subprocess.run([sys.executable, "-m", *command], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_missing_peer_is_a_row_and_the_benchmark_goes_on(tmp_path):
    done = hidden(tmp_path, "x_transformers", "benchmarks.decode", "--peers", "aiayn", "x-transformers",
                  "--batch", "1", "--new-tokens", "2", "--prompt-len", "4", "--no-recompute", "--no-compiled",
                  "--no-overhead", "--repeats", "1", "--warmup", "0", "--threads", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "* x-transformers: not installed (pip install -e '.[bench]')" in done.stdout
    assert "| 1 | on | aiayn |" in done.stdout and "Traceback" not in done.stderr
    assert " UTC; `python -m benchmarks.decode --peers aiayn x-transformers --batch 1 " in done.stdout  # the header


def test_the_row_names_the_extra(monkeypatch, capsys):
    from benchmarks import common

    monkeypatch.setattr(common, "MISSING", {})
    monkeypatch.setattr(common, "HEADER_SHOWN", True)  # a header is out: the row is printed at once
    monkeypatch.setitem(sys.modules, "x_transformers", None)  # import x_transformers raises ImportError

    def build():
        import x_transformers

        return x_transformers

    assert common.load_peer("x-transformers", build) is None
    assert common.load_peer("x-transformers", build) is None  # its row once
    assert common.load_peer("plain", lambda: 3) == 3
    assert capsys.readouterr().out == "* x-transformers: not installed (pip install -e '.[bench]')\n"


@pytest.mark.slow  # training steps of a small decoder and the measured matmul peaks
def test_the_training_benchmark_without_x_transformers(tmp_path):
    done = hidden(tmp_path, "x_transformers", "benchmarks.train", "--suite", "decoder", "--quick", "--peers",
                  "aiayn", "x-transformers", "--no-compiled", "--no-plain", "--repeats", "1", "--warmup", "0",
                  "--threads", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "* x-transformers: not installed (pip install -e '.[bench]')" in done.stdout
    assert "| aiayn |" in done.stdout and "Traceback" not in done.stderr


def test_a_missing_client_ends_the_benchmark_with_its_row(tmp_path):
    """benchmarks.serve's clients are openai's: without it, the row and exit status 1, before any server starts."""
    done = hidden(tmp_path, "openai", "benchmarks.serve", "--no-hf")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "openai: not installed (pip install -e '.[test]')\n"


def test_llama_cpp_row_names_its_install_command(monkeypatch, capsys):
    from benchmarks import common, llama_cpp

    monkeypatch.setattr(common, "MISSING", {})
    monkeypatch.setattr(common, "HEADER_SHOWN", True)
    monkeypatch.setattr(llama_cpp, "llama_cpp_cffi_library", lambda: None)  # llama-cpp-cffi absent
    assert common.load_peer("llama.cpp", llama_cpp.LlamaCpp, "model.gguf", 1) is None
    assert capsys.readouterr().out == ("* llama.cpp: not installed (pip install cffi && pip install --no-deps "
                                       "llama-cpp-cffi)\n")
