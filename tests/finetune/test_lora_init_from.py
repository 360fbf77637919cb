"""LoRA on a loaded model, end to end through the command line: ``aiayn train --init-from DIR
--lora-rank R`` saves only the adapters, the run loads as the source's weights plus them (and
generates what the merged model generates), resumes exactly, and ``aiayn adapter`` writes them
in PEFT's layout."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from aiayn.api import generate_text
from aiayn.finetune.lora import is_adapter_key
from aiayn.tasks.runs import load_text_model
from aiayn.tasks.sources import load_source
from aiayn.tasks.trained import load_run
from aiayn.train.checkpoint import latest_checkpoint

LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,k,v,o")
QUIET = ("--batch-size", "4", "--no-progress", "--lr", "1e-2", "--schedule", "constant")


def _train(run_aiayn, run_dir, source_dir, text_file, steps, *extra):
    code, out, err = run_aiayn("train", "--task", "text", "--data", str(text_file), "--init-from", str(source_dir),
                               "--max-steps", str(steps), "--save-every", "2", "--run-dir", str(run_dir), *LORA,
                               *QUIET, *extra)
    assert code == 0, err
    return out


def test_a_lora_fine_tune_of_a_loaded_model_keeps_only_adapters_and_loads_on_its_source(
        tmp_path, text_file, hf_dir, run_aiayn):
    source_dir = hf_dir("llama")
    _train(run_aiayn, tmp_path / "run", source_dir, text_file, 4)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    saved = load_file(ckpt / "model.safetensors")
    assert saved and all(is_adapter_key(k) for k in saved)
    assert json.loads((ckpt / "state.json").read_text())["weights"] == "adapters"
    assert any(bool(v.abs().sum()) for k, v in saved.items() if "lora_B" in k)  # trained: B left zero

    base = load_source(source_dir).model.state_dict()
    run = load_run(tmp_path / "run", prepare=False)
    for name, value in run.model.state_dict().items():  # the source's weights, the run's adapters
        expected = saved[name] if is_adapter_key(name) else base[name]
        torch.testing.assert_close(value, expected, rtol=0, atol=0)

    tokens = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        adapted = run.model(tokens).logits
        lm = load_text_model(tmp_path / "run", plain=True)  # merged for generation
        torch.testing.assert_close(lm.model(tokens).logits, adapted, rtol=1e-5, atol=1e-5)
        source_logits = load_source(source_dir).model.eval()(tokens).logits
    assert not torch.allclose(adapted, source_logits, atol=1e-4)  # fine-tuning changed the output
    code, out, err = run_aiayn("generate", "--run", str(tmp_path / "run"), "--prompt", "the quick",
                               "--max-new-tokens", "6", "--temperature", "0")
    assert code == 0 and out.startswith("the quick" + generate_text(lm, "the quick", max_new_tokens=6).text), err

    code, out, err = run_aiayn("adapter", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "adapter"))
    assert code == 0, err
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert set(config["target_modules"]) >= {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_a_lora_fine_tune_of_a_loaded_model_resumes_exactly(tmp_path, text_file, hf_dir, run_aiayn):
    """(A constant rate: a linear decay over 2 steps is not the first half of one over 4.)"""
    source_dir = hf_dir("gpt2")
    _train(run_aiayn, tmp_path / "straight", source_dir, text_file, 4)
    _train(run_aiayn, tmp_path / "resumed", source_dir, text_file, 2)
    code, _, err = run_aiayn("train", "--resume", "--run-dir", str(tmp_path / "resumed"), "--max-steps", "4",
                             "--no-progress")
    assert code == 0, err
    straight = load_file(latest_checkpoint(tmp_path / "straight" / "checkpoints") / "model.safetensors")
    resumed = load_file(latest_checkpoint(tmp_path / "resumed" / "checkpoints") / "model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
