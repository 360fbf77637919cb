"""The caps on what a JSON schema leaves open (``JsonBounds``) as options: ``--json-integer-digits``,
``--json-decimals``, ``--json-string-chars`` and ``--json-array-items`` of ``aiayn serve`` and
``aiayn generate``, and ``build_state(json_bounds=...)``.

Proofs: the options' defaults and ranges are ``JsonBounds``' own; a cap outside its range is refused
(``JsonBounds``, and the commands in one line); every cap at the ends of its range compiles, and
the largest number cap still holds exactly; smaller caps bound the grammar; a live server over the
tiny model, biased to write digits and never to close a string, answers within its caps in
``response_format`` and in tool arguments; ``aiayn generate --json-string-chars`` reaches its grammar.
"""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest
from serve_helpers import MODEL_NAME, live_server, tiny_text_model
from tokenizer_helpers import grammar_accepts

from aiayn.cli import cli, main
from aiayn.cli.app import JSON_CAPS
from aiayn.generate.constrain import BOUND_RANGES, BOUNDS, GrammarConstraint, JsonBounds
from aiayn.serve import ServedModel, build_state
from aiayn.serve.tool_calls import ToolFormat
from aiayn.serve.tools import Tool, tool_settings

SMALL = JsonBounds(integer_digits=2, decimals=1, string_chars=3, array_items=2)
SCHEMA = {"type": "object", "properties": {"n": {"type": "number"}, "s": {"type": "string"},
                                           "a": {"type": "array", "items": {"type": "integer"}}},
          "required": ["n", "s", "a"], "additionalProperties": False}


def accepts(lm, schema: dict, bounds: JsonBounds | None, text: str) -> bool:
    """``text`` is a whole answer under ``schema`` within ``bounds`` (a fresh grammar state each time)."""
    constraint = GrammarConstraint.from_schema(lm.tokenizer, schema, eos_id=lm.eos_id, bounds=bounds)
    return grammar_accepts(constraint, lm.tokenizer, text)


def test_the_options_defaults_and_ranges_are_json_bounds_own():
    fields = [f.name for f in dataclasses.fields(JsonBounds)]
    assert [name for name, *_ in JSON_CAPS] == fields == list(BOUND_RANGES)
    for name, default, low, high, _ in JSON_CAPS:
        assert default == getattr(JsonBounds(), name) == getattr(BOUNDS, name)
        assert (low, high) == BOUND_RANGES[name]
    for command in ("serve", "generate"):
        options = {p.name: p for p in cli.commands[command].params}
        for name, default, low, high, _ in JSON_CAPS:
            option = options[f"json_{name}"]
            assert (option.default, option.type.min, option.type.max) == (default, low, high)


@pytest.mark.parametrize("caps", [{"integer_digits": 16}, {"integer_digits": 0}, {"decimals": -1},
                                  {"decimals": 11}, {"string_chars": 0}, {"array_items": 1_000_001},
                                  {"array_items": 2.5}, {"string_chars": True}])
def test_json_bounds_refuses_a_cap_outside_its_range(caps):
    [(name, value)] = caps.items()
    with pytest.raises(ValueError, match=f"^{name} must be a whole number from .* got {value!r}$"):
        JsonBounds(**caps)


def test_every_cap_at_the_ends_of_its_range_compiles_and_the_largest_number_cap_holds(tiny_lm):
    for end in (0, 1):
        bounds = JsonBounds(**{name: limits[end] for name, limits in BOUND_RANGES.items()})
        assert accepts(tiny_lm, SCHEMA, bounds, '{"n": 1, "s": "a", "a": [1]}')
    widest = JsonBounds(integer_digits=15)
    assert accepts(tiny_lm, {"type": "integer"}, widest, "9" * 15)
    assert not accepts(tiny_lm, {"type": "integer"}, widest, "1" + "0" * 15)
    assert not accepts(tiny_lm, {"type": "number"}, widest, "-1" + "0" * 15)


@pytest.mark.parametrize(("text", "within"), [
    ('{"n": -99.5, "s": "abc", "a": [99, -99]}', True),
    ('{"n": 100, "s": "", "a": []}', False),  # three digits before the point
    ('{"n": 1.25, "s": "", "a": []}', False),  # two decimals
    ('{"n": 1, "s": "abcd", "a": []}', False),  # four characters
    ('{"n": 1, "s": "", "a": [1, 2, 3]}', False),  # three items
    ('{"n": 1, "s": "", "a": [100]}', False),  # an item of three digits
])
def test_smaller_caps_bound_the_grammar(tiny_lm, text, within):
    assert accepts(tiny_lm, SCHEMA, SMALL, text) is within
    assert accepts(tiny_lm, SCHEMA, BOUNDS, text)  # the default caps allow each


