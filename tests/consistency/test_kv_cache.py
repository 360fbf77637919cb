"""Cached decoding equals full recomputation.

Every test builds a small float32 model in eval mode, re-initialises its weights with a seeded
generator at a scale where attention is far from uniform (so a wrong position, mask or cache slot
shows up), and compares the cached path with a forward over the whole sequence at
``torch.testing.assert_close``'s default float32 tolerances.
"""

from __future__ import annotations

import pytest
import torch
from random_weights import randomize_, right_pad
from torch.testing import assert_close

from aiayn.generate import greedy_decoder_only, greedy_encoder_decoder
from aiayn.models import DecoderOnly, EncoderDecoder, get_preset
from aiayn.nn.kv_cache import KVCache, kv_cache_bytes

SCHEMES = ["sinusoidal", "learned", "rope", "alibi", "t5", "none"]
KV_HEADS = [6, 2, 1]  # n_heads = 6: multi-head, grouped-query, multi-query
VOCAB = 99
PAD = 0


# ---- helpers ----------------------------------------------------------------------------------
# Models are built and seeded on the CPU (the same weights on every device), then moved to the test's
# device; token ids are drawn on the CPU and moved likewise.
def decoder_only(positional: str = "learned", n_kv_heads: int | None = None, *,
                 preset: str = "gpt-tiny", seed: int = 0, device: torch.device, **overrides) -> DecoderOnly:
    torch.manual_seed(seed)
    config = get_preset(preset, positional=positional, n_kv_heads=n_kv_heads, **overrides)
    return randomize_(DecoderOnly(config), seed).eval().to(device)


def encoder_decoder(positional: str = "sinusoidal", n_kv_heads: int | None = None, *,
                    seed: int = 0, device: torch.device, **overrides) -> EncoderDecoder:
    torch.manual_seed(seed)
    config = get_preset("tiny", positional=positional, n_kv_heads=n_kv_heads, **overrides)
    return randomize_(EncoderDecoder(config), seed).eval().to(device)


def random_tokens(b: int, t: int, seed: int = 1, low: int = 1, *, device: torch.device) -> torch.Tensor:
    """Token ids in [low, VOCAB): with low=1 never the pad id 0."""
    return torch.randint(low, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed)).to(device)


