"""The KV cache three ways (one flag each):

* default (benchmark 5): memory. A LLaMA-style decoder (d 512, 8 query heads of 64, 6 layers) with
  8, 2 and 1 key/value heads and the MHA cache in int8 and int4, batch 16, 1,024 tokens:
  ``KVCache.nbytes`` against ``kv_cache_bytes`` (asserted equal), the bytes allocated, and the time
  of a prefill + 32 decode steps.
* ``--quality``: the int8 / int4 caches on SmolLM2-135M: bytes, greedy agreement with the float
  cache and the perplexity of a Tiny Shakespeare passage fed in chunks of ``--chunk``.
* ``--paged``: a SmolLM2-135M decode step over ``PagedKVCache`` (plain gather, and
  ``aiayn.fast.paged_attention``'s kernel) against fixed slots, at ``--batches`` x ``--contexts``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn import ModelConfig, build_model
from aiayn.fast import optimize, switch
from aiayn.generate.step import decode_step
from aiayn.nn.kv_cache import kv_cache_bytes
from benchmarks import common

STEPS_PER_ROUND = 4  # --paged: decode steps per timed call


def memory(args: argparse.Namespace) -> None:
    """The default: bytes, estimate, allocation and decode time per cache layout."""
    seq = args.seq_len if not args.quick else min(args.seq_len, 256)
    batch = args.batch
    common.header(f"KV cache, decoder d 512, 8 query heads x 64, 6 layers, batch {batch}, {seq} tokens, float32", args)
    rows, timed, nbytes = [], [], []
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
        allocated = common.peak_bytes(lambda m=model, q=quantize: m.new_cache(batch, seq, quantize=q))
        estimate = kv_cache_bytes(n_layers=6, n_kv_heads=kv_heads, head_dim=64, seq_len=seq,
                                  batch_size=batch, dtype=quantize or torch.float32)
        if cache.nbytes != estimate:
            raise AssertionError(f"{label}: cache holds {cache.nbytes} bytes, estimator says {estimate}")
        rows.append([label, common.fmt_int(cache.nbytes), common.fmt_int(estimate), common.mib(allocated)])
        nbytes.append(cache.nbytes)

        def decode(m=model, q=quantize):
            with torch.inference_mode():
                c = m.new_cache(batch, prompt_len + steps, quantize=q)
                logits = m(prompt, cache=c).logits[:, -1]
                for _ in range(steps):
                    logits = m(logits.argmax(-1)[:, None], cache=c).logits[:, -1]
                return logits

        timed.append(common.Timed(label, decode))
    common.measure(timed, args)
    for row, n, t in zip(rows, nbytes, timed, strict=True):
        row += [f"{nbytes[0] / n:.2f}x", f"{t.median / steps * 1e3:.2f}"]
    print(common.table(["cache", "KVCache.nbytes (measured)", "kv_cache_bytes (estimate)",
                 "MiB allocated building it", "saving vs MHA", "ms per new token (prompt 32 + 32 tokens, 64-slot cache)"],
                rows))
    print("\nMeasured buffer bytes equal the estimator exactly (asserted). The allocated column adds "
          "the cache's valid/positions bookkeeping (batch x max_len bool + int64). The quantised "
          "caches dequantise what attention reads, so their steps cost more time for less memory.")


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colours are",
    "To make a cup of tea, first",
    "The Transformer architecture replaced recurrence with",
    "In 1969, the first humans",
    "The quick brown fox",
    "Water boils at a temperature of",
    "A good way to learn a new language is",
    "The largest planet in the solar system is",
    "import torch\nimport torch.nn as nn\n\nclass",
]
QUANT_CACHES = [("float32", None, None), ("int8", "int8", None), ("int4", "int4", None), ("int4 g32", "int4", 32)]


def perplexity(model, ids: torch.Tensor, chunk: int, quantize: str | None, group: int | None) -> float:
    cache = model.new_cache(1, ids.shape[1], quantize=quantize, group_size=group)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, ids.shape[1] - 1, chunk):
            piece = ids[:, start : min(start + chunk, ids.shape[1] - 1)]
            logits = model(piece, cache=cache).logits[0]
            targets = ids[0, start + 1 : start + 1 + piece.shape[1]]
            nll += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
            count += targets.numel()
    return math.exp(nll / count)


def quality(args: argparse.Namespace) -> None:
    """--quality: the quantised caches' bytes, greedy agreement and perplexity on a real model."""
    from aiayn.data import dataset_file
    from aiayn.interop import load_gguf
    path = common.smollm2(args.model)
    loaded = load_gguf(path)
    model, tok, cfg = optimize(loaded.model.eval(), mode="inference"), loaded.tokenizer, loaded.config
    print(f"model {Path(path).name}: {cfg.n_layers} layers, {cfg.n_kv_heads} kv heads x {cfg.head_dim}")

    print("\nKV cache bytes, batch 1 x 2,048 tokens (KVCache.nbytes):")
    base = model.new_cache(1, 2048).nbytes
    for name, quantize, group in QUANT_CACHES:
        n = model.new_cache(1, 2048, quantize=quantize, group_size=group).nbytes
        print(f"  {name:9s} {n / 2**20:8.2f} MiB  {base / n:5.2f}x smaller than float32")

    encoded = [torch.tensor([tok.encode(p, add_special_tokens=False).ids]) for p in PROMPTS]
    text = dataset_file("tinyshakespeare", "input.txt").read_text(encoding="utf-8")[:20000]
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids[: args.ppl_tokens]])
    print(f"\ngreedy agreement over {len(PROMPTS)} prompts x {args.new_tokens} tokens; perplexity of "
          f"{ids.shape[1]} Tiny Shakespeare tokens in chunks of {args.chunk}:")
    reference: list[torch.Tensor] = []
    ppl_ref = None
    for name, quantize, group in QUANT_CACHES:
        start = time.perf_counter()
        outs = [greedy(model, prompt, args.new_tokens, quantize, group) for prompt in encoded]
        ppl = perplexity(model, ids, args.chunk, quantize, group)
        seconds = time.perf_counter() - start
        if not reference:
            reference, ppl_ref = outs, ppl
            print(f"  {name:9s} reference: perplexity {ppl:.3f}  ({seconds:.0f} s)")
            continue
        prefix = sum(common.same_prefix(a, b) for a, b in zip(outs, reference, strict=True))
        equal = sum(int(torch.equal(a, b)) for a, b in zip(outs, reference, strict=True))
        raw = sum(int((a == b).sum()) for a, b in zip(outs, reference, strict=True))
        total = sum(r.numel() for r in reference)
        print(f"  {name:9s} agreement to first divergence {prefix / total:6.1%}, same position "
              f"{raw / total:6.1%}, identical continuations {equal}/{len(PROMPTS)}; perplexity "
              f"{ppl:.3f} ({(ppl / ppl_ref - 1):+.2%})  ({seconds:.0f} s)")
    first = tok.decode(reference[0].tolist())
    print(f"\nfloat32 greedy on {PROMPTS[0]!r}: {first!r}")


