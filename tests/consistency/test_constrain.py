"""Constrained decoding (``aiayn.generate.constrain``): every answer is JSON that
validates against its schema.

Proofs: a tiny random LLaMA-style model with a real byte-level BPE tokenizer answers under several
schemas (objects, enums, arrays, nesting, numbers, booleans, optional keys), greedy and sampled
with several seeds, and every answer parses and validates (``jsonschema``); ``json_object`` gives
a JSON object; the mask is sound: over random walks through each grammar, every token it allows
is one llguidance's matcher accepts, end-of-text only when the answer is complete, other
special tokens never, padded vocabulary rows never; batch rows mask independently; an invalid
schema is one ``ValueError`` of one line. How much the mask costs is ``benchmarks/constrain.py``'s.

The model's output layer gets a bias toward tokens holding ``"``, ``,``, ``]`` or ``}``, so that
its strings, numbers and containers end within a few tokens (a random model would otherwise write
one string until ``max_new_tokens``); which token comes next is still its choice.
"""

from __future__ import annotations

import copy
import json
import math
import random

import jsonschema
import pytest
import torch
from tokenizer_helpers import CHAT_TEMPLATE, SPECIALS, grammar_accepts, train_tokenizer
from torch import nn

from aiayn.generate import SamplingConfig, stream_decoder_only
from aiayn.generate import constrain as c
from aiayn.generate.constrain import (
    ConstraintError,
    GrammarConstraint,
    generate_constrained,
    generate_json,
    mask_rows,
)
from aiayn.interop.gguf_text import ChatTemplate
from aiayn.models import DecoderOnly, get_preset
from aiayn.textgen import TextModel

TEXT = ('{"name": "Ada", "age": 36, "tags": ["math", "engines"], "ok": true, "score": -1.5e3, "x": null}\n'
        "The quick brown fox jumps over the lazy dog. Numbers like 12345 and 678.\n") * 4
CLOSERS = '"],}'

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
               "required": ["name", "age", "tags"], "additionalProperties": False},
    "enum_bool": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                                    "ok": {"type": "boolean"}, "none": {"type": "null"}},
                  "required": ["colour", "ok", "none"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 120},
                                                  "x": {"type": "number"}, "p": {"type": "number", "minimum": 0}},
                "required": ["n", "x", "p"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "langs": {"type": "array", "items": {"enum": ["en", "fr"]},
                                                            "minItems": 1, "maxItems": 3}},
                 "required": ["id", "langs"], "additionalProperties": False},
        "note": {"type": "string", "minLength": 2, "maxLength": 6}},
        "required": ["user", "note"], "additionalProperties": False},
    "optional_keys": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                      "required": ["a"], "additionalProperties": False},
    "array_top": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
}
SAMPLINGS = [None, SamplingConfig(temperature=1.0, seed=0), SamplingConfig(temperature=1.0, seed=1),
             SamplingConfig(temperature=0.8, top_k=20, seed=2, repetition_penalty=1.2)]


class Biased(nn.Module):
    """An output layer plus a fixed bias (v,)."""

    def __init__(self, head: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("bias", bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden) + self.bias


def tiny_lm(tok, *, pad_vocab: int = 0, seed: int = 0, biased: bool = True) -> TextModel:
    """A 2-layer LLaMA-style model over ``tok`` (its output layer ``pad_vocab`` rows wider than the
    vocabulary), weights at a scale far from ties, biased toward closing tokens (the docstring;
    ``biased=False``: a plain model, as ``aiayn export`` writes it)."""
    n = tok.get_vocab_size()
    torch.manual_seed(seed)
    model = DecoderOnly(get_preset("llama-tiny", vocab_size=n + pad_vocab, max_seq_len=256)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) / math.sqrt(module.in_features))
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
    bias = torch.tensor([3.0 if any(ch in tok.decode([i]) for ch in CLOSERS) else 0.0 for i in range(n)]
                        + [50.0] * pad_vocab)  # padded rows would win everywhere if not masked
    if biased:
        model.lm_head = Biased(model.lm_head, bias)
    eos = tok.token_to_id("<|im_end|>")
    return TextModel(model, lambda text: tok.encode(text, add_special_tokens=False).ids, lambda ids: tok.decode(ids),
                     256, eos, None, ChatTemplate(CHAT_TEMPLATE, {"eos_token": "<|im_end|>"}), tok)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXT)


