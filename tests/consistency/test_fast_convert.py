"""``aiayn.fast.optimize``, the converter: each swap against the plain module it replaces.

A converted copy of a model (encoder-decoder, decoder-only with GQA and RoPE or ALiBi, encoder-only,
and models large enough that the oneDNN products and the block-causal attention really run)
computes what the plain model does: eval logits, a training step's loss and every parameter
gradient (dropout 0), cached greedy decoding (the same tokens, close logits), at
``assert_close``'s default float32 tolerances. The swap keeps the state dict (the very tensors),
tied weights and parameters; ``plain`` undoes it; ``optimize`` twice is idempotent; an unknown
mode is refused; a model off the CPU is left as it is. Then each fast module against the plain one
it replaces: ``FastLinear``, ``FusedLossLinear.cross_entropy``, ``FastDropout``, ``fast_attention``
(its attention-dropout path: tests/unit/test_dropout.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from random_weights import randomize_
from torch import Tensor, nn
from torch.testing import assert_close

import aiayn.fast.attention as fast_attention_module
import aiayn.fast.fused_loss as fused_loss
import aiayn.fast.linear as fast_linear
from aiayn.fast import block_causal, is_optimized, onednn, optimize, plain, plain_torch
from aiayn.fast.attention import fast_attention
from aiayn.fast.dropout import FastDropout
from aiayn.fast.fused_loss import FusedLossLinear
from aiayn.fast.linear import FastLinear
from aiayn.fast.matvec import EAGER_TRANSPOSED_ROWS
from aiayn.generate import greedy_decoder_only, greedy_encoder_decoder
from aiayn.models import build_model, get_preset
from aiayn.nn.attention import MultiHeadAttention, scaled_dot_product_attention
from aiayn.train.losses import IGNORE, sequence_loss

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear op")


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[tuple]:
    """Wrap ``module.name`` (looked up at call time by its callers): each call appends its
    arguments to the returned list."""
    calls: list[tuple] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


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
    attention = count_calls(monkeypatch, fast_attention_module, "scaled_dot_product_attention")
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
    assert all(modules[n].kernel is scaled_dot_product_attention for n in attentions)
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


# --- each module against the one it replaces --------------------------------------------------------

def linear_twins(i: int, o: int, bias: bool) -> tuple[nn.Linear, FastLinear]:
    torch.manual_seed(0)
    reference = nn.Linear(i, o, bias=bias)
    fast = copy.deepcopy(reference)
    fast.__class__ = FastLinear
    return reference, fast


def grads_of(layer: nn.Linear, x: Tensor, grad_out: Tensor) -> list[Tensor]:
    x = x.clone().requires_grad_()
    y = layer(x)
    params = [x, layer.weight] + ([layer.bias] if layer.bias is not None else [])
    return [y.detach(), *torch.autograd.grad(y, params, grad_out)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 40), (1, 40), (3, 5, 40)])
def test_fast_linear_on_few_rows_equals_nn_linear(shape, bias):
    """1 row, a few rows with several tokens each: nn.Linear's forward and gradients."""
    reference, fast = linear_twins(40, 24, bias)
    x = torch.randn(*shape)
    grad_out = torch.randn(*shape[:-1], 24)
    for got, want in zip(grads_of(fast, x, grad_out), grads_of(reference, x, grad_out), strict=True):
        assert_close(got, want)
    with torch.inference_mode():
        assert_close(fast(x), reference(x))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [2, 3, 17, 64])
