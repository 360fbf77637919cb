"""Structured output in ``aiayn serve``: ``response_format`` ``json_object`` and
``json_schema`` on /v1/chat/completions (and /v1/completions, an extension), through the official
``openai`` client against a live server.

Proofs: with the tiny random model, every answer of several schemas, prompts, greedy and sampled
(n = 2 copies of one grammar), streamed and not, sent at once so that the grammar rows share the
engine's batches, parses and validates (``jsonschema``) and finishes "stop"; an answer cut by
max_tokens finishes "length" (as OpenAI); grammar-forced end-of-text never shows in the text; the
openai client's ``parse`` (a pydantic model as a strict schema) gets its object; an invalid schema
is a 400 naming why; the engine drops a request's grammar when it finishes. With the real
SmolLM2-135M (4-bit, GGUF) the same holds without any help.

The tiny model writes random text: left alone, a string goes on until max_tokens. Its requests
carry a ``logit_bias`` on the tokens holding ``"`` (+8), ``}`` (+6), ``]`` (+4) or ``,`` (+3) (as
the library's tests build one into the model's output layer) so that strings and containers end within a few tokens;
which token comes next is still the model's choice, under the grammar.
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel
from serve_helpers import MODEL_NAME, live_server

from aiayn.generate import SamplingConfig
from aiayn.generate.constrain import GrammarConstraint
from aiayn.serve import ServedModel, build_state
from aiayn.serve.engine import Engine, Request, SamplingParams, slot_plan

# Numbers are bounded: a grammar cannot make a model end, and SmolLM2 may write an unbounded
# integer's digits until max_tokens (docs/structured-output.md); the answers here must all end.
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                                 "tags": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 3}},
               "required": ["name", "age", "tags"], "additionalProperties": False},
    "enum_bool": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                                    "ok": {"type": "boolean"}, "none": {"type": "null"}},
                  "required": ["colour", "ok", "none"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 120},
                                                  "x": {"type": "number", "minimum": -1000, "maximum": 1000}},
                "required": ["n", "x"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10**6},
                                                  "langs": {"type": "array", "items": {"enum": ["en", "fr"]},
                                                            "minItems": 1, "maxItems": 3}},
                 "required": ["id", "langs"], "additionalProperties": False},
        "note": {"type": "string", "minLength": 2, "maxLength": 6}},
        "required": ["user", "note"], "additionalProperties": False},
    "array_top": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
}
PROMPTS = ["Describe someone.", "Answer in JSON, please.", "What is the weather like?"]
CLOSERS = {'"': 8.0, "}": 6.0, "]": 4.0, ",": 3.0}  # the bias on a token holding each (the docstring)


@pytest.fixture(scope="module")
def lm(tiny_lm):
    return tiny_lm


@pytest.fixture(scope="module")
def server(tiny_lm_client):
    return tiny_lm_client


@pytest.fixture(scope="module")
def closers(lm) -> dict[str, float]:
    """logit_bias toward the tokens that end strings and containers (the module docstring)."""
    return {str(i): bias for i, bias in closer_bias(lm)}


def closer_bias(lm) -> list[tuple[int, float]]:
    """A bias on the tokens holding a closer (``CLOSERS``: the largest of theirs)."""
    pieces = [(i, lm.decode([i])) for i in range(lm.tokenizer.get_vocab_size())]
    return [(i, max(CLOSERS.get(ch, 0.0) for ch in text)) for i, text in pieces if set(text) & set(CLOSERS)]


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(client: openai.OpenAI, *, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice, by index, streamed or not."""
    if not stream:
        return [(c.message.content, c.finish_reason) for c in client.chat.completions.create(**kwargs).choices]
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return [("".join(texts[i]), finish[i]) for i in sorted(texts)]