@pytest.fixture(scope="module")
def lm(tok, device):
    lm = tiny_lm(tok, pad_vocab=7)  # a padded output layer: the extra rows must be masked
    lm.model.to(device)
    return lm


def valid(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_answers_validate(lm, name, device):
    schema = SCHEMAS[name]
    constraint = GrammarConstraint.from_schema(lm.tokenizer, schema, eos_id=lm.eos_id)
    for sampling in SAMPLINGS:
        result = generate_constrained(lm, f"Answer with {name} JSON.", constraint, max_new_tokens=120,
                                      sampling=sampling)
        assert result.complete, (sampling, result.text)
        valid(result.text, schema)
        assert "\n" not in result.text  # compact JSON, one line


def test_json_object_and_generate_json(lm, device):
    seen = set()
    for sampling in SAMPLINGS:
        value = generate_json(lm, "Describe Paris.", max_new_tokens=150, sampling=sampling)
        assert isinstance(value, dict)
        seen.add(json.dumps(value))
    assert len(seen) > 1  # the seeds do choose
    value = generate_json(lm, "A person.", SCHEMAS["person"], max_new_tokens=150)
    jsonschema.validate(value, SCHEMAS["person"])


def test_reset_and_copy(lm, device):
    constraint = GrammarConstraint.from_schema(lm.tokenizer, SCHEMAS["nested"], eos_id=lm.eos_id)
    first = generate_constrained(lm, "Q", constraint, max_new_tokens=120)
    again = generate_constrained(lm, "Q", constraint, max_new_tokens=120)  # resets at the start
    assert first.tokens == again.tokens and constraint.is_finished()
    constraint.reset()
    twin = constraint.copy()
    constraint.advance(first.tokens[0])
    assert not twin.allowed().equal(constraint.allowed())  # the copy did not move
    cut = generate_constrained(lm, "Q", constraint, max_new_tokens=3)
    assert cut.stop == "length" and not cut.complete
    with pytest.raises(ValueError, match="cut after 3 tokens"):
        generate_json(lm, "Q", SCHEMAS["nested"], max_new_tokens=3)


# -- the library's decode loop and aiayn generate ----------------------------------------------------


def loop_answer(lm, ids: torch.Tensor, constraints: list, sampling: SamplingConfig | None) -> list[list[int]]:
    """Each row's tokens from ``stream_decoder_only`` with ``constraints`` (end-of-text and the fill
    after a row is done left out)."""
    rows: list[list[int]] = [[] for _ in range(ids.shape[0])]
    for step in stream_decoder_only(lm.model, ids, max_new_tokens=120, sampling=sampling, eos_id=lm.eos_id,
                                    constraints=constraints):
        for row, (token, active) in enumerate(zip(step.tokens.tolist(), step.active.tolist(), strict=True)):
            if active and token != lm.eos_id:
                rows[row].append(token)
    return rows


@pytest.mark.parametrize("name", ["person", "nested", "array_top"])
def test_the_decode_loop_steers_rows_as_generate_constrained(lm, name, device):
    """``stream_decoder_only(constraints=...)`` (what aiayn generate --json-schema runs) gives the
    tokens of ``generate_constrained`` (its own loop), greedy and seeded; in a batch, a free row beside
    a constrained one gets its tokens alone, and the loop stops once every row is done."""
    ids = lm.prompt_ids("Answer with JSON.", chat=True)  # (1, t)
    constraint = GrammarConstraint.from_schema(lm.tokenizer, SCHEMAS[name], eos_id=lm.eos_id)
    for sampling in (None, SamplingConfig(temperature=1.0, seed=4)):
        expected = generate_constrained(lm, "Answer with JSON.", constraint, max_new_tokens=120, sampling=sampling)
        assert expected.complete
        [got] = loop_answer(lm, ids, [constraint], sampling)
        assert got == expected.tokens and constraint.is_finished()
        valid(lm.decode(got), SCHEMAS[name])
    free_alone = loop_answer(lm, ids, [None], None)[0]
    steered, free = loop_answer(lm, ids.repeat(2, 1), [constraint, None], None)
    assert free == free_alone and steered == generate_constrained(lm, "Answer with JSON.", constraint,
                                                                 max_new_tokens=120).tokens
    with pytest.raises(ValueError, match="1 constraints for 2 prompt rows"):
        stream_decoder_only(lm.model, ids.repeat(2, 1), max_new_tokens=4, constraints=[constraint])


@pytest.fixture(scope="module")
def plain_dir(tok, tmp_path_factory):
    from aiayn.textgen import export_text_model

    return export_text_model(tiny_lm(tok, biased=False), tmp_path_factory.mktemp("models") / "plain")


@pytest.mark.cpu_only
def test_aiayn_generate_json_schema(plain_dir, tmp_path, run_aiayn):
    """aiayn generate --json-schema FILE / --json: stdout is the JSON alone (an enum's value: a random
    model reaches the end of it), the summary says it is complete; cut by --max-new-tokens it exits
    1 saying so; an invalid schema, a file that is not JSON, or both options are one-line errors."""
    enum = tmp_path / "enum.json"
    enum.write_text(json.dumps({"enum": ["yes", "no", "maybe"]}))
    base = ("generate", "--model", str(plain_dir), "--chat", "--prompt", "Yes or no?")
    for sampling in (("--temperature", "0"), ("--seed", "3")):
        code, out, err = run_aiayn(*base, "--json-schema", str(enum), *sampling)
        assert code == 0 and json.loads(out) in ("yes", "no", "maybe"), (out, err)
        assert "stopped: the answer is complete (its grammar ends)" in err
    person = tmp_path / "person.json"
    person.write_text(json.dumps(SCHEMAS["person"]))
    code, out, err = run_aiayn(*base, "--json-schema", str(person), "--max-new-tokens", "3", "--temperature", "0")
    assert code == 1 and out.startswith('{"') and "the answer was cut after 3 tokens" in err
    code, out, err = run_aiayn(*base, "--json", "--max-new-tokens", "2", "--temperature", "0")
    assert code == 1 and out.startswith("{") and "before its JSON was complete" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "strin"}))
    code, _, err = run_aiayn(*base, "--json-schema", str(bad))
    assert code == 2 and "invalid JSON schema: Invalid type: strin" in err
    bad.write_text("{not json")
    code, _, err = run_aiayn(*base, "--json-schema", str(bad))
    assert code == 2 and "bad.json is not JSON" in err
    code, _, err = run_aiayn(*base, "--json-schema", str(enum), "--json")
    assert code == 2 and "not both" in err


