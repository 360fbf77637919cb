"""How often lower precision changes SmolLM2's greedy answers (docs/pretrained.md, "Lower precision").

SmolLM2-135M-Instruct as float32, bf16 and int8 answers the same chat prompts greedily; per prompt,
the leading tokens equal to float32's (the honest figure: greedy forks at a near-tie) and the share
of positions equal.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import footer, header, same_prefix, smollm2

PROMPTS = ("What is the capital of France?",
           "Write a short story about a robot who learns to paint.",
           "Give three tips for staying healthy.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import aiayn
    from aiayn.generate.decoder_only import greedy_decoder_only

    path = smollm2()
    header(f"Greedy answers under lower precision: {path.name}, {len(PROMPTS)} chat prompts x {args.new_tokens} "
           "new tokens", args, dtype="float32, bf16, int8")
    answers: dict[str, list[list[int]]] = {}
    for precision in ("none", "bf16", "int8"):
        lm = aiayn.load(path, quantize=precision)
        answers[precision] = [greedy_decoder_only(lm.model, lm.prompt_ids(prompt, chat=True), eos_id=lm.eos_id,
                                                  max_new_tokens=args.new_tokens).tokens[0].tolist()
                              for prompt in PROMPTS]
        if precision == "none":
            for prompt, tokens in zip(PROMPTS, answers["none"], strict=True):
                print(f"float32, {prompt!r}: {lm.tokenizer.decode(tokens)[:60]!r}...")
    print(f"greedy tokens vs float32 ({len(PROMPTS)} chat prompts, {args.new_tokens} new tokens each):")
    for precision in ("bf16", "int8"):
        pairs = list(zip(answers[precision], answers["none"], strict=True))  # float32's may be shorter: it ended
        runs = ", ".join(f"{same_prefix(ours, ref)} of {len(ref)}" for ours, ref in pairs)
        shares = [sum(a == b for a, b in zip(ours, ref, strict=False)) / max(len(ref), 1) for ours, ref in pairs]
        print(f"  {precision}: identical for the first {runs} tokens; "
              f"{', '.join(f'{s:.0%}' for s in shares)} of positions equal")
    footer()


if __name__ == "__main__":
    main()
