"""The explorer's JSON routes through Starlette's TestClient: every number the page draws equals the
model's own (attention weights from ``need_weights=True``, decode steps from aiayn.generate, the KV
cache's real bytes, beam search's n-best), and bad input gets one short message."""

from __future__ import annotations

import base64
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from aiayn.explore import create_app
from aiayn.generate import (
    beam_search_decoder_only,
    beam_search_encoder_decoder,
    greedy_decoder_only,
    greedy_encoder_decoder,
)
from aiayn.nn.kv_cache import kv_cache_bytes
from aiayn.nn.positional import sinusoidal_encoding

REPO = Path(__file__).resolve().parents[2]


def unpack_matrix(packed: dict) -> np.ndarray:
    """``aiayn.explore.probes.pack_matrix``'s inverse: the float32 values the page reads."""
    return np.frombuffer(base64.b64decode(packed["data"]), dtype="<f4").reshape(packed["shape"])


def client(ex) -> TestClient:
    return TestClient(create_app(ex))


def layer_weights(api: TestClient, probe: dict, stack: str, layer: int) -> np.ndarray:
    response = api.get(f"/api/attention/{probe['key']}/{stack}/{layer}")
    assert response.status_code == 200, response.text
    return unpack_matrix(response.json()["weights"])


# ---- attention: the model's own need_weights values ----------------------------------------------
def test_translation_attention_equals_the_models_own(translation_ex):
    ex, api = translation_ex, client(translation_ex)
    source, target = "A man is riding a bike.", "Ein Mann fährt Fahrrad."
    probe = api.post("/api/attention", json={"text": source, "target": target}).json()
    src_ids = ex.encode(source)  # with </s>
    tgt_ids = [ex.bos_id, *ex.encode(target)[:-1]]  # <s> + target: the decoder's queries
    assert probe["ids"] == {"source": src_ids, "target": tgt_ids}
    assert probe["tokens"]["source"][-1] == "</s>" and probe["tokens"]["target"][0] == "<s>"
    with ex.lock, torch.inference_mode():
        out = ex.model(torch.tensor([src_ids]), torch.tensor([tgt_ids]), need_weights=True)
    stacks = {s["name"]: s for s in probe["stacks"]}
    s, t = len(src_ids), len(tgt_ids)
    assert stacks["encoder"]["shape"] == [s, s] and stacks["decoder"]["shape"] == [t, t]
    assert stacks["cross"]["shape"] == [t, s]  # target queries x source keys
    assert stacks["encoder"]["layers"] == 2 and stacks["decoder"]["layers"] == stacks["cross"]["layers"] == 3
    for name, expected in (("encoder", out.encoder_attentions), ("decoder", out.attentions),
                           ("cross", out.cross_attentions)):
        for layer, weights in enumerate(expected):
            assert np.array_equal(layer_weights(api, probe, name, layer), weights[0].numpy()), (name, layer)
    decoder0 = layer_weights(api, probe, "decoder", 0)
    assert np.all(np.triu(decoder0, k=1) == 0)  # causal: no query sees a later key
    np.testing.assert_allclose(decoder0.sum(-1), 1.0, rtol=1e-5)


def test_translation_attention_defaults_to_the_models_greedy_translation(translation_ex):
    ex, api = translation_ex, client(translation_ex)
    probe = api.post("/api/attention", json={"text": "Two dogs run."}).json()
    src = torch.tensor([ex.encode("Two dogs run.")])
    greedy = greedy_encoder_decoder(ex.model, src, bos_id=ex.bos_id, eos_id=ex.eos_id,
                                    max_new_tokens=int(1.2 * src.shape[1] + 10))
    ids = greedy.tokens[0, : int(greedy.lengths[0])].tolist()
    assert probe["ids"]["target"] == [ex.bos_id, *[i for i in ids if i != ex.eos_id]]
    assert "greedy translation" in probe["note"]


