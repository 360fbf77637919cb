"""The config knobs that pretrained families need (added for aiayn.interop): finer bias switches,
an lm_head bias, BART's position offset, Marian's split sinusoid layout. Defaults keep the
previous behaviour; bad values say what to change."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from aiayn import ConfigError, ModelConfig, build_model, get_preset
from aiayn.nn import LearnedPositionalEmbedding, MultiHeadAttention, sinusoidal_encoding


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (dict(attn_bias="yes"), "attn_bias must be True, False or None (= follow bias), got 'yes'"),
        (dict(mlp_bias=1), "mlp_bias must be True, False or None"),
        (dict(lm_head_bias=None), "lm_head_bias must be True or False, got None"),
        (dict(position_offset=-1, positional="learned"), "position_offset must be an integer >= 0, got -1"),
        (dict(position_offset=2), "position_offset=2 only applies to positional='learned'"),
        (dict(sinusoidal_layout="mixed"), "sinusoidal_layout='mixed' is not known; choose one of interleaved, split"),
    ],
)
def test_invalid_knobs_say_what_to_change(changes, needle):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**changes)
    assert needle in str(info.value)


def test_bias_switches_follow_bias_by_default():
    cfg = ModelConfig(bias=False)
    assert (cfg.attn_bias, cfg.attn_out_bias, cfg.mlp_bias) == (False, False, False)
    qwen2 = ModelConfig(bias=False, attn_bias=True, attn_out_bias=False)
    assert (qwen2.attn_bias, qwen2.attn_out_bias, qwen2.mlp_bias) == (True, False, False)
    assert ModelConfig(attn_bias=False, mlp_bias=True).attn_out_bias is False  # follows attn_bias


def test_bias_switches_reach_the_modules():
    cfg = get_preset("llama-tiny", attn_bias=True, attn_out_bias=False, mlp_bias=True, lm_head_bias=True)
    model = build_model(cfg)
    block = model.decoder.blocks[0]
    assert block.self_attn.qkv_proj.bias is not None and block.self_attn.out_proj.bias is None
    assert block.ffn.fc_in.bias is not None and block.ffn.fc_out.bias is not None
    assert model.lm_head.bias is not None
    assert build_model(get_preset("llama-tiny")).lm_head.bias is None


def test_attention_out_bias_defaults_to_bias():
    assert MultiHeadAttention(16, 4, bias=True).out_proj.bias is not None
    assert MultiHeadAttention(16, 4, bias=True, out_bias=False).out_proj.bias is None
    assert MultiHeadAttention(16, 4, bias=False, out_bias=True, cross=True).out_proj.bias is not None


def test_learned_positions_with_offset():
    emb = LearnedPositionalEmbedding(10, 8, offset=2)
    assert emb.weight.shape == (12, 8)
    assert_close(emb(torch.tensor([[0, 9]])), emb.weight[[2, 11]][None])
    with pytest.raises(ValueError, match="position 10 is beyond the model's maximum"):
        emb(torch.tensor([[10]]))


def test_split_sinusoids_are_the_interleaved_ones_regrouped():
    positions = torch.arange(50)
    interleaved = sinusoidal_encoding(positions, 16)
    split = sinusoidal_encoding(positions, 16, layout="split")
    assert_close(split, torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=-1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown sinusoidal layout"):
        sinusoidal_encoding(positions, 16, layout="mixed")


def test_json_round_trip_keeps_the_knobs():
    cfg = get_preset("tiny", positional="learned", position_offset=2, lm_head_bias=True,
                     attn_bias=True, attn_out_bias=False, mlp_bias=False)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