def left_pad(rows: list[torch.Tensor], seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D rows to one length with *random* (non-pad) junk ids, which the valid mask
    must hide; returns (tokens (b, t), valid (b, t)) on the rows' device."""
    t = max(len(r) for r in rows)
    device = rows[0].device
    junk = random_tokens(len(rows), t, seed=seed, device=device)
    tokens = junk.clone()
    valid = torch.zeros(len(rows), t, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        tokens[i, t - len(r):] = r
        valid[i, t - len(r):] = True
    return tokens, valid


# ---- decoder-only: step by step ---------------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_stepwise_decode_equals_full_forward(positional: str, n_kv_heads: int, device: torch.device) -> None:
    model = decoder_only(positional, n_kv_heads, device=device)
    b, total, prompt_len = 2, 12, 5
    seq = random_tokens(b, total, device=device)
    cache = model.new_cache(b, total)
    with torch.no_grad():
        prefill = model(seq[:, :prompt_len], cache=cache).logits
        assert_close(prefill, model(seq[:, :prompt_len]).logits)
        for i in range(prompt_len, total):
            step = model(seq[:, i : i + 1], cache=cache).logits
            assert step.shape == (b, 1, VOCAB)
            full = model(seq[:, : i + 1]).logits[:, -1]
            assert_close(step[:, -1], full)
    assert cache.length == total


@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_greedy_cached_equals_uncached(positional: str, n_kv_heads: int, device: torch.device) -> None:
    model = decoder_only(positional, n_kv_heads, device=device)
    prompt = random_tokens(3, 6, seed=2, device=device)
    cached = greedy_decoder_only(model, prompt, max_new_tokens=10, use_cache=True)
    uncached = greedy_decoder_only(model, prompt, max_new_tokens=10, use_cache=False)
    assert cached.tokens.shape == (3, 10)
    assert torch.equal(cached.tokens, uncached.tokens)
    assert_close(cached.logits, uncached.logits)


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("llama-tiny", {}),  # GQA + RoPE + RMSNorm + SwiGLU, as shipped
        ("gpt-tiny", {"norm_position": "post", "activation": "relu", "scale_embeddings": True}),
        ("gpt-tiny", {"pad_id": 0, "attn_impl": "reference"}),
    ],
    ids=["llama-tiny", "post-norm", "reference-impl"],
)
def test_presets_cached_equals_uncached(preset: str, overrides: dict, device: torch.device) -> None:
    torch.manual_seed(0)
    config = get_preset(preset, **overrides)
    model = randomize_(DecoderOnly(config), 3).eval().to(device)
    prompt = random_tokens(2, 5, seed=4, device=device)
    cached = greedy_decoder_only(model, prompt, max_new_tokens=8, use_cache=True)
    uncached = greedy_decoder_only(model, prompt, max_new_tokens=8, use_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    assert_close(cached.logits, uncached.logits)


# ---- decoder-only: several new tokens per step (right-aligned causal mask) --------------------
@pytest.mark.parametrize("n_kv_heads", [6, 2])
@pytest.mark.parametrize("positional", SCHEMES)
def test_multi_token_chunks_equal_full_forward(positional: str, n_kv_heads: int, device: torch.device) -> None:
    model = decoder_only(positional, n_kv_heads, device=device)
    b, prompt_len, chunk, n_chunks = 2, 4, 3, 3
    total = prompt_len + chunk * n_chunks
    seq = random_tokens(b, total, seed=5, device=device)
    cache = model.new_cache(b, total)
    with torch.no_grad():
        full = model(seq).logits
        got = [model(seq[:, :prompt_len], cache=cache).logits]
        for start in range(prompt_len, total, chunk):
            out = model(seq[:, start : start + chunk], cache=cache).logits
            assert out.shape == (b, chunk, VOCAB)
            # Each chunk, on its own, against the matching slice of the full forward.
            assert_close(out, full[:, start : start + chunk])
            got.append(out)
    assert_close(torch.cat(got, dim=1), full)


def test_multi_token_chunks_with_left_padding(device: torch.device) -> None:
    model = decoder_only("rope", 2, device=device)
    rows = [random_tokens(1, n, seed=10 + n, device=device)[0] for n in (6, 3, 1)]
    prompt, valid = left_pad(rows)
    cont = random_tokens(3, 6, seed=20, device=device)
    tokens = torch.cat([prompt, cont], dim=1)
    all_valid = torch.cat([valid, torch.ones_like(cont, dtype=torch.bool)], dim=1)
    cache = model.new_cache(3, tokens.shape[1])
    with torch.no_grad():
        full = model(tokens, valid=all_valid).logits
        model(prompt, valid=valid, cache=cache)
        t0 = prompt.shape[1]
        for start in range(t0, tokens.shape[1], 3):
            out = model(tokens[:, start : start + 3], valid=all_valid[:, start : start + 3],
                        cache=cache).logits
            assert_close(out, full[:, start : start + 3])


# ---- decoder-only: left-padded batches --------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads", [6, 1])
@pytest.mark.parametrize("positional", SCHEMES)
def test_left_padded_batch_cached_uncached_and_alone(positional: str, n_kv_heads: int, device: torch.device) -> None:
    model = decoder_only(positional, n_kv_heads, device=device)
    lengths = (7, 4, 1)
    rows = [random_tokens(1, n, seed=30 + n, device=device)[0] for n in lengths]
    prompt, valid = left_pad(rows)
    new = 8
    cached = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=new)
    uncached = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=new,
                                   use_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    assert_close(cached.logits, uncached.logits)
    # Padding invariance under the cache: every row as if it had been run alone, unpadded.
    for i, row in enumerate(rows):
        alone = greedy_decoder_only(model, row[None], max_new_tokens=new)
        assert torch.equal(cached.tokens[i : i + 1], alone.tokens), f"row {i}"
        assert_close(cached.logits[i : i + 1], alone.logits)


