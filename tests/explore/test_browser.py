"""The explorer in a real browser: Debian's chromium driven by Playwright against a live uvicorn
server on 127.0.0.1. Every view of the four kinds of model is loaded, clicked through and checked
on what it draws (head cells = layers x heads, the cross-attention map's size = target x source
tokens, the value under the mouse = the model's own weight, the KV cache's slots and bytes, the
beam tree's nodes and n-best, the position tables, the run's curves), with no console error
(the ``page`` fixture fails the test on any)."""

from __future__ import annotations

import pytest
import torch
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect

from aiayn.generate import greedy_encoder_decoder

WAIT_MS = 30_000  # as the page's default timeout (conftest): every retrying assertion is bounded
HOVER_TRY_MS = 2_000  # one hover's wait for the readout before the move is measured and made again


def open_view(page, server, view: str, response: str | None = None) -> dict | None:
    """Go to a view; with ``response``, also return the JSON of the first response whose URL
    contains it (the data the view drew)."""
    if response is None:
        page.goto(f"{server.url}#{view}")
        page.wait_for_selector("body[data-ready='1']")
        return None
    with page.expect_response(lambda r: response in r.url) as info:
        page.goto(f"{server.url}#{view}")
    page.wait_for_selector("body[data-ready='1']")
    return info.value.json()


