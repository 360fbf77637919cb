"""Sampling options of ``aiayn serve``: ``n``, ``logit_bias``, ``presence_penalty``,
``frequency_penalty``, and the extensions ``repetition_penalty`` (CTRL) and ``top_k``.

Proofs: ``sampler.choose`` picks, step after step, the tokens a plain reference computes from the
definitions (OpenAI's: ``logit[j] += bias[j]``, ``logit[j] -= c[j] * frequency + [c[j] > 0] *
presence`` over the answer's counts c; CTRL's over the prompt and the answer), greedy and with
seeded draws, and reports the raw model's log-probabilities; it reads nothing from the device but
its one read; a live server's greedy answers under the options equal a reference decode loop over
the model's full forward; ``n`` answers are indexed prompt * n + i, seeded seed + i (three
different samples, the same three on a rerun, each the n=1 answer of its seed), streamed as not,
with the prompt counted once in ``usage``; ``logit_bias`` +100 forces a token and -100 bans one;
out-of-range options are 400s naming the field.
"""

from __future__ import annotations

import openai
import pytest
import torch
from serve_helpers import MODEL_NAME, device_path

from aiayn.generate import SamplingConfig
from aiayn.generate.sampling import sample_next
from aiayn.serve.engine import Request, SamplingParams
from aiayn.serve.sampler import choose


@pytest.fixture(scope="module")
def lm(tiny_lm):
    return tiny_lm


@pytest.fixture(scope="module")
def client(tiny_lm_client):
    return tiny_lm_client


def reference_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                     answer: list[int]) -> torch.Tensor:
    """One row (v,) under the definitions, token by token (no vectorised trick)."""
    out = logits.clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    penalty = params.sampling.repetition_penalty
    for token in set(prompt) | set(answer):
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    for token in set(answer):
        out[token] -= answer.count(token) * params.frequency_penalty
        out[token] -= params.presence_penalty
    return out


OPTIONS = [
    dict(),
    dict(logit_bias=((5, 4.0), (17, -100.0), (40, 2.5))),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(presence_penalty=-0.5, frequency_penalty=2.0, logit_bias=((9, 3.0),)),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.7, frequency_penalty=0.4),
]


def requests_for(temperature: float) -> list[Request]:
    requests = []
    for k, options in enumerate(OPTIONS):
        sampling = SamplingConfig(temperature=temperature, top_k=50 if k % 2 else None, seed=k,
                                  repetition_penalty=options.pop("repetition_penalty", 1.0))
        params = SamplingParams(max_tokens=100, sampling=sampling, logprobs=2 if k % 3 == 0 else None, **options)
        options["repetition_penalty"] = sampling.repetition_penalty
        request = Request(list(range(10 + k, 30 + 2 * k)), params, lambda event: None)
        request.generator = torch.Generator().manual_seed(k)
        requests.append(request)
    return requests


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_choose_follows_the_definitions_step_after_step(temperature):
    v, steps = 64, 40  # a small vocabulary: tokens repeat, so the penalties bite
    requests = requests_for(temperature)
    references = [torch.Generator().manual_seed(k) for k in range(len(requests))]
    answers: list[list[int]] = [[] for _ in requests]
    g = torch.Generator().manual_seed(0)
    differ = 0
    for _ in range(steps):
        logits = torch.randn(len(requests), v, generator=g) * 3  # (m, v)
        expected = []
        for i, request in enumerate(requests):
            row = reference_logits(logits[i], request.params, request.prompt, answers[i])
            if temperature == 0:
                expected.append(int(row.argmax()))
            else:
                no_history = torch.empty(1, 0, dtype=torch.long)
                expected.append(int(sample_next(row[None], no_history, request.params.sampling, references[i])[0]))
            differ += expected[-1] != int(logits[i].argmax())
        chosen = choose(logits.clone(), requests)
        assert [token for token, _ in chosen] == expected
        for i, (token, info) in enumerate(chosen):
            answers[i].append(token)
            if requests[i].params.logprobs is not None:  # the raw model's
                assert info is not None and info.logprob == pytest.approx(float(logits[i].log_softmax(-1)[token]))
    assert differ > steps  # the options did change the choices


def test_choose_reads_nothing_more_with_penalties_and_bias():
    requests = requests_for(0.8)
    logits = torch.randn(len(requests), 64, generator=torch.Generator().manual_seed(1))
    choose(logits.clone(), requests)  # the first call makes the rows' tensors
    with device_path() as reads:
        choose(logits.clone(), requests)
    assert {r.split(" ")[0] for r in reads} == {"choose"} and len(reads) == 1, reads


