"""How much memory a model will take, from its config alone: an absurd size fails before it is built."""

from __future__ import annotations

import os

from aiayn.config import ConfigError, ModelConfig

BYTES_PER_VALUE = 4  # float32, as built


def estimated_values(config: ModelConfig) -> int:
    """An upper estimate of the values ``build_model`` allocates (exact: ``count_parameters``)."""
    d, d_ff = config.d_model, config.d_ff
    attention = d * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads) + 4 * d
    ffn = (3 if config.activation.startswith(("swi", "ge", "reg")) else 2) * d * d_ff + d_ff + d
    layer = attention + ffn + 4 * d
    positions = config.max_seq_len * d * (2 if config.arch == "encoder-decoder" else 1)
    head = 0 if config.tie_output else (config.tgt_vocab_size or config.vocab_size) * d
    if config.arch == "encoder-decoder":
        layers = config.n_layers * layer + config.n_decoder_layers * (layer + attention)
        target = 0 if config.share_embeddings else (config.tgt_vocab_size or config.vocab_size) * d
        return config.vocab_size * d + target + head + positions + layers
    return config.vocab_size * d + head + positions + config.n_layers * layer + d * d


def available_memory() -> int | None:
    """Bytes this machine can give: MemAvailable (Linux), else the physical memory, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(config: ModelConfig) -> None:
    """Refuse a config whose float32 weights alone would not fit in the memory available now."""
    needed = estimated_values(config) * BYTES_PER_VALUE
    available = available_memory()
    if available is not None and needed > available:
        raise ConfigError(
            f"this model would need about {needed / 2**30:,.1f} GiB for its float32 weights (d_model="
            f"{config.d_model}, d_ff={config.d_ff}, n_layers={config.n_layers}, vocab_size={config.vocab_size}, "
            f"max_seq_len={config.max_seq_len}), more than the {available / 2**30:,.1f} GiB available here; "
            f"choose smaller sizes"
        )