@pytest.mark.parametrize("kind", ["char", "minilm"])
def test_self_attention_equals_the_models_own(kind, char_ex, minilm_ex):
    ex = char_ex if kind == "char" else minilm_ex
    api = client(ex)
    text = "ROMEO: Is it so?" if kind == "char" else "The cat sat on the mat."
    probe = api.post("/api/attention", json={"text": text}).json()
    ids = probe["ids"]["tokens"]
    assert ids == ex.encode(text)
    if kind == "minilm":
        assert probe["tokens"]["tokens"][0] == "[CLS]" and probe["tokens"]["tokens"][-1] == "[SEP]"
    with ex.lock, torch.inference_mode():
        expected = ex.model(torch.tensor([ids]), need_weights=True).attentions
    (stack,) = probe["stacks"]
    assert stack["layers"] == len(expected) and stack["heads"] == ex.config.n_heads
    assert stack["causal"] == (kind == "char")
    for layer, weights in enumerate(expected):
        assert np.array_equal(layer_weights(api, probe, "self", layer), weights[0].numpy())


@pytest.mark.slow
def test_smollm2_attention_by_layer_equals_the_models_own(smollm2_ex):
    ex, api = smollm2_ex, client(smollm2_ex)
    assert (ex.config.n_layers, ex.config.n_heads, ex.config.n_kv_heads) == (30, 9, 3)
    probe = api.post("/api/attention", json={"text": "The capital of France is"}).json()
    ids = probe["ids"]["tokens"]
    with ex.lock, torch.inference_mode():
        expected = ex.model(torch.tensor([ids]), need_weights=True).attentions
    for layer in (0, 17, 29):  # any layer on its own, in any order
        assert np.array_equal(layer_weights(api, probe, "self", layer), expected[layer][0].numpy())
    assert api.get(f"/api/attention/{probe['key']}/self/30").status_code == 404


# ---- generation and the KV cache ---------------------------------------------------------------
def test_decoder_steps_are_greedy_decoding_and_the_cache_bytes_match_the_formula(char_ex):
    ex, api = char_ex, client(char_ex)
    prompt = "ROMEO:"
    data = api.post("/api/generate", json={"text": prompt, "steps": 12, "top_k": 4}).json()
    ids = torch.tensor([ex.encode(prompt)])
    greedy = greedy_decoder_only(ex.model, ids, max_new_tokens=12)
    assert [s["id"] for s in data["steps"]] == greedy.tokens[0].tolist()
    assert data["text"] == ex.decode(greedy.tokens[0].tolist())
    c = ex.config
    for step, logits in zip(data["steps"], greedy.logits[0], strict=True):
        probs = torch.softmax(logits, -1)
        assert [t["id"] for t in step["top"]] == probs.topk(4).indices.tolist()
        assert step["top"][0]["id"] == step["id"]  # greedy: the most likely token
        assert step["p"] == pytest.approx(float(probs[step["id"]]), rel=1e-6)
        figures = step["cache"]
        assert figures["filled"] == len(prompt) + step["index"]  # the prompt, then one slot a step
        assert figures["measured"] == figures["formula"] == 2 * c.n_layers * c.n_kv_heads * c.head_dim * \
            figures["filled"] * 4
        assert figures["int8"] == kv_cache_bytes(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                                 seq_len=figures["filled"], batch_size=1, dtype="int8")
    cache = data["cache"]
    assert cache["capacity"] == len(prompt) + 12 and cache["allocated"] == kv_cache_bytes(
        n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, seq_len=len(prompt) + 12, batch_size=1)
    assert len(cache["slot_norms"]) == c.n_layers and len(cache["slot_norms"][0]) == len(prompt) + 11


