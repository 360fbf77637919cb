"""Invariances every model of the family must hold: causality, padding and batch invariance,
finite outputs and gradients with fully padded rows, and well-formed attention weights.

Small float32 models in eval mode (train mode with dropout 0 for backward passes), weights
re-initialised from a seeded generator at a scale where attention is far from uniform; all
comparisons use ``torch.testing.assert_close`` at its default tolerances.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from random_weights import randomize_, right_pad
from torch import nn
from torch.testing import assert_close

from aiayn.models import DecoderOnly, EncoderDecoder, EncoderOnly, get_preset

SCHEMES = ["sinusoidal", "learned", "rope", "alibi", "t5", "none"]
IMPLS = ["fused", "reference"]
VOCAB = 99
PAD = 0


# ---- helpers ----------------------------------------------------------------------------------
# Models are built and seeded on the CPU (the same weights on every device), then moved to the test's
# device; token ids are drawn on the CPU and moved likewise.
def decoder_only(positional: str = "learned", n_kv_heads: int | None = 2, *, seed: int = 0,
                 device: torch.device, **overrides) -> DecoderOnly:
    torch.manual_seed(seed)
    config = get_preset("gpt-tiny", positional=positional, n_kv_heads=n_kv_heads, **overrides)
    return randomize_(DecoderOnly(config), seed).eval().to(device)


def encoder_decoder(positional: str = "sinusoidal", n_kv_heads: int | None = 2, *, seed: int = 0,
                    device: torch.device, **overrides) -> EncoderDecoder:
    torch.manual_seed(seed)
    config = get_preset("tiny", positional=positional, n_kv_heads=n_kv_heads, **overrides)
    return randomize_(EncoderDecoder(config), seed).eval().to(device)


def encoder_only(positional: str = "learned", *, seed: int = 0, device: torch.device,
                 **overrides) -> EncoderOnly:
    torch.manual_seed(seed)
    config = get_preset("bert-tiny", positional=positional, **overrides)
    return randomize_(EncoderOnly(config), seed).eval().to(device)


def random_tokens(b: int, t: int, seed: int = 1, *, device: torch.device) -> torch.Tensor:
    """Ids in [1, VOCAB): never the pad id."""
    return torch.randint(1, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed)).to(device)


def no_tokens(device: torch.device) -> torch.Tensor:
    """An empty row: a sequence with no real token at all."""
    return torch.tensor([], dtype=torch.long, device=device)


def changed(tokens: torch.Tensor, start: int, seed: int = 99) -> torch.Tensor:
    """A copy with every token at positions >= start replaced by a different non-pad id."""
    out = tokens.clone()
    shift = random_tokens(*tokens[:, start:].shape, seed=seed, device=tokens.device)
    shift = shift % (VOCAB - 2) + 1  # in [1, VOCAB-2]
    out[:, start:] = (tokens[:, start:] - 1 + shift) % (VOCAB - 1) + 1
    assert bool((out[:, start:] != tokens[:, start:]).all()) and bool((out > 0).all())
    return out


def left_pad(rows: list[torch.Tensor], t: int | None = None,
             seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad with random junk ids (the valid mask, not the id, must hide them); on the rows' device."""
    t = max(len(r) for r in rows) if t is None else t
    device = rows[0].device
    tokens = random_tokens(len(rows), t, seed=seed, device=device)
    valid = torch.zeros(len(rows), t, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        if len(r):
            tokens[i, t - len(r):] = r
            valid[i, t - len(r):] = True
    return tokens, valid


def rows_of(lengths: tuple[int, ...], seed: int, *, device: torch.device) -> list[torch.Tensor]:
    return [random_tokens(1, n, seed=seed + 13 * i, device=device)[0] for i, n in enumerate(lengths)]


def assert_differs(a: torch.Tensor, b: torch.Tensor) -> None:
    assert not torch.allclose(a, b), "expected the outputs to change"


def assert_finite(name: str, t: torch.Tensor) -> None:
    assert bool(torch.isfinite(t).all()), f"{name} has NaN/inf"


# ---- causality --------------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads", [6, 1])
@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_causality(positional: str, n_kv_heads: int, device: torch.device) -> None:
    model = decoder_only(positional, n_kv_heads, device=device)
    seq = random_tokens(2, 12, device=device)
    with torch.no_grad():
        base = model(seq).logits
        for k in (1, 4, 11):
            out = model(changed(seq, k)).logits
            assert_close(out[:, :k], base[:, :k])
            assert_differs(out[:, k:], base[:, k:])


@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_causality_left_padded(positional: str, device: torch.device) -> None:
    model = decoder_only(positional, device=device)
    tokens, valid = left_pad(rows_of((9, 5), seed=3, device=device))
    with torch.no_grad():
        base = model(tokens, valid=valid).logits
        for k in (5, 8):
            out = model(changed(tokens, k), valid=valid).logits
            assert_close(out[:, :k], base[:, :k])


@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_decoder_decoder_causality(positional: str, device: torch.device) -> None:
    model = encoder_decoder(positional, device=device)
    src = right_pad(rows_of((8, 4), seed=5, device=device))
    tgt = random_tokens(2, 10, seed=6, device=device)
    with torch.no_grad():
        base = model(src, tgt).logits
        for k in (1, 6, 9):
            out = model(src, changed(tgt, k)).logits
            assert_close(out[:, :k], base[:, :k])
            assert_differs(out[:, k:], base[:, k:])


# ---- padding invariance -----------------------------------------------------------------------
@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_left_padding_invariance(positional: str, device: torch.device) -> None:
    model = decoder_only(positional, device=device)
    seq = random_tokens(2, 7, seed=8, device=device)
    with torch.no_grad():
        base = model(seq).logits
        for n_pad in (1, 5):
            padded, valid = left_pad([seq[0], seq[1]], t=7 + n_pad, seed=9 + n_pad)
            out = model(padded, valid=valid).logits
            assert_close(out[:, n_pad:], base)


@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_left_padding_from_pad_id(positional: str, device: torch.device) -> None:
    """With config.pad_id set and no valid=, pad ids are recognised as padding."""
    model = decoder_only(positional, pad_id=PAD, device=device)
    seq = random_tokens(2, 6, seed=10, device=device)
    padded = torch.cat([torch.full((2, 3), PAD, device=device), seq], dim=1)
    with torch.no_grad():
        assert_close(model(padded).logits[:, 3:], model(seq).logits)


@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_decoder_right_padding_invariance(positional: str, device: torch.device) -> None:
    model = encoder_decoder(positional, device=device)
    src, tgt = random_tokens(2, 7, seed=11, device=device), random_tokens(2, 5, seed=12, device=device)
    with torch.no_grad():
        base = model(src, tgt).logits
        for src_pads, tgt_pads in ((3, 0), (0, 4), (2, 2)):
            src_p = F.pad(src, (0, src_pads), value=PAD)
            tgt_p = F.pad(tgt, (0, tgt_pads), value=PAD)
            out = model(src_p, tgt_p).logits
            assert_close(out[:, :5], base)
            # Explicit validity instead of pad ids gives the same.
            out_v = model(src_p, tgt_p, src_valid=src_p != PAD, tgt_valid=tgt_p != PAD).logits
            assert_close(out_v[:, :5], base)


@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_only_right_padding_invariance(positional: str, device: torch.device) -> None:
    model = encoder_only(positional, device=device)
    seq = random_tokens(2, 8, seed=13, device=device)
    segments = torch.tensor([[0] * 4 + [1] * 4, [0] * 6 + [1] * 2], device=device)
    with torch.no_grad():
        base = model(seq, segments=segments)
        for n_pad in (1, 6):
            out = model(F.pad(seq, (0, n_pad), value=PAD), segments=F.pad(segments, (0, n_pad)))
            assert_close(out.hidden[:, :8], base.hidden)
            assert_close(out.logits[:, :8], base.logits)
            assert_close(out.pooled, base.pooled)


@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_position_shift(positional: str, device: torch.device) -> None:
    """Explicit positions equal to the default ones change nothing; shifting every position by a
    constant changes nothing for relative schemes (RoPE, ALiBi, T5, none) and does change the
    output for absolute ones (sinusoidal, learned)."""
    model = decoder_only(positional, device=device)
    seq = random_tokens(2, 9, seed=29, device=device)
    positions = torch.arange(9, device=device).expand(2, 9)
    with torch.no_grad():
        base = model(seq).logits
        assert_close(model(seq, positions=positions).logits, base)
        shifted = model(seq, positions=positions + 17).logits
    if positional in ("sinusoidal", "learned"):
        assert_differs(shifted, base)
    else:
        assert_close(shifted, base)


# ---- batch invariance -------------------------------------------------------------------------
@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_batch_invariance(positional: str, device: torch.device) -> None:
    model = decoder_only(positional, device=device)
    rows = rows_of((5, 9, 2, 7), seed=14, device=device)
    tokens, valid = left_pad(rows)
    t = tokens.shape[1]
    with torch.no_grad():
        batch = model(tokens, valid=valid).logits
        for i, row in enumerate(rows):
            alone = model(row[None]).logits
            assert_close(batch[i : i + 1, t - len(row):], alone)


@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_decoder_batch_invariance(positional: str, device: torch.device) -> None:
    model = encoder_decoder(positional, device=device)
    srcs, tgts = rows_of((6, 9, 3), seed=15, device=device), rows_of((4, 2, 7), seed=16, device=device)
    src, tgt = right_pad(srcs), right_pad(tgts)
    with torch.no_grad():
        batch = model(src, tgt).logits
        for i, (s, t) in enumerate(zip(srcs, tgts, strict=True)):
            alone = model(s[None], t[None]).logits
            assert_close(batch[i : i + 1, : len(t)], alone)


@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_only_batch_invariance(positional: str, device: torch.device) -> None:
    model = encoder_only(positional, device=device)
    rows = rows_of((6, 10, 3), seed=17, device=device)
    tokens = right_pad(rows)
    with torch.no_grad():
        batch = model(tokens)
        for i, row in enumerate(rows):
            alone = model(row[None])
            assert_close(batch.hidden[i : i + 1, : len(row)], alone.hidden)
            assert_close(batch.logits[i : i + 1, : len(row)], alone.logits)
            assert_close(batch.pooled[i : i + 1], alone.pooled)


# ---- no NaN with fully padded rows, forward and backward --------------------------------------
def backward_and_check(model: nn.Module, outputs: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
    for name, t in outputs.items():
        assert_finite(name, t)
    assert_finite("loss", loss)
    loss.backward()
    n_grads = 0
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_finite(f"grad of {name}", p.grad)
            n_grads += 1
    assert n_grads > 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_no_nan_encoder_decoder_fully_padded_source(positional: str, impl: str, device: torch.device) -> None:
    model = encoder_decoder(positional, attn_impl=impl, dropout=0.0, device=device).train()
    src = right_pad([*rows_of((6, 3), seed=18, device=device), no_tokens(device)], t=6)
    assert bool((src[2] == PAD).all())
    tgt = right_pad(rows_of((5, 2, 4), seed=19, device=device))
    out = model(src, tgt)
    targets = torch.roll(tgt, -1, dims=1)
    # Cross-entropy on real target positions, plus a term that reaches every padded position.
    loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=PAD)
    loss = loss + out.logits.square().mean() + out.hidden.square().mean()
    backward_and_check(model, {"logits": out.logits, "hidden": out.hidden}, loss)
    with torch.no_grad():
        model.eval()
        encoded = model.encode(src)
        assert_finite("memory", encoded.memory)
        assert_finite("eval logits", model.decode(tgt, encoded).logits)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_no_nan_encoder_only_fully_padded_row(positional: str, impl: str, device: torch.device) -> None:
    model = encoder_only(positional, attn_impl=impl, dropout=0.0, device=device).train()
    tokens = right_pad([*rows_of((7, 2), seed=20, device=device), no_tokens(device)], t=7)
    out = model(tokens)
    loss = out.logits.square().mean() + out.pooled.sum() + out.hidden.square().mean()
    backward_and_check(model, {"hidden": out.hidden, "pooled": out.pooled,
                               "mlm_logits": out.logits}, loss)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_no_nan_decoder_only_left_padded(positional: str, impl: str, device: torch.device) -> None:
    model = decoder_only(positional, attn_impl=impl, dropout=0.0, device=device).train()
    # Long and short prompts plus a row with no real token at all.
    tokens, valid = left_pad([*rows_of((8, 3, 1), seed=21, device=device), no_tokens(device)])
    out = model(tokens, valid=valid)
    targets = torch.roll(tokens, -1, dims=1).masked_fill(~torch.roll(valid, -1, dims=1), -100)
    loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss = loss + out.logits.square().mean()
    backward_and_check(model, {"logits": out.logits, "hidden": out.hidden}, loss)


# ---- encoder-only is bidirectional ------------------------------------------------------------
@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_only_is_bidirectional(positional: str, device: torch.device) -> None:
    model = encoder_only(positional, device=device)
    seq = random_tokens(2, 8, seed=22, device=device)
    with torch.no_grad():
        base = model(seq)
        out = model(changed(seq, 7))
        assert_differs(out.hidden[:, 0], base.hidden[:, 0])
        assert_differs(out.pooled, base.pooled)


# ---- attention weights ------------------------------------------------------------------------
def check_weights(weights: list[torch.Tensor], *, n_layers: int, shape: tuple[int, ...],
                  query_valid: torch.Tensor, key_valid: torch.Tensor, causal: bool) -> None:
    """Per layer (b, h, t, t_k); rows of real queries sum to 1; zero on padded/future keys."""
    assert len(weights) == n_layers
    _b, _, t, t_k = shape
    for w in weights:
        assert tuple(w.shape) == shape
        assert_finite("attention weights", w)
        assert bool((w >= 0).all())
        sums = w.sum(dim=-1)  # (b, h, t)
        real = query_valid[:, None, :].expand_as(sums)
        assert_close(sums[real], torch.ones_like(sums[real]))
        pad_keys = ~key_valid[:, None, None, :].expand_as(w)
        assert bool((w[pad_keys] == 0).all()), "weight on a padded key"
        if causal:
            q_pos = torch.arange(t_k - t, t_k, device=w.device)[:, None]
            future = (torch.arange(t_k, device=w.device)[None, :] > q_pos).expand_as(w)
            assert bool((w[future] == 0).all()), "weight on a future key"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_attention_weights(positional: str, impl: str, device: torch.device) -> None:
    model = decoder_only(positional, attn_impl=impl, device=device)
    tokens, valid = left_pad(rows_of((9, 4, 6), seed=23, device=device))
    with torch.no_grad():
        plain = model(tokens, valid=valid)
        out = model(tokens, valid=valid, need_weights=True)
    assert plain.attentions == []
    assert_close(out.logits, plain.logits)
    b, t = tokens.shape
    check_weights(out.attentions, n_layers=model.config.n_layers,
                  shape=(b, model.config.n_heads, t, t), query_valid=valid, key_valid=valid,
                  causal=True)
    for w in out.attentions:  # a left pad sees only pads: its row is all zero, not NaN
        assert bool((w.sum(-1)[~valid[:, None, :].expand(b, w.shape[1], t)] == 0).all())


@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_attention_weights_with_cache(positional: str, device: torch.device) -> None:
    """A cached step's weights cover the cached keys too: (b, h, t_new, cache.length)."""
    model = decoder_only(positional, device=device)
    tokens, valid = left_pad(rows_of((6, 2), seed=24, device=device))
    step = random_tokens(2, 2, seed=25, device=device)
    step_valid = torch.ones_like(step, dtype=torch.bool)
    with torch.no_grad():
        cache = model.new_cache(2, 10)
        model(tokens, valid=valid, cache=cache)
        out = model(step, valid=step_valid, cache=cache, need_weights=True)
        cache2 = model.new_cache(2, 10)
        model(tokens, valid=valid, cache=cache2)
        plain = model(step, valid=step_valid, cache=cache2)
    assert_close(out.logits, plain.logits)
    t_k = tokens.shape[1] + 2
    check_weights(out.attentions, n_layers=model.config.n_layers,
                  shape=(2, model.config.n_heads, 2, t_k), query_valid=step_valid,
                  key_valid=torch.cat([valid, step_valid], dim=1), causal=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_decoder_attention_weights(positional: str, impl: str, device: torch.device) -> None:
    model = encoder_decoder(positional, attn_impl=impl, n_decoder_layers=3, device=device)
    src = right_pad(rows_of((7, 3, 5), seed=26, device=device))
    tgt = right_pad(rows_of((4, 6, 2), seed=27, device=device))
    src_valid, tgt_valid = src != PAD, tgt != PAD
    with torch.no_grad():
        plain = model(src, tgt)
        out = model(src, tgt, need_weights=True)
    assert_close(out.logits, plain.logits)
    c = model.config
    (b, s), t = src.shape, tgt.shape[1]
    check_weights(out.encoder_attentions, n_layers=c.n_layers, shape=(b, c.n_heads, s, s),
                  query_valid=src_valid, key_valid=src_valid, causal=False)
    check_weights(out.attentions, n_layers=c.n_decoder_layers, shape=(b, c.n_heads, t, t),
                  query_valid=tgt_valid, key_valid=tgt_valid, causal=True)
    check_weights(out.cross_attentions, n_layers=c.n_decoder_layers, shape=(b, c.n_heads, t, s),
                  query_valid=tgt_valid, key_valid=src_valid, causal=False)
    # The encoder really is bidirectional: real queries put weight on later real keys.
    upper = torch.ones(7, 7, dtype=torch.bool, device=device).triu(1)  # row 0 has 7 real source tokens
    for w in out.encoder_attentions:
        assert float(w[0, :, :7, :7][:, upper].sum()) > 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_only_attention_weights(positional: str, impl: str, device: torch.device) -> None:
    model = encoder_only(positional, attn_impl=impl, device=device)
    tokens = right_pad(rows_of((8, 3, 5), seed=28, device=device))
    valid = tokens != PAD
    with torch.no_grad():
        plain = model(tokens)
        out = model(tokens, need_weights=True)
    assert_close(out.hidden, plain.hidden)
    assert_close(out.logits, plain.logits)
    b, t = tokens.shape
    check_weights(out.attentions, n_layers=model.config.n_layers,
                  shape=(b, model.config.n_heads, t, t), query_valid=valid, key_valid=valid,
                  causal=False)