def test_left_padding_from_pad_id_default_valid(device: torch.device) -> None:
    """With config.pad_id set, valid defaults to tokens != pad_id, also with a cache."""
    model = decoder_only("alibi", 2, pad_id=PAD, device=device)
    rows = [random_tokens(1, n, seed=40 + n, device=device)[0] for n in (5, 2)]
    prompt, valid = left_pad(rows)
    prompt[~valid] = PAD  # no valid= given: the pads must be recognised by their id
    cont = random_tokens(2, 4, seed=41, device=device)
    cache = model.new_cache(2, 9)
    with torch.no_grad():
        model(prompt, cache=cache)
        for j in range(cont.shape[1]):
            step = model(cont[:, j : j + 1], cache=cache).logits[:, -1]
            for i, row in enumerate(rows):
                seq = torch.cat([row, cont[i, : j + 1]])[None]
                assert_close(step[i : i + 1], model(seq).logits[:, -1])


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_greedy_left_padding_from_pad_id(use_cache: bool, device: torch.device) -> None:
    """greedy_decoder_only without prompt_valid follows the model's default: with config.pad_id
    set, pad ids in the prompt are padding (as in ``model(prompt)``), not real tokens."""
    model = decoder_only("rope", 2, pad_id=PAD, device=device)
    rows = [random_tokens(1, n, seed=45 + n, device=device)[0] for n in (6, 3, 1)]
    prompt, valid = left_pad(rows)
    prompt[~valid] = PAD
    out = greedy_decoder_only(model, prompt, max_new_tokens=6, use_cache=use_cache)
    explicit = greedy_decoder_only(model, prompt, prompt_valid=valid, max_new_tokens=6,
                                   use_cache=use_cache)
    assert torch.equal(out.tokens, explicit.tokens)
    assert_close(out.logits, explicit.logits)
    for i, row in enumerate(rows):
        alone = greedy_decoder_only(model, row[None], max_new_tokens=6, use_cache=use_cache)
        assert torch.equal(out.tokens[i : i + 1], alone.tokens), f"row {i}"
        assert_close(out.logits[i : i + 1], alone.logits)


# ---- encoder-decoder --------------------------------------------------------------------------
def padded_sources(lengths: tuple[int, ...] = (9, 5, 2), seed: int = 50, *, device: torch.device) -> torch.Tensor:
    return right_pad([random_tokens(1, n, seed=seed + n, device=device)[0] for n in lengths])


@pytest.mark.parametrize("n_kv_heads", [6, 2])
@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_decoder_greedy_cached_equals_uncached(positional: str, n_kv_heads: int, device: torch.device) -> None:
    model = encoder_decoder(positional, n_kv_heads, device=device)
    src = padded_sources(device=device)
    cached = greedy_encoder_decoder(model, src, bos_id=1, max_new_tokens=10, use_cache=True)
    uncached = greedy_encoder_decoder(model, src, bos_id=1, max_new_tokens=10, use_cache=False)
    assert cached.tokens.shape == (3, 10)
    assert torch.equal(cached.tokens, uncached.tokens)
    assert_close(cached.logits, uncached.logits)