def test_translation_steps_are_greedy_translation_with_the_cross_attention_cache(translation_ex):
    ex, api = translation_ex, client(translation_ex)
    data = api.post("/api/generate", json={"text": "A dog.", "steps": 64}).json()
    src = torch.tensor([ex.encode("A dog.")])
    greedy = greedy_encoder_decoder(ex.model, src, bos_id=ex.bos_id, eos_id=ex.eos_id,
                                    max_new_tokens=int(1.2 * src.shape[1] + 10))
    n = int(greedy.lengths[0])
    assert [s["id"] for s in data["steps"]] == greedy.tokens[0, :n].tolist()
    assert [s["cache"]["filled"] for s in data["steps"]] == list(range(1, n + 1))  # <s>, then a token a step
    c = ex.config
    cross = data["cache"]["cross"]
    assert cross["slots"] == src.shape[1]
    assert cross["measured"] == cross["formula"] == 2 * c.n_decoder_layers * c.n_kv_heads * c.head_dim * src.shape[1] * 4


def test_sampling_is_seeded(char_ex):
    api = client(char_ex)
    request = {"text": "To be", "steps": 10, "temperature": 1.0, "seed": 7}
    first, again = (api.post("/api/generate", json=request).json() for _ in range(2))
    assert first["sampling"] and [s["id"] for s in first["steps"]] == [s["id"] for s in again["steps"]]


# ---- beam search tree --------------------------------------------------------------------------
@pytest.mark.parametrize(("beam", "alpha"), [(1, 0.6), (3, 0.0), (4, 1.0)])
def test_beam_tree_holds_the_searchs_own_nbest(translation_ex, beam, alpha):
    ex, api = translation_ex, client(translation_ex)
    tree = api.post("/api/beam", json={"text": "A man.", "beam": beam, "length_penalty": alpha}).json()
    src = torch.tensor([ex.encode("A man.")])
    result = beam_search_encoder_decoder(ex.model, src, bos_id=ex.bos_id, eos_id=ex.eos_id, beam_size=beam,
                                         length_penalty=alpha, max_len_a=1.2, max_len_b=10, n_best=beam)
    assert [(h["score"], h["length"]) for h in tree["nbest"]] == \
           [(h.score, int(h.tokens.shape[0])) for h in result.nbest[0]]
    nodes = tree["nodes"]
    assert nodes[0]["parent"] is None and all(n["parent"] < n["id"] for n in nodes[1:])
    for h, hyp in zip(tree["nbest"], result.nbest[0], strict=True):  # each n-best ends at a node of the tree
        path, node = [], nodes[h["node"]]
        while node["parent"] is not None:
            path.append(node["label"])
            node = nodes[node["parent"]]
        assert path[::-1] == [ex.label(i) for i in hyp.tokens.tolist()]
        assert nodes[h["node"]]["normalized"] == pytest.approx(hyp.normalized_score, rel=1e-6)
    per_step = {}
    for n in nodes[1:]:
        per_step[n["t"]] = per_step.get(n["t"], 0) + 1
    assert max(per_step.values()) <= 2 * beam and tree["steps"] == max(per_step)
    if beam == 1:  # beam 1 is greedy decoding
        greedy = greedy_encoder_decoder(ex.model, src, bos_id=ex.bos_id, eos_id=ex.eos_id,
                                        max_new_tokens=int(1.2 * src.shape[1] + 10))
        assert result.nbest[0][0].tokens.tolist() == greedy.tokens[0, : int(greedy.lengths[0])].tolist()


def test_beam_tree_of_a_decoder_only_model(char_ex):
    """A character-level LM (no end-of-text token): every hypothesis runs to the step limit."""
    ex, api = char_ex, client(char_ex)
    tree = api.post("/api/beam", json={"text": "ROMEO:", "beam": 3, "length_penalty": 0.6, "steps": 7}).json()
    result = beam_search_decoder_only(ex.model, torch.tensor([ex.encode("ROMEO:")]), eos_id=None, max_new_tokens=7,
                                      beam_size=3, length_penalty=0.6, n_best=3)
    assert [(h["score"], h["text"]) for h in tree["nbest"]] == \
           [(h.score, ex.decode(h.tokens.tolist())) for h in result.nbest[0]]
    assert tree["steps"] == 7 and all(h["length"] == 7 for h in tree["nbest"])
    assert tree["nodes"][0]["label"] == ":" and {n["status"] for n in tree["nodes"]} <= {"kept", "pruned", "limit"}
    assert sum(n["status"] == "limit" for n in tree["nodes"]) == 3