def test_fast_linear_decode_rows_without_grad_equal_nn_linear(rows, bias, monkeypatch):
    """A decode step of 2-64 rows (b, 1, i), no autograd graph: the turned-around product."""
    reference, fast = linear_twins(40, 24, bias)
    transposed = count_calls(monkeypatch, fast_linear, "transposed_linear")
    x = torch.randn(rows, 1, 40)
    with torch.no_grad():
        got = fast(x)
    assert len(transposed) == 1
    with torch.inference_mode():
        assert_close(fast(x), reference(x))
    assert_close(got, reference(x).detach())
    assert len(transposed) == 2


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(64, 256), (2, 40, 256)])  # 64 and 80 rows x 256 x 1,024 >= MIN_WORK
def test_fast_linear_through_onednn_equals_nn_linear(shape, bias, monkeypatch):
    reference, fast = linear_twins(256, 1024, bias)
    products = count_calls(monkeypatch, onednn, "linear_product")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    grad_out = torch.randn(*shape[:-1], 1024, generator=g)
    got = grads_of(fast, x, grad_out)
    assert len(products) == 3  # forward, input gradient, weight gradient
    for a, b in zip(got, grads_of(reference, x, grad_out), strict=True):
        assert_close(a, b)
    with torch.no_grad():
        assert_close(fast(x), reference(x))
    assert len(products) == 4


