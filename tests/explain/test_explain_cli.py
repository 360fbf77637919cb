"""`aiayn explain`: the list of topics, one topic's page and plot, its errors."""

from __future__ import annotations

import pytest

from aiayn.cli import main
from aiayn.explain import TOPICS


def test_lists_the_topics(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["explain"])
    assert exited.value.code == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(TOPICS)


def test_runs_one_topic_through_the_real_command(tmp_path, run_aiayn_process):
    result = run_aiayn_process("explain", "scaling", "--quick", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Variance of q·k" in result.stdout and f"page: {tmp_path / 'scaling.md'}" in result.stdout
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert "aiayn explain scaling --out" in (tmp_path / "scaling.md").read_text(encoding="utf-8")


def test_errors_exit_2_in_one_line(capsys):
    for args, needle in ((["nope"], "unknown topic 'nope'; topics: scaling"),
                         (["scaling", "--all"], "give a TOPIC or --all, not both")):
        with pytest.raises(SystemExit) as exited:
            main(["explain", *args])
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and needle in stderr and "Traceback" not in stderr