# -- the mask itself: no model ---------------------------------------------------------------------


def _walk(constraint: GrammarConstraint, tok, rng: random.Random, steps: int) -> list[int]:
    """Random allowed tokens until finished or ``steps``; at every step every token the mask allows
    must be one llguidance's matcher accepts (the mask may allow fewer: where the grammar forces
    bytes, such as ``{"`` at the start of an object, it allows their canonical token only)."""
    eos, n = constraint.info.eos_id, constraint.info.n_vocab
    specials = {tok.token_to_id(s) for s in SPECIALS}
    walked: list[int] = []
    for _ in range(steps):
        allowed = constraint.allowed()  # (n,) bool
        probe = constraint._matcher.deep_copy()
        accepted = torch.tensor([probe.validate_tokens([t]) == 1 for t in range(n)])
        assert not (allowed & ~accepted).any()
        assert bool(allowed[eos]) == constraint.is_complete()
        assert not any(bool(allowed[s]) for s in specials - {eos})
        choices = allowed.nonzero().flatten().tolist()
        assert choices, "the grammar left no token"
        # Prefer a closing token half the time, so that walks reach the end of their answers.
        closers = [t for t in choices if t != eos and any(ch in tok.decode([t]) for ch in CLOSERS)]
        token = rng.choice(closers if closers and rng.random() < 0.5 else choices)
        constraint.advance(token)
        if token == eos:
            break
        walked.append(token)
        if constraint.is_finished():
            break
    return walked


