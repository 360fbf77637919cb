"""A peer whose library is not installed is a row naming the extra that installs it, and the
benchmark goes on with the others (``benchmarks.common.load_peer``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_missing_peer_is_a_row_and_the_benchmark_goes_on(tmp_path):
    """benchmarks.decode with x-transformers made unimportable (a stub that raises on import)."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "x_transformers.py").write_text(
        "raise ModuleNotFoundError('hidden by the test', name='x_transformers')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--peers", "aiayn", "x-transformers",
                           "--batch", "1", "--new-tokens", "2", "--prompt-len", "4", "--no-recompute",
                           "--no-compiled", "--no-overhead", "--repeats", "1", "--warmup", "0", "--threads", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
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
