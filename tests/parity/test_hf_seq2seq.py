"""BART and Marian loaded through ``aiayn.interop.load_hf`` equal Hugging Face: logits with a
right-padded source (and a right-padded target), 20-token greedy translations with and without
the KV cache (tokens and every step's logits), the export round trip.

Cases: ``bart`` (learned positions offset by 2, embedding LayerNorm, 3 decoder layers against 2
encoder layers, final_logits_bias); ``bart-scaled`` (scale_embedding, untied output, ReLU);
``marian`` (split-layout sinusoids, swish, scaled embeddings, pad = decoder start = 98);
``marian-separate`` (own target vocabulary of 77 and embedding). Hugging Face counts positions
over padding too; with right padding the real tokens agree, and only they are compared.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_helpers import VOCAB, converted_case, lengths_mask, random_tokens, save
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from aiayn.device import model_device
from aiayn.generate import greedy_encoder_decoder
from aiayn.interop import InteropError, export_hf, from_hf_model, load_hf

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=VOCAB, d_model=48, encoder_attention_heads=6, decoder_attention_heads=6,
            encoder_layers=2, decoder_layers=3, encoder_ffn_dim=37, decoder_ffn_dim=37,
            max_position_embeddings=64)
BART = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
            forced_eos_token_id=None)
MARIAN = dict(pad_token_id=98, eos_token_id=0, decoder_start_token_id=98, forced_eos_token_id=None,
              scale_embedding=True, activation_function="swish")
CASES = {  # name -> (config class, model class, extra config)
    "bart": ("BartConfig", "BartForConditionalGeneration", BART),
    "bart-scaled": ("BartConfig", "BartForConditionalGeneration",
                    {**BART, "scale_embedding": True, "tie_word_embeddings": False,
                     "activation_function": "relu"}),
    "marian": ("MarianConfig", "MarianMTModel", MARIAN),
    "marian-separate": ("MarianConfig", "MarianMTModel",
                        {**MARIAN, "pad_token_id": 76, "decoder_start_token_id": 76,
                         "share_encoder_decoder_embeddings": False, "decoder_vocab_size": 77}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, device):
    """(name, HF model, its directory, aiayn model, aiayn config); both models on ``device``."""
    config_cls, model_cls, extra = CASES[request.param]
    hf_config = getattr(transformers, config_cls)(**BASE, **extra)
    return converted_case(request.param, getattr(transformers, model_cls), hf_config, tmp_path_factory, device)


def batch(hf, *, pad_target: bool) -> tuple[torch.Tensor, ...]:
    """Source (3, 11) right-padded, target (3, 7) starting with the decoder start id; on ``hf``'s
    device."""
    pad, start = hf.config.pad_token_id, hf.config.decoder_start_token_id
    tgt_vocab = hf.config.decoder_vocab_size if hf.config.model_type == "marian" else VOCAB
    device = model_device(hf)
    src_mask = lengths_mask([11, 6, 2], 11, left=False, device=device)
    src = random_tokens((3, 11), seed=2, device=device).clamp(max=VOCAB - 2).masked_fill(src_mask == 0, pad)
    tgt_mask = lengths_mask([7, 4, 6] if pad_target else [7, 7, 7], 7, left=False, device=device)
    tgt = (random_tokens((3, 7), seed=3, device=device) % (tgt_vocab - 3) + 3).masked_fill(tgt_mask == 0, pad)
    tgt[:, 0] = start
    return src, src_mask, tgt, tgt_mask


def test_config_is_converted(case):
    name, hf, _, _, config = case
    assert config.arch == "encoder-decoder" and config.norm_position == "post"
    assert (config.n_layers, config.n_decoder_layers, config.d_ff) == (2, 3, 37)
    assert config.lm_head_bias and config.pad_id == hf.config.pad_token_id
    if name.startswith("bart"):
        assert (config.positional, config.position_offset, config.embedding_norm) == ("learned", 2, True)
    else:
        assert (config.positional, config.sinusoidal_layout, config.activation) == ("sinusoidal", "split", "silu")
    assert config.scale_embeddings == (name != "bart")
    assert config.share_embeddings == (name in ("bart", "marian"))
    assert config.tgt_vocab_size == (77 if name == "marian-separate" else VOCAB)


@pytest.mark.parametrize("pad_target", [False, True], ids=["full-target", "padded-target"])
@torch.no_grad()
def test_logits_match(case, pad_target):
    _, hf, _, model, _ = case
    src, src_mask, tgt, tgt_mask = batch(hf, pad_target=pad_target)
    expected = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt,
                  decoder_attention_mask=tgt_mask).logits
    got = model(src, tgt, src_valid=src_mask.bool(), tgt_valid=tgt_mask.bool()).logits
    real = tgt_mask.bool()
    assert_close(got[real], expected[real])


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "recompute"])
def test_greedy_translation_matches(case, use_cache):
    _, hf, _, model, _ = case
    src, src_mask, _, _ = batch(hf, pad_target=False)
    start = hf.config.decoder_start_token_id
    with torch.no_grad():
        expected = hf.generate(src, attention_mask=src_mask, max_new_tokens=20, do_sample=False,
                               num_beams=1, decoder_start_token_id=start, eos_token_id=None,
                               forced_eos_token_id=None, forced_bos_token_id=None,
                               no_repeat_ngram_size=0, bad_words_ids=None, min_length=0,
                               return_dict_in_generate=True, output_logits=True)
    got = greedy_encoder_decoder(model, src, bos_id=start, max_new_tokens=20,
                                 src_valid=src_mask.bool(), use_cache=use_cache)
    assert expected.sequences.shape == (3, 1 + 20)
    assert torch.equal(got.tokens, expected.sequences[:, 1:])
    assert_close(got.logits, torch.stack(expected.logits, dim=1))


@torch.no_grad()
def test_from_hf_model_equals_load_hf(case, device):
    """In memory, Marian's state dict also holds its sinusoid tables: checked, not loaded."""
    _, hf, _, model, _ = case
    converted, _ = from_hf_model(hf)  # built on the CPU, as load_hf's model is
    converted = converted.to(device)
    src, src_mask, tgt, _ = batch(hf, pad_target=False)
    assert_close(converted(src, tgt, src_valid=src_mask.bool()).logits,
                 model(src, tgt, src_valid=src_mask.bool()).logits, rtol=0, atol=0)


