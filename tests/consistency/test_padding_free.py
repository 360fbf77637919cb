"""Padding-free forward passes (``ModelConfig.padding_free``, ``aiayn.nn.packing``) compute what the
padded ones do at every real token: logits, and the gradients of a loss over real tokens, equal
(``assert_close`` at its default tolerances) for every positional scheme, both attention paths,
grouped-query attention, pre- and post-norm, right and left padding, fully padded rows.

The same seeded weights in both models; train mode with dropout 0 (the path training takes).

The spine packs only where a forward may read data back (eager on the CPU:
``aiayn.nn.data_checks.reads_data``; elsewhere packing would stall the stream once per forward).
These tests take the packed path on every test device (the fixture below allows the reads), so its
arithmetic is checked on a GPU too; ``test_packs_only_where_data_is_read`` checks the policy itself.
"""

from __future__ import annotations

import pytest
import torch
from random_weights import randomize_
from torch import nn
from torch.testing import assert_close

from aiayn.models import DecoderOnly, EncoderDecoder, build_model, get_preset
from aiayn.nn import data_checks
from aiayn.nn.attention import AttentionInputs
from aiayn.nn.packing import Packing
from aiayn.train.losses import IGNORE, sequence_loss

REAL_READS_DATA = data_checks.reads_data


@pytest.fixture(autouse=True)
def packed_path_on_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let an eager forward on any device read data, so padding-free models pack there too (the same
    answer as the real rule on the CPU)."""
    monkeypatch.setattr(data_checks, "reads_data", lambda t: not torch.compiler.is_compiling())


SCHEMES = ["sinusoidal", "learned", "rope", "alibi", "t5", "none"]
IMPLS = ["fused", "reference"]
VOCAB = 99


def twins(preset: str, *, device: torch.device, **overrides) -> tuple[nn.Module, nn.Module]:
    """(padded model, padding-free model) with the same seeded weights, train mode, no dropout;
    seeded on the CPU (the same weights on every device), then moved to ``device``."""
    config = get_preset(preset, dropout=0.0, **overrides)
    padded = randomize_(build_model(config), seed=0).train()
    free = build_model(config.replace(padding_free=True)).train()
    free.load_state_dict(padded.state_dict())
    return padded.to(device), free.to(device)


def tokens_and_valid(lengths: list[int], t: int, *, left: bool = False, seed: int = 1,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (b, t) with row i holding lengths[i] real tokens (right- or left-aligned)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (len(lengths), t), generator=g).to(device)
    pos = torch.arange(t, device=device)[None, :]
    n = torch.tensor(lengths, device=device)[:, None]
    valid = pos >= t - n if left else pos < n
    return tokens.masked_fill(~valid, 0), valid


def assert_same_at_real_tokens(padded: nn.Module, free: nn.Module, run, valid: torch.Tensor) -> None:
    """Logits at real positions and the gradients of a loss over them match; padding gives zeros."""
    out_p, out_f = run(padded), run(free)
    assert out_f.packing is not None and out_p.packing is None
    packed_logits = out_f.head(out_f.hidden_rows)
    assert packed_logits.shape == (int(valid.sum()), out_p.logits.shape[-1])
    assert_close(out_f.logits[valid], out_p.logits[valid])
    assert_close(out_f.hidden[valid], out_p.hidden[valid])
    assert torch.all(out_f.logits[~valid] == 0)
    weights = torch.randn(out_p.logits[valid].shape, generator=torch.Generator().manual_seed(5)).to(valid.device)
    (out_p.logits[valid] * weights).sum().backward()
    (packed_logits * weights).sum().backward()
    grads_p = dict(padded.named_parameters())
    for name, p in free.named_parameters():
        q = grads_p[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_decoder(positional: str, impl: str, device: torch.device) -> None:
    padded, free = twins("tiny", positional=positional, n_kv_heads=2, attn_impl=impl, device=device)
    src, src_valid = tokens_and_valid([9, 4, 7, 1], 9, seed=1, device=device)
    tgt, tgt_valid = tokens_and_valid([3, 8, 8, 5], 8, seed=2, device=device)
    assert_same_at_real_tokens(padded, free, lambda m: m(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid),
                               tgt_valid)


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("positional", SCHEMES)
def test_decoder_only_left_padded(preset: str, positional: str, device: torch.device) -> None:
    padded, free = twins(preset, positional=positional, device=device)
    tokens, valid = tokens_and_valid([10, 3, 7], 10, left=True, device=device)
    assert_same_at_real_tokens(padded, free, lambda m: m(tokens, valid=valid), valid)


@pytest.mark.parametrize("positional", SCHEMES)
def test_encoder_only(positional: str, device: torch.device) -> None:
    """BERT-style: hidden, pooled and MLM logits at real tokens (float32), and their gradients
    (float64: the loss adds the pooled vector, whose gradient every weight sums over all positions,
    packed or padded, in orders a GPU makes differ by more than float32's rounding of the result;
    float64 shows both sides compute the same sum)."""
    padded, free = twins("bert-tiny", positional=positional, device=device)
    tokens, valid = tokens_and_valid([8, 5, 1], 8, seed=16, device=device)
    out_p, out_f = padded(tokens, valid=valid), free(tokens, valid=valid)
    assert out_f.packing is not None
    assert_close(out_f.logits[valid], out_p.logits[valid])
    assert_close(out_f.hidden[valid], out_p.hidden[valid])
    assert_close(out_f.pooled, out_p.pooled)
    assert torch.all(out_f.logits[~valid] == 0)
    padded, free = padded.double(), free.double()
    out_p, out_f = padded(tokens, valid=valid), free(tokens, valid=valid)
    assert out_f.packing is not None and out_f.logits.dtype == out_p.logits.dtype == torch.float64
    weights = torch.randn(out_p.logits[valid].shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(5)).to(device)
    ((out_p.logits[valid] * weights).sum() + out_p.pooled.sum()).backward()
    ((out_f.logits[valid] * weights).sum() + out_f.pooled.sum()).backward()
    for (name, p), q in zip(free.named_parameters(), padded.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_encoder_decoder_fully_padded_rows(device: torch.device) -> None:
    """A source row with no real token (its target attends to nothing) and an empty target row."""
    padded, free = twins("tiny", device=device)
    src, src_valid = tokens_and_valid([6, 0, 3], 6, seed=3, device=device)
    tgt, tgt_valid = tokens_and_valid([4, 5, 0], 5, seed=4, device=device)
    assert_same_at_real_tokens(padded, free, lambda m: m(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid),
                               tgt_valid)


def test_pad_id_default_validity(device: torch.device) -> None:
    """Without valid=, pad ids mark padding (config.pad_id), packed the same way."""
    padded, free = twins("tiny", device=device)
    src, _ = tokens_and_valid([5, 2], 5, seed=6, device=device)
    tgt, tgt_valid = tokens_and_valid([2, 4], 4, seed=7, device=device)
    assert_same_at_real_tokens(padded, free, lambda m: m(src, tgt), tgt_valid)


def test_no_padding_runs_the_plain_path(device: torch.device) -> None:
    """Nothing to skip: the ordinary output, bit for bit the padded model's."""
    padded, free = twins("gpt-tiny", device=device)
    tokens = torch.randint(1, VOCAB, (2, 6), device=device)
    out_p, out_f = padded(tokens), free(tokens)
    assert out_f.packing is None
    assert torch.equal(out_p.logits, out_f.logits)