# ---- through the openai client -------------------------------------------------------------------
def reference_answer(lm, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Greedy under ``params``, recomputing the whole sequence each step (no cache, no batch)."""
    ids, answer = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = lm.model(torch.tensor([ids])).logits[0, -1].float()
            token = int(reference_logits(logits, params, prompt, answer).argmax())
            answer.append(token)
            ids.append(token)
    return answer


def test_greedy_answers_under_the_options_equal_a_reference_loop(client, lm):
    prompt = lm.encode("The quick brown fox jumps over")
    plain = client.completions.create(model=MODEL_NAME, prompt=[prompt], max_tokens=24, temperature=0).choices[0].text
    cases = [
        dict(presence_penalty=1.0),
        dict(frequency_penalty=1.5),
        dict(logit_bias={"60": 6.0, "61": -3}),
        dict(presence_penalty=0.5, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.5}),
        dict(extra_body={"repetition_penalty": 2.0, "top_k": 3}),
    ]
    for case in cases:
        extra = case.get("extra_body", {})
        params = SamplingParams(
            max_tokens=24, sampling=SamplingConfig(temperature=0, repetition_penalty=extra.get("repetition_penalty", 1)),
            logit_bias=tuple((int(k), float(b)) for k, b in case.get("logit_bias", {}).items()),
            presence_penalty=case.get("presence_penalty", 0.0), frequency_penalty=case.get("frequency_penalty", 0.0))
        expected = lm.decode(reference_answer(lm, prompt, params, 24))
        got = client.completions.create(model=MODEL_NAME, prompt=[prompt], max_tokens=24, temperature=0, **case)
        assert got.choices[0].text == expected, case
        assert expected != plain, case  # the option changed the answer


def test_logit_bias_forces_and_bans(client, lm):
    messages = [{"role": "user", "content": "Say something."}]
    forced = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0.7,
                                            seed=1, logit_bias={"70": 100}).choices[0].message.content
    assert forced == lm.decode([70]) * 6
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True)
    banned = [lm.encode(t.token)[0] for t in plain.choices[0].logprobs.content[:3]]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, logit_bias={str(t): -100 for t in banned})
    tokens = [lm.encode(t.token) for t in answer.choices[0].logprobs.content]
    assert not any(t in [[b] for b in banned] for t in tokens)


def texts_by_index(result) -> dict[int, str]:
    return {c.index: c.text for c in result.choices}


def test_n_choices_seeds_indices_and_usage(client, lm):
    prompts = ["The quick brown fox", "A server answers"]
    first = client.completions.create(model=MODEL_NAME, prompt=prompts, n=3, seed=7, max_tokens=10, temperature=1.0)
    assert sorted(texts_by_index(first)) == list(range(6))
    assert first.usage.prompt_tokens == sum(len(lm.encode(p)) for p in prompts)  # once per prompt, as OpenAI
    assert first.usage.completion_tokens == 60
    again = client.completions.create(model=MODEL_NAME, prompt=prompts, n=3, seed=7, max_tokens=10, temperature=1.0)
    assert texts_by_index(again) == texts_by_index(first)
    texts = texts_by_index(first)
    for p, prompt in enumerate(prompts):
        own = [texts[p * 3 + i] for i in range(3)]
        assert len(set(own)) == 3  # three different samples
        for i in range(3):  # each is the n=1 answer of seed 7 + i
            single = client.completions.create(model=MODEL_NAME, prompt=prompt, seed=7 + i, max_tokens=10,
                                               temperature=1.0)
            assert single.choices[0].text == own[i]
    streamed: dict[int, list[str]] = {}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, n=3, seed=7, max_tokens=10,
                                           temperature=1.0, stream=True):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).append(choice.text)
    assert {i: "".join(t) for i, t in streamed.items()} == texts


def test_n_chat_streamed_as_whole_and_greedy_allowed(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=3)
    whole = client.chat.completions.create(**kwargs, seed=3)
    assert [c.index for c in whole.choices] == [0, 1, 2] and whole.usage.completion_tokens == 24
    streamed: dict[int, list[str]] = {}
    finishes = {}
    for chunk in client.chat.completions.create(**kwargs, seed=3, stream=True):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).append(choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert {i: "".join(t) for i, t in streamed.items()} == {c.index: c.message.content for c in whole.choices}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    greedy = client.chat.completions.create(**kwargs, temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1  # allowed, as OpenAI: n equal answers


@pytest.mark.parametrize(("fields", "param", "needle"), [
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids written as strings"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ({"logit_bias": {"320": 1}}, "logit_bias", "outside the model's vocabulary of 320"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"top_k": 0}, "top_k", "greater than or equal to 1"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 100}, "n", "holds at most 68 requests at once"),
])
def test_out_of_range_options_are_400s_naming_the_field(client, fields, param, needle):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body=fields)
    error = caught.value.body
    assert error["param"] == param and needle in error["message"], error
