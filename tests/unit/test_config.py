"""ModelConfig validation, JSON round trip and the paper's parameter counts."""

from __future__ import annotations

import pytest

from aiayn import ConfigError, ModelConfig, build_model, count_parameters, get_preset
from aiayn.models import preset_names


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (dict(d_model=50, n_heads=8), "d_model=50 is not divisible by n_heads=8"),
        (dict(n_heads=8, n_kv_heads=3), "n_heads=8 is not divisible by n_kv_heads=3"),
        (dict(positional="rotary"), "positional='rotary' is not known"),
        (dict(activation="tanh"), "activation='tanh' is not known"),
        (dict(norm="batchnorm"), "norm='batchnorm' is not known"),
        (dict(norm_position="middle"), "norm_position='middle' is not known"),
        (dict(arch="rnn"), "arch='rnn' is not known"),
        (dict(dropout=1.5), "dropout must be a probability in [0, 1), got 1.5"),
        (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
        (dict(n_layers=-1), "n_layers must be a positive integer, got -1"),
        (dict(pad_id=1000, vocab_size=1000), "pad_id=1000 is outside the vocabulary [0, 1000)"),
        (dict(tgt_vocab_size=500), "share_embeddings=True needs one vocabulary"),
        (dict(positional="rope", d_model=36, n_heads=4), "needs an even head_dim, got 9"),
        (dict(norm_eps=0.0), "norm_eps must be positive"),
    ],
)
def test_invalid_configs_say_what_to_change(changes, needle):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**changes)
    assert needle in str(info.value)


def test_known_choices_are_listed_in_the_message():
    with pytest.raises(ConfigError, match="choose one of sinusoidal, learned, rope, alibi, t5, none"):
        ModelConfig(positional="relative")


def test_json_round_trip(tmp_path):
    cfg = get_preset("llama-tiny", vocab_size=123)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    path = tmp_path / "config.json"
    cfg.to_json(path)
    assert ModelConfig.from_json(path) == cfg


def test_json_unknown_field_and_bad_json():
    with pytest.raises(ConfigError, match="unknown ModelConfig field"):
        ModelConfig.from_dict({"d_modle": 64})
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json("{not json")


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="known presets: bert-tiny"):
        get_preset("paper-huge")


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds(name):
    cfg = get_preset(name) if not name.startswith("paper") else get_preset(name, vocab_size=99)
    build_model(cfg)


@pytest.mark.parametrize(("name", "paper_millions"), [("paper-base", 65), ("paper-big", 213)])
def test_paper_parameter_counts(name, paper_millions):
    """Vaswani et al. 2017, Table 3, with the shared 37k vocabulary and tied embeddings."""
    cfg = get_preset(name)
    assert cfg.vocab_size == 37000 and cfg.n_layers == 6 and cfg.share_embeddings and cfg.tie_output
    n = count_parameters(build_model(cfg))
    assert abs(n / 1e6 - paper_millions) / paper_millions < 0.05, n


def test_paper_presets_match_the_paper():
    base, big = get_preset("paper-base"), get_preset("paper-big")
    assert (base.d_model, base.d_ff, base.n_heads, base.dropout) == (512, 2048, 8, 0.1)
    assert (big.d_model, big.d_ff, big.n_heads, big.dropout) == (1024, 4096, 16, 0.3)
    assert base.norm_position == "post" and base.positional == "sinusoidal" and base.scale_embeddings


def test_weight_sharing_options():
    shared = build_model(get_preset("tiny"))
    assert shared.encoder.embedding is shared.decoder.embedding
    assert shared.lm_head.weight is shared.decoder.embedding.weight
    separate = build_model(get_preset("tiny", share_embeddings=False, tgt_vocab_size=77, tie_output=False))
    assert separate.encoder.embedding is not separate.decoder.embedding
    assert separate.lm_head.weight.shape == (77, 48)
    assert count_parameters(separate) > count_parameters(shared)


def test_one_name_per_concept_derived_fields_resolve_and_rederive() -> None:
    """Fields left None are filled in once (one name, one concrete value) and derived again by
    replace(); to_dict keeps them None so a saved config still derives them."""
    cfg = ModelConfig(d_model=64, n_heads=4)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.n_decoder_layers, cfg.tgt_vocab_size) == (4, 16, 6, 1000)
    assert (cfg.final_norm, cfg.attn_bias, cfg.attn_out_bias, cfg.mlp_bias) == (False, True, True, True)
    assert cfg.to_dict()["head_dim"] is None and cfg.to_dict()["n_kv_heads"] is None
    wider = cfg.replace(d_model=128, n_heads=2)
    assert (wider.head_dim, wider.n_kv_heads) == (64, 2)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    explicit = ModelConfig(d_model=64, n_heads=4, head_dim=8)
    assert explicit.replace(d_model=128).head_dim == 8  # given, so kept


def test_old_field_names_load_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="'kv_heads' is now called 'n_kv_heads'"):
        cfg = ModelConfig.from_dict({"d_model": 64, "n_heads": 4, "kv_heads": 2})
    assert cfg.n_kv_heads == 2
    with pytest.raises(ConfigError, match="disagrees"):
        ModelConfig.from_dict({"d_model": 64, "n_heads": 4, "kv_heads": 2, "n_kv_heads": 4})
