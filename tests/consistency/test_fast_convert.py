"""``aiayn.fast.optimize``, the converter: a converted model computes what the plain one does.

A converted copy of a model (encoder-decoder, decoder-only with GQA and RoPE or ALiBi, encoder-only,
and models large enough that the oneDNN products and the block-causal attention really run)
computes what the plain model does: eval logits, a training step's loss and every parameter
gradient (dropout 0), cached greedy decoding (the same tokens, close logits), at
``assert_close``'s default float32 tolerances. The swap keeps the state dict (the very tensors),
tied weights and parameters; ``plain`` undoes it; ``optimize`` twice is idempotent; an unknown
mode is refused; a model off the CPU is left as it is. Each fast module against the plain one it
replaces: tests/consistency/test_fast_modules.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
from kernel_spies import count_calls
from random_weights import randomize_
from torch import Tensor, nn
from torch.testing import assert_close

import aiayn.fast.attention as fast_attention_module
import aiayn.fast.fused_loss as fused_loss
import aiayn.fast.linear as fast_linear
from aiayn.fast import is_optimized, onednn, optimize, plain
from aiayn.fast.attention import fast_attention
from aiayn.fast.dropout import FastDropout
from aiayn.fast.fused_loss import FusedLossLinear
from aiayn.fast.linear import FastLinear
from aiayn.fast.matvec import EAGER_TRANSPOSED_ROWS
from aiayn.generate import greedy_decoder_only, greedy_encoder_decoder
from aiayn.models import build_model, get_preset
from aiayn.nn.attention import MultiHeadAttention, attend
from aiayn.train.losses import IGNORE, sequence_loss

# aiayn.fast.optimize swaps in CPU kernels and leaves a model on another device as it is (the last
# test): once, on the CPU.
pytestmark = pytest.mark.cpu_only

# --- whole models ----------------------------------------------------------------------------------

@dataclass
class Case:
    """A model kind with its batch: ``b`` rows of ``t`` tokens, padded (some rows shorter) or not."""

    preset: str
    overrides: dict = field(default_factory=dict)
    b: int = 3
    t: int = 9
    padded: bool = True
    large: bool = False  # the oneDNN products and the block-causal attention run (checked)

    @property
    def arch(self) -> str:
        return get_preset(self.preset).arch

    def model(self) -> nn.Module:
        config = get_preset(self.preset, dropout=0.0, **self.overrides)
        return randomize_(build_model(config), seed=0)

    def batch(self, seed: int = 1) -> dict[str, Tensor]:
        """Token ids and validity (left padding for a decoder-only model, right otherwise), targets."""
        vocab = get_preset(self.preset, **self.overrides).vocab_size
        g = torch.Generator().manual_seed(seed)
        b, t = self.b, self.t
        lengths = [t] + [max(1, t - 2 - 3 * i) for i in range(b - 1)] if self.padded else [t] * b
        pos, n = torch.arange(t)[None, :], torch.tensor(lengths)[:, None]
        valid = pos >= t - n if self.arch == "decoder-only" else pos < n
        tokens = torch.randint(1, vocab, (b, t), generator=g).masked_fill(~valid, 0)
        targets = torch.randint(1, vocab, (b, t), generator=g).masked_fill(~valid, IGNORE)
        src_valid = torch.arange(t + 2)[None, :] < torch.tensor(lengths)[:, None] + 2
        src = torch.randint(1, vocab, (b, t + 2), generator=g).masked_fill(~src_valid, 0)
        return dict(tokens=tokens, valid=valid, targets=targets, src=src, src_valid=src_valid)

    def forward(self, model: nn.Module, batch: dict[str, Tensor]):
        if self.arch == "encoder-decoder":
            return model(batch["src"], batch["tokens"], src_valid=batch["src_valid"], tgt_valid=batch["valid"])
        return model(batch["tokens"], valid=batch["valid"])

    def causal_layers(self, model: nn.Module) -> int:
        """Self-attention layers that run square causal attention (the block-causal kernel's)."""
        c = model.config
        return c.n_layers if self.arch == "decoder-only" else c.n_decoder_layers or c.n_layers


# A smooth activation at this size: a ReLU input within float32 rounding of 0 flips its gradient
# mask between two summation orders, a jump rather than a rounding error (measured: the tiny
# encoder-decoder's ReLU at this size had one input at 2.9e-8 change sign between the plain
# model and float64, which moved the plain model's gradients by 9e-5 while the converted one's
# stayed within 1e-7 of float64).
LARGE = dict(vocab_size=251, d_model=128, n_heads=2, n_layers=2, d_ff=259, max_seq_len=160, activation="gelu")
CASES = {
    "encoder-decoder": Case("tiny"),
    "encoder-decoder-gqa-t5": Case("tiny", dict(n_kv_heads=2, positional="t5", d_model=32, n_heads=4)),
    "decoder-only-gqa-rope": Case("llama-tiny"),
    "decoder-only-alibi-tied": Case("gpt-tiny", dict(positional="alibi", d_model=32, n_heads=4)),
    "encoder-only": Case("bert-tiny"),
    # 8 x 128 rows of width 128: oneDNN products (>= 64 rows, >= 16.8M multiply-adds) and
    # block-causal attention (8 x 2 heads x 128^2 x 64 >= 4.2M multiply-adds, no padding mask)
    "decoder-only-large": Case("gpt-tiny", LARGE, b=8, t=128, padded=False, large=True),
    "encoder-decoder-large": Case("tiny", LARGE, b=8, t=128, padded=False, large=True),
}
GENERATIVE = [name for name, case in CASES.items() if case.arch != "encoder-only"]


def twins(case: Case, mode: str) -> tuple[nn.Module, nn.Module]:
    """(plain model, optimized deep copy)."""
    model = case.model()
    fast = optimize(copy.deepcopy(model), mode=mode)
    assert is_optimized(fast) and not is_optimized(model)
    return model, fast


@pytest.mark.parametrize("name", CASES)
def test_eval_forward_equals_plain(name, monkeypatch):
    case = CASES[name]
    model, fast = twins(case, "inference")
    model.eval(), fast.eval()
    batch = case.batch()
    products = count_calls(monkeypatch, onednn, "linear_product")
    with torch.no_grad():
        want = case.forward(model, batch)
        assert not products
        got = case.forward(fast, batch)
    assert bool(products) == case.large
    assert_close(got.logits, want.logits)
    assert_close(got.hidden, want.hidden)
    if case.arch == "encoder-only":
        assert_close(got.pooled, want.pooled)


@pytest.mark.parametrize("name", CASES)
def test_training_step_equals_plain(name, monkeypatch):
    """Dropout 0, train mode: the loss (fused with the output layer where there is an ``lm_head``)
    and every parameter's gradient."""
    case = CASES[name]
    model, fast = twins(case, "train")
    batch = case.batch()
    products = count_calls(monkeypatch, onednn, "linear_product")
    blocks = count_calls(monkeypatch, fast_attention_module, "block_causal_attention")
    fused = count_calls(monkeypatch, fused_loss, "linear_cross_entropy")
    results = []
    for m in (model, fast):
        m.train()
        out = case.forward(m, batch)
        loss = sequence_loss(out, batch["targets"], label_smoothing=0.1).loss
        if out.pooled is not None:
            loss = loss + out.pooled.square().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
        if m is model:
            assert not products and not blocks and not fused
    (want, want_grads), (got, got_grads) = results
    assert len(fused) == (case.arch != "encoder-only")
    if case.large:
        assert products and len(blocks) == case.causal_layers(fast)
    assert_close(got, want)
    assert got_grads.keys() == want_grads.keys()
    for n, grad in got_grads.items():
        assert (grad is None) == (want_grads[n] is None), n
        if grad is not None:
            assert_close(grad, want_grads[n], msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("name", GENERATIVE)
def test_cached_greedy_decoding_equals_plain(name, b, monkeypatch):
    """The decode steps: a single query per row (GQA folded into the key/value heads), (W x^T)^T
    for 2-64 rows, over a key mask from the padding."""
    case = CASES[name]
    model, fast = twins(case, "inference")
    model.eval(), fast.eval()
    batch = Case(case.preset, case.overrides, b=b, t=6).batch(seed=2)
    attention = count_calls(monkeypatch, fast_attention_module, "attend")
    transposed = count_calls(monkeypatch, fast_linear, "transposed_linear")

    def decode(m: nn.Module):
        if case.arch == "encoder-decoder":
            return greedy_encoder_decoder(m, batch["src"], bos_id=1, max_new_tokens=7, src_valid=batch["src_valid"])
        return greedy_decoder_only(m, batch["tokens"], max_new_tokens=7, prompt_valid=batch["valid"])

    want = decode(model)
    assert not attention and not transposed
    got = decode(fast)
    assert torch.equal(got.tokens, want.tokens)
    assert_close(got.logits, want.logits)
    if got.lengths is not None:
        assert torch.equal(got.lengths, want.lengths)
    # the single-query paths ran (they write the equation out: need_weights=True), except where
    # every attention layer adds a positional bias (a decoder-only ALiBi model): that passes through
    single = [args[0].shape for args, kwargs in attention if kwargs.get("need_weights")]
    c = model.config
    assert bool(single) == (case.arch == "encoder-decoder" or c.positional not in ("alibi", "t5"))
    if c.n_kv_heads != c.n_heads and single:
        assert (b, c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim) in single
    low, high = EAGER_TRANSPOSED_ROWS[torch.float32]
    assert bool(transposed) == (low <= b <= high)


# --- what the swap keeps ---------------------------------------------------------------------------

SMALL = ["encoder-decoder", "decoder-only-gqa-rope", "decoder-only-alibi-tied", "encoder-only"]


def kinds(model: nn.Module) -> dict[str, object]:
    """Each module's class, and each attention layer's kernel."""
    found: dict[str, object] = {name: type(m) for name, m in model.named_modules()}
    found.update({f"{name}.kernel": m.kernel for name, m in model.named_modules()
                  if isinstance(m, MultiHeadAttention)})
    return found


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("name", SMALL)
def test_plain_model_is_plain_and_optimize_swaps_every_module(name, mode):
    model = CASES[name].model()
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    drops = {n for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    attentions = {n for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    assert linears and drops and attentions
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is nn.Linear for n in linears)
    assert all(type(modules[n]) is nn.Dropout for n in drops)
    assert all(modules[n].kernel is attend for n in attentions)
    assert optimize(model, mode=mode) is model  # in place
    head = "lm_head" if mode == "train" and hasattr(model, "lm_head") else None
    for n in linears:
        assert type(modules[n]) is (FusedLossLinear if n == head else FastLinear), n
    assert all(type(modules[n]) is FastDropout for n in drops)
    assert all(modules[n].kernel is fast_attention for n in attentions)
    assert dict(model.named_modules()) == modules  # the same module objects, no new ones


@pytest.mark.parametrize("name", SMALL)
def test_swap_keeps_state_dict_parameters_and_ties(name):
    model = CASES[name].model()
    before, params = model.state_dict(), list(model.named_parameters())
    optimize(model, mode="train")
    after = model.state_dict()
    assert list(after) == list(before)
    for key, tensor in after.items():
        assert tensor.data_ptr() == before[key].data_ptr(), key  # the very storage
        assert (tensor.shape, tensor.stride(), tensor.dtype) == (before[key].shape, before[key].stride(),
                                                                  before[key].dtype), key
    assert all(p is q and n == m for (n, p), (m, q) in zip(model.named_parameters(), params, strict=True))
    c = model.config
    embedding = model.embedding if hasattr(model, "embedding") else model.decoder.embedding
    output = model.mlm_head if c.arch == "encoder-only" else model.lm_head
    assert (output.weight is embedding.weight) == c.tie_output
    if c.arch == "encoder-decoder" and c.share_embeddings:
        assert model.encoder.embedding.weight is model.decoder.embedding.weight
    # a checkpoint of either loads into the other (strict)
    twin = CASES[name].model()
    twin.load_state_dict(model.state_dict())
    model.load_state_dict(twin.state_dict())


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("name", SMALL)
def test_plain_undoes_optimize(name, mode):
    model = CASES[name].model()
    original = kinds(model)
    optimize(model, mode=mode)
    assert kinds(model) != original
    assert plain(model) is model
    assert kinds(model) == original and not is_optimized(model)


@pytest.mark.parametrize("name", SMALL)
def test_optimize_twice_is_idempotent(name):
    model = optimize(CASES[name].model(), mode="train")
    once, params = kinds(model), list(model.parameters())
    optimize(model, mode="train")
    assert kinds(model) == once
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    if hasattr(model, "lm_head"):  # another mode: the output layer follows it
        assert type(optimize(model, mode="inference").lm_head) is FastLinear
        assert type(optimize(model, mode="train").lm_head) is FusedLossLinear
        assert kinds(model) == once


def test_unknown_mode_is_refused():
    model = CASES["decoder-only-gqa-rope"].model()
    with pytest.raises(ValueError, match=r"mode='eval' is not known; choose one of train, inference"):
        optimize(model, mode="eval")
    assert not is_optimized(model)


def test_model_off_the_cpu_is_returned_unchanged():
    """The meta device stands in for one without these kernels (a GPU)."""
    model = CASES["decoder-only-gqa-rope"].model().to("meta")
    original = kinds(model)
    assert optimize(model, mode="train") is model
    assert kinds(model) == original and not is_optimized(model)
