"""aiayn's own CPU kernels compute what the plain torch ops do: oneDNN linear layers
(``aiayn.fast.onednn``), query-block causal attention (``aiayn.fast.block_causal``) and the fused
loss's max/argmax. Each float32 result is compared with a float64 reference at ``assert_close``'s
default float32 tolerances; at full layer sizes, where no float32 path meets those, each element's
error is held to the rounding bound of its sum, and for whole training steps (of a model that
``aiayn.fast.optimize`` converted) the errors against float64 are compared with the plain-op
path's (``aiayn.fast.plain_torch``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kernel_spies import count_calls, needs_onednn
from torch.testing import assert_close

from aiayn.fast import onednn, optimize, switch
from aiayn.fast.attention import fast_attention
from aiayn.fast.block_causal import MAX_LENGTH, block_causal_attention, use_block_causal
from aiayn.fast.fused_loss import _max_and_argmax, linear_cross_entropy
from aiayn.fast.linear import FastLinear
from aiayn.models import build_model, get_preset
from aiayn.train.losses import IGNORE

# aiayn's own CPU kernels (oneDNN, block-causal attention, the fused loss's max/argmax): once, on the CPU.
pytestmark = pytest.mark.cpu_only


def _float64_twins(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


# --- oneDNN linear -------------------------------------------------------------------------------

@needs_onednn
@pytest.mark.parametrize("shape", [(96, 48, 80), (70, 80, 48), (2, 40, 24, 24)])  # i < o, i > o, 3-D
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_float64(shape, bias):
    *lead, i, o = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, i, generator=g).requires_grad_()
    weight = (torch.randn(o, i, generator=g) / i**0.5).requires_grad_()
    b = torch.randn(o, generator=g).requires_grad_() if bias else None
    params = [x, weight] + ([b] if bias else [])
    grad_out = torch.randn(*lead, o, generator=g)
    y = onednn.onednn_linear(x, weight, b)  # small: use_onednn would pick F.linear, the op is the same
    grads = torch.autograd.grad(y, params, grad_out)
    params64 = _float64_twins(*params)
    y64 = F.linear(params64[0], params64[1], params64[2] if bias else None)
    grads64 = torch.autograd.grad(y64, params64, grad_out.double())
    assert_close(y, y64.float())
    for got, want in zip(grads, grads64, strict=True):
        assert got.is_contiguous()
        assert_close(got, want.float())


def _rounding_bounds(x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """The classical bound on a float32 inner product of n terms, |fl(a.b) - a.b| <= n u |a|.|b|
    with u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5, gamma_n ~ n u),
    for the output, each gradient and the bias gradient (sums over i, o, m and m terms)."""
    ax, aw, ag = (t.detach().double().abs() for t in (x, weight, grad_out))
    (m, i), o = ax.shape, aw.shape[0]
    u = 2.0**-24
    return [i * u * (ax @ aw.T), o * u * (ag @ aw), m * u * (ag.T @ ax), m * u * ag.sum(0)]


@needs_onednn
@pytest.mark.parametrize("shape", [(512, 256, 1024), (512, 1024, 256)])  # over MIN_WORK, both ways round
def test_onednn_linear_at_full_size_is_within_float32_rounding(shape):
    """At sizes the layer really runs at, sums over 256-1,024 terms, no float32 path stays within
    float64's default tolerances, and how oneDNN's error compares with F.linear's (MKL's) depends on
    the kernels each library picks for the CPU. What holds for a correct float32 product on every
    CPU: each element of the output and of every gradient is within the rounding bound of its sum
    (F.linear's too, checked alongside so the bound is known to be met by the reference)."""
    m, i, o = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, i, generator=g).requires_grad_()
    weight = (torch.randn(o, i, generator=g) / i**0.5).requires_grad_()
    b = torch.randn(o, generator=g).requires_grad_()
    grad_out = torch.randn(m, o, generator=g)
    params64 = _float64_twins(x, weight, b)
    y64 = F.linear(*params64)
    want = [y64.detach(), *torch.autograd.grad(y64, params64, grad_out.double())]
    bounds = _rounding_bounds(x, weight, grad_out)

    def worst(fn) -> list[float]:
        y = fn(x, weight, b)
        got = [y.detach(), *torch.autograd.grad(y, [x, weight, b], grad_out)]
        return [float(((a.double() - w).abs() / bound).max()) for a, w, bound in zip(got, want, bounds, strict=True)]

    assert onednn.use_onednn(x, weight)
    fast, plain = worst(onednn.onednn_linear), worst(F.linear)
    assert max(plain) <= 1, plain
    assert max(fast) <= 1, (fast, plain)


