"""What constrained decoding costs: llguidance, xgrammar and outlines-core on SmolLM2-135M.

SmolLM2-135M-Instruct (q4), batch 1, greedy, answers under a JSON schema and under "any JSON
object". Per library, interleaved rounds: the grammar's work per step (bitmask, ``apply_bitmask``,
advance) against the decode step timed in the same loop (the < 10% goal's figure), the one-off
costs, and whether every answer validates. llguidance runs ``aiayn.generate.constrain`` itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from aiayn.generate import constrain
from aiayn.generate.step import decode_step
from benchmarks import common
from benchmarks.common import footer, header, load_peer, mark_start, smollm2, table

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CASES = {
    "schema": ("Describe a fictional person as JSON with the keys name (a string), age (an integer) and "
               "tags (a list of short strings).", SCHEMA),
    "json_object": ("Give the city, country and population of Paris as a JSON object.", None),
}
GOAL = 0.10  # the grammar's share of decode time at batch 1


class Llguidance:
    """Each library: ``name``, ``module`` (its import), ``prepare`` (describe the tokenizer), ``compile``
    (a schema, None: any object; afresh, up to the first mask) and ``start(grammar)`` -> a ``_State``.
    This one is aiayn's own path, ``aiayn.generate.constrain`` (caches off for compile timings)."""

    name, module = "llguidance", "llguidance"

    def prepare(self, tokenizer: Any, eos_id: int) -> None:
        self.tokenizer, self.eos_id = tokenizer, eos_id
        constrain.tokenizer_info(tokenizer, eos_id)

    def compile(self, schema: dict | None) -> Any:
        with constrain._lock:  # the tokenizer stays described; the schema is compiled afresh
            constrain._grammars.clear()
        if schema is None:
            grammar = constrain.GrammarConstraint.json_object(self.tokenizer, eos_id=self.eos_id)
        else:
            grammar = constrain.GrammarConstraint.from_schema(self.tokenizer, schema, eos_id=self.eos_id)
        grammar.copy().bitmask()  # up to the first mask (llguidance builds its lexer as masks ask)
        return grammar

    def start(self, grammar: Any) -> Any:
        state = grammar.copy()
        return _State(lambda words: state.bitmask(), state.advance, state.is_finished)