@torch.inference_mode()
def greedy(model, prompt: torch.Tensor, n: int, quantize: str | None, group: int | None) -> torch.Tensor:
    """Greedy continuation (n,) of one prompt (1, t); as ``greedy_decoder_only`` with a group size."""
    cache = model.new_cache(1, prompt.shape[1] + n, quantize=quantize, group_size=group)
    logits = model(prompt, cache=cache).logits[:, -1]
    out = []
    for _ in range(n):
        token = logits.argmax(-1)
        out.append(token)
        logits = model(token[:, None], cache=cache).logits[:, -1]
    return torch.cat(out)


def filled_caches(model: torch.nn.Module, batch: int, context: int, block_size: int, steps: int):
    """A per-row KVCache and two PagedKVCaches of ``batch`` rows each holding ``context`` tokens, with
    room for ``steps`` more per row."""
    prompt = torch.randint(3, 40000, (1, context), generator=torch.Generator().manual_seed(0))
    max_len = context + steps
    rows = model.new_cache(1, max_len, per_row=True)
    blocks_per_row = -(-max_len // block_size)
    paged = [model.new_cache(batch, max_len, per_row=True, block_size=block_size,
                             n_blocks=1 + context // block_size + batch * (blocks_per_row - context // block_size + 1))
             for _ in range(2)]
    for cache in (rows, *paged):
        view = cache.rows(0, 1)
        for start in range(0, context, 512):
            chunk = prompt[:, start: start + 512]
            decode_step(model, chunk, view.expect([chunk.shape[1]]))
            view = cache.rows(0, 1)
    rows.reorder([0] * batch)
    for cache in paged:
        shared = cache.table(0)
        for row in range(1, batch):
            cache.adopt(row, shared)
    return rows, *paged


def paged_step(model: torch.nn.Module, cache, batch: int, *, gather: bool = False) -> None:
    """One decode step of every row (``gather``: the paged cache read by the plain gather)."""
    tokens = torch.full((batch, 1), 7, dtype=torch.long)
    view = cache.rows(0, batch).expect([1] * batch)
    with switch.without("paged_attention") if gather else contextlib.nullcontext():
        decode_step(model, tokens, view, valid=torch.ones_like(tokens, dtype=torch.bool))


def paged(args: argparse.Namespace) -> None:
    """--paged: a decode step over the paged cache (gather, kernel) against fixed slots."""
    from aiayn.fast.paged_attention_build import kernel_ops

    model = common.smollm2_text_model().model
    if kernel_ops() is None:
        raise SystemExit("the paged-attention kernel did not build (a C++ compiler and ninja are needed)")
    torch.set_grad_enabled(False)
    common.mark_start(args)
    rows_out = []
    for batch in args.batches:
        for context in args.contexts:
            steps = (args.warmup + args.repeats) * STEPS_PER_ROUND
            with torch.inference_mode():
                fixed, gathered, kernel = filled_caches(model, batch, context, args.block_size, steps)
                peers = [common.Timed("slots", lambda c=fixed, b=batch: paged_step(model, c, b), iters=STEPS_PER_ROUND),
                         common.Timed("gather", lambda c=gathered, b=batch: paged_step(model, c, b, gather=True),
                               iters=STEPS_PER_ROUND),
                         common.Timed("kernel", lambda c=kernel, b=batch: paged_step(model, c, b), iters=STEPS_PER_ROUND)]
                common.measure(peers, args)
            slots_ms, gather_ms, kernel_ms = (p.median * 1e3 for p in peers)
            rows_out.append([batch, context, f"{slots_ms:.1f}", f"{gather_ms:.1f}", f"{kernel_ms:.1f}",
                             f"{gather_ms / slots_ms:.2f}x", f"{kernel_ms / slots_ms:.2f}x",
                             f"{max(p.spread for p in peers):.0%}"])
            print(f"batch {batch}, context {context}: slots {slots_ms:.1f} ms, paged gather {gather_ms:.1f} ms, "
                  f"paged kernel {kernel_ms:.1f} ms", flush=True)
    common.header(f"Decode step, SmolLM2-135M: paged KV cache (blocks of {args.block_size}) vs fixed slots", args)
    print(common.table(["batch", "context held", "slots ms/step", "paged gather ms/step", "paged kernel ms/step",
                 "gather / slots", "kernel / slots", "spread"], rows_out))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache", description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--quality", action="store_true", help="the quantised caches on SmolLM2-135M")
    how.add_argument("--paged", action="store_true", help="a decode step over the paged cache vs fixed slots")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--model", type=Path, default=None, help="--quality: a GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--new-tokens", type=int, default=32, help="--quality: greedy tokens per prompt")
    parser.add_argument("--ppl-tokens", type=int, default=1024, help="--quality: tokens of the perplexity text")
    parser.add_argument("--chunk", type=int, default=64, help="--quality: tokens fed through the cache at once")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="--paged")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048], help="--paged")
    parser.add_argument("--block-size", type=int, default=16, help="--paged: tokens per block")
    common.add_common_args(parser, repeats=5, warmup=1)
    args = parser.parse_args(argv)
    common.setup(args)
    (quality if args.quality else paged if args.paged else memory)(args)
    common.footer()


if __name__ == "__main__":
    main()
