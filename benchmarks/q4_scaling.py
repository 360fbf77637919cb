"""How 4-bit decoding scales with the bytes of weights: random LLaMA-shaped Q4_0 GGUF files of
growing size, decoded at batch 1 by aiayn (``quantize="auto"``) and llama.cpp, against the
memory-read bandwidth measured in the same run. Per size: tokens/s, effective GB/s (bytes read per
token x tokens/s) and its share of the bandwidth; over the sizes, a least-squares fit of time per
token as a cost per layer plus bytes / a rate. Files are deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import gc
import math
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import common
from benchmarks.generate_q4 import packed_model, runner
from benchmarks.llama_cpp import LlamaCpp, require_library


@dataclass(frozen=True)
class LlamaShape:
    """A LLaMA's sizes, as the GGUF metadata states them."""

    d: int
    layers: int
    d_ff: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def kv_dim(self) -> int:
        return self.d // self.heads * self.kv_heads

    def matrices(self) -> dict[str, tuple[int, int]]:
        """GGUF tensor name -> (rows, inputs) of every weight matrix."""
        out = {"token_embd.weight": (self.vocab, self.d)}
        for i in range(self.layers):
            out |= {f"blk.{i}.attn_q.weight": (self.d, self.d), f"blk.{i}.attn_k.weight": (self.kv_dim, self.d),
                    f"blk.{i}.attn_v.weight": (self.kv_dim, self.d), f"blk.{i}.attn_output.weight": (self.d, self.d),
                    f"blk.{i}.ffn_gate.weight": (self.d_ff, self.d), f"blk.{i}.ffn_up.weight": (self.d_ff, self.d),
                    f"blk.{i}.ffn_down.weight": (self.d, self.d_ff)}
        if not self.tied:
            out["output.weight"] = (self.vocab, self.d)
        return out

    def norms(self) -> list[str]:
        return [f"blk.{i}.{n}.weight" for i in range(self.layers) for n in ("attn_norm", "ffn_norm")] + [
            "output_norm.weight"]

    @property
    def parameters(self) -> int:
        return sum(r * k for r, k in self.matrices().values()) + len(self.norms()) * self.d


SHAPES = {
    "tiny": LlamaShape(d=128, layers=2, d_ff=256, heads=4, kv_heads=2, vocab=512, tied=False),  # smoke runs
    "135M": LlamaShape(d=576, layers=30, d_ff=1536, heads=9, kv_heads=3, vocab=49152, tied=True),  # SmolLM2-135M
    "360M": LlamaShape(d=960, layers=32, d_ff=2560, heads=15, kv_heads=5, vocab=49152, tied=True),  # SmolLM2-360M
    "1.1B": LlamaShape(d=2048, layers=22, d_ff=5632, heads=32, kv_heads=4, vocab=32000, tied=False),  # TinyLlama
}
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0-2; bos = eos = 0


def tokenizer_metadata(vocab: int) -> dict[str, object]:
    """A minimal byte-level BPE of ``vocab`` tokens: 3 control tokens, the 256 byte tokens, one merge
    (llama.cpp refuses a BPE vocabulary without merges) and fillers "x0", "x1", ... up to ``vocab``."""
    tokens = [*CONTROL, *common.byte_level_alphabet(), "ab"]
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} < the {len(tokens)} tokens a byte-level BPE needs")
    tokens += [f"x{i}" for i in range(vocab - len(tokens))]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] * len(CONTROL) + [1] * (vocab - len(CONTROL)),
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.ggml.add_bos_token": False}


GGUF_WRITERS = ((bool, "add_bool"), (int, "add_uint32"), (float, "add_float32"), (str, "add_string"))


def add_metadata(writer: Any, metadata: Mapping[str, Any]) -> None:
    """GGUF key-values written by their Python type (int as uint32, float as float32, else an
    array); None is skipped. tests/parity/test_gguf.py uses it too."""
    for key, value in metadata.items():
        if value is not None:
            kind = next((m for t, m in GGUF_WRITERS if isinstance(value, t)), "add_array")
            getattr(writer, kind)(key, value)