# ---- positions and the run ---------------------------------------------------------------------
def test_positions_are_the_models_own(translation_ex, char_ex, minilm_ex):
    data = client(translation_ex).get("/api/positions").json()
    table = unpack_matrix(data["sinusoidal"]["table"])
    assert np.array_equal(table, sinusoidal_encoding(torch.arange(table.shape[0]), table.shape[1]).numpy())
    for curves in (data["sinusoidal"]["dots"]["curves"], data["rope"]["dots"]["curves"]):
        first = np.array(curves[0]["values"])
        for other in curves[1:]:  # the dot product depends only on the offset
            np.testing.assert_allclose(other["values"], first, rtol=1e-4, atol=1e-4)
    own = data["model"]
    assert own["scheme"] == "sinusoidal"
    assert np.array_equal(unpack_matrix(own["table"]), translation_ex.model.encoder.absolute.pe.numpy())
    for ex in (char_ex, minilm_ex):
        own = client(ex).get("/api/positions").json()["model"]
        stack = ex.model.decoder if ex.kind == "decoder" else ex.model.encoder
        assert own["scheme"] == "learned"
        n = unpack_matrix(own["table"]).shape[0]
        assert np.array_equal(unpack_matrix(own["table"]), stack.absolute.weight[:n].detach().numpy())
        np.testing.assert_allclose(np.diag(unpack_matrix(own["similarity"])), 1.0, rtol=1e-5)


def test_run_record_is_the_runs_metrics_and_config(char_run, char_ex, minilm_ex):
    record = client(char_ex).get("/api/run").json()
    assert record["available"] and record["config"] == json.loads((char_run / "config.json").read_text())
    lines = (char_run / "metrics.csv").read_text().splitlines()[1:]
    assert record["rows"] == len(lines) and len(record["series"]["val_nll"]) == 2  # evaluated at steps 2 and 4
    assert [p[0] for p in record["series"]["train_loss"]] == [4.0]
    assert client(minilm_ex).get("/api/run").json() == {
        "available": False, "reason": "this model was loaded from a file, not trained here: it has no run to show"}


def test_a_shipped_models_run_view_reads_its_record():
    """A shipped model keeps its run's metrics and summary in record/: the training view shows them."""
    from aiayn.explore import load_explorable
    from aiayn.tasks.trained import shipped_path

    release = shipped_path("shakespeare-char")
    record = client(load_explorable(run_dir=release)).get("/api/run").json()
    lines = (release / "record" / "metrics.csv").read_text().splitlines()[1:]
    assert record["available"] and record["rows"] == len(lines) and record["series"]["val_nll"]
    assert record["summary"] == json.loads((release / "record" / "summary.json").read_text())
    assert record["config"] == json.loads((release / "config.json").read_text())


