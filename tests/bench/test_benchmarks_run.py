"""The benchmark scripts still run (tiny settings, aiayn only; their figures are not checked)."""

from __future__ import annotations

import pytest

from benchmarks import attention, decode, kv_cache, loss, matvec, onednn, train


def test_attention_benchmark(capsys):
    attention.main(["--lengths", "32", "64", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| 64 | reference |" in out and "fused saves" in out
    attention.main(["--lengths", "64", "--backward", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| 64 | block causal |" in out and "block causal vs fused" in out


def test_onednn_benchmark(capsys):
    onednn.main(["--quick", "--rows", "64", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "oneDNN / MKL" in out and ("| 256 -> 8000 | weight grad g^T x |" in out or "no oneDNN" in out)


def test_kv_cache_benchmark(capsys):
    kv_cache.main(["--batch", "2", "--seq-len", "64", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "GQA (2 kv heads)" in out and "| 4.00x |" in out


@pytest.mark.slow
def test_train_and_decode_benchmarks(capsys):
    pytest.importorskip("transformers")
    train.main(["--suite", "small", "--peers", "aiayn", "--repeats", "1", "--warmup", "0", "--threads", "1",
                "--no-compiled"])
    decode.main(["--peers", "aiayn", "--batch", "1", "--new-tokens", "4", "--no-recompute", "--no-overhead",
                 "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| aiayn | 7,577,600 |" in out and "| 1 | on | aiayn |" in out
    assert "| 1 | on | aiayn compiled |" in out


@pytest.mark.slow
def test_matvec_benchmark(capsys):
    matvec.main(["--quick", "--dtypes", "float32", "--layers", "1", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| float32 | 1 | compiled multiply + sum |" in out and "**yes**" in out


def test_loss_benchmark(capsys):
    loss.main(["--quick", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| aiayn fused |" in out and "less peak memory" in out
