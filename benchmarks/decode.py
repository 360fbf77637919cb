"""Greedy decoding tokens/s: aiayn against Hugging Face ``generate`` and x-transformers ``generate``.

Benchmark 3. Equal decoder-only models (d 256, 4 layers, 4 heads, d_ff 1024, vocab 8,000, GPT-2
layout, random weights), a 16-token prompt, exactly 256 new tokens, batch 1 and 16, KV cache on and
off, under ``torch.inference_mode()``; tokens/s counts the whole call (prefill included). aiayn is
``aiayn.fast.optimize(model, "inference")`` through ``greedy_decoder_only``, eager and with
``compile=True`` (compiled in the warm-up); ``--plain`` adds the model without ``optimize``.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

from aiayn.generate import greedy_decoder_only
from benchmarks import common
from benchmarks.peers import LM_PEERS, Dropouts, LMSize, optimize_aiayn, quiet

TARGETS = {1: 3.0, 16: 1.5}  # batch -> aiayn / best peer, with the cache


COMPILED = "aiayn compiled"  # the same aiayn model, decoded with compile=True
PLAIN = "aiayn plain torch"  # the same aiayn model without aiayn.fast.optimize (--plain)
AIAYN = ("aiayn", COMPILED, PLAIN)


def aiayn_model(size: LMSize, seed: int, *, plain: bool = False) -> nn.Module:
    """The aiayn decoder in eval mode through ``optimize(model, "inference")`` (``aiayn
    generate``'s model) unless ``plain``."""
    torch.manual_seed(seed)
    model = LM_PEERS["aiayn"](size, Dropouts()).eval()
    return model if plain else optimize_aiayn(model, "inference")


def load_models(size: LMSize, args: argparse.Namespace) -> tuple[dict[str, nn.Module], nn.Module | None]:
    """The peers' models in eval mode (aiayn's optimized; a missing library's: its row printed) and,
    with ``--plain``, aiayn's plain one."""
    models = {}
    for name in args.peers or LM_PEERS:
        torch.manual_seed(args.seed)
        model = (aiayn_model(size, args.seed) if name == "aiayn"
                 else common.load_peer(name, lambda n=name: LM_PEERS[n](size, Dropouts()).eval()))
        if model is not None:
            models[name] = model
    return models, aiayn_model(size, args.seed, plain=True) if args.plain and "aiayn" in models else None


def with_aiayn_rows(models: dict[str, nn.Module], plain: nn.Module | None, args: argparse.Namespace,
                    use_cache: bool) -> dict[str, nn.Module]:
    """``models`` and aiayn's extra rows: compiled (with the cache, unless ``--no-compiled``), plain."""
    runs = dict(models)
    if use_cache and "aiayn" in models and not args.no_compiled:
        runs[COMPILED] = models["aiayn"]
    if plain is not None:
        runs[PLAIN] = plain
    return runs


def decoder(name: str, model: nn.Module, prompt: Tensor, new: int, use_cache: bool):
    if name in AIAYN:
        compile = name == COMPILED

        def run() -> Tensor:
            return greedy_decoder_only(model, prompt, max_new_tokens=new, use_cache=use_cache,
                                       compile=compile).tokens
    elif name == "HF GPT-2":
        def run() -> Tensor:
            return common.hf_greedy(model, prompt, new, use_cache=use_cache, eos_token_id=None)
    else:
        from x_transformers import AutoregressiveWrapper

        wrapper = AutoregressiveWrapper(model, pad_value=0)

        def run() -> Tensor:
            return wrapper.generate(prompt, new, temperature=0.0, cache_kv=use_cache)

    def call() -> Tensor:
        with torch.inference_mode():
            out = run()
        if out.shape != (prompt.shape[0], new):
            raise AssertionError(f"{name} produced {tuple(out.shape)} tokens, expected {(prompt.shape[0], new)}")
        return out

    return call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--no-recompute", action="store_true", help="skip the cache-off rows (slow)")
    parser.add_argument("--peers", nargs="*", help="subset of peers (aiayn first)")
    parser.add_argument("--no-overhead", action="store_true",
                        help="skip the per-token framework overhead rows (a tiny model, batch 1)")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip the 'aiayn compiled' rows (compile=True; needs a C++ compiler)")
    parser.add_argument("--plain", action="store_true",
                        help=f"add '{PLAIN}' rows: the same model without aiayn.fast.optimize, eager")
    common.add_common_args(parser, repeats=5, warmup=1)
    args = parser.parse_args(argv)
    common.setup(args)
    quiet()
    new = args.new_tokens if not args.quick else min(args.new_tokens, 64)
    size = LMSize()
    models, plain_model = load_models(size, args)
    params = {name: common.count_params(model) for name, model in models.items()}
    common.header(f"Greedy decoding, decoder-only (d {size.d_model}, {size.n_layers} layers, {size.n_heads} heads, "
           f"vocab {size.vocab:,}), prompt {args.prompt_len}, {new} new tokens", args)
    print(common.table(["peer", "parameters"], [[n, common.fmt_int(p)] for n, p in params.items()]) + "\n")
    gen = torch.Generator().manual_seed(args.seed)
    rows, ratios = [], []
    for batch in args.batch:
        prompt = torch.randint(1, size.vocab, (batch, args.prompt_len), generator=gen)
        for use_cache in (True, False) if not args.no_recompute else (True,):
            peers = [common.Timed(n, decoder(n, m, prompt, new, use_cache))
                     for n, m in with_aiayn_rows(models, plain_model, args, use_cache).items()]
            # Recomputing is slow: fewer rounds (still interleaved and a median).
            repeats = args.repeats if use_cache else max(1, min(args.repeats, 3))
            common.run_interleaved(peers, repeats=repeats, warmup=args.warmup if use_cache else 0)
            tps = {p.name: batch * new / p.median for p in peers}
            for p in peers:
                rows.append([batch, "on" if use_cache else "off", p.name, f"{p.median * 1e3:.0f}",
                             f"±{p.spread * 50:.0f}%", common.fmt_int(tps[p.name]),
                             f"{p.median / new * 1e3:.2f}"])
            target = TARGETS.get(batch) if use_cache else None
            others = {n: v for n, v in tps.items() if not n.startswith("aiayn")}
            for ours in (n for n in tps if n.startswith("aiayn")):
                ratios.append(common.ratio_line(f"batch {batch}, cache {'on' if use_cache else 'off'}, {ours}",
                                         tps[ours], others, target=target))
    print(common.table(["batch", "KV cache", "peer", "ms / call (median)", "spread", "new tokens/s",
                 "ms / token step"], rows))
    print()
    for line in ratios:
        print("* " + line)
    if not args.no_overhead:
        overhead(args, new)
    common.footer()


def overhead(args: argparse.Namespace, new: int) -> None:
    """Per-token cost of each library's decoding loop itself: a model so small (d 32, 1 layer,
    vocab 64) that its arithmetic is negligible, batch 1, cache on."""
    tiny = LMSize(vocab=64, d_model=32, n_heads=2, n_layers=1, d_ff=64)
    prompt = torch.randint(1, tiny.vocab, (1, args.prompt_len))
    peers = [common.Timed(name, decoder(name, model, prompt, new, True))
             for name, model in with_aiayn_rows(*load_models(tiny, args), args, True).items()]
    common.run_interleaved(peers, repeats=args.repeats, warmup=args.warmup)
    print(f"\nFramework overhead per generated token (tiny model: d 32, 1 layer, vocab 64; batch 1, "
          f"cache on, {new} new tokens):\n")
    print(common.table(["peer", "ms / token step"], [[p.name, f"{p.median / new * 1e3:.3f}"] for p in peers]))


if __name__ == "__main__":
    main()