# ---- what is refused, and how ----------------------------------------------------------------
def test_bad_input_gets_one_short_message(char_ex, minilm_ex, translation_ex):
    api = client(char_ex)
    too_long = api.post("/api/attention", json={"text": "x" * 65})
    assert too_long.status_code == 400
    assert too_long.json() == {"error": "the text is 65 tokens; this model's context is 64 tokens. Shorten it."}
    assert api.post("/api/tokenize", json={"text": "x" * 65}).json()["error"] == too_long.json()["error"]
    assert api.post("/api/tokenize", json={"text": "hello"}).json()["count"] == 5
    unknown = api.post("/api/attention", json={"text": "héllo"})
    assert unknown.status_code == 400 and "outside the vocabulary" in unknown.json()["error"]
    assert api.post("/api/attention", json={"text": "  "}).json() == {"error": "the text is empty; type something"}
    huge = api.post("/api/attention", json={"text": "x" * 20_001})
    assert huge.status_code == 422 and huge.json()["error"].startswith("text: String should have at most 20000")
    assert api.post("/api/generate", json={"text": "a", "steps": 65}).json() == {
        "error": "steps: Input should be less than or equal to 64"}
    assert api.post("/api/generate", json={"text": "x" * 64}).json() == {
        "error": "the prompt is 64 tokens and fills the model's context of 64; shorten it"}
    assert api.post("/api/generate", json={"text": "a", "temperature": "nan"}).status_code == 422
    assert api.post("/api/beam", json={"text": "a", "steps": 65}).json() == {
        "error": "steps: Input should be less than or equal to 64"}
    assert client(minilm_ex).post("/api/beam", json={"text": "a"}).json() == {
        "error": "an encoder-only model does not generate text: no beam search"}
    assert api.get("/api/attention/0123456789abcdef/self/0").json() == {
        "error": "this text's attention is no longer kept; show it again"}
    assert api.post("/api/attention", content=b"{not json", headers={"Content-Type": "application/json"}
                    ).status_code == 422
    assert client(minilm_ex).post("/api/generate", json={"text": "a"}).json() == {
        "error": "an encoder-only model does not generate text"}
    assert client(translation_ex).post("/api/beam", json={"text": "a", "beam": 9}).status_code == 422
    probe = api.post("/api/attention", json={"text": "abc"}).json()
    assert api.get(f"/api/attention/{probe['key']}/cross/0").json() == {
        "error": "no attention stack 'cross'; this text has self"}


def test_concurrent_requests_get_their_own_answers(char_ex):
    """The server runs requests on a thread pool; the model runs one at a time (Explorable.lock)."""
    api = client(char_ex)
    texts = ["To be, or not", "ROMEO:", "What light", "Is it so"]
    alone = {t: api.post("/api/generate", json={"text": t, "steps": 8}).json()["text"] for t in texts}

    def both(text: str) -> tuple[str, str, list[int]]:
        generated = api.post("/api/generate", json={"text": text, "steps": 8}).json()["text"]
        return text, generated, api.post("/api/attention", json={"text": text}).json()["ids"]["tokens"]

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(both, texts * 3))
    assert all(generated == alone[text] and ids == char_ex.encode(text) for text, generated, ids in results)


def test_the_page_and_its_modules_are_served(char_ex):
    api = client(char_ex)
    page = api.get("/")
    assert page.status_code == 200 and '<script type="module" src="/static/js/main.js">' in page.text
    for name in ("main", "api", "draw", "attention", "generate", "beam", "positions", "training"):
        module = api.get(f"/static/js/{name}.js")
        assert module.status_code == 200 and "javascript" in module.headers["content-type"]
        imports = re.findall(r'from "([^"]+)"', module.text)
        assert all(name.startswith("./") for name in imports), imports  # nothing from the network
        assert not re.search(r"https?://", module.text.replace("http://www.w3.org/2000/svg", "")), name
    assert api.get("/static/style.css").status_code == 200
    assert api.get("/static/../models.py").status_code == 404


def test_a_run_of_any_other_task_shows_its_attention_example():
    """A copy run (tests/fixtures/old_runs: written by an older aiayn) has no text tokenizer: its
    attention view is the task's own attention example, in the task's input syntax."""
    from aiayn.explore import load_explorable

    run = REPO / "tests" / "fixtures" / "old_runs" / "copy"
    ex = load_explorable(run_dir=run)
    api = client(ex)
    summary = api.get("/api/model").json()
    assert summary["kind"] == "task" and summary["views"]["generate"] and summary["views"]["attention"] is None
    default = api.post("/api/attention", json={"text": ""}).json()  # empty: the task's test example
    first = ex.task.attention_example(ex.model, None)
    assert default["tokens"] == {"queries": first.query_labels, "keys": first.key_labels}
    text = " ".join(reversed(first.key_labels))  # another input in the task's syntax
    probe = api.post("/api/attention", json={"text": text}).json()
    example = ex.task.attention_example(ex.model, text)
    assert probe["tokens"] == {"queries": example.query_labels, "keys": example.key_labels}
    for layer, weights in enumerate(example.weights):
        assert np.array_equal(layer_weights(api, probe, "task", layer), weights.numpy())
    bad = api.post("/api/attention", json={"text": "not digits"})
    assert bad.status_code == 400 and "must be space-separated integers" in bad.json()["error"]
    assert api.get("/api/run").json()["available"]