@pytest.mark.cpu_only
@pytest.mark.parametrize("name", [*SCHEMAS, None])
def test_mask_is_sound_over_random_walks(tok, name):
    schema = SCHEMAS.get(name) if name else None
    eos = tok.token_to_id("<|im_end|>")
    constraint = (GrammarConstraint.from_schema(tok, schema, eos_id=eos) if schema
                  else GrammarConstraint.json_object(tok, eos_id=eos))
    finished = 0
    for seed in range(6):
        constraint.reset()
        walked = _walk(constraint, tok, random.Random(seed), steps=60)
        if constraint.is_finished() or constraint.is_complete():
            finished += 1
            valid(tok.decode(walked), schema or {"type": "object"})
    assert finished >= 3


@pytest.mark.cpu_only
def test_mask_logits_shapes_padding_and_rows(tok):
    eos = tok.token_to_id("<|im_end|>")
    n = tok.get_vocab_size()
    a = GrammarConstraint.from_schema(tok, SCHEMAS["enum_bool"], eos_id=eos)
    b = GrammarConstraint.json_object(tok, eos_id=eos)
    a.advance(tok.encode("{", add_special_tokens=False).ids[0])
    logits = torch.randn(3, n + 9)  # a padded output layer
    single = a.mask_logits(logits[0].clone())  # (v,)
    assert torch.isinf(single[n:]).all() and torch.isfinite(single[:n]).eq(a.allowed()).all()
    both = a.mask_logits(logits[:2].clone())  # (b, v): the same mask on each row
    assert both[0].equal(single) and both[1][torch.isfinite(both[1])].numel() == int(a.allowed().sum())
    rows = mask_rows(logits.clone(), [a, None, b])
    assert rows[0].equal(single) and rows[1].equal(logits[1]) and rows[2].equal(b.mask_logits(logits[2].clone()))
    assert mask_rows(logits.clone(), [None, None, None]).equal(logits)
    half = mask_rows(logits[:, :].to(torch.bfloat16), [b, a, None])  # another dtype
    assert torch.isinf(half[0, n:]).all() and half.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="2 constraints for 3 rows"):
        mask_rows(logits, [a, b])