def test_encoder_decoder_greedy_with_eos(device: torch.device) -> None:
    model = encoder_decoder(device=device)
    src = padded_sources(device=device)
    free = greedy_encoder_decoder(model, src, bos_id=1, max_new_tokens=8)
    # eos = a token that row 0 emits for the first time at step j > 0 (or at step 0).
    row = free.tokens[0].tolist()
    j = next((k for k in range(1, len(row)) if row[k] not in row[:k] and row[k] != PAD), 0)
    eos = row[j]
    cached = greedy_encoder_decoder(model, src, bos_id=1, max_new_tokens=8, eos_id=eos)
    uncached = greedy_encoder_decoder(model, src, bos_id=1, max_new_tokens=8, eos_id=eos,
                                      use_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    assert_close(cached.logits, uncached.logits)
    assert torch.equal(cached.tokens[0, : j + 1], free.tokens[0, : j + 1])
    assert bool((cached.tokens[0, j + 1 :] == PAD).all())  # filled with pad after eos


@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_decoder_cached_chunks_equal_teacher_forcing(positional: str, device: torch.device) -> None:
    model = encoder_decoder(positional, 2, device=device)
    src = padded_sources(device=device)
    tgt = random_tokens(3, 10, seed=60, device=device)
    tgt[:, 0] = 1  # bos
    with torch.no_grad():
        full = model(src, tgt).logits
        encoded = model.encode(src)
        cache = model.new_cache(3, tgt.shape[1])
        pieces = []
        for start, stop in ((0, 1), (1, 4), (4, 7), (7, 10)):
            out = model.decode(tgt[:, start:stop], encoded, cache=cache).logits
            assert_close(out, full[:, start:stop])
            pieces.append(out)
    assert_close(torch.cat(pieces, dim=1), full)
    assert cache.length == tgt.shape[1]


def test_encoder_decoder_cached_right_padded_target(device: torch.device) -> None:
    """Padded target slots in the cache are masked for later tokens, as in teacher forcing."""
    model = encoder_decoder("t5", 2, device=device)
    src = padded_sources(device=device)
    tgt = random_tokens(3, 8, seed=61, device=device)
    tgt[:, 0] = 1
    tgt[1, 5:] = PAD
    tgt[2, 2:] = PAD
    with torch.no_grad():
        full = model(src, tgt).logits
        encoded = model.encode(src)
        cache = model.new_cache(3, tgt.shape[1])
        for start, stop in ((0, 3), (3, 4), (4, 8)):
            out = model.decode(tgt[:, start:stop], encoded, cache=cache).logits
            assert_close(out, full[:, start:stop])


def test_cross_attention_kv_projected_once_per_source(device: torch.device) -> None:
    model = encoder_decoder(n_kv_heads=2, device=device)
    src = padded_sources(device=device)
    calls = [0] * len(model.decoder.blocks)
    handles = []
    for i, block in enumerate(model.decoder.blocks):
        def hook(_module, _inputs, _output, i=i):
            calls[i] += 1
        handles.append(block.cross_attn.kv_proj.register_forward_hook(hook))
    try:
        steps = 7
        out = greedy_encoder_decoder(model, src, bos_id=1, max_new_tokens=steps)
        assert out.tokens.shape[1] == steps
        assert calls == [1] * len(model.decoder.blocks)
        # The hook does count: without the cache every step projects the memory again.
        calls[:] = [0] * len(calls)
        greedy_encoder_decoder(model, src, bos_id=1, max_new_tokens=steps, use_cache=False)
        assert calls == [steps] * len(model.decoder.blocks)
    finally:
        for h in handles:
            h.remove()


# ---- the cache itself -------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads", KV_HEADS)
def test_cache_is_preallocated_and_holds_only_kv_heads(n_kv_heads: int, device: torch.device) -> None:
    model = decoder_only("rope", n_kv_heads, device=device)
    config = model.config
    b, max_len = 2, 16
    cache = model.new_cache(b, max_len)
    assert isinstance(cache, KVCache)
    assert len(cache.layers) == config.n_layers
    expected_shape = (b, n_kv_heads, max_len, config.head_dim)
    ptrs = [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers]
    for layer in cache.layers:
        assert tuple(layer.k.shape) == expected_shape
        assert tuple(layer.v.shape) == expected_shape
    seq = random_tokens(b, 12, seed=70, device=device)
    with torch.no_grad():
        model(seq[:, :4], cache=cache)
        assert [(la.k.data_ptr(), la.v.data_ptr()) for la in cache.layers] == ptrs
        for i in range(4, 12, 2):
            model(seq[:, i : i + 2], cache=cache)
            assert [(la.k.data_ptr(), la.v.data_ptr()) for la in cache.layers] == ptrs
            assert all(tuple(la.k.shape) == expected_shape for la in cache.layers)
    assert cache.length == 12
    # Slots past the filled length were never written.
    for layer in cache.layers:
        assert bool((layer.k[:, :, 12:] == 0).all()) and bool((layer.v[:, :, 12:] == 0).all())
        assert bool((layer.k[:, :, :12] != 0).any())


def test_encoder_decoder_cache_preallocated_through_greedy(device: torch.device) -> None:
    model = encoder_decoder(n_kv_heads=2, device=device)
    src = padded_sources(device=device)
    encoded = model.encode(src)
    cache = model.new_cache(3, 9)
    ptrs = [(la.k.data_ptr(), la.v.data_ptr()) for la in cache.layers]
    shape = (3, 2, 9, model.config.head_dim)
    step = torch.ones(3, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        for _ in range(9):
            logits = model.decode(step, encoded, cache=cache).logits[:, -1]
            step = logits.argmax(-1, keepdim=True)
            assert [(la.k.data_ptr(), la.v.data_ptr()) for la in cache.layers] == ptrs
            assert all(tuple(la.k.shape) == shape for la in cache.layers)
    # Cross-attention keeps one (b, h_kv, s, d_h) pair per layer, computed from the source.
    assert len(cache.cross) == len(cache.layers)
    for k, v in cache.cross:
        assert tuple(k.shape) == tuple(v.shape) == (3, 2, src.shape[1], model.config.head_dim)


def test_cache_overflow_raises(device: torch.device) -> None:
    model = decoder_only("learned", 2, device=device)
    cache = model.new_cache(1, 4)
    seq = random_tokens(1, 6, seed=80, device=device)
    with torch.no_grad():
        model(seq[:, :3], cache=cache)
        with pytest.raises(ValueError, match="full") as excinfo:
            model(seq[:, 3:5], cache=cache)  # 3 + 2 > 4
        assert "4" in str(excinfo.value)
        assert cache.length == 3  # the failed call recorded nothing
        model(seq[:, 3:4], cache=cache)  # exactly full is fine
        with pytest.raises(ValueError, match=r"full.*max_len=4"):
            model(seq[:, 4:5], cache=cache)


def test_encoder_decoder_cache_overflow_raises(device: torch.device) -> None:
    model = encoder_decoder(device=device)
    cache = model.new_cache(1, 2)
    encoded = model.encode(padded_sources((3,), device=device))
    with torch.no_grad():
        model.decode(torch.ones(1, 2, dtype=torch.long, device=device), encoded, cache=cache)
        with pytest.raises(ValueError, match="full") as excinfo:
            model.decode(torch.ones(1, 1, dtype=torch.long, device=device), encoded, cache=cache)
    assert "max_len=2" in str(excinfo.value)


# ---- KV memory --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("arch", "overrides", "batch_size", "max_len"),
    [
        ("gpt-tiny", {}, 2, 16),
        ("llama-tiny", {}, 3, 40),  # GQA: 2 kv heads
        ("gpt-tiny", {"n_kv_heads": 1, "n_layers": 3}, 1, 64),  # MQA
        ("gpt-tiny", {"head_dim": 10}, 4, 7),
        ("tiny", {"n_kv_heads": 3, "n_decoder_layers": 3}, 2, 11),  # encoder-decoder
    ],
)
def test_kv_cache_bytes_matches_real_cache(arch: str, overrides: dict, batch_size: int,
                                           max_len: int, dtype: torch.dtype, device: torch.device) -> None:
    config = get_preset(arch, **overrides)
    model = (DecoderOnly(config) if config.arch == "decoder-only" else EncoderDecoder(config)).to(device)
    cache = model.new_cache(batch_size, max_len, dtype=dtype)
    assert all(la.k.dtype == dtype for la in cache.layers)
    n_layers = config.n_decoder_layers if config.arch == "encoder-decoder" else config.n_layers
    estimate = kv_cache_bytes(n_layers=n_layers, n_kv_heads=config.n_kv_heads,
                              head_dim=config.head_dim, seq_len=max_len,
                              batch_size=batch_size, dtype=dtype)
    assert estimate == cache.nbytes
    actual = sum(t.numel() * t.element_size() for la in cache.layers for t in (la.k, la.v))
    assert estimate == actual
    name = "float32" if dtype == torch.float32 else "bf16"
    assert kv_cache_bytes(n_layers=n_layers, n_kv_heads=config.n_kv_heads,
                          head_dim=config.head_dim, seq_len=max_len, batch_size=batch_size,
                          dtype=name) == cache.nbytes


@pytest.mark.cpu_only  # arithmetic on sizes: no tensor
def test_kv_cache_bytes_documented_example() -> None:
    assert kv_cache_bytes(n_layers=32, n_kv_heads=32, head_dim=128, seq_len=2048,
                          batch_size=32, dtype=torch.float32) == 64 * 2**30


@pytest.mark.parametrize(("model_dtype", "quantize"), [(torch.float32, None), (torch.bfloat16, None),
                                                       (torch.float32, "int8"), (torch.float32, "int4")])
def test_encoder_decoder_estimate_counts_the_cross_attention_keys_and_values(model_dtype, quantize, device: torch.device):
    """After the first decode step every decoder layer holds the source's cross-attention keys and
    values too: the estimate with src_len equals the cache's real bytes then."""
    model = encoder_decoder(n_kv_heads=3, device=device).to(model_dtype)
    config, batch, src_len, max_len = model.config, 2, 9, 11
    src = torch.randint(3, VOCAB, (batch, src_len), device=device)
    cache = model.new_cache(batch, max_len, quantize=quantize)
    sizes = dict(n_layers=config.n_decoder_layers, n_kv_heads=3, head_dim=config.head_dim, seq_len=max_len,
                 batch_size=batch, dtype=quantize or model_dtype)
    assert cache.nbytes == cache.self_nbytes == kv_cache_bytes(**sizes)  # nothing computed yet
    with torch.no_grad():
        model.decode(torch.ones(batch, 1, dtype=torch.long, device=device), model.encode(src), cache=cache)
    cross = sum(t.numel() * t.element_size() for kv in cache.cross for t in kv)
    assert cross == cache.cross_nbytes > 0
    assert cache.nbytes == kv_cache_bytes(**sizes, src_len=src_len) == cache.self_nbytes + cross
    if quantize:  # the cross-attention keys/values stay in the model's float dtype
        assert all(k.dtype == v.dtype == model_dtype for k, v in cache.cross)
    assert kv_cache_bytes(**sizes, src_len=src_len) - kv_cache_bytes(**sizes) == (
        2 * config.n_decoder_layers * 3 * config.head_dim * src_len * batch * (2 if model_dtype == torch.bfloat16 else 4))