def write_random_llama(path: Path, shape: LlamaShape, *, kind: str = "Q4_0", seed: int = 0) -> Path:
    """A random LLaMA GGUF at ``path``: every matrix ``kind`` (quantised from N(0, 1/k) floats), norms
    float32 near 1; tensors written one at a time, so one matrix at most is in memory."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random llama {shape.parameters / 1e6:.0f}M {kind}")
    add_metadata(w, {f"llama.{key}": value for key, value in {
        "context_length": 2048, "embedding_length": shape.d, "block_count": shape.layers,
        "feed_forward_length": shape.d_ff, "attention.head_count": shape.heads,
        "attention.head_count_kv": shape.kv_heads, "rope.dimension_count": shape.d // shape.heads,
        "vocab_size": shape.vocab, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0}.items()})
    add_metadata(w, tokenizer_metadata(shape.vocab))
    matrices = shape.matrices()
    for name, (rows, k) in matrices.items():
        row_bytes = k // block_elems * block_bytes  # given as (rows, bytes) of uint8, as add_tensor takes blocks
        w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype)
    for name in shape.norms():
        w.add_tensor_info(name, (shape.d,), np.dtype(np.float32), shape.d * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for rows, k in matrices.values():
        w.write_tensor_data(quantize(rng.standard_normal((rows, k), dtype=np.float32) / math.sqrt(k), qtype))
    for _ in shape.norms():
        w.write_tensor_data((1 + 0.1 * rng.standard_normal(shape.d)).astype(np.float32))
    w.close()
    return path


def bytes_per_token(path: Path) -> tuple[int, int]:
    """(all tensor bytes, bytes a batch-1 decode step reads: all but an untied embedding table; the
    KV cache, under 1% here, left out)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    return total, total - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