def test_bitmask_unpacking(device):
    """numpy's unpackbits (the CPU's path) and the shifts (a GPU's) read the packed words alike,
    and applying a mask on the device masks exactly the 0 bits and the rows past n."""
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    want = torch.tensor([[bool(int(words[r, t // 32]) >> (t % 32) & 1) for t in range(150)] for r in range(3)])
    assert c.unpack_bitmask(words, 150).equal(want) and c.unpack_bitmask(words, 150, invert=True).equal(~want)
    assert c.unpack_by_shifts(words.to(device), 150).cpu().equal(want)
    logits = torch.randn(3, 157, device=device)
    masked = logits.clone()
    c.apply_bitmask(masked, words, 150)
    assert torch.isinf(masked[:, 150:]).all() and masked[:, :150].isfinite().cpu().equal(want)


@pytest.mark.cpu_only
def test_end_of_text_and_advance_errors(tok):
    eos = tok.token_to_id("<|im_end|>")
    constraint = GrammarConstraint.from_schema(tok, {"enum": ["ab"]}, eos_id=eos)
    assert not constraint.allowed()[eos]
    with pytest.raises(ConstraintError, match="does not fit the grammar"):
        constraint.copy().advance(eos)  # not complete yet
    for token in tok.encode('"ab"', add_special_tokens=False).ids:
        constraint.advance(token)
    assert constraint.is_complete() and constraint.is_finished()
    assert constraint.allowed().nonzero().flatten().tolist() == [eos]  # only the end is left
    constraint.advance(eos)
    with pytest.raises(ConstraintError):
        constraint.advance(tok.encode("a", add_special_tokens=False).ids[0])
    # A model without an end-of-text token: the tokenizer's stand-in is never allowed.
    free = GrammarConstraint.from_schema(tok, {"type": "integer"}, eos_id=None)
    free.advance(tok.encode("7", add_special_tokens=False).ids[0])
    assert free.is_complete() and not free.allowed()[free.info.llg.eos_token]


@pytest.mark.cpu_only
@pytest.mark.parametrize("schema, why", [
    ([1, 2], "must be a JSON object"),
    ({"type": "strin"}, "Invalid type"),
    ({"type": "string", "pattern": "(("}, "unclosed group"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum"),
    ({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}, "does not exist"),
    ({"type": "object", "required": ["a"], "properties": {}, "additionalProperties": False}, "Unsatisfiable"),
    ({"type": "string", "format": "colour"}, "Unknown format"),
    ({"enum": {1, 2}}, "not JSON"),
    ({"type": "array", "uniqueItems": True}, "Unimplemented keys"),  # unenforced would mean invalid answers
])
def test_invalid_schema_is_one_value_error(tok, schema, why):
    with pytest.raises(ValueError, match=why) as caught:
        GrammarConstraint.from_schema(tok, schema, eos_id=2)
    assert "\n" not in str(caught.value)


@pytest.mark.cpu_only
def test_response_format_and_caches(tok, monkeypatch):
    eos = tok.token_to_id("<|im_end|>")
    assert GrammarConstraint.from_response_format(tok, None, eos_id=eos) is None
    assert GrammarConstraint.from_response_format(tok, {"type": "text"}, eos_id=eos) is None
    assert GrammarConstraint.from_response_format(tok, {"type": "json_object"}, eos_id=eos) is not None
    spec = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"], "strict": True}}
    assert GrammarConstraint.from_response_format(tok, spec, eos_id=eos) is not None
    for bad, why in [({"type": "xml"}, "must be"), ({"type": "json_schema"}, "needs"),
                     ({"type": "json_schema", "json_schema": {"schema": []}}, "needs"), ("json", "must be")]:
        with pytest.raises(ValueError, match=why):
            GrammarConstraint.from_response_format(tok, bad, eos_id=eos)
    with pytest.raises(ValueError, match="character-level"):
        GrammarConstraint.json_object(None, eos_id=0)
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        GrammarConstraint.json_object(tok, eos_id=10_000)
    # One description per tokenizer, one compiled grammar per schema (the last GRAMMAR_CACHE kept).
    assert c.tokenizer_info(tok, eos) is c.tokenizer_info(tok, eos)
    monkeypatch.setattr(c, "GRAMMAR_CACHE", 2)
    c.clear_caches()
    schemas = [{"enum": [i]} for i in range(3)]
    first = c._template(c.tokenizer_info(tok, eos), schemas[0])
    assert c._template(c.tokenizer_info(tok, eos), schemas[0]) is first
    for schema in schemas[1:]:
        c._template(c.tokenizer_info(tok, eos), schema)
    assert len(c._grammars) == 2 and c._template(c.tokenizer_info(tok, eos), schemas[0]) is not first


@pytest.mark.slow
@pytest.mark.cpu_only
def test_smollm2_answers_validate(smollm2_text_model):
    """SmolLM2-135M-Instruct in 4 bits answers chat prompts with JSON that validates. The person's
    tags are bounded (``maxItems``), as docs/structured-output.md advises: unbounded, this small model
    can repeat a tag until the token limit."""
    lm = smollm2_text_model("q4")
    schema = copy.deepcopy(SCHEMAS["person"])
    schema["properties"]["tags"]["maxItems"] = 3
    value = generate_json(lm, "Describe a fictional person as JSON with a name, an age and a few tags.",
                          schema, max_new_tokens=96)
    jsonschema.validate(value, schema)
    city = generate_json(lm, "Give the city, country and population of Paris as a JSON object.", max_new_tokens=96)
    assert isinstance(city, dict) and city


@pytest.mark.cpu_only
def test_open_numbers_strings_and_arrays_get_the_default_caps(tok):
    """``constrain.BOUNDS``: 15 digits before the point, 6 after, no exponent; 1000 characters a
    string; 100 items an array. The schema's own bounds win; ``bounds=None`` leaves it as given."""
    eos = tok.token_to_id("<|im_end|>")
    caps = c.BOUNDS
    number = GrammarConstraint.from_schema(tok, {"type": "number"}, eos_id=eos)
    digits = "9" * caps.integer_digits
    assert grammar_accepts(number, tok, f"-{digits}.{'1' * caps.decimals}") and grammar_accepts(number, tok, "11.5")
    for cut in (f"1{digits}", f"11.{'1' * (caps.decimals + 1)}", "1e5"):
        assert not grammar_accepts(number, tok, cut), cut
    integer = GrammarConstraint.from_schema(tok, {"type": "integer"}, eos_id=eos)
    assert grammar_accepts(integer, tok, digits) and not grammar_accepts(integer, tok, f"-1{digits}")
    string = GrammarConstraint.from_schema(tok, {"type": "string"}, eos_id=eos)
    assert grammar_accepts(string, tok, json.dumps("a" * caps.string_chars))
    assert not grammar_accepts(string, tok, json.dumps("a" * (caps.string_chars + 1)))
    array = GrammarConstraint.from_schema(tok, {"type": "array", "items": {"type": "integer"}}, eos_id=eos)
    assert grammar_accepts(array, tok, json.dumps([1] * caps.array_items))
    assert not grammar_accepts(array, tok, json.dumps([1] * (caps.array_items + 1)))
    own = GrammarConstraint.from_schema(tok, {"type": "object", "properties": {
        "x": {"type": "number", "maximum": 1e17, "multipleOf": 1e-9}, "s": {"type": "string", "maxLength": 1500}},
        "required": ["x", "s"], "additionalProperties": False}, eos_id=eos)
    assert grammar_accepts(own, tok, json.dumps({"x": 12345678901234567, "s": "b" * 1200}))
    assert grammar_accepts(own, tok, '{"x": 0.123456789, "s": ""}') and not grammar_accepts(own, tok, '{"x": 0.1234567891, "s": ""}')
    free = GrammarConstraint.from_schema(tok, {"type": "number"}, eos_id=eos, bounds=None)
    assert grammar_accepts(free, tok, f"1{digits}.{'1' * 12}e5")


@pytest.mark.cpu_only
def test_bounded_schema_reaches_nested_values_and_leaves_the_given_schema_alone():
    bounds = c.JsonBounds(integer_digits=3, decimals=2, string_chars=10, array_items=4)
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": ["string", "null"]}},
        "pick": {"anyOf": [{"$ref": "#/$defs/n"}, {"enum": ["a" * 50]}, {"type": "integer", "minimum": 0}]},
        "fixed": {"type": "string", "const": "x"}, "when": {"type": "string", "format": "date"}},
        "$defs": {"n": {"type": "number"}}}
    given = copy.deepcopy(schema)
    out = c.bounded_schema(schema, bounds)
    assert schema == given  # a copy is bounded
    assert out["properties"]["tags"]["maxItems"] == 4 and out["properties"]["tags"]["items"]["maxLength"] == 10
    assert out["$defs"]["n"] == {"type": "number", "exclusiveMinimum": -1000, "exclusiveMaximum": 1000,
                                 "multipleOf": 0.01}
    choices = out["properties"]["pick"]["anyOf"]
    assert choices[1] == {"enum": ["a" * 50]} and choices[2] == {"type": "integer", "minimum": 0,
                                                                  "exclusiveMaximum": 1000}
    assert out["properties"]["fixed"] == given["properties"]["fixed"]
    assert out["properties"]["when"] == given["properties"]["when"]
    assert c.bounded_schema(schema, None) is schema


@pytest.mark.cpu_only
def test_a_refused_token_leaves_the_state_usable(tok):
    """A token the grammar refuses changes nothing: the same state still accepts the answer, and after
    ``reset`` the grammar starts over."""
    eos = tok.token_to_id("<|im_end|>")
    constraint = GrammarConstraint.from_schema(tok, {"enum": ["ab"]}, eos_id=eos)
    answer = tok.encode('"ab"', add_special_tokens=False).ids
    constraint.advance(answer[0])
    with pytest.raises(ConstraintError, match="not allowed here"):
        constraint.advance(tok.encode("x", add_special_tokens=False).ids[0])
    before = constraint.allowed().clone()
    for token in answer[1:]:
        constraint.advance(token)
    assert constraint.is_complete()
    constraint.reset()
    assert constraint.allowed().equal(_fresh_allowed(tok, eos)) and not before.equal(_fresh_allowed(tok, eos))
    for token in answer:
        constraint.advance(token)
    assert constraint.is_complete()


def _fresh_allowed(tok, eos):
    return GrammarConstraint.from_schema(tok, {"enum": ["ab"]}, eos_id=eos).allowed()
