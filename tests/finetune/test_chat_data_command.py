"""``aiayn chat-data`` (parallel text as chat JSONL that the chat task reads back), the names
``--model`` / ``--init-from`` take besides paths (``smollm2``, one member of a shipped ensemble), and
``--adapter`` on ``aiayn evaluate``, which goes with ``--prompt``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiayn.finetune.chat import read_conversations
from aiayn.interop.gguf import smollm2_path
from aiayn.tasks.trained import RunInputError, resolve_model, shipped_path


def test_parallel_text_becomes_conversations_the_chat_task_reads(tmp_path, run_aiayn):
    (tmp_path / "s.en").write_text("Two dogs.\nA cat.\nA bird.\n", encoding="utf-8")
    (tmp_path / "s.de").write_text("Zwei Hunde.\nEine Katze.\nEin Vogel.\n", encoding="utf-8")
    out = tmp_path / "train.jsonl"
    code, stdout, err = run_aiayn("chat-data", "--src", str(tmp_path / "s.en"), "--tgt", str(tmp_path / "s.de"),
                                  "--prompt", "Translate to German: {src}", "--out", str(out), "--limit", "2")
    assert code == 0 and stdout == f"2 conversations -> {out}\n", err
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert first == {"messages": [{"role": "user", "content": "Translate to German: Two dogs."},
                                  {"role": "assistant", "content": "Zwei Hunde."}]}
    assert len(read_conversations(out)) == 2
    code, _, err = run_aiayn("chat-data", "--src", str(tmp_path / "s.en"), "--tgt", str(tmp_path / "s.de"),
                             "--prompt", "Translate", "--out", str(tmp_path / "x.jsonl"))
    assert code == 2 and "has no {src}" in err and not (tmp_path / "x.jsonl").exists()


def test_names_besides_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (no file of those names here)
    assert resolve_model("multi30k-en-de/seed0") == shipped_path("multi30k-en-de") / "seed0"
    if smollm2_path() is not None:
        assert resolve_model("smollm2") == smollm2_path()
    assert resolve_model("multi30k-en-de/seed9") == Path("multi30k-en-de/seed9")  # no such member: a path
    with pytest.raises(RunInputError, match="neither a shipped model"):
        resolve_model("no-such-model")


def test_evaluate_takes_an_adapter_only_with_a_prompt(tmp_path, run_aiayn):
    (tmp_path / "s.en").write_text("a\n", encoding="utf-8")
    (tmp_path / "adapter").mkdir()
    code, _, err = run_aiayn("evaluate", "--adapter", str(tmp_path / "adapter"), "--src", str(tmp_path / "s.en"),
                             "--ref", str(tmp_path / "s.en"))
    assert code == 2 and "--adapter goes with --prompt" in err, err
