"""Each module ``aiayn.fast.optimize`` swaps in, against the plain one it replaces: ``FastLinear``
(few rows, decode rows, through oneDNN) against ``nn.Linear``, ``FusedLossLinear.cross_entropy``
against the cross-entropy of the linear layer, ``FastDropout`` against ``nn.Dropout``, and
``fast_attention`` (single query with MHA/GQA/MQA and masks, block-causal training attention, the
calls it passes on) against the plain ``scaled_dot_product_attention``; ``plain_torch`` turns every
kernel off. Whole converted models: tests/consistency/test_fast_convert.py; the attention-dropout
path: tests/unit/test_dropout.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from kernel_spies import count_calls, needs_onednn
from torch import Tensor, nn
from torch.testing import assert_close

import aiayn.fast.attention as fast_attention_module
import aiayn.fast.linear as fast_linear
from aiayn.fast import block_causal, onednn, plain_torch
from aiayn.fast.attention import fast_attention
from aiayn.fast.dropout import FastDropout
from aiayn.fast.fused_loss import FusedLossLinear
from aiayn.fast.linear import FastLinear
from aiayn.nn.attention import scaled_dot_product_attention
from aiayn.train.losses import IGNORE

# The modules aiayn.fast.optimize swaps in run their kernels on the CPU only: once, on the CPU.
pytestmark = pytest.mark.cpu_only


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
    written_out = count_calls(monkeypatch, fast_attention_module, "attend")
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