def hover_value(page, i: int, j: int) -> float:
    """Hover the detail heatmap's cell (query i, key j); the value the page shows for it.

    The cell's place is measured just before each move and the move is retried until the readout
    names (i, j): on a loaded machine the page can still shift (the token chips above the heatmap
    arrive late) or redraw the heatmap under a still mouse, which fires no new mousemove."""
    canvas = page.locator("#attn-heatmap")
    readout = page.locator("#attn-hover")
    named = "([i, j]) => { const r = document.getElementById('attn-hover');" \
            " return r.dataset.query === String(i) && r.dataset.key === String(j); }"
    for attempt in range(WAIT_MS // HOVER_TRY_MS):
        rows, cols = int(canvas.get_attribute("height")), int(canvas.get_attribute("width"))
        page.evaluate("([i, rows]) => { const c = document.getElementById('attn-heatmap'); const b = c.getBoundingClientRect();"
                      " window.scrollBy(0, b.top + (i + 0.5) * b.height / rows - innerHeight / 2); }", [i, rows])
        box = canvas.bounding_box()
        if attempt:  # leave the canvas first, so that coming back is a fresh mousemove on whatever is there now
            page.mouse.move(0, 0)
        page.mouse.move(box["x"] + (j + 0.5) * box["width"] / cols, box["y"] + (i + 0.5) * box["height"] / rows)
        try:
            page.wait_for_function(named, arg=[i, j], timeout=HOVER_TRY_MS)
            break
        except PlaywrightTimeout:
            continue
    else:
        raise AssertionError(f"the heatmap's readout never showed query {i}, key {j} within {WAIT_MS} ms")
    shown = float(readout.inner_text().rsplit(": ", 1)[1])
    exact = float(readout.get_attribute("data-value"))
    assert abs(shown - exact) <= 5e-5  # the text shows it to 4 decimals
    return exact


def wait_all_cells(page, n: int) -> None:
    assert page.locator("canvas.head-cell").count() == n
    page.wait_for_function(f"document.querySelectorAll('canvas.head-cell[data-loaded=\"1\"]').length === {n}")


def probe_cells(weights: torch.Tensor, head: int) -> list[tuple[int, int, float]]:
    """Two cells of one head's (t_q, t_k) map to hover: the last query's strongest key, and (0, 0)."""
    w = weights[head]
    j = int(w[-1].argmax())
    return [(w.shape[0] - 1, j, float(w[-1, j])), (0, 0, float(w[0, 0]))]


# ---- a translation run: encoder, decoder and cross-attention; decoding; the beam tree ---------------
def test_translation_attention_views(page, live, translation_ex):
    ex, server = translation_ex, live(translation_ex)
    probe = open_view(page, server, "attention", "/api/attention")
    page.wait_for_selector("#attn-heatmap")
    src, tgt = probe["ids"]["source"], probe["ids"]["target"]
    with ex.lock, torch.inference_mode():
        out = ex.model(torch.tensor([src]), torch.tensor([tgt]), need_weights=True)
    expected = {"encoder": out.encoder_attentions, "decoder": out.attentions, "cross": out.cross_attentions}
    sides = {"encoder": (len(src), len(src)), "decoder": (len(tgt), len(tgt)), "cross": (len(tgt), len(src))}
    assert page.locator("#attn-stacks button").count() == 3
    for stack in ("cross", "encoder", "decoder"):
        page.click(f"#attn-stacks button[data-stack='{stack}']")
        layers = len(expected[stack])
        wait_all_cells(page, layers * ex.config.n_heads)
        page.click(f"canvas.head-cell[data-layer='{layers - 1}'][data-head='1']")
        page.wait_for_selector(f"#attn-detail-title:has-text('layer {layers - 1}, head 1')")
        heat = page.locator("#attn-heatmap")
        queries, keys = sides[stack]  # cross: target tokens x source tokens
        assert (int(heat.get_attribute("height")), int(heat.get_attribute("width"))) == (queries, keys)
        for i, j, value in probe_cells(expected[stack][layers - 1][0], head=1):
            assert hover_value(page, i, j) == value
    assert page.locator("#attn-lines-svg").count() == 1


def test_translation_generation_steps_fill_the_cache(page, live, translation_ex):
    ex, server = translation_ex, live(translation_ex)
    data = open_view(page, server, "generate", "/api/generate")
    page.wait_for_selector("#gen-current")
    layers = ex.config.n_decoder_layers
    assert page.locator(".kv-row.cross-row").count() == layers  # computed once, from the first step
    for k in range(min(4, len(data["steps"]))):
        if k:
            page.click("#gen-next")
        step = data["steps"][k]
        page.wait_for_selector(f"#gen-step-label:has-text('step {k + 1} of')")
        assert page.locator("#gen-current").inner_text() == step["label"]
        assert page.locator("#gen-topk-table tr").count() == 5
        assert page.locator("#gen-topk-table tr.chosen td").nth(1).inner_text() == step["label"]
        filled = step["cache"]["filled"]
        assert filled == k + 1
        assert page.locator(".kv-row:not(.cross-row) .kv-slot.filled").count() == layers * filled
        assert page.locator(".kv-row:not(.cross-row) .kv-slot.new").count() == layers  # one slot a step
        measured = page.locator("#gen-bytes tr[data-field='measured'] td.num").get_attribute("data-value")
        formula = page.locator("#gen-bytes tr[data-field='formula'] td.num").get_attribute("data-value")
        assert int(measured) == int(formula) == 2 * layers * ex.config.n_kv_heads * ex.config.head_dim * filled * 4
    page.click("#gen-last")
    assert page.locator("#gen-current").inner_text() == data["steps"][-1]["label"]


def test_translation_beam_tree(page, live, translation_ex):
    ex, server = translation_ex, live(translation_ex)
    tree = open_view(page, server, "beam", "/api/beam")
    page.wait_for_selector("#beam-svg")
    assert page.locator("#beam-svg g.node").count() == len(tree["nodes"])
    assert page.locator("#beam-nbest tr").count() == len(tree["nbest"]) + 1 == 5  # beam 4, with its header
    for status in ("kept", "pruned"):
        assert page.locator(f"#beam-svg g.node[data-status='{status}']").count() == \
            sum(n["status"] == status for n in tree["nodes"])
    assert page.locator("#beam-svg g.node.best").count() == tree["nbest"][0]["length"] + 1  # <s> + its tokens
    with page.expect_response(lambda r: "/api/beam" in r.url) as info:
        page.locator("#beam-size").fill("1")
    one = info.value.json()
    page.wait_for_function(f"document.querySelectorAll('#beam-svg g.node').length === {len(one['nodes'])}")
    src = torch.tensor([ex.encode(ex.default_text)])
    greedy = greedy_encoder_decoder(ex.model, src, bos_id=ex.bos_id, eos_id=ex.eos_id,
                                    max_new_tokens=int(1.2 * src.shape[1] + 10))
    ids = [i for i in greedy.tokens[0, : int(greedy.lengths[0])].tolist() if i != ex.eos_id]
    assert page.locator("#beam-nbest td.hyp").all_inner_texts() == [ex.decode(ids)]  # beam 1 = greedy
    with page.expect_response(lambda r: "/api/beam" in r.url):
        page.locator("#beam-alpha").fill("1.5")
    page.wait_for_selector("#beam-alpha-value:has-text('1.5')")


def test_translation_positions_and_training_views(page, live, translation_ex, translation_run):
    server = live(translation_ex)
    data = open_view(page, server, "positions", "/api/positions")
    page.wait_for_selector("#pos-model")
    assert page.locator("#pos-model").get_attribute("data-scheme") == "sinusoidal"
    d = translation_ex.config.d_model
    assert int(page.locator("#pos-sin-table").get_attribute("width")) == d
    assert int(page.locator("#pos-own-table").get_attribute("height")) == translation_ex.config.max_seq_len
    assert page.locator("#pos-sin-dots polyline.series").count() == len(data["sinusoidal"]["dots"]["curves"]) == 3
    gaps = page.locator(".offset-gap").all_inner_texts()
    assert len(gaps) == 3 and all("lie on top of each other" in g for g in gaps)

    page.click("#tabs a[data-view='training']")
    page.wait_for_selector("#train-loss")
    record = page.evaluate("fetch('/api/run').then(r => r.json())")
    val = page.locator("#train-loss polyline[data-name='val NLL']")
    assert int(val.get_attribute("data-points")) == len(record["series"]["val_nll"])
    assert "translation" in page.locator("#train-config").inner_text()
    with page.expect_response(lambda r: r.url.endswith("/api/run")):
        page.click("#train-reload")  # a run still training: read metrics.csv again
    page.wait_for_selector("#train-loss")
    page.click("#tabs a[data-view='attention']")  # views are kept: switching back is instant
    page.wait_for_selector("#attn-heatmap")


# ---- shakespeare-char: a causal decoder-only run ---------------------------------------------------
def test_char_lm_views_and_the_context_limit(page, live, char_ex):
    ex, server = char_ex, live(char_ex)
    probe = open_view(page, server, "attention", "/api/attention")
    page.wait_for_selector("#attn-heatmap")
    wait_all_cells(page, ex.config.n_layers * ex.config.n_heads)
    ids = probe["ids"]["tokens"]
    with ex.lock, torch.inference_mode():
        weights = ex.model(torch.tensor([ids]), need_weights=True).attentions[0][0]
    for i, j, value in probe_cells(weights, head=0):
        assert hover_value(page, i, j) == value
    assert hover_value(page, 0, len(ids) - 1) == 0.0  # causal: the first query never sees the last key

    page.fill("#attn-text", "x" * 65)  # one character past the context
    page.wait_for_selector("#attn-message:has-text('65 tokens')")
    assert page.locator("#attn-message").inner_text() == "the text is 65 tokens; this model's context is 64 tokens. Shorten it."
    assert page.locator("#attn-show").is_disabled()
    page.fill("#attn-text", "x" * 64)
    page.wait_for_selector("#attn-count:has-text('64 / 64 tokens')")
    assert page.locator("#attn-show").is_enabled() and page.locator("#attn-message").inner_text() == ""

    data = open_view(page, server, "generate", "/api/generate")
    page.wait_for_selector("#gen-current")
    prompt = len(data["prompt"]["ids"])
    page.press("body", "ArrowRight")
    page.press("body", "ArrowRight")
    page.wait_for_selector("#gen-step-label:has-text('step 3 of')")
    # the grid and chips render just after the step label: retrying assertions, bounded by the page's timeout
    expect(page.locator(".kv-slot.filled")).to_have_count(ex.config.n_layers * (prompt + 2), timeout=WAIT_MS)
    expect(page.locator("#gen-chips, #gen-seq-chips .chip.gen")).to_have_count(2, timeout=WAIT_MS)
    with page.expect_response(lambda r: "/api/beam" in r.url) as info:
        page.click("#tabs a[data-view='beam']")  # no end-of-text token: every hypothesis runs to the limit
    tree = info.value.json()
    page.wait_for_selector("#beam-svg")
    expect(page.locator("#beam-svg g.node")).to_have_count(len(tree["nodes"]), timeout=WAIT_MS)
    assert page.locator("#beam-nbest td.hyp").all_inner_texts() == [h["text"] for h in tree["nbest"]]
    assert page.locator("#beam-svg g.node[data-status='limit']").count() == 4  # beam 4, 12 new tokens each
    page.click("#tabs a[data-view='training']")
    page.wait_for_selector("#train-loss")


# ---- all-MiniLM-L6-v2: a BERT-family encoder from a Hugging Face directory --------------------------
def test_minilm_attention_and_what_it_does_not_have(page, live, minilm_ex):
    ex, server = minilm_ex, live(minilm_ex)
    probe = open_view(page, server, "attention", "/api/attention")
    page.wait_for_selector("#attn-heatmap")
    assert (ex.config.n_layers, ex.config.n_heads) == (6, 12)
    wait_all_cells(page, 6 * 12)
    assert probe["tokens"]["tokens"][0] == "[CLS]"
    ids = probe["ids"]["tokens"]
    with ex.lock, torch.inference_mode():
        weights = ex.model(torch.tensor([ids]), need_weights=True).attentions[5][0]
    page.click("canvas.head-cell[data-layer='5'][data-head='11']")
    page.wait_for_selector("#attn-detail-title:has-text('layer 5, head 11')")
    for i, j, value in probe_cells(weights, head=11):
        assert hover_value(page, i, j) == value
    for view, reason in (("generate", "does not generate text"), ("beam", "does not generate text"),
                         ("training", "loaded from a file")):
        page.click(f"#tabs a[data-view='{view}']")
        assert reason in page.locator(f"#view-{view} .lead").inner_text()
    page.click("#tabs a[data-view='positions']")
    page.wait_for_selector("#pos-own-similarity")
    assert page.locator("#pos-model").get_attribute("data-scheme") == "learned"


# ---- SmolLM2-135M: 30 layers x 9 heads (3 kv heads), fetched a layer at a time -----------------------
@pytest.mark.slow
def test_smollm2_loads_attention_lazily_by_layer(page, live, smollm2_ex):
    ex, server = smollm2_ex, live(smollm2_ex)
    layer_requests: list[str] = []
    page.on("request", lambda r: layer_requests.append(r.url) if "/api/attention/" in r.url else None)
    open_view(page, server, "attention", "/api/attention")
    page.wait_for_selector("#attn-heatmap")
    page.wait_for_selector("canvas.head-cell[data-layer='0'][data-loaded='1']")
    assert page.locator("canvas.head-cell").count() == 30 * 9
    assert page.locator(".kv-group").count() == 3  # 9 query heads in 3 groups sharing a kv head
    first = len(set(layer_requests))
    assert first < 30, f"{first} layers fetched before scrolling: not lazy"
    page.locator("#attn-grid-wrap").evaluate("el => { el.scrollTop = el.scrollHeight; }")
    page.wait_for_selector("canvas.head-cell[data-layer='29'][data-loaded='1']")
    page.click("canvas.head-cell[data-layer='29'][data-head='8']")
    page.wait_for_selector("#attn-detail-title:has-text('layer 29, head 8 (kv head 2)')")
    ids = ex.encode(ex.default_text)
    with ex.lock, torch.inference_mode():
        weights = ex.model(torch.tensor([ids]), need_weights=True).attentions[29][0]
    for i, j, value in probe_cells(weights, head=8):
        assert hover_value(page, i, j) == value
    assert len(set(layer_requests)) == len(layer_requests)  # each layer fetched once
    print(f"SmolLM2: {first} of 30 layers fetched before scrolling")

    data = open_view(page, server, "generate", "/api/generate")  # decoding: 30 layers, 3 kv heads of 64
    page.wait_for_selector("#gen-current")
    prompt = len(data["prompt"]["ids"])
    page.click("#gen-next")
    page.wait_for_selector("#gen-step-label:has-text('step 2 of')")
    assert page.locator(".kv-row").count() == 30
    assert page.locator(".kv-slot.filled").count() == 30 * (prompt + 1)
    mha = int(page.locator("#gen-bytes tr[data-field='mha'] td.num").get_attribute("data-value"))
    assert mha == 3 * data["steps"][1]["cache"]["formula"]  # 9 kv heads instead of 3
    assert page.locator("#gen-current").inner_text() == data["steps"][1]["label"]
    with page.expect_response(lambda r: "/api/beam" in r.url) as info:
        page.click("#tabs a[data-view='beam']")
    tree = info.value.json()
    page.wait_for_selector("#beam-svg")
    assert page.locator("#beam-svg g.node").count() == len(tree["nodes"])
    assert page.locator("#beam-nbest td.hyp").first.inner_text().startswith("Berlin")  # "... Germany is" Berlin
    page.click("#tabs a[data-view='positions']")
    page.wait_for_selector("#pos-model[data-scheme='rope']")
    assert int(page.locator("#pos-own-table").get_attribute("width")) == 32  # 64 / 2 rotated pairs