@torch.no_grad()
def test_export_round_trip(case, tmp_path, device):
    _, hf, _, model, config = case
    out = export_hf(model, config, tmp_path / "exported")
    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval().to(device)
    assert type(reloaded) is type(hf)
    src, src_mask, tgt, _ = batch(hf, pad_target=False)
    kwargs = dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt)
    assert_close(reloaded(**kwargs).logits, hf(**kwargs).logits)
    again, config_again = load_hf(out)
    again = again.to(device)
    assert config_again.replace(name=config.name) == config
    assert_close(again(src, tgt, src_valid=src_mask.bool()).logits,
                 model(src, tgt, src_valid=src_mask.bool()).logits, rtol=0, atol=0)


@pytest.mark.cpu_only  # what load_hf accepts from a file: nothing runs on a device
def test_marian_position_table_is_checked(tmp_path):
    """Older Marian files store the sinusoid tables: the true ones load, others are refused."""
    hf = transformers.MarianMTModel(transformers.MarianConfig(**BASE, **MARIAN))
    path = save(hf, tmp_path / "saved")
    tensors = load_file(f"{path}/model.safetensors")
    table = hf.model.encoder.embed_positions.weight.detach().clone()
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    save_file({**tensors, "model.encoder.embed_positions.weight": table}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    load_hf(tmp_path)
    table[:, :24], table[:, 24:] = table[:, 24:].clone(), table[:, :24].clone()  # cos | sin
    save_file({**tensors, "model.encoder.embed_positions.weight": table}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(InteropError, match=r"model.encoder.embed_positions.weight is not Marian's sinusoidal table"):
        load_hf(tmp_path)