def test_every_answer_validates_greedy_and_sampled_streamed_or_not(server, closers):
    jobs = []
    for k, (name, schema) in enumerate(SCHEMAS.items()):
        for stream in (False, True):
            greedy = {"temperature": 0}
            sampled = {"temperature": 1.0, "seed": k, "n": 2}
            for sampling in (greedy, sampled):
                jobs.append((name, stream, dict(
                    model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
                    max_tokens=160, response_format=json_schema_format(name, schema), logit_bias=closers,
                    **sampling)))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # the grammar rows share the engine's batches
        answers = list(pool.map(lambda job: ask(server, stream=job[1], **job[2]), jobs))
    distinct = set()
    for (name, stream, kwargs), choices in zip(jobs, answers, strict=True):
        assert len(choices) == kwargs.get("n", 1)
        for text, finish in choices:
            assert finish == "stop", (name, stream, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            assert "<|im_end|>" not in text and "\n" not in text
            distinct.add(text)
    assert len(distinct) > len(SCHEMAS)  # the samples do differ


def test_json_object_on_chat_and_completions(server, closers):
    for stream in (False, True):
        for seed in (0, 1):
            [(text, finish)] = ask(server, stream=stream, model=MODEL_NAME, max_tokens=160, temperature=0.9,
                                   seed=seed, logit_bias=closers, response_format={"type": "json_object"},
                                   messages=[{"role": "user", "content": "Anything."}])
            assert finish == "stop" and isinstance(json.loads(text), dict), text
    result = server.completions.create(model=MODEL_NAME, prompt=["The fox", "A server"], max_tokens=160,
                                       temperature=0, logit_bias=closers,
                                       extra_body={"response_format": {"type": "json_object"}})
    assert [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.text), dict), choice.text
    text = server.chat.completions.create(model=MODEL_NAME, max_tokens=20, temperature=0, messages=[
        {"role": "user", "content": "hi"}], response_format={"type": "text"}).choices[0].message.content
    assert text  # free text, as without response_format


class Colour(BaseModel):
    name: str
    ok: bool


def test_the_clients_parse_gets_its_object(server, closers):
    parsed = server.chat.completions.parse(model=MODEL_NAME, max_tokens=120, temperature=0, logit_bias=closers,
                                           messages=[{"role": "user", "content": "A colour."}],
                                           response_format=Colour).choices[0].message.parsed
    assert isinstance(parsed, Colour)


def test_cut_by_max_tokens_is_length_as_openai(server, closers):
    for stream in (False, True):
        [(text, finish)] = ask(server, stream=stream, model=MODEL_NAME, max_tokens=3, temperature=0,
                               response_format=json_schema_format("person", SCHEMAS["person"]),
                               messages=[{"role": "user", "content": "Someone."}])
        assert finish == "length" and text.startswith('{"')
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


@pytest.mark.parametrize("response_format, why", [
    (json_schema_format("bad", {"type": "strin"}), "response_format: invalid JSON schema: Invalid type: strin"),
    (json_schema_format("bad", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                                                      "maximum": 1}}, "required": ["a"]}),
     "response_format: invalid JSON schema"),
    ({"type": "xml"}, "response_format: Input tag 'xml' found using 'type' does not match any of the expected "
                      "tags: 'text', 'json_object', 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.json_schema.name: is "
                                                               "required"),
    ({"type": "json_schema", "json_schema": {"name": "a b"}}, "response_format.json_schema.json_schema.name: String "
                                                              "should match pattern"),
])
def test_an_invalid_response_format_is_a_400_naming_why(server, response_format, why):
    with pytest.raises(openai.BadRequestError) as caught:
        server.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       response_format=response_format)
    error = caught.value.body
    assert error["message"].startswith(why), error["message"]
    assert error["param"].startswith("response_format") and "\n" not in error["message"]


# ---- the engine ----------------------------------------------------------------------------------
def test_engine_forced_end_of_text_never_shows_and_the_grammar_is_dropped(lm):
    """A top-level integer >= 0 may end after any digit; a +100 bias on end-of-text makes the model
    end at the first chance: one token of digits, then end-of-text, which finishes "stop" and is not text. A
    request that finished holds no grammar any more (nor bias tensors)."""
    plan = slot_plan(lm, max_batch=2, context=64, budget=1 << 30, kv_cache=None)
    engine = Engine(lm, plan, prefill_chunk=16)
    events: list = []
    constraint = GrammarConstraint.from_schema(lm.tokenizer, {"type": "integer", "minimum": 0}, eos_id=lm.eos_id)
    params = SamplingParams(max_tokens=10, sampling=SamplingConfig(temperature=0.0),
                            logit_bias=((lm.eos_id, 100.0),))
    request = Request(lm.encode("Count:"), params, events.append, constraint)
    engine.submit(request)
    while not (events and events[-1].finish_reason):
        engine.step()
    assert [e.finish_reason for e in events] == [None, "stop"]
    assert events[-1].token == lm.eos_id
    text = "".join(e.text for e in events)
    assert text.isdigit() and len(text) == len(lm.decode([events[0].token]))
    assert request.constraint is None and request.adjustments is None and engine.running == 0


def test_engine_grammar_rows_beside_free_rows_keep_their_own_tokens(lm):
    """A free greedy row in a batch with grammar rows gets the tokens it gets alone (the masks touch
    only their rows), and each grammar row's answer validates."""
    plan = slot_plan(lm, max_batch=4, context=256, budget=1 << 30, kv_cache=None)
    greedy = SamplingParams(max_tokens=12, sampling=SamplingConfig(temperature=0.0))
    prompt = lm.encode("The quick brown fox")

    def run(with_grammar: bool) -> tuple[list[int], list[str]]:
        engine = Engine(lm, plan, prefill_chunk=16)
        free: list = []
        engine.submit(Request(prompt, greedy, free.append))
        answers: list[list] = []
        if with_grammar:
            bias = tuple(closer_bias(lm))
            for name in ("enum_bool", "array_top", "numbers"):
                answers.append([])
                constraint = GrammarConstraint.from_schema(lm.tokenizer, SCHEMAS[name], eos_id=lm.eos_id)
                params = SamplingParams(max_tokens=120, sampling=SamplingConfig(temperature=1.0, seed=3),
                                        logit_bias=bias)
                engine.submit(Request(lm.encode(f"{name}:"), params, answers[-1].append, constraint))
        while engine.running or engine.waiting:
            engine.step()
        return [e.token for e in free], ["".join(e.text for e in a) for a in answers]

    alone, _ = run(False)
    together, texts = run(True)
    assert together == alone
    for name, text in zip(("enum_bool", "array_top", "numbers"), texts, strict=True):
        jsonschema.validate(json.loads(text), SCHEMAS[name])


# ---- the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_client(smollm2_text_model):
    lm = smollm2_text_model("q4")
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    state, _ = build_state(ServedModel("smollm2", lm=lm), max_batch=4, context=512)
    with live_server(state) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    torch.set_num_threads(threads)


REAL = [
    ("Describe a fictional person with a name, an age and a few tags.", "person"),
    ("Pick a colour and say whether you like it.", "enum_bool"),
    ("Give a small number and a decimal.", "numbers"),
    ("A user of a website, with an id and the languages they speak, and a short note.", "nested"),
]


@pytest.mark.slow
def test_smollm2_answers_validate_through_the_openai_client(smollm2_client):
    """SmolLM2-135M-Instruct (Q4, as aiayn generate --quantize q4) answers every schema with JSON that
    validates, greedy and sampled, streamed and not, four at once; json_object gives an object."""
    jobs = [(name, stream, dict(model="smollm2", max_tokens=100, messages=[{"role": "user", "content": question}],
                                response_format=json_schema_format(name, SCHEMAS[name]),
                                **({"temperature": 0} if k % 2 == 0 else {"temperature": 0.8, "seed": k})))
            for k, (question, name) in enumerate(REAL) for stream in (k % 2 == 0, k % 2 == 1)]
    jobs.append(("object", True, dict(model="smollm2", max_tokens=100, temperature=0,
                                      messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format={"type": "json_object"})))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda job: ask(smollm2_client, stream=job[1], **job[2]), jobs))
    for (name, _, _), [(text, finish)] in zip(jobs, answers, strict=True):
        assert finish == "stop", (name, text)
        value = json.loads(text)
        if name == "object":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, SCHEMAS[name])