def test_cache_and_attention_weights_take_the_padded_path(device: torch.device) -> None:
    """Decoding with a cache and need_weights=True are not packed (and still work)."""
    padded, free = twins("tiny", device=device)
    padded.eval(), free.eval()
    src, src_valid = tokens_and_valid([5, 3], 5, seed=8, device=device)
    tgt, tgt_valid = tokens_and_valid([4, 2], 4, seed=9, device=device)
    out = free(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid, need_weights=True)
    assert out.packing is None and len(out.attentions) == 2
    lm_p, lm_f = twins("gpt-tiny", device=device)
    lm_p.eval(), lm_f.eval()
    tokens, valid = tokens_and_valid([6, 4], 6, left=True, device=device)
    cache_p, cache_f = lm_p.new_cache(2, 8), lm_f.new_cache(2, 8)
    assert_close(lm_f(tokens, valid=valid, cache=cache_f).logits[valid],
                 lm_p(tokens, valid=valid, cache=cache_p).logits[valid])


def test_padding_free_training_step_matches(device: torch.device) -> None:
    """One SGD step on the packed loss (only the real targets' logits) leaves the same weights.
    (SGD, not Adam: Adam's first step is lr * sign(grad), which turns float noise in gradients
    that are zero in exact arithmetic, such as the key bias's, into full-size differences.)"""
    padded, free = twins("tiny", device=device)
    src, src_valid = tokens_and_valid([7, 4, 6], 7, seed=10, device=device)
    tgt, tgt_valid = tokens_and_valid([6, 6, 2], 6, seed=11, device=device)
    targets = torch.randint(1, VOCAB, tgt.shape, device=device).masked_fill(~tgt_valid, -100)
    for model in (padded, free):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        out = model(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid)
        if out.packing is not None:
            loss = nn.functional.cross_entropy(out.head(out.hidden_rows), targets.reshape(-1)[out.packing.index])
        else:
            loss = nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
    for (name, p), q in zip(free.named_parameters(), padded.parameters(), strict=True):
        assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