def test_tool_arguments_get_the_format_s_caps():
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": SCHEMA}})
    fmt = ToolFormat(tool_settings([tool], "required", None), hermes=False, bounds=SMALL)
    arguments = fmt.call_schema()["properties"]["arguments"]["properties"]
    assert arguments["s"]["maxLength"] == 3 and arguments["a"]["maxItems"] == 2
    assert arguments["n"]["exclusiveMaximum"] == 100 and arguments["n"]["multipleOf"] == 0.1


def forcing_bias(lm) -> dict[str, float]:
    """logit_bias that makes the model write digits (+10) and never close a string itself (-100):
    only the caps end a number or a string."""
    bias = {}
    for i in range(lm.tokenizer.get_vocab_size()):
        text = lm.decode([i])
        if '"' in text:
            bias[str(i)] = -100.0
        elif text.strip() and text.strip().isdigit():
            bias[str(i)] = 10.0
    return bias


@pytest.fixture(scope="module")
def capped_lm():
    """The tiny model with a context of 1,024 tokens (a tool's description is long in a 320-token vocabulary)."""
    return tiny_text_model(context=1024)


@pytest.fixture(scope="module")
def capped_client(capped_lm):
    """The openai client of a live server over ``capped_lm`` with the ``SMALL`` caps."""
    state, _ = build_state(ServedModel(MODEL_NAME, lm=capped_lm), max_batch=2, context=1024, prefill_chunk=64,
                           json_bounds=SMALL)
    assert state.bounds == SMALL
    with live_server(state) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def within_small(value: dict) -> None:
    """``value`` (a ``SCHEMA`` object) is within the ``SMALL`` caps, which it reaches."""
    assert abs(value["n"]) < 100 and len(repr(float(value["n"])).split(".")[1]) <= 1, value
    assert len(value["s"]) == 3, value  # the model never closes it: the cap does
    assert len(value["a"]) <= 2 and all(abs(x) < 100 for x in value["a"]), value


def test_a_served_answer_stays_within_the_server_s_caps(capped_client, capped_lm):
    bias = forcing_bias(capped_lm)
    response_format = {"type": "json_schema", "json_schema": {"name": "capped", "schema": SCHEMA}}
    for seed in (0, 1):
        choice = capped_client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Numbers, please."}], max_tokens=120,
            temperature=0.8, seed=seed, logit_bias=bias, response_format=response_format).choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        within_small(json.loads(choice.message.content))


def test_served_tool_arguments_stay_within_the_server_s_caps(capped_client, capped_lm):
    tool = {"type": "function", "function": {"name": "f", "description": "f", "parameters": SCHEMA}}
    choice = capped_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Call f."}], tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0, logit_bias=forcing_bias(capped_lm)).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [call] = choice.message.tool_calls
    within_small(json.loads(call.function.arguments))


@pytest.mark.parametrize(("command", "option", "value", "needle"), [
    ("serve", "--json-decimals", "11", "'--json-decimals': 11 is not in the range 0<=x<=10"),
    ("serve", "--json-integer-digits", "16", "'--json-integer-digits': 16 is not in the range 1<=x<=15"),
    ("generate", "--json-string-chars", "0", "'--json-string-chars': 0 is not in the range"),
    ("generate", "--json-array-items", "many", "'--json-array-items': 'many' is not a valid integer"),
])
def test_the_commands_refuse_a_bad_cap_in_one_line(capsys, command, option, value, needle):
    extra = ["--prompt", "x"] if command == "generate" else []
    with pytest.raises(SystemExit) as info:
        main([command, "--model", "nowhere", *extra, option, value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and err.count("\n") == 1, err


def test_generate_s_string_cap_reaches_its_grammar(tiny_dir, tmp_path, run_aiayn):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"],
                                  "additionalProperties": False}))
    code, out, err = run_aiayn("generate", "--model", str(tiny_dir), "--prompt", "Say", "--temperature", "0",
                               "--max-new-tokens", "40", "--json-schema", str(schema), "--json-string-chars", "2",
                               "--device", "cpu")
    assert code == 0, err
    assert len(json.loads(out)["s"]) <= 2, out