def head_rows(n: int, d: int, v: int, *, bias: bool, ignore_index: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(d, v, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(v, d, generator=g) / d**0.5)
        if bias:
            layer.bias.copy_(torch.randn(v, generator=g))
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = ignore_index
    fast = copy.deepcopy(layer)
    fast.__class__ = FusedLossLinear
    return layer, fast, hidden, targets


@pytest.mark.parametrize("ignore_index", [IGNORE, -1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("size", [(37, 16, 53), pytest.param((300, 64, 1000), marks=needs_onednn)],
                         ids=["small", "onednn"])
def test_fused_loss_linear_equals_cross_entropy_of_linear(size, bias, ignore_index):
    """Values, gradients (hidden, weight, bias) and the ignored rows; the large size runs the
    three products through oneDNN."""
    n, d, v = size
    layer, fast, hidden, targets = head_rows(n, d, v, bias=bias, ignore_index=ignore_index)
    want = F.cross_entropy(layer(hidden), targets, ignore_index=ignore_index)
    params = [hidden, *layer.parameters()]
    want_grads = torch.autograd.grad(want, params)
    head = fast.cross_entropy(hidden, targets, ignore_index=ignore_index)
    assert head is not None
    got_grads = torch.autograd.grad(head.nll_sum, [hidden, *fast.parameters()])
    assert_close(head.nll_sum, want)
    for got, expected in zip(got_grads, want_grads, strict=True):
        assert_close(got, expected)
    assert torch.all(got_grads[0][targets == ignore_index] == 0)  # ignored rows get no gradient
    logits = layer(hidden).detach()
    counted = targets != ignore_index
    nll = F.cross_entropy(logits, targets.masked_fill(~counted, 0), reduction="none")
    assert_close(head.token_nll[counted], nll[counted])
    assert torch.equal(head.predictions, logits.argmax(-1))
    assert torch.equal(head.targets, targets)
    assert_close(fast(hidden), layer(hidden))  # the layer itself: FastLinear's forward


def test_fused_loss_linear_of_a_non_plain_weight_declines():
    """A weight that is not a plain tensor (sharded, quantised): None, the caller takes logits."""

    class Marked(Tensor):
        pass

    _, fast, hidden, targets = head_rows(37, 16, 53, bias=False, ignore_index=IGNORE)
    fast.weight = nn.Parameter(fast.weight.detach().as_subclass(Marked))
    assert fast.cross_entropy(hidden, targets, ignore_index=IGNORE) is None


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_fast_dropout_is_the_identity_in_eval(p):
    x = torch.randn(4, 6, 8)
    fast, reference = FastDropout(p).eval(), nn.Dropout(p).eval()
    assert fast(x) is x and torch.equal(reference(x), x)


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_fast_dropout_drops_at_nn_dropout_rate_in_train(p):
    torch.manual_seed(0)
    n = 200_000
    x = torch.rand(n) + 0.5  # no zeros of its own
    fast, reference = FastDropout(p).train(), nn.Dropout(p).train()
    bound = 5 * (p * (1 - p) / n) ** 0.5 + 1 / 65536  # 5 binomial standard deviations + mask rounding
    for module in (fast, reference):
        y = module(x)
        assert abs(float((y == 0).float().mean()) - p) < bound
        kept = y != 0
        assert_close(y[kept], x[kept] / (1 - p))
    x_grad = x.clone().requires_grad_()
    y = fast(x_grad)
    (grad,) = torch.autograd.grad(y.sum(), x_grad)
    assert torch.equal(grad != 0, y != 0)  # back through the same mask
    assert FastDropout(0.0).train()(x) is x


def test_fast_dropout_in_place_is_nn_dropout():
    x = torch.randn(5, 7)
    torch.manual_seed(3)
    want = nn.Dropout(0.4, inplace=True).train()(x.clone())
    torch.manual_seed(3)
    assert torch.equal(FastDropout(0.4, inplace=True).train()(x.clone()), want)


def attention_inputs(b: int, h: int, h_kv: int, t_q: int, t_k: int, d_h: int = 16, *, seed: int = 0,
                     grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t_q, d_h, generator=g)
    k, v = (torch.randn(b, h_kv, t_k, d_h, generator=g) for _ in range(2))
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def key_mask(b: int, t_k: int) -> Tensor:
    """(b, 1, 1, t_k): row i sees its first t_k - 2 i keys; the last row, when b > 2, none."""
    lengths = torch.tensor([max(0, t_k - 2 * i) for i in range(b)])
    lengths[-1] = 0 if b > 2 else lengths[-1]
    return (torch.arange(t_k)[None, :] < lengths[:, None])[:, None, None, :]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(("h", "h_kv"), [(4, 4), (6, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])  # a cached decode step is causal, right-aligned
def test_fast_attention_single_query_equals_plain(h, h_kv, masked, causal, monkeypatch):
    b, t_k = 3, 11
    q, k, v = attention_inputs(b, h, h_kv, 1, t_k)
    mask = key_mask(b, t_k) if masked else None
    written_out = count_calls(monkeypatch, fast_attention_module, "scaled_dot_product_attention")
    got, weights = fast_attention(q, k, v, mask=mask, causal=causal)
    want, _ = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal)
    assert weights is None and got.shape == (b, h, 1, 16)
    assert_close(got, want)
    g = h // h_kv
    assert [(args[0].shape, kwargs["need_weights"]) for args, kwargs in written_out] == [
        ((b, h_kv, g, 16) if h != h_kv else (b, h, 1, 16), True)]
    if masked:
        assert torch.all(got[-1] == 0)  # a row that sees no key: zeros, as the plain function


@pytest.mark.parametrize("t", [64, 128, 130])
def test_fast_attention_square_causal_training_equals_plain(t, monkeypatch):
    """Square causal self-attention with gradients: the block-causal kernel (4 x 4 heads x t^2 x 64
    >= block_causal.MIN_WORK; one block, two, a partial third), forward and the gradients of q, k, v."""
    b, h = 4, 4
    q, k, v = attention_inputs(b, h, h, t, t, d_h=64, seed=t, grad=True)
    assert block_causal.use_block_causal(q, k, v, 0.0)
    blocks = count_calls(monkeypatch, fast_attention_module, "block_causal_attention")
    grad_out = torch.randn(b, h, t, 64, generator=torch.Generator().manual_seed(1))
    got, _ = fast_attention(q, k, v, causal=True)
    assert len(blocks) == 1
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    want, _ = scaled_dot_product_attention(q, k, v, causal=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    assert_close(got, want)
    for a, w in zip(got_grads, want_grads, strict=True):
        assert_close(a, w)
    with torch.no_grad():  # a forward alone keeps SDPA
        assert_close(fast_attention(q, k, v, causal=True)[0], want)
    assert len(blocks) == 1


def passing_through() -> dict[str, Callable[[], tuple[tuple, dict]]]:
    """Calls that fast_attention must hand to the plain function as they are."""
    b, t = 3, 130  # square cases: 3 x 4 heads x 130^2 x 64, enough work for the block-causal kernel
    g = torch.Generator().manual_seed(5)

    def case(h, h_kv, t_q, t_k, grad=False, **kwargs):
        d_h = 64 if t_q == t_k == t else 16
        return lambda: (attention_inputs(b, h, h_kv, t_q, t_k, d_h, seed=t_q + t_k, grad=grad), kwargs)

    bias, square_bias = torch.randn(b, 4, 1, 9, generator=g), torch.randn(1, 4, t, t, generator=g)
    return {
        "single-query-bias": case(4, 4, 1, 9, bias=bias),
        "single-query-per-head-mask": case(4, 4, 1, 9, mask=torch.rand(b, 4, 1, 9, generator=g) > 0.3),
        "square-causal-bias": case(4, 4, t, t, grad=True, causal=True, bias=square_bias),
        "square-causal-padding-mask": case(4, 4, t, t, grad=True, causal=True, mask=key_mask(b, t)),
        "square-causal-gqa": case(4, 2, t, t, grad=True, causal=True),
        "square-not-causal": case(4, 4, t, t, grad=True),
        "cross-key-mask": case(4, 2, 5, 9, mask=key_mask(b, 9)),
        "cross-full-mask": case(4, 4, 5, 9, mask=torch.rand(b, 1, 5, 9, generator=g) > 0.3),
        "prefill-causal-with-cache": case(4, 4, 5, 9, causal=True, mask=key_mask(b, 9)),
        "need-weights-single-query": case(6, 2, 1, 9, need_weights=True, mask=key_mask(b, 9)),
        "need-weights-square-causal": case(4, 4, t, t, grad=True, causal=True, need_weights=True),
    }


@pytest.mark.parametrize("name", list(passing_through()))
def test_fast_attention_passes_other_calls_to_the_plain_function(name, monkeypatch):
    """The same function with the same arguments: bit for bit the plain result (and weights)."""
    (q, k, v), kwargs = passing_through()[name]()
    if q.shape[2] == k.shape[2] > 1:  # square: enough work that plain causal attention would take the kernel
        assert block_causal.use_block_causal(q, q, q, 0.0)
    blocks = count_calls(monkeypatch, fast_attention_module, "block_causal_attention")
    got, got_weights = fast_attention(q, k, v, **kwargs)
    want, want_weights = scaled_dot_product_attention(q, k, v, **kwargs)
    assert not blocks
    assert torch.equal(got, want)
    assert (got_weights is None) == (not kwargs.get("need_weights"))
    if got_weights is not None:
        assert torch.equal(got_weights, want_weights)


def test_fast_attention_under_plain_torch_is_the_plain_function(monkeypatch):
    q, k, v = attention_inputs(2, 4, 4, 128, 128, d_h=64, grad=True)
    blocks = count_calls(monkeypatch, fast_attention_module, "block_causal_attention")
    with plain_torch():
        got, _ = fast_attention(q, k, v, causal=True)
        single, _ = fast_attention(q[:, :, :1], k, v)
    assert not blocks
    assert torch.equal(got, scaled_dot_product_attention(q, k, v, causal=True)[0])
    assert torch.equal(single, scaled_dot_product_attention(q[:, :, :1], k, v)[0])


def test_plain_torch_turns_off_every_kernel_of_an_optimized_model(monkeypatch):
    """Under plain_torch() an optimized model runs nn.Linear's, nn.Dropout's and the plain
    attention's own code: no oneDNN, no turned-around product, no fast dropout mask."""
    calls: list[str] = []
    for module, name in ((fast_linear, "transposed_linear"), (fast_linear, "onednn_linear")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    import aiayn.fast.dropout as fast_dropout

    original_dropout = fast_dropout.dropout
    monkeypatch.setattr(fast_dropout, "dropout", lambda *a, **k: (calls.append("dropout"), original_dropout(*a, **k))[1])
    layer = FastLinear(64, 48)
    drop = FastDropout(0.5).train()
    with plain_torch(), torch.no_grad():
        layer(torch.randn(4, 1, 64))
        layer(torch.randn(512, 512)[:, :64])
        drop(torch.randn(8, 8))
    assert calls == []
    with torch.no_grad():
        layer(torch.randn(4, 1, 64))
        drop(torch.randn(8, 8))
    assert calls == ["transposed_linear", "dropout"]