def test_packing_round_trip(device: torch.device) -> None:
    valid = torch.tensor([[True, True, False], [False, True, True]], device=device)
    packing = Packing.of(valid)
    x = torch.arange(2 * 3 * 2, dtype=torch.float32, device=device).reshape(2, 3, 2).requires_grad_()
    packed = packing.pack(x)
    assert packing.n_tokens == 4 and torch.equal(packed, x.detach()[valid])
    back = packing.unpack(packed)
    assert torch.equal(back[valid], x.detach()[valid]) and torch.all(back[~valid] == 0)
    back.sum().backward()
    assert torch.equal(x.grad, valid[..., None].float().expand(2, 3, 2))


def test_packed_input_of_the_wrong_shape_is_explained(device: torch.device) -> None:
    model = EncoderDecoder(get_preset("tiny")).to(device)
    attn = model.encoder.blocks[0].self_attn
    packing = Packing.of(packing_valid(device))
    with pytest.raises(ValueError, match=r"packed x must be \(real tokens=3, d_model=48\)"):
        attn(torch.zeros(2, 2, 48, device=device), inputs=AttentionInputs(packing=packing))
    with pytest.raises(ValueError, match="does not go with a cache"):
        lm = DecoderOnly(get_preset("gpt-tiny")).to(device)
        lm.decoder(torch.ones(2, 2, dtype=torch.long, device=device), valid=packing_valid(device),
                   cache=lm.new_cache(2, 4), pack=True)


def packing_valid(device: torch.device) -> torch.Tensor:
    return torch.tensor([[True, False], [True, True]], device=device)


def test_sequence_loss_on_packed_logits(device: torch.device) -> None:
    """The trainer's loss over a padding-free output (the packed rows' logits) equals it over the
    padded logits: loss, NLL, token and sequence accuracy, gradients."""
    padded, free = twins("tiny", device=device)
    src, src_valid = tokens_and_valid([7, 4, 6], 7, seed=12, device=device)
    tgt, tgt_valid = tokens_and_valid([6, 6, 2], 6, seed=13, device=device)
    targets = torch.randint(1, VOCAB, tgt.shape, generator=torch.Generator().manual_seed(3)).to(device)
    targets = targets.masked_fill(~tgt_valid, IGNORE)
    targets[1, :3] = IGNORE  # counted positions need not be all the valid ones
    out_p = sequence_loss(padded(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid), targets,
                          label_smoothing=0.1)
    model_out_f = free(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid)
    assert model_out_f.packing is not None and model_out_f.head(model_out_f.hidden_rows).shape == (14, VOCAB)
    out_f = sequence_loss(model_out_f, targets, label_smoothing=0.1)
    assert_close(out_f.loss, out_p.loss)
    assert_close(out_f.nll_sum, out_p.nll_sum)
    assert (out_f.n_tokens, out_f.n_correct, out_f.n_seq_correct, out_f.n_seqs) == (
        out_p.n_tokens, out_p.n_correct, out_p.n_seq_correct, out_p.n_seqs)
    out_p.loss.backward()
    out_f.loss.backward()
    for (name, p), q in zip(free.named_parameters(), padded.parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_sequence_loss_rejects_targets_at_skipped_positions(device: torch.device) -> None:
    _, free = twins("tiny", device=device)
    src, src_valid = tokens_and_valid([5, 3], 5, seed=14, device=device)
    tgt, tgt_valid = tokens_and_valid([4, 2], 4, seed=15, device=device)
    out = free(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid)
    assert out.packing is not None
    targets = torch.ones_like(tgt)  # counts the padded positions of row 1 too
    with pytest.raises(ValueError, match="skipped"):
        sequence_loss(out, targets)
    with pytest.raises(ValueError, match=r"targets must have the \(batch, seq\) shape"):
        sequence_loss(out, targets[:, :3])


def test_packs_only_where_data_is_read(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy, unpatched: a padding-free model packs eager on the CPU and runs padded elsewhere
    (no host-device sync per forward), with the same logits at real tokens either way."""
    monkeypatch.setattr(data_checks, "reads_data", REAL_READS_DATA)
    padded, free = twins("gpt-tiny", device=device)
    tokens, valid = tokens_and_valid([6, 3], 6, device=device)
    out_p, out_f = padded(tokens, valid=valid), free(tokens, valid=valid)
    assert (out_f.packing is not None) == (device.type == "cpu")
    assert_close(out_f.logits[valid], out_p.logits[valid])
