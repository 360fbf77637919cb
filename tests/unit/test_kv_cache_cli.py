"""The KV-cache memory estimator, in Python and as `aiayn kv-cache`; `aiayn --version`. The command
runs in this process (``run_aiayn``), once as a real child process."""

from __future__ import annotations

import pytest

import aiayn
from aiayn.nn.kv_memory import format_bytes, kv_cache_bytes


def test_seeds_example_is_64_gib():
    n = kv_cache_bytes(n_layers=32, n_kv_heads=32, head_dim=4096 // 32, seq_len=2048,
                       batch_size=32, dtype="float32")
    assert n == 64 * 2**30
    assert format_bytes(n) == "64 GiB"


def test_gqa_and_dtype_scale_the_estimate():
    base = dict(n_layers=2, head_dim=8, seq_len=10, batch_size=3)
    assert kv_cache_bytes(n_kv_heads=8, **base) == 4 * kv_cache_bytes(n_kv_heads=2, **base)
    assert kv_cache_bytes(n_kv_heads=2, dtype="bfloat16", **base) * 2 == kv_cache_bytes(n_kv_heads=2, **base)
    with pytest.raises(ValueError, match="seq_len must be positive, got 0"):
        kv_cache_bytes(n_layers=1, n_kv_heads=1, head_dim=1, seq_len=0, batch_size=1)


def test_cli_prints_64_gib_for_the_seeds_example(run_aiayn):
    code, out, err = run_aiayn("kv-cache", "--batch-size", "32", "--n-heads", "32", "--n-layers", "32",
                               "--d-model", "4096", "--seq-len", "2048", "--dtype", "float32")
    assert code == 0, err
    assert "KV cache: 64 GiB (68,719,476,736 bytes)" in out


def test_cli_gqa_shows_the_saving(run_aiayn):
    code, out, err = run_aiayn("kv-cache", "--n-heads", "32", "--n-kv-heads", "8", "--n-layers", "32",
                               "--d-model", "4096", "--seq-len", "2048", "--batch-size", "32")
    assert code == 0, err
    assert "KV cache: 16 GiB" in out and "would need 64 GiB" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["kv-cache", "--n-heads", "3"], "missing --n-layers"),
        (["kv-cache", "--n-heads", "32", "--n-kv-heads", "5", "--n-layers", "1", "--d-model", "64",
          "--seq-len", "8"], "5 does not divide --n-heads 32"),
        (["kv-cache", "--preset", "nope"], "unknown preset 'nope'"),
        (["kv-cache", "--batch-size", "0", "--preset", "tiny"], "0 is not in the range x>=1"),
        (["kv-cache", "--preset", "tiny", "--dtype", "float8"], "'float8' is not one of"),
    ],
)
def test_cli_bad_arguments_exit_2_without_traceback(run_aiayn, args, needle):
    code, _, err = run_aiayn(*args)  # run_aiayn fails the test on a traceback
    assert code == 2
    assert needle in err


def test_cli_version(run_aiayn):
    code, out, _ = run_aiayn("--version")
    assert code == 0 and aiayn.__version__ in out


def test_cli_encoder_decoder_preset_adds_the_cross_attention_keys_and_values(run_aiayn):
    """paper-base, 100 target and 100 source tokens, batch 4: the cross-attention keys/values (6
    layers x 8 heads x 64 x 100 source tokens x 4 x 2 x 4 bytes) double the self-attention's."""
    code, out, err = run_aiayn("kv-cache", "--preset", "paper-base", "--seq-len", "100", "--batch-size", "4")
    assert code == 0, err
    cross = 2 * 6 * 8 * 64 * 100 * 4 * 4
    assert f"KV cache: {format_bytes(2 * cross)} ({2 * cross:,} bytes)" in out
    assert f"cross-attention (encoder-decoder): {format_bytes(cross)} ({cross:,} bytes)" in out
    assert "x 100 source tokens x 4 batch x 4 bytes (float32" in out
    _, longer, _ = run_aiayn("kv-cache", "--preset", "paper-base", "--seq-len", "100", "--src-len", "300")
    assert f"KV cache: {format_bytes(cross)} " in longer  # batch 1: 100 + 300 tokens = 4 x 100
    _, none, _ = run_aiayn("kv-cache", "--preset", "paper-base", "--seq-len", "100", "--src-len", "0")
    assert f"KV cache: {format_bytes(cross // 4)} " in none and "cross-attention" not in none
    code, decoder_only, _ = run_aiayn("kv-cache", "--preset", "gpt-tiny")
    assert code == 0 and "cross-attention" not in decoder_only
