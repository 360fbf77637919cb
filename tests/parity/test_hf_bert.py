"""BERT loaded through ``aiayn.interop.load_hf`` equals Hugging Face: hidden states, pooled output
and MLM logits, with segments (token types) and a right-padded batch; the export round trip.

Three checkpoints, three namings: BertForPreTraining (``bert.`` prefix, pooler, MLM head and a
next-sentence head aiayn drops with a warning), BertForMaskedLM (``bert.`` prefix, no pooler) and
BertModel (no prefix, no MLM head). Hugging Face counts positions 0..t-1 over padding too, aiayn
over real tokens: with right padding the real tokens agree, and only they are compared.
"""

from __future__ import annotations

import re
import shutil
import warnings

import pytest
import torch
from hf_helpers import VOCAB, lengths_mask, random_tokens, randomize_hf_, save
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from aiayn.device import model_device
from aiayn.interop import export_hf, from_hf_model, load_hf

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_hidden_layers=2,
            intermediate_size=37, max_position_embeddings=64, type_vocab_size=2, pad_token_id=0)
CASES = {  # name -> (class, has pooler, has MLM head, expected warning)
    "pretraining": ("BertForPreTraining", True, True, "dropped the next-sentence head"),
    "masked-lm": ("BertForMaskedLM", False, True, "no tensors for the pooler"),
    "model": ("BertModel", True, False, "no tensors for the MLM head"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, device):
    """(name, HF model, aiayn model, aiayn config, warnings raised while loading); both models on
    ``device``."""
    cls, *_ = CASES[request.param]
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(**BASE, hidden_act="gelu")
    hf = randomize_hf_(getattr(transformers, cls)(hf_config), seed=1)
    path = save(hf, tmp_path_factory.mktemp(request.param))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, config = load_hf(path)
    return request.param, hf.to(device), model.to(device), config, [str(w.message) for w in caught]


def hf_outputs(hf, tokens, mask, segments) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(hidden, pooled or None, MLM logits or None) of any of the three classes."""
    out = hf(tokens, attention_mask=mask, token_type_ids=segments, output_hidden_states=True)
    if isinstance(hf, transformers.BertModel):
        return out.last_hidden_state, out.pooler_output, None
    logits = out.prediction_logits if isinstance(hf, transformers.BertForPreTraining) else out.logits
    pooled = hf.bert.pooler(out.hidden_states[-1]) if hf.bert.pooler is not None else None
    return out.hidden_states[-1], pooled, logits


def test_config_and_warnings(case):
    name, _, _, config, caught = case
    assert (config.arch, config.norm_position, config.positional, config.embedding_norm) == (
        "encoder-only", "post", "learned", True)
    assert config.norm_eps == 1e-12 and config.pad_id == 0 and config.type_vocab_size == 2
    expected = CASES[name][3]
    assert any(expected in w for w in caught), caught


@pytest.mark.parametrize("padded", [False, True], ids=["full", "right-padded"])
@torch.no_grad()
def test_outputs_match(case, padded):
    name, hf, model, _, _ = case
    _, has_pooler, has_mlm, _ = CASES[name]
    device = model_device(model)
    mask = lengths_mask([11, 7, 3] if padded else [11, 11, 11], 11, left=False, device=device)
    tokens = random_tokens((3, 11), seed=2, device=device).masked_fill(mask == 0, 0)
    segments = (torch.arange(11, device=device) >= 5).long().expand(3, 11) * mask
    hidden, pooled, logits = hf_outputs(hf, tokens, mask, segments)
    out = model(tokens, valid=mask.bool(), segments=segments)
    real = mask.bool()
    assert_close(out.hidden[real], hidden[real])
    if has_pooler:
        assert_close(out.pooled, pooled)
    if has_mlm:
        assert_close(out.logits[real], logits[real])


@torch.no_grad()
def test_from_hf_model_equals_load_hf(case, device):
    _, hf, model, _, _ = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted, _ = from_hf_model(hf)  # built on the CPU, as load_hf's model is
    converted = converted.to(device)
    tokens = random_tokens((2, 7), seed=5, device=device)
    a, b = converted(tokens), model(tokens)
    assert_close(a.hidden, b.hidden, rtol=0, atol=0)


@torch.no_grad()
def test_export_round_trip(case, tmp_path, device):
    """Exported as BertForMaskedLM + pooler: AutoModelForMaskedLM gives the MLM logits,
    AutoModel the hidden states and pooled output (of the heads the source had)."""
    name, hf, model, config, _ = case
    _, has_pooler, has_mlm, _ = CASES[name]
    out = export_hf(model, config, tmp_path / "exported")
    tokens = random_tokens((3, 11), seed=6, device=device)
    hidden, pooled, logits = hf_outputs(hf, tokens, torch.ones_like(tokens), torch.zeros_like(tokens))
    base = transformers.AutoModel.from_pretrained(out).eval().to(device)
    assert_close(base(tokens).last_hidden_state, hidden)
    if has_pooler:
        assert_close(base(tokens).pooler_output, pooled)
    if has_mlm:
        mlm = transformers.AutoModelForMaskedLM.from_pretrained(out).eval().to(device)
        assert_close(mlm(tokens).logits, logits)
    again, config_again = load_hf(out)
    again = again.to(device)
    assert config_again.replace(name=config.name) == config
    assert_close(again(tokens).logits, model(tokens).logits, rtol=0, atol=0)


@torch.no_grad()
def test_old_checkpoint_names(tmp_path, device):
    """TF-converted BERT files: LayerNorm ``gamma``/``beta``, plus a ``position_ids`` buffer."""
    hf = randomize_hf_(transformers.BertForMaskedLM(transformers.BertConfig(**BASE)), seed=2)
    path = save(hf, tmp_path / "saved")
    old = {re.sub(r"LayerNorm\.weight$", "LayerNorm.gamma", re.sub(r"LayerNorm\.bias$", "LayerNorm.beta", k)): v
           for k, v in load_file(f"{path}/model.safetensors").items()}
    old["bert.embeddings.position_ids"] = torch.arange(64)[None]
    assert any(k.endswith("gamma") for k in old)
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, _ = load_hf(tmp_path)
    tokens = random_tokens((2, 7), seed=7, device=device)
    assert_close(loaded.to(device)(tokens).logits, hf.to(device)(tokens).logits)