def test_the_responsiveness_benchmark_runs(char_run, capsys):
    from benchmarks import explore

    explore.main(["--run", str(char_run), "--tokens", "20", "--steps", "4", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert re.search(r"\| attention of 1\d tokens, all 3 layers \| \d+\.\d+ \|", out), out
    assert "| 4 decode steps with their figures |" in out


def test_an_unforeseen_failure_is_one_line_too(char_ex, monkeypatch):
    import aiayn.explore.app as explore_app

    def broken(run_dir):
        raise RuntimeError("metrics.csv vanished")

    monkeypatch.setattr(explore_app, "run_record", broken)
    api = TestClient(create_app(char_ex), raise_server_exceptions=False)
    response = api.get("/api/run")
    assert response.status_code == 500
    assert response.json() == {"error": "internal error: RuntimeError: metrics.csv vanished (please report it)"}


def test_a_long_run_is_thinned_for_the_page(tmp_path):
    from aiayn.explore.training import MAX_POINTS, run_record

    rows = ["step,lr,train_loss,val_nll"] + [f"{s},0.001,{10 / s},{'' if s % 100 else 5 / s}" for s in range(1, 5001)]
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    record = run_record(tmp_path)
    loss = record["series"]["train_loss"]
    assert record["rows"] == 5000 and len(loss) <= MAX_POINTS + 1
    assert loss[0] == [1.0, 10.0] and loss[-1] == [5000.0, 10 / 5000]  # the first and the last kept
    assert len(record["series"]["val_nll"]) == 50 and record["config"] is None


def test_a_damaged_metrics_file_leaves_the_rest_of_the_run(tmp_path):
    """A metrics.csv that is not numbers (or not UTF-8) empties the curves and says why, instead of
    failing the page's run view."""
    from aiayn.explore.training import run_record

    (tmp_path / "config.json").write_text('{"task": "reverse"}')
    for damage in (b"step,lr\n1,0.1\n2,zz\n", b"\xff\xfe\x00step"):
        (tmp_path / "metrics.csv").write_bytes(damage)
        record = run_record(tmp_path)
        assert record["available"] and record["rows"] == 0 and record["series"] == {}
        assert record["config"] == {"task": "reverse"}
        assert "metrics.csv" in record["note"] and ("line 3: a value is not a number" in record["note"]
                                                    or "is not a CSV file" in record["note"]
                                                    or "no header with a step column" in record["note"])


def test_every_error_has_the_one_shape_and_big_bodies_are_refused_unread(char_ex):
    """Framework errors too (no route, wrong method, a missing static file) answer {"error": ...}
    with a short message; a body over 1 MiB is 413 by its declared length or as it streams."""
    from aiayn.explore.app import MAX_BODY_BYTES

    api = client(char_ex)
    for response, status, needle in [
        (api.get("/api/nothing"), 404, "no route GET /api/nothing"),
        (api.get("/" + "x" * 50_000), 404, "no route GET /xxxx"),
        (api.delete("/api/model"), 405, "DELETE is not allowed on /api/model"),
        (api.get("/static/no-such-file.js"), 404, ""),
    ]:
        assert response.status_code == status, response.text
        body = response.json()
        assert list(body) == ["error"] and needle in body["error"] and len(response.text) < 300, body
    declared = api.post("/api/attention", content=b"x" * (MAX_BODY_BYTES + 1),
                        headers={"Content-Type": "application/json"})
    assert declared.status_code == 413 and "over 1 MiB" in declared.json()["error"]
    streamed = api.post("/api/attention", content=(b" " * (1 << 16) for _ in range(20)),
                        headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413 and "over 1 MiB" in streamed.json()["error"]
    assert api.post("/api/tokenize", json={"text": "hello"}).json()["count"] == 5  # small bodies pass