@needs_onednn
def test_onednn_linear_of_strided_input_and_no_grad():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 32, generator=g).transpose(0, 1)  # (3, 64, 32), not contiguous
    weight = torch.randn(40, 32, generator=g)
    with torch.no_grad():
        y = onednn.onednn_linear(x, weight)
    assert not y.requires_grad and y.shape == (3, 64, 40)
    assert_close(y, F.linear(x.double(), weight.double()).float())


@needs_onednn
def test_onednn_linear_is_counted_as_a_linear():
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(64, 256, requires_grad=True)
    layer = FastLinear(256, 1024)
    assert onednn.use_onednn(x, layer.weight)
    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 64 * 256 * 1024


@needs_onednn
def test_linear_layer_uses_onednn_only_where_it_was_measured_faster(monkeypatch):
    layer = FastLinear(256, 1024)  # 64 rows: 16.8M multiply-adds, onednn.MIN_WORK
    calls = count_calls(monkeypatch, onednn, "linear_product")
    layer(torch.randn(64, 256))
    assert calls, "64 float32 CPU rows of enough work go through oneDNN"
    calls.clear()
    layer(torch.randn(63, 256))  # fewer rows, less work: F.linear was as fast
    FastLinear(32, 32)(torch.randn(4096, 32))  # many rows but little work: the op's fixed cost wins
    layer.double()(torch.randn(64, 256, dtype=torch.float64))  # oneDNN's product is float32 only
    layer.float()
    with switch.plain_torch():
        layer(torch.randn(64, 256))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(64, 256))
    assert not calls


# --- block-causal attention ------------------------------------------------------------------------

