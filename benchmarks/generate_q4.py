"""The 4-bit parts of ``benchmarks/generate.py``: aiayn's packed GGUF model (``quantize="auto"``: the
file's own Q4_1 and Q8_0 blocks) against llama.cpp on the same file: batched decode rates, peak
resident memory of a fresh process (load, prefill 512, decode 128), and perplexity.
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from aiayn.data import dataset_file
from aiayn.fast import optimize
from aiayn.fast.quantize import lower_precision
from aiayn.generate import SamplingConfig, generate_decoder_only
from aiayn.interop import load_gguf
from benchmarks.common import load_peer
from benchmarks.llama_cpp import LlamaCpp, peak_rss_mib

GREEDY = SamplingConfig(temperature=0)


def packed_model(path: Path, mode: str = "auto") -> torch.nn.Module:
    """SmolLM2 as ``aiayn generate --quantize MODE`` runs it (auto, q4: packed blocks), then ``optimize``."""
    return optimize(load_gguf(path, quantize=mode, tokenizer=False).model.eval(), mode="inference")


def runner(model: torch.nn.Module, ids: torch.Tensor, *, compile: bool = False) -> Callable[[int], torch.Tensor]:
    return lambda n: generate_decoder_only(model, ids, max_new_tokens=n, sampling=GREEDY, compile=compile)


def batch_rows(path: Path, ids: torch.Tensor, batches: list[int], new_tokens: int, threads: int,
               rate: Callable[[Callable[[int], object], int], float]) -> dict[str, float]:
    """tokens/s of all rows together: b * (n - 1) / (t(n) - t(1)), aiayn q4 compiled and llama.cpp."""
    llama = load_peer("llama.cpp", LlamaCpp, path, threads, n_ctx=max(batches) * (ids.shape[1] + new_tokens + 8),
                      sequences=max(batches))
    if llama is None:
        return {}
    model = packed_model(path)
    rates = {}
    for b in batches:
        rows = ids.repeat(b, 1)
        ours = b * rate(runner(model, rows, compile=True), new_tokens)
        theirs = b * rate(llama.greedy_batch([ids[0].tolist()] * b), new_tokens)
        rates[f"aiayn q4 compiled, batch {b}"], rates[f"llama.cpp, batch {b}"] = ours, theirs
        print(f"  batch {b:2d}: aiayn q4 compiled {ours:7.1f} tokens/s   llama.cpp {theirs:7.1f} tokens/s   "
              f"aiayn / llama.cpp = {ours / theirs:.0%}", flush=True)
    return rates


def peak_memory(path: Path, threads: int) -> dict[str, float]:
    """Peak resident MiB of a fresh process per peer (see the module docstring)."""
    out = {}
    jobs = {"python + torch + aiayn, no model": ("generate_q4", ("none", None)),
            "aiayn q4 (auto)": ("generate_q4", ("auto", str(path))),
            "aiayn float32": ("generate_q4", ("float32", str(path))), "llama.cpp": ("llama_cpp", (str(path),))}
    for name, (module, child_args) in jobs.items():
        child = f"from benchmarks.{module} import rss_child; rss_child(*{child_args!r}, threads={threads})"
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("peak_rss_mib")]
        if done.returncode != 0 or not lines:
            print(f"  {name}: failed ({done.stderr.strip().splitlines()[-1:]})")
            continue
        out[name] = float(lines[-1].split()[1])
        print(f"  {name:34s} {out[name]:7.0f} MiB", flush=True)
    if "aiayn q4 (auto)" in out and "llama.cpp" in out:
        print(f"  aiayn q4 / llama.cpp peak memory = {out['aiayn q4 (auto)'] / out['llama.cpp']:.2f}x"
              + (f"; above the bare interpreter: {out['aiayn q4 (auto)'] - out['python + torch + aiayn, no model']:.0f}"
                 f" MiB against llama.cpp's {out['llama.cpp']:.0f} MiB whole process"
                 if "python + torch + aiayn, no model" in out else ""))
    return out


def rss_child(mode: str, path: str | None, threads: int) -> None:
    """The measured process of ``peak_memory``: load, prefill 512 tokens, decode 128, print the peak."""
    torch.set_num_threads(threads)
    if mode != "none":
        model = packed_model(Path(path), "auto" if mode == "auto" else "none")
        generate_decoder_only(model, torch.arange(100, 612)[None], max_new_tokens=128, sampling=GREEDY)
    print(f"peak_rss_mib {peak_rss_mib():.1f}")


def validation_windows(tokenizer, windows: int, length: int = 512) -> list[list[int]]:
    """The first ``windows`` windows of ``length`` tokens of Tiny Shakespeare's last 10%."""
    text = dataset_file("tinyshakespeare", "input.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text[int(0.9 * len(text)):], add_special_tokens=False).ids
    return [ids[i * length:(i + 1) * length] for i in range(windows) if (i + 1) * length <= len(ids)]


@torch.no_grad()
def _nll(model: torch.nn.Module, window: list[int]) -> tuple[float, int]:
    ids = torch.tensor([window])
    logits = model(ids).logits[0, :-1].double()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")), len(window) - 1


def perplexity(path: Path, tokenizer, windows: int, threads: int) -> dict[str, float]:
    """exp(mean negative log-likelihood) per peer over the same windows."""
    data = validation_windows(tokenizer, windows)
    print(f"  {len(data)} windows of 512 tokens from the last 10% of tinyshakespeare/input.txt")

    def aiayn(build: Callable[[], torch.nn.Module]) -> Callable[[], Callable[[list[int]], tuple[float, int]]]:
        return lambda: functools.partial(_nll, build())  # the model is built when the peer's turn comes

    def floats() -> torch.nn.Module:
        return load_gguf(path, tokenizer=False).model.eval()

    peers: dict[str, Callable[[], Callable[[list[int]], tuple[float, int]]]] = {
        "aiayn float32": aiayn(floats),
        "aiayn bfloat16": aiayn(lambda: lower_precision(floats(), "bf16")),
        "aiayn int8": aiayn(lambda: lower_precision(floats(), "int8")),
        "aiayn q4 (auto)": aiayn(lambda: packed_model(path, "auto")),
        "aiayn q4 (all 4-bit)": aiayn(lambda: packed_model(path, "q4")),
        "llama.cpp": lambda: getattr(load_peer("llama.cpp", LlamaCpp, path, threads, n_ctx=1024), "nll", None),
    }
    out = {}
    for name, make in peers.items():
        nll = make()
        if nll is None:  # llama.cpp not installed: its row is printed
            continue
        total = count = 0.0
        for window in data:
            t, c = nll(window)
            total, count = total + t, count + c
        out[name] = math.exp(total / count)
        print(f"  {name:24s} perplexity {out[name]:8.3f}", flush=True)
        del nll
    if "llama.cpp" in out:
        for name in ("aiayn q4 (auto)", "aiayn float32"):
            print(f"  {name} / llama.cpp perplexity = {out[name] / out['llama.cpp']:.4f}")
    return out