class Xgrammar:
    name, module = "xgrammar", "xgrammar"

    def prepare(self, tokenizer: Any, eos_id: int) -> None:
        import xgrammar as xgr

        n = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = [""] * n
        for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
            vocab[i] = text
        # Special tokens as "" (xgrammar then never allows them); raw, it would read <|im_start|> as text.
        for added in json.loads(tokenizer.to_str()).get("added_tokens", []):
            if added.get("special") and added["id"] != eos_id:
                vocab[added["id"]] = ""
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=n, stop_token_ids=[eos_id])
        self.compiler = lambda: xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.xgr, self.n = xgr, n

    def compile(self, schema: dict | None) -> Any:
        grammar = self.compiler().compile_json_schema(schema or {"type": "object"}, any_whitespace=False,
                                                      separators=(", ", ": "), strict_mode=True)
        self.start(grammar).fill(torch.empty((self.n + 31) // 32, dtype=torch.int32))  # up to the first mask
        return grammar

    def start(self, grammar: Any) -> Any:
        matcher = self.xgr.GrammarMatcher(grammar)
        def fill(words: torch.Tensor) -> torch.Tensor:
            matcher.fill_next_token_bitmask(words[None])
            return words

        return _State(fill, matcher.accept_token, matcher.is_terminated)


class OutlinesCore:
    name, module = "outlines-core", "outlines_core"

    def prepare(self, tokenizer: Any, eos_id: int) -> None:
        import outlines_core

        # Byte-level BPE: each token's characters stand for bytes (GPT-2's table); specials left out.
        to_byte = {c: b for b, c in enumerate(common.byte_level_alphabet())}
        special = {a["id"] for a in json.loads(tokenizer.to_str()).get("added_tokens", []) if a.get("special")}
        tokens: dict[bytes, list[int]] = {}
        for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
            if i not in special:
                tokens.setdefault(bytes(to_byte[c] for c in text), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos_id, tokens)
        self.oc, self.n = outlines_core, tokenizer.get_vocab_size(with_added_tokens=True)

    def compile(self, schema: dict | None) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        # " ?": at most one space around separators, the nearest its regexes come to compact JSON.
        regex = build_regex_from_schema(json.dumps(schema or {"type": "object"}), " ?")
        return self.oc.Index(regex, self.vocab)  # the automaton over the vocabulary: all its work

    def start(self, grammar: Any) -> Any:
        guide = self.oc.Guide(grammar)
        def fill(words: torch.Tensor) -> torch.Tensor:
            guide.write_mask_into(words.data_ptr(), words.numel(), 4)
            return words

        return _State(fill, lambda token: guide.advance(token, return_tokens=False), lambda: False)


@dataclass
class _State:
    fill: Callable[[torch.Tensor], torch.Tensor]  # (w,) int32 buffer -> the packed mask (that buffer or its own)
    advance: Callable[[int], Any]
    finished: Callable[[], bool]


LIBRARIES = [Llguidance, Xgrammar, OutlinesCore]


@dataclass
class Run:
    """One library on one case: per-step seconds of each part, every round's answer."""

    decode: list[float] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    advance: list[float] = field(default_factory=list)
    compile: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)


@torch.inference_mode()
def constrained_greedy(lm: Any, ids: torch.Tensor, lib, grammar: Any, run: Run, max_new_tokens: int) -> None:
    """One greedy answer under ``grammar``, each part of each step timed into ``run``."""
    clock = time.perf_counter
    state = lib.start(grammar)
    n = lm.tokenizer.get_vocab_size(with_added_tokens=True)
    words = torch.empty((n + 31) // 32, dtype=torch.int32)  # (w,)
    cache = lm.model.new_cache(1, ids.shape[1] + max_new_tokens)
    inputs, produced, stop = ids, [], "length"
    for _ in range(max_new_tokens):
        t0 = clock()
        logits = decode_step(lm.model, inputs, cache).float()  # (1, v)
        t1 = clock()
        mask = state.fill(words)
        t2 = clock()
        constrain.apply_bitmask(logits, mask, n)
        t3 = clock()
        token = int(logits.argmax(-1))
        t4 = clock()
        if token != lm.eos_id:  # end-of-text ends the answer; outlines-core has no state past it
            state.advance(token)
        t5 = clock()
        if inputs.shape[1] == 1:  # the prompt's step is prefill, not decode
            run.decode.append(t1 - t0)
        run.mask.append(t2 - t1)
        run.apply.append(t3 - t2)
        run.advance.append(t5 - t4)
        if token == lm.eos_id:
            stop = "eos"
            break
        produced.append(token)
        if state.finished():
            stop = "finished"
            break
        inputs = torch.tensor([[token]])
    run.answers.append(lm.decode(produced))
    run.stops.append(stop)


def check(answer: str, schema: dict | None) -> str:
    """'ok', or why the answer is not valid."""
    try:
        value = json.loads(answer)
    except ValueError as exc:
        return f"not JSON ({exc})"
    try:
        import jsonschema
    except ImportError:
        return "ok" if schema is not None or isinstance(value, dict) else "not an object"
    try:
        jsonschema.validate(value, schema or {"type": "object"})
    except jsonschema.ValidationError as exc:
        return f"invalid ({exc.message})"
    return "ok"


def run(lm: Any, *, rounds: int, max_new_tokens: int, compiles: int, names: list[str] | None = None) -> dict:
    """Measure every installed library on every case; print the tables; return the figures."""
    libs = [lib for lib in (make() for make in LIBRARIES) if (not names or lib.name in names)
            and load_peer(lib.name, importlib.import_module, lib.module) is not None]
    began = time.perf_counter()
    prepare: dict[str, float] = {}
    for lib in libs:
        constrain.clear_caches()
        start = time.perf_counter()
        lib.prepare(lm.tokenizer, lm.eos_id)
        prepare[lib.name] = time.perf_counter() - start
    runs = {(lib.name, case): Run() for lib in libs for case in CASES}
    prompts = {case: lm.prompt_ids(text, chat=True) for case, (text, _) in CASES.items()}
    grammars = {}
    for case, (_, schema) in CASES.items():  # compile timings, interleaved; the last one is used
        for _ in range(compiles):
            for lib in libs:
                start = time.perf_counter()
                grammars[lib.name, case] = lib.compile(schema)
                runs[lib.name, case].compile.append(time.perf_counter() - start)
    for case in CASES:  # warm-up: one untimed answer each (first-touch costs, lazy lexers)
        for lib in libs:
            constrained_greedy(lm, prompts[case], lib, grammars[lib.name, case], Run(), max_new_tokens)
    print(f"tokenizer described, schemas compiled in {time.perf_counter() - began:.0f} s; answering", flush=True)
    for i in range(rounds):
        for case in CASES:
            for lib in libs:
                constrained_greedy(lm, prompts[case], lib, grammars[lib.name, case], runs[lib.name, case],
                                   max_new_tokens)
        print(f"round {i + 1}/{rounds} done, {time.perf_counter() - began:.0f} s", flush=True)
    print()
    return report(runs, prepare)


def report(runs: dict[tuple[str, str], Run], prepare: dict[str, float]) -> dict:
    rows, figures = [], {}
    for (name, case), r in runs.items():
        grammar = [m + a + d for m, a, d in zip(r.mask, r.apply, r.advance, strict=True)]
        share = sum(grammar) / sum(r.decode) if r.decode else float("nan")
        valid = sum(check(a, CASES[case][1]) == "ok" for a in r.answers)
        ms = {part: statistics.median(getattr(r, part)) * 1e3 for part in ("compile", "decode", "mask", "apply", "advance")}
        figures[name, case] = {"share": share, "compile_ms": ms["compile"], "valid": valid, "answers": len(r.answers)}
        rows.append([name, case, f"{prepare[name]:.2f}", f"{ms['compile']:.1f}", f"{ms['decode']:.2f}",
                     *(f"{ms[part]:.3f}" for part in ("mask", "apply", "advance")),
                     f"{sorted(grammar)[int(0.95 * (len(grammar) - 1))] * 1e3:.3f}", f"**{share:.1%}**",
                     f"{valid}/{len(r.answers)}", f"{len(r.mask) // max(len(r.answers), 1)}"])
    print(table(["library", "case", "tokenizer s", "compile ms", "decode ms/step", "mask ms/step",
                 "apply ms/step", "advance ms/step", "grammar p95 ms", "grammar / decode", "valid",
                 "steps"], rows))
    print("\nmedians per step; 'grammar / decode' = sum(mask + apply + advance) / sum(decode step) over "
          f"every timed step (goal < {GOAL:.0%}); compile: schema -> first mask, fresh, median")
    for name in {n for n, _ in runs}:
        worst = max(figures[name, case]["share"] for case in CASES)
        print(f"{name}: worst case grammar / decode = {worst:.1%} "
              f"({'goal met' if worst < GOAL else 'goal MISSED'})")
    for (name, case), r in runs.items():
        print(f"\n{name}, {case}: {r.stops[-1]}: {r.answers[-1]!r}")
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved answers per library and case")
    parser.add_argument("--compiles", type=int, default=3, help="fresh compiles per library and schema (>= 1)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--quantize", default="q4", help="SmolLM2's weights: q4 (default) or none (float32)")
    parser.add_argument("--libraries", nargs="*", help="only these (llguidance, xgrammar, outlines-core)")
    args = parser.parse_args(argv)
    from aiayn.tasks.runs import load_text_model

    torch.set_num_threads(args.threads)
    mark_start(args)
    lm = load_text_model(model_path=smollm2(), quantize=args.quantize)
    header(f"Constrained decoding: SmolLM2-135M-Instruct ({args.quantize}), batch 1, greedy; {args.rounds} "
           "interleaved rounds after one warm-up answer each", args)
    run(lm, rounds=args.rounds, max_new_tokens=args.max_new_tokens, compiles=args.compiles,
        names=args.libraries)
    footer()


if __name__ == "__main__":
    main()
