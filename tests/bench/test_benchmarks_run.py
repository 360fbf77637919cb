"""The benchmark scripts still run (tiny settings, aiayn only; their figures are not checked)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from aiayn.fast import onednn as aiayn_onednn
from aiayn.fast.fused_loss import FusedLossLinear
from aiayn.fast.linear import FastLinear
from benchmarks import (
    attention,
    decode,
    fast,
    kv_cache,
    loss,
    matvec,
    onednn,
    q4,
    q4_scaling,
    train,
)
from benchmarks.peers import SEQ2SEQ_PEERS, SEQ2SEQ_SIZES, Dropouts, LMSize, aiayn_seq2seq


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


def test_q4_benchmark(capsys):
    q4.main(["--quick", "--rows", "1,64", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| 1 rows | aiayn Q4_1" in out and "dequantise + oneDNN f32" in out


def test_q4_scaling_benchmark(capsys, tmp_path):
    pytest.importorskip("gguf")
    q4_scaling.main(["--sizes", "tiny", "--new-tokens", "4", "--repeats", "1", "--no-compiled", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "read bandwidth, 1 thread(s)" in out and "| tiny | 0.2 |" in out and "aiayn q4 eager tokens/s" in out
    assert not list(tmp_path.iterdir())  # the file is deleted without --keep


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
    assert "| aiayn | 7,577,600 |" in out and "| aiayn plain torch | 7,577,600 |" in out
    # Counted on the plain padding-free model, whose output layer runs on the positions that count only.
    assert "34.92 GFLOP (aiayn, aiayn plain torch)" in out
    assert "| 1 | on | aiayn |" in out and "| 1 | on | aiayn compiled |" in out


def test_train_benchmark_rows_are_the_models_they_name():
    """aiayn's rows in the training benchmark: optimize(model, "train") (fused output layer, fast
    linear layers) for all but "aiayn plain torch", the plain PyTorch model; the same weights."""
    args = argparse.Namespace(seed=0)
    size = SEQ2SEQ_SIZES["small"]
    rows = {name: train.aiayn_row(name, build, args, Dropouts(), size)
            for name, build in ((train.PLAIN, aiayn_seq2seq), ("aiayn", aiayn_seq2seq),
                                (train.PADDED, SEQ2SEQ_PEERS[train.PADDED]))}
    for name, wrapped in rows.items():
        model = wrapped.model
        linears = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
        if name == train.PLAIN:
            assert linears == {nn.Linear}
        else:
            assert type(model.lm_head) is FusedLossLinear and FastLinear in linears
    assert rows["aiayn"].model.config.padding_free and not rows[train.PADDED].model.config.padding_free
    plain, optimized = rows[train.PLAIN].state_dict(), rows["aiayn"].state_dict()
    assert plain.keys() == optimized.keys() and all(torch.equal(plain[k], optimized[k]) for k in plain)
    lm = train.aiayn_row(train.UNFUSED, train.LM_TRAIN_PEERS[train.UNFUSED], args, Dropouts(), LMSize())
    assert type(lm.lm_head) is FusedLossLinear


def test_decode_benchmark_model_is_optimized_for_inference():
    model = decode.aiayn_model(LMSize(vocab=64, d_model=32, n_heads=2, n_layers=1, d_ff=64), 0)
    assert not model.training and {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {FastLinear}


@pytest.mark.slow
def test_matvec_benchmark(capsys):
    matvec.main(["--quick", "--dtypes", "float32", "--layers", "1", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| float32 | 1 | compiled multiply + sum |" in out and "**yes**" in out


def test_loss_benchmark(capsys):
    loss.main(["--quick", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| aiayn fused |" in out and "less peak memory" in out


def test_fast_benchmark(capsys):
    # Two threads: the turned-around product is routed to from two threads only (aiayn.fast.matvec).
    fast.main(["--quick", "--threads", "2", "--repeats", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    for kernel in fast.KERNELS:
        if kernel != "compiled-matvec":  # --quick skips the compiled step
            assert f"### {kernel}:" in out and f"| {kernel} | 2 |" in out
    # The cases measure the kernels themselves, not the fast modules' fallbacks.
    assert "| block causal | 2 |" in out and "| single query, written-out | 2 |" in out
    assert "| GQA fold + written-out | 2 |" in out and "| (W x^T)^T | 2 |" in out
    assert "| oneDNN | 2 |" in out or not aiayn_onednn.available()
    assert "### Summary" in out and "plain / fast" in out


def test_fast_benchmark_threads_option():
    assert fast.parse_threads("1,2") == [1, 2] and fast.parse_threads("2") == [2]
    with pytest.raises(argparse.ArgumentTypeError):
        fast.parse_threads("0,2")


@pytest.mark.slow
def test_fast_benchmark_compiled_matvec(capsys):
    fast.main(["--kernels", "compiled-matvec", "--compiled-rows", "1", "--threads", "1", "--repeats", "1",
               "--warmup", "0"])
    out = capsys.readouterr().out
    assert "| multiply + sum | 1 |" in out and "| compiled-matvec | 1 |" in out
