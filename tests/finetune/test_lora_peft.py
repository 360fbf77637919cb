"""Adapters in PEFT's layout (aiayn.finetune.peft_format): an adapter trained in aiayn gives the same
logits when PEFT loads it onto the transformers model, and a PEFT adapter the same logits in aiayn."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch.testing import assert_close

from aiayn.finetune.lora import LoraConfig, apply_lora, lora_state_dict
from aiayn.finetune.peft_format import CONFIG_FILE, WEIGHTS_FILE, load_adapter, save_adapter
from aiayn.interop import InteropError

peft = pytest.importorskip("peft")


def _randomize_adapters(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_state_dict(model).values():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _peft_logits(hf, adapter_dir, tokens):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), adapter_dir).eval()
        return peft_model(tokens).logits


@pytest.mark.parametrize(("family", "targets", "modules"), [
    ("tiny_llama", ("q", "k", "v", "o", "gate", "up", "down"),
     ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ("tiny_llama", ("q", "v"), ["q_proj", "v_proj"]),
    ("tiny_gpt2", ("qkv", "o", "up", "down"), ["c_attn", "c_fc", "c_proj"]),
    ("tiny_gpt2", ("qkv", "o"), ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                                 "transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj"]),
])
def test_aiayn_adapter_loads_in_peft(request, tmp_path, tokens, family, targets, modules):
    hf, hf_dir, base, config = request.getfixturevalue(family)
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=4, alpha=8, targets=targets))
    _randomize_adapters(model)
    out = save_adapter(model, config, tmp_path / "adapter", base=str(hf_dir))
    saved = json.loads((out / CONFIG_FILE).read_text())
    assert (saved["peft_type"], saved["r"], saved["lora_alpha"], saved["task_type"]) == ("LORA", 4, 8, "CAUSAL_LM")
    assert saved["target_modules"] == modules and saved["base_model_name_or_path"] == str(hf_dir)
    with torch.no_grad():
        assert_close(model(tokens).logits, _peft_logits(hf, out, tokens))


@pytest.mark.parametrize(("family", "modules"), [
    ("tiny_llama", ["q_proj", "v_proj", "down_proj"]),
    ("tiny_llama", ["k_proj", "o_proj", "gate_proj", "up_proj"]),
    ("tiny_gpt2", ["c_attn", "c_proj"]),
])
def test_peft_adapter_loads_in_aiayn(request, tmp_path, tokens, family, modules):
    hf, _, base, config = request.getfixturevalue(family)
    torch.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # init_lora_weights=False: random B, so the adapter changes the logits
        theirs = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
            r=3, lora_alpha=5, target_modules=modules, init_lora_weights=False)).eval()
        theirs.save_pretrained(tmp_path)
    model = copy.deepcopy(base)
    lora = load_adapter(model, config, tmp_path)
    assert (lora.rank, lora.alpha) == (3, 5)
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert not torch.allclose(expected, hf(tokens).logits)
        assert_close(model(tokens).logits, expected)
    again = tmp_path / "again"  # and back: aiayn writes what it read
    save_adapter(model, config, again)
    with torch.no_grad():
        assert_close(_peft_logits(hf, again, tokens), expected)


def test_refusals(tiny_gpt2, tiny_llama, tmp_path):
    _, _, base, config = tiny_gpt2
    with pytest.raises(InteropError, match=r"adapter on q .* fused projection"):
        save_adapter(apply_lora(copy.deepcopy(base), LoraConfig(targets=("q",))), config, tmp_path / "q")
    _, _, llama, llama_config = tiny_llama
    save_adapter(apply_lora(copy.deepcopy(llama), LoraConfig(targets=("q",))), llama_config, tmp_path / "a")
    with pytest.raises(InteropError, match="fits no projection"):  # a LLaMA adapter on GPT-2
        load_adapter(copy.deepcopy(base), config, tmp_path / "a")
    data = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    (tmp_path / "a" / CONFIG_FILE).write_text(json.dumps({**data, "use_dora": True}))
    with pytest.raises(InteropError, match="use_dora is not supported"):
        load_adapter(copy.deepcopy(llama), llama_config, tmp_path / "a")
    (tmp_path / "a" / WEIGHTS_FILE).unlink()
    (tmp_path / "a" / CONFIG_FILE).write_text(json.dumps(data))
    with pytest.raises(InteropError, match=r"no adapter_model\.safetensors"):
        load_adapter(copy.deepcopy(llama), llama_config, tmp_path / "a")
