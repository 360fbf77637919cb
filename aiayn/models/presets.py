"""Named configurations. ``get_preset("paper-base", vocab_size=37000)`` returns a ModelConfig."""

from __future__ import annotations

from typing import Any

from aiayn.config import ConfigError, ModelConfig

PRESETS: dict[str, dict[str, Any]] = {
    # Vaswani et al. 2017, Table 3: the base and big models (shared 37k BPE vocabulary en-de);
    # why paper-base counts fewer parameters than Table 3: `aiayn explain parameters`.
    "paper-base": dict(arch="encoder-decoder", vocab_size=37000, d_model=512, n_heads=8,
                       n_layers=6, d_ff=2048, dropout=0.1, positional="sinusoidal",
                       norm_position="post", share_embeddings=True, tie_output=True, max_seq_len=1024),
    "paper-big": dict(arch="encoder-decoder", vocab_size=37000, d_model=1024, n_heads=16,
                      n_layers=6, d_ff=4096, dropout=0.3, positional="sinusoidal",
                      norm_position="post", share_embeddings=True, tie_output=True, max_seq_len=1024),
    # Debug flavours: odd sizes so that a transposed weight fails loudly.
    "tiny": dict(arch="encoder-decoder", vocab_size=99, d_model=48, n_heads=6, n_layers=2,
                 d_ff=37, max_seq_len=64),
    "gpt-tiny": dict(arch="decoder-only", vocab_size=99, d_model=48, n_heads=6, n_layers=2,
                     d_ff=37, activation="gelu", norm_position="pre", positional="learned",
                     scale_embeddings=False, pad_id=None, max_seq_len=64),
    "llama-tiny": dict(arch="decoder-only", vocab_size=99, d_model=48, n_heads=6, n_kv_heads=2,
                       n_layers=2, d_ff=37, activation="swiglu", norm="rmsnorm",
                       norm_position="pre", positional="rope", bias=False, scale_embeddings=False,
                       tie_output=False, pad_id=None, max_seq_len=64),
    "bert-tiny": dict(arch="encoder-only", vocab_size=99, d_model=48, n_heads=6, n_layers=2,
                      d_ff=37, activation="gelu", norm_position="post", positional="learned",
                      scale_embeddings=False, embedding_norm=True, norm_eps=1e-12, max_seq_len=64),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named config, with any field overridden (e.g. ``vocab_size=8000``)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return ModelConfig.from_dict({**PRESETS[name], "name": name, **overrides})