def read_bandwidth(threads: int, *, gib: float = 1.5, repeats: int = 5, clock=time.perf_counter) -> float:
    """Bytes/s of reading a ``gib`` GiB buffer once (far past the L3), best of ``repeats``, at
    ``threads``: the faster of a float32 and an int64 sum (a uint8 sum is not memory-bound)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    buf = torch.full((int(gib * 2**30),), 1, dtype=torch.uint8)  # written, so every page is real memory
    try:
        best = min(common.best_of(lambda v=view: v.sum(), repeats, clock)
                   for view in (buf.view(torch.float32), buf.view(torch.int64)))
    finally:
        del buf
        torch.set_num_threads(before)
    return int(gib * 2**30) / best


def measure_size(name: str, shape: LlamaShape, out_dir: Path, args: argparse.Namespace,
                 llama: tuple | None) -> dict[str, float]:
    """Write the file, then, in this order: the bandwidth, aiayn (compiled, eager), llama.cpp."""
    start = time.perf_counter()
    path = write_random_llama(out_dir / f"random-llama-{name}.Q4_0.gguf", shape, seed=args.seed)
    total, streamed = bytes_per_token(path)
    print(f"\n{name}: {shape.parameters / 1e6:,.1f}M parameters (d {shape.d}, {shape.layers} layers, d_ff {shape.d_ff}, "
          f"{shape.heads}/{shape.kv_heads} heads, vocab {shape.vocab:,}, {'tied' if shape.tied else 'untied'}); "
          f"file {path.stat().st_size / 1e6:,.1f} MB, tensors {total / 1e6:,.1f} MB, read per token "
          f"{streamed / 1e6:,.1f} MB; written in {time.perf_counter() - start:.0f} s", flush=True)
    row: dict[str, float] = {"bytes": streamed}
    for threads in sorted({1, args.threads}):
        row[f"bandwidth {threads}"] = read_bandwidth(threads, repeats=args.repeats + 2, clock=common.CLOCKS[args.clock])
        print(f"  read bandwidth, {threads} thread(s): {row[f'bandwidth {threads}'] / 1e9:.1f} GB/s", flush=True)
    prompt = torch.randint(len(CONTROL), shape.vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(1))
    rate = lambda run: common.decode_rate(run, args.new_tokens, args.repeats, common.CLOCKS[args.clock])  # noqa: E731
    model = packed_model(path, "auto")
    ours = {}
    for label, compile in (("aiayn q4 compiled", True), ("aiayn q4 eager", False)):
        if (compile and args.no_compiled) or (not compile and args.no_eager):
            continue
        start = time.perf_counter()
        row[label] = rate(runner(model, prompt, compile=compile))
        ours[label] = runner(model, prompt, compile=compile)(args.new_tokens)[0].tolist()
        print(f"  {label:20s} {row[label]:7.1f} tokens/s ({time.perf_counter() - start:.0f} s)", flush=True)
    del model
    gc.collect()
    if llama is not None:
        start = time.perf_counter()
        greedy = LlamaCpp(path, args.threads).greedy(prompt[0].tolist())
        row["llama.cpp"] = rate(greedy)
        theirs = greedy(args.new_tokens)
        print(f"  {'llama.cpp':20s} {row['llama.cpp']:7.1f} tokens/s ({time.perf_counter() - start:.0f} s)", flush=True)
        for label, tokens in ours.items():  # a check that both read the file as the same model
            print(f"  greedy tokens, {label} vs llama.cpp: identical for the first {common.same_prefix(tokens, theirs)} "
                  f"of {len(tokens)}")
    if not args.keep:
        path.unlink()  # llama.cpp's mapping of it stays valid until the process ends
    return row


def report(rows: dict[str, dict[str, float]], threads: int) -> None:
    """One markdown table: per size and decoder, tokens/s, effective GB/s, % of the bandwidth."""
    peers = [p for p in ("aiayn q4 compiled", "aiayn q4 eager", "llama.cpp") if any(p in r for r in rows.values())]
    print(f"\nbatch 1, {threads} thread(s); effective GB/s = bytes read per token x tokens/s; "
          f"% of the read bandwidth measured just before, at {threads} thread(s)\n")
    ours = [p for p in peers if p != "llama.cpp" and "llama.cpp" in peers]  # the ratio columns
    head = ["size", "MB read / token", f"bandwidth GB/s ({threads} th)",
            *(f"{p} {what}" for p in peers for what in ("tokens/s", "GB/s (%)")), *(f"{p} / llama.cpp" for p in ours)]
    cells = []
    for name, r in rows.items():
        bw, n = r[f"bandwidth {threads}"], r["bytes"]
        cells.append([name, f"{n / 1e6:,.1f}", f"{bw / 1e9:.1f}",
                      *(c for p in peers for c in ((f"{r[p]:.1f}", f"{r[p] * n / 1e9:.1f} ({r[p] * n / bw:.0%})")
                                                   if p in r else ("-", "-"))),
                      *(f"{r[p] / r['llama.cpp']:.0%}" if p in r and "llama.cpp" in r else "-" for p in ours)])
    print(common.table(head, cells))
    if len(rows) >= 2:
        print()
        for p in peers:
            print(fit_line(p, {name: r for name, r in rows.items() if p in r}))


def fit_line(peer: str, rows: dict[str, dict[str, float]]) -> str:
    """Least squares of seconds per token = c * layers + bytes / B over the sizes (c: a block's fixed
    cost, what does not grow with the matrices)."""
    if len(rows) < 2:
        return f"{peer}: fewer than two sizes, no fit"
    a = np.array([[SHAPES[name].layers, r["bytes"]] for name, r in rows.items()], dtype=np.float64)
    t = np.array([1 / r[peer] for r in rows.values()])
    (per_layer, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    worst = np.abs(a @ [per_layer, per_byte] / t - 1).max()
    return (f"{peer}: seconds per token ~ {per_layer * 1e3:.3f} ms per layer + bytes read / "
            f"{1 / per_byte / 1e9:.1f} GB/s (least squares over {len(rows)} sizes; off by <= {worst:.0%})")


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default="135M,360M,1.1B", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="each timing is the best of this many runs")
    common.add_clock_arg(parser)
    parser.add_argument("--no-compiled", action="store_true", help="skip aiayn's compiled decode step")
    parser.add_argument("--no-eager", action="store_true", help="skip aiayn's eager decode step")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    parser.add_argument("--out", type=Path, help="where to write the files (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the written files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    common.require("gguf")  # it writes the files
    sizes = args.sizes.split(",")
    if unknown := [s for s in sizes if s not in SHAPES]:
        parser.error(f"unknown size(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    torch.set_num_threads(args.threads)
    common.header(f"4-bit decoding against the bytes of weights: random LLaMA-shaped Q4_0 GGUF files, batch 1, greedy, "
           f"{args.new_tokens} new tokens after {args.prompt_tokens}, best of {args.repeats}, {args.clock} clock", args,
           dtype="Q4_0")
    llama = None if args.no_llama_cpp else common.load_peer("llama.cpp", require_library)  # its row when absent
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="aiayn-q4-scaling-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    try:
        for name in sizes:
            rows[name] = measure_size(name, SHAPES[name], out_dir, args, llama)
    finally:
        if args.out is None and not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
        elif args.keep:
            print(f"files kept in {out_dir}")
    report(rows, args.threads)
    common.footer()
    return rows


if __name__ == "__main__":
    main()
