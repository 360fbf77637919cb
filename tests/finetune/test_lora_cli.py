"""The LoRA commands: ``aiayn merge``, ``--adapter`` on generate and serve, ``--lora-*`` on train."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch.testing import assert_close

from aiayn.finetune.lora import LoraConfig, apply_lora, lora_state_dict
from aiayn.finetune.peft_format import save_adapter
from aiayn.serve.models import load_served_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
PROMPT = "w5 w9 w13 w2"


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    """An aiayn adapter (nonzero B) on the tiny LLaMA, naming it as its base."""
    _, hf_dir, base, config = tiny_llama
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=4, alpha=8, targets=("q", "v", "down")))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in lora_state_dict(model).values():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return save_adapter(model, config, tmp_path_factory.mktemp("adapter"), base=str(hf_dir))


def test_merge_writes_what_peft_computes(run_aiayn, tiny_llama, adapter, tmp_path, tokens):
    hf = tiny_llama[0]
    code, out, _ = run_aiayn("merge", "--adapter", str(adapter), "--out", str(tmp_path / "merged"))
    assert code == 0 and "model.safetensors" in out
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        expected = peft.PeftModel.from_pretrained(copy.deepcopy(hf), adapter).eval()(tokens).logits
        assert_close(merged(tokens).logits, expected)
    code, _, err = run_aiayn("merge", "--adapter", str(adapter), "--out", str(tmp_path / "merged"))
    assert code == 2 and "not an empty directory" in err


def test_generate_and_serve_with_an_adapter_are_the_merged_model(run_aiayn, tiny_llama, adapter, tmp_path):
    run_aiayn("merge", "--adapter", str(adapter), "--out", str(tmp_path / "merged"))
    greedy = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "6"]
    code, with_adapter, _ = run_aiayn("generate", "--adapter", str(adapter), *greedy)  # base: the adapter's
    assert code == 0
    assert with_adapter == run_aiayn("generate", "--model", str(tmp_path / "merged"), *greedy)[1]
    assert with_adapter != run_aiayn("generate", "--model", str(tiny_llama[1]), *greedy)[1]
    served = load_served_model(tiny_llama[1], adapter=adapter, plain=True, device="cpu")
    ids = torch.tensor([served.lm.encode(PROMPT)])
    merged = load_served_model(tmp_path / "merged", plain=True, device="cpu")
    with torch.no_grad():
        assert_close(served.lm.model(ids).logits, merged.lm.model(ids).logits)


def test_train_takes_lora_options(run_aiayn, tmp_path):
    run_dir = tmp_path / "run"
    code, _, err = run_aiayn("train", "--task", "reverse", "--run-dir", str(run_dir), "--max-steps", "2",
                             "--batch-size", "16", "--lora-rank", "2", "--lora-targets", "q,v,down",
                             "--no-progress")
    assert code == 0, err
    assert json.loads((run_dir / "config.json").read_text())["train"]["lora"] == {
        "rank": 2, "targets": ["q", "v", "down"]}
    code, _, err = run_aiayn("train", "--task", "reverse", "--lora-alpha", "4")
    assert code == 2 and "--lora-alpha needs --lora-rank" in err
    code, _, err = run_aiayn("train", "--task", "reverse", "--lora-rank", "2", "--lora-targets", "q,query")
    assert code == 2 and "query: choose from q, k, v, qkv, o, gate, up, down" in err