@pytest.mark.parametrize("t", [2, 63, 64, 65, 130, 256])
def test_block_causal_attention_equals_float64_sdpa(t):
    g = torch.Generator().manual_seed(t)
    b, h, d_h = 2, 3, 16
    # q, k, v as the model makes them: head views of one (b, t, 3 h d_h) projection
    qkv = torch.randn(b, t, 3 * h * d_h, generator=g).requires_grad_()
    grad_out = torch.randn(b, h, t, d_h, generator=g)

    def attend(qkv: torch.Tensor, fn) -> torch.Tensor:
        q, k, v = (x.view(b, t, h, d_h).transpose(1, 2) for x in qkv.split(h * d_h, dim=-1))
        return fn(q, k, v)

    out = attend(qkv, lambda q, k, v: block_causal_attention(q, k, v, scale=d_h**-0.5))
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    (qkv64,) = _float64_twins(qkv)
    out64 = attend(qkv64, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    (grad64,) = torch.autograd.grad(out64, qkv64, grad_out.double())
    assert_close(out, out64.float())
    assert_close(grad, grad64.float())
    # the output is laid out (b, t, h, d_h): the output projection's reshape is a view
    assert out.transpose(1, 2).is_contiguous()
    with torch.no_grad():
        assert_close(attend(qkv, lambda q, k, v: block_causal_attention(q, k, v, scale=d_h**-0.5)), out)


def test_block_causal_attention_is_taken_only_where_it_applies():
    q = torch.randn(1, 4, 128, 64, requires_grad=True)  # 4.2M multiply-adds per product: MIN_WORK
    assert use_block_causal(q, q, q, 0.0)
    assert not use_block_causal(q, q[:, :2], q[:, :2], 0.0)  # grouped key heads: SDPA's enable_gqa
    assert not use_block_causal(q, q, q, 0.1)  # dropout on the weights
    assert not use_block_causal(q[:, :, :64], q[:, :, :64], q[:, :, :64], 0.0)  # too little work
    long = torch.randn(1, 1, MAX_LENGTH + 1, 64, requires_grad=True)
    assert not use_block_causal(long, long, long, 0.0)  # the kept weights would grow as t^2
    assert not use_block_causal(q.double().half(), q.half(), q.half(), 0.0)
    with torch.no_grad():
        assert not use_block_causal(q, q, q, 0.0)  # a forward alone: SDPA is as fast
    fixed = q.detach()
    assert not use_block_causal(fixed, fixed, fixed, 0.0)
    with switch.plain_torch():
        assert not use_block_causal(q, q, q, 0.0)
    assert switch.enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not use_block_causal(q, q, q, 0.0)


# --- the fused loss: max/argmax and its oneDNN products ------------------------------------------

@pytest.mark.parametrize("v", [50, 128, 200, 8000])  # one block (torch.max), exact blocks, a partial one
def test_max_and_argmax_equals_torch_max(v):
    g = torch.Generator().manual_seed(v)
    z = torch.randn(33, v, generator=g)
    z[0] = 1.0  # all tied: the first index
    z[1, v // 3] = z[1, v - 1] = 9.0  # tied across blocks (and with the partial block): the first
    z[2, v - 1] = 9.0  # the maximum in the last (partial) block
    z[3, 5] = float("nan")  # NaN wins, as in torch.max
    top, ids = _max_and_argmax(z)
    want_top, want_ids = z.max(dim=1)
    assert torch.equal(ids, want_ids)
    assert_close(top, want_top, equal_nan=True, rtol=0, atol=0)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_fused_loss_on_onednn_equals_float64(bias):
    """≥ 64 float32 rows: the fused loss's three products run through oneDNN."""
    g = torch.Generator().manual_seed(2)
    n, d, v = 300, 64, 1000  # 19.2M multiply-adds per product: over onednn.MIN_WORK
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d**0.5).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE
    params = [hidden, weight] + ([b] if bias else [])
    assert onednn.use_onednn(hidden, weight)
    head = linear_cross_entropy(hidden, weight, b, targets, chunk_rows=128)
    loss = 0.9 * head.nll_sum + 0.1 * head.uniform_sum
    grads = torch.autograd.grad(loss, params)
    params64 = _float64_twins(*params)
    logits64 = F.linear(params64[0], params64[1], params64[2] if bias else None)
    loss64 = F.cross_entropy(logits64, targets, ignore_index=IGNORE, label_smoothing=0.1)
    grads64 = torch.autograd.grad(loss64, params64)
    assert_close(loss, loss64.float())
    for got, want in zip(grads, grads64, strict=True):
        assert_close(got, want.float())
    assert torch.equal(head.predictions, logits64.argmax(-1))


# --- a whole training step -------------------------------------------------------------------------

def _step_error(model: torch.nn.Module, model64: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(|loss - loss64|, max |grad - grad64|) of one training step against the float64 twin."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    losses, grads = [], []
    for m in (model, model64):
        m.zero_grad()
        out = m(inputs)
        loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        loss.backward()
        losses.append(loss.detach().double())
        grads.append([p.grad.double() for p in m.parameters()])
    grad_error = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
    return float((losses[0] - losses[1]).abs()), grad_error


@needs_onednn
def test_training_step_with_cpu_kernels_is_as_accurate_as_plain_torch(monkeypatch):
    """A GPT-style model (d 128, causal attention over 128 positions, 8 x 128 rows): with aiayn's CPU
    kernels (``optimize(model, "train")``), its loss and gradients are within twice the plain-op
    step's error against a float64 twin."""
    import aiayn.fast.attention as attention

    attention_calls = count_calls(monkeypatch, attention, "block_causal_attention")
    linear_calls = count_calls(monkeypatch, onednn, "linear_product")
    torch.manual_seed(0)
    model = build_model(get_preset("gpt-tiny", vocab_size=97, d_model=128, n_heads=2, n_layers=2, d_ff=256,
                                   max_seq_len=128, dropout=0.0))
    model64 = build_model(get_preset("gpt-tiny", vocab_size=97, d_model=128, n_heads=2, n_layers=2, d_ff=256,
                                     max_seq_len=128, dropout=0.0)).double()
    model64.load_state_dict(model.state_dict())
    optimize(model, mode="train")
    optimize(model64, mode="train")
    ids = torch.randint(0, 97, (8, 129), generator=torch.Generator().manual_seed(1))
    fast = _step_error(model, model64, ids)
    assert len(attention_calls) >= 2 and linear_calls  # float64 attention takes it too
    attention_calls.clear()
    linear_calls.clear()
    with switch.plain_torch():
        plain = _step_error(model, model64, ids)
    assert not attention_calls and not linear_calls
    # both are float32 roundings of the same sums: neither may be more than twice the other's error
    assert fast[0] <= 2 * plain[0] + 1e-7 and fast[1] <= 2 * plain[1] + 1e-9, (fast, plain)
    assert fast[1] < 1e-5


@needs_onednn
@pytest.mark.slow
def test_compiled_layer_keeps_the_onednn_op_and_its_gradients(monkeypatch):
    """Under torch.compile the custom op stays in the graph (Inductor calls it as an opaque kernel)
    and the forward and gradients equal the eager layer's."""
    torch.manual_seed(0)
    layer = FastLinear(256, 1024)
    x = torch.randn(2, 40, 256, requires_grad=True)  # 80 rows: 21M multiply-adds, over MIN_WORK
    grad_out = torch.randn(2, 40, 1024)

    def run(fn) -> list[torch.Tensor]:
        x.grad = layer.weight.grad = layer.bias.grad = None
        y = fn(x)
        y.backward(grad_out)
        return [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]

    eager = run(layer)
    calls = count_calls(monkeypatch, onednn, "linear_product")  # the op looks it up at call time
    compiled = run(torch.compile(layer, fullgraph=True))
    assert calls, "the compiled graph runs the oneDNN op"
    for got, want in zip(compiled, eager, strict=True):
        assert_close(got, want)


@pytest.mark.parametrize(("value", "enabled"), [("true", False), ("0", True)])
def test_environment_switch(value, enabled):
    """AIAYN_PLAIN_TORCH=1 (true, yes, on) turns the kernels off for the process; 0 (off, ...) not."""
    code = "from aiayn.fast import enabled; print(enabled())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AIAYN_PLAIN_TORCH": value},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(enabled)


def test_torch_func_transforms_take_the_plain_ops():
    """Under torch.func (grad, vmap) the kernels step aside: their custom ops and autograd
    functions have no functorch rules, the plain ops do."""
    torch.manual_seed(0)
    layer = FastLinear(256, 1024)  # 64 rows: over onednn.MIN_WORK
    x = torch.randn(3, 64, 256)
    batched = torch.func.vmap(layer)(x)
    assert_close(batched, F.linear(x, layer.weight, layer.bias))
    params = {"weight": layer.weight.detach(), "bias": layer.bias.detach()}
    grad = torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x[0],)).square().sum())(params)
    weight = layer.weight.detach().requires_grad_()
    F.linear(x[0], weight, layer.bias).square().sum().backward()
    assert_close(grad["weight"], weight.grad)

    q = torch.randn(2, 4, 128, 64)  # 8.4M multiply-adds per product: over block_causal.MIN_WORK
    got = torch.func.grad(lambda q: fast_attention(q, q, q, causal=True)[0].square().sum())(q)
    q_ = q.clone().requires_grad_()
    F.scaled_dot_product_attention(q_, q_, q_, is_causal=True).square().sum().backward()
    assert_close(got, q_.grad)
