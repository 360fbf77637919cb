"""`aiayn explain`: the list of topics, one topic's page and plot, its errors."""

from __future__ import annotations

import subprocess
import sys

from aiayn.explain import TOPICS


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", "explain", *args], capture_output=True, text=True,
                          timeout=300)


def test_lists_the_topics_and_runs_one(tmp_path):
    listing = run_cli()
    assert listing.returncode == 0, listing.stderr
    assert [line.split()[0] for line in listing.stdout.splitlines()] == list(TOPICS)
    result = run_cli("scaling", "--quick", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Variance of q·k" in result.stdout and f"page: {tmp_path / 'scaling.md'}" in result.stdout
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert "aiayn explain scaling --out" in (tmp_path / "scaling.md").read_text(encoding="utf-8")


def test_errors_exit_2_in_one_line():
    for args, needle in ((["nope"], "unknown topic 'nope'; topics: scaling"),
                         (["scaling", "--all"], "give a TOPIC or --all, not both")):
        result = run_cli(*args)
        assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr
