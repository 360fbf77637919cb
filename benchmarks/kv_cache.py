"""KV-cache memory: aiayn's measured cache bytes against the estimator, and what GQA/MQA save.

Benchmark 5. For a LLaMA-style decoder (d 512, 8 query heads of 64, 6 layers) with 8 (MHA),
2 (GQA) and 1 (MQA) key/value heads, and the MHA cache quantised to int8 and int4, batch 16,
1,024 tokens: the bytes of the cache's buffers
(``KVCache.nbytes``), the bytes the allocator handed out while building it (torch.profiler
allocator events, ``benchmarks/memory.py``; includes the small valid/positions bookkeeping), and
``kv_cache_bytes`` (the estimator behind ``aiayn kv-cache``). Then a real prefill + 32 decode
steps through each cache, to show the saving costs no correctness (same shapes of logits) and
what it does to decode-step time (the model after ``aiayn.fast.optimize(model, "inference")``, as
``aiayn generate`` runs it).
"""

from __future__ import annotations

import argparse

import torch

from aiayn import ModelConfig, build_model
from aiayn.fast import optimize
from aiayn.nn.kv_cache import kv_cache_bytes
from benchmarks.common import (
    Timed,
    add_common_args,
    fmt_int,
    footer,
    header,
    run_interleaved,
    setup,
    table,
)
from benchmarks.memory import mib, peak_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    add_common_args(parser, repeats=5, warmup=1)
    args = parser.parse_args(argv)
    setup(args)
    seq = args.seq_len if not args.quick else min(args.seq_len, 256)
    batch = args.batch
    header(f"KV cache, decoder d 512, 8 query heads x 64, 6 layers, batch {batch}, {seq} tokens, float32", args)
    rows, timed = [], []
    prompt_len, steps = 32, 32
    prompt = torch.randint(0, 1000, (batch, prompt_len))
    variants = ((8, None, "MHA (8 kv heads)"), (2, None, "GQA (2 kv heads)"), (1, None, "MQA (1 kv head)"),
                (8, "int8", "MHA, int8 quantised (fp16 scale per token and head)"),
                (8, "int4", "MHA, int4 quantised (fp16 scale per token and head)"))
    for kv_heads, quantize, label in variants:
        torch.manual_seed(args.seed)
        cfg = ModelConfig(arch="decoder-only", vocab_size=1000, d_model=512, n_heads=8, n_kv_heads=kv_heads,
                          n_layers=6, d_ff=1376, activation="swiglu", norm="rmsnorm", norm_position="pre",
                          positional="rope", bias=False, scale_embeddings=False, pad_id=None,
                          max_seq_len=seq, tie_output=False)
        model = optimize(build_model(cfg).eval(), mode="inference")
        cache = model.new_cache(batch, seq, quantize=quantize)
        allocated = peak_bytes(lambda m=model, q=quantize: m.new_cache(batch, seq, quantize=q))
        estimate = kv_cache_bytes(n_layers=6, n_kv_heads=kv_heads, head_dim=64, seq_len=seq,
                                  batch_size=batch, dtype=quantize or torch.float32)
        if cache.nbytes != estimate:
            raise AssertionError(f"{label}: cache holds {cache.nbytes} bytes, estimator says {estimate}")
        rows.append([label, fmt_int(cache.nbytes), fmt_int(estimate), mib(allocated), "", ""])

        def decode(m=model, q=quantize):
            with torch.inference_mode():
                c = m.new_cache(batch, prompt_len + steps, quantize=q)
                logits = m(prompt, cache=c).logits[:, -1]
                for _ in range(steps):
                    logits = m(logits.argmax(-1)[:, None], cache=c).logits[:, -1]
                return logits

        timed.append(Timed(label, decode))
    run_interleaved(timed, repeats=args.repeats, warmup=args.warmup)
    base = rows[0]
    mha = int(base[1].replace(",", ""))
    for row, t in zip(rows, timed, strict=True):
        row[4] = f"{mha / int(row[1].replace(',', '')):.2f}x"
        row[5] = f"{t.median / steps * 1e3:.2f}"
    print(table(["cache", "KVCache.nbytes (measured)", "kv_cache_bytes (estimate)",
                 "MiB allocated building it", "saving vs MHA", "ms per new token (prompt 32 + 32 tokens, 64-slot cache)"],
                rows))
    print("\nMeasured buffer bytes equal the estimator exactly (asserted). The allocated column adds "
          "the cache's valid/positions bookkeeping (batch x max_len bool + int64). The quantised "
          "caches dequantise what attention reads, so their steps cost more time for less memory.")
    footer()


if __name__ == "__main__":
    main()
