"""The output layer fused with the cross-entropy (``aiayn.fast.fused_loss``, what
``sequence_loss`` runs on the output of a model that ``aiayn.fast.optimize(model, "train")``
converted) computes what the logits + loss path (the plain model's) does: the loss, the reported
NLL and accuracies, and every gradient, equal at ``assert_close``'s default tolerances (float32),
chunk sizes that do and do not divide the rows, ignored rows, label smoothing, bias, tied weights,
padded and padding-free models; under bfloat16 autocast equal at bfloat16's tolerances.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_spies import count_calls
from random_weights import randomize_
from torch.testing import assert_close

import aiayn.fast.fused_loss as fused_loss
from aiayn.fast import optimize
from aiayn.fast.fused_loss import FusedLossLinear, linear_cross_entropy
from aiayn.fast.quantize import Int8Linear, quantize_int8_
from aiayn.models import ModelOutput, build_model, get_preset
from aiayn.train.losses import IGNORE, sequence_loss

# The fused output layer + loss runs for models that aiayn.fast.optimize converted, which it does on
# the CPU only: once, on the CPU.
pytestmark = pytest.mark.cpu_only


def rows(n: int = 37, d: int = 16, v: int = 53, *, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d**0.5).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = IGNORE
    return hidden, weight, b, targets


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 8, 37, None])
def test_equals_linear_then_cross_entropy(eps, bias, chunk_rows):
    hidden, weight, b, targets = rows(bias=bias)
    params = [hidden, weight] + ([b] if bias else [])
    expected = F.cross_entropy(F.linear(hidden, weight, b), targets, ignore_index=IGNORE, label_smoothing=eps)
    expected_grads = torch.autograd.grad(expected, params)
    head = linear_cross_entropy(hidden, weight, b, targets, chunk_rows=chunk_rows)
    loss = (1 - eps) * head.nll_sum + eps * head.uniform_sum
    assert_close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, params), expected_grads, strict=True):
        assert_close(got, want)
    logits = F.linear(hidden, weight, b).detach()
    counted = targets != IGNORE
    nll = F.cross_entropy(logits, targets.masked_fill(~counted, 0), reduction="none")
    assert_close(head.token_nll, nll)
    assert torch.equal(head.predictions, logits.argmax(-1))


class _SeenRows(FusedLossLinear):
    """A fused output layer that records how many rows each call gets."""

    seen: list[int]

    def cross_entropy(self, hidden, targets, *, ignore_index):
        self.seen.append(hidden.shape[0])
        return super().cross_entropy(hidden, targets, ignore_index=ignore_index)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_output_layer_runs_on_the_counted_rows_only(fused, eps):
    """``sequence_loss`` gives a model's output layer only the rows whose targets count (a chat
    example's prompt, padding): the loss, its gradients, the NLL and both accuracies are those of every
    row's logits through ``F.cross_entropy``."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, 9, 16, generator=g).requires_grad_()
    targets = torch.randint(0, 53, (4, 9), generator=g)
    targets[:, :4] = IGNORE  # each row's prompt
    targets[3] = IGNORE  # and a row with nothing to learn
    layer = _SeenRows(16, 53, bias=False) if fused else torch.nn.Linear(16, 53, bias=False)
    randomize_(layer, seed=6)
    seen: list[int] = []
    if fused:
        layer.seen = seen
    else:
        layer.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    got = sequence_loss(ModelOutput(hidden_rows=hidden, head=layer), targets, label_smoothing=eps)
    want = sequence_loss(F.linear(hidden, layer.weight), targets, label_smoothing=eps)
    assert seen == [int((targets != IGNORE).sum())] == [15]
    assert_close(got.loss, want.loss)
    for a, b in zip(torch.autograd.grad(got.loss, [hidden, layer.weight]),
                    torch.autograd.grad(want.loss, [hidden, layer.weight]), strict=True):
        assert_close(a, b)
    assert_close(got.nll_sum, want.nll_sum)
    assert (got.n_tokens, got.n_correct, got.n_seq_correct) == (want.n_tokens, want.n_correct, want.n_seq_correct)


def test_tied_weight_gets_both_gradients():
    """The output layer's weight shared with an embedding: the fused gradient adds to the lookup's."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(53, 16, generator=g).requires_grad_()
    ids, targets = torch.randint(0, 53, (40,), generator=g), torch.randint(0, 53, (40,), generator=g)

    def loss(fused: bool) -> torch.Tensor:
        hidden = torch.tanh(F.embedding(ids, table))
        if fused:
            return linear_cross_entropy(hidden, table, None, targets, chunk_rows=16).nll_sum
        return F.cross_entropy(hidden @ table.T, targets)

    (want,) = torch.autograd.grad(loss(False), table)
    (got,) = torch.autograd.grad(loss(True), table)
    assert_close(got, want)


def test_flop_counter_sees_the_same_matmuls():
    """The benchmarks' MFU counts a step's FLOPs with FlopCounterMode: the fused step's three
    matmuls (logits, and the two gradients, done in the forward) count as the unfused step's."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight, b, targets = rows(bias=True)
    counts = []
    for fused in (False, True):
        with FlopCounterMode(display=False) as counter:
            if fused:
                loss = linear_cross_entropy(hidden, weight, b, targets, chunk_rows=8).nll_sum
            else:
                loss = F.cross_entropy(F.linear(hidden, weight, b), targets, ignore_index=IGNORE)
            loss.backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 3 * 2 * 37 * 16 * 53


def test_without_grad_computes_no_gradients():
    hidden, weight, b, targets = rows(bias=True)
    with torch.no_grad():
        head = linear_cross_entropy(hidden, weight, b, targets)
    assert not head.nll_sum.requires_grad
    assert_close(head.nll_sum, F.cross_entropy(F.linear(hidden, weight, b), targets, ignore_index=IGNORE))


def test_nothing_counted_is_nan_with_zero_gradients():
    """As F.cross_entropy, the mean over no rows is NaN; the gradients stay zero (a rank of a
    data-parallel step whose batch share has no target must still join the all-reduce)."""
    hidden, weight, _, targets = rows(bias=False)
    targets = torch.full_like(targets, IGNORE)
    head = linear_cross_entropy(hidden, weight, None, targets)
    grads = torch.autograd.grad(head.nll_sum * 0.0, [hidden, weight])
    assert all(torch.all(grad == 0) for grad in grads)
    # sequence_loss through the fused output layer (a (37, 1) batch of hidden rows)
    layer = FusedLossLinear(16, 53, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    model_out = ModelOutput(hidden_rows=hidden[:, None], head=layer)
    out = sequence_loss(model_out, targets[:, None])
    assert out.n_tokens == 0 and torch.isnan(out.loss)
    grads = torch.autograd.grad(out.loss, [hidden, layer.weight])
    assert all(torch.all(grad == 0) for grad in grads)
    (grad,) = torch.autograd.grad(model_out.hidden_rows.sum() * 0.0, hidden)
    assert torch.all(grad == 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfloat16_autocast_is_as_accurate_as_the_autocast_layer(seed):
    """Under autocast the fused matmuls run in bfloat16 as ``nn.Linear`` would. The two paths round
    at different points (the unfused one its finished logits gradient, the fused one G before its
    matmuls), so they are compared with the truth, not with each other: float64 arithmetic on the
    same bfloat16-rounded inputs. The fused loss and gradients are within bfloat16's precision
    (relative error < 2^-7) and no further from the truth than the unfused path's (x 1.25)."""
    hidden, weight, b, targets = rows(n=64, d=32, v=200, bias=True, seed=seed)
    params = [hidden, weight, b]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unfused = sequence_loss(F.linear(hidden, weight, b)[None], targets[None], label_smoothing=0.1).loss
        head = linear_cross_entropy(hidden, weight, b, targets, chunk_rows=16)
    fused = 0.9 * head.nll_sum + 0.1 * head.uniform_sum
    exact = [p.detach().bfloat16().double().requires_grad_() for p in params]
    truth = F.cross_entropy(F.linear(*exact), targets, ignore_index=IGNORE, label_smoothing=0.1)

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.detach().double() - want.detach()).norm() / want.detach().norm())

    assert error(fused, truth) < 2**-7
    grads_fused = torch.autograd.grad(fused, params)
    grads_unfused = torch.autograd.grad(unfused, params)
    for name, got, ref, want in zip("hWb", grads_fused, grads_unfused, torch.autograd.grad(truth, exact),
                                    strict=True):
        assert got.dtype == torch.float32, name
        assert error(got, want) < 2**-7, name
        assert error(got, want) <= 1.25 * error(ref, want), name


def seeded_model(preset: str, **overrides):
    """A preset model with seeded weights, train mode, no dropout (plain: not optimized)."""
    return randomize_(build_model(get_preset(preset, dropout=0.0, **overrides)), seed=0).train()


def batch(b: int = 3, t: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 99, (b, t), generator=g)
    targets = torch.randint(1, 99, (b, t), generator=g)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 6:] = False
    valid[2, 3:] = False
    return tokens.masked_fill(~valid, 0), valid, targets.masked_fill(~valid, IGNORE)


def assert_same_step(model, run, targets, eps: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """sequence_loss of the optimized model's output (fused) == of the plain model's (logits),
    and so do the gradients."""
    calls = count_calls(monkeypatch, fused_loss, "linear_cross_entropy")
    plain_out = run()
    assert isinstance(plain_out, ModelOutput) and type(plain_out.head) is torch.nn.Linear
    want = sequence_loss(plain_out, targets, label_smoothing=eps)
    assert not calls
    want.loss.backward()
    want_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    optimize(model, mode="train")
    fused = run()
    assert isinstance(fused.head, FusedLossLinear)
    got = sequence_loss(fused, targets, label_smoothing=eps)
    assert len(calls) == 1  # the loss ran fused
    got.loss.backward()
    assert_close(got.loss, want.loss)
    assert_close(got.nll_sum, want.nll_sum)
    assert (got.n_tokens, got.n_correct, got.n_seq_correct, got.n_seqs) == \
        (want.n_tokens, want.n_correct, want.n_seq_correct, want.n_seqs)
    assert_close(fused.hidden, plain_out.hidden)
    got_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        assert_close(grad, want_grads[name], msg=name)


@pytest.mark.parametrize("overrides", [dict(), dict(tie_output=False, lm_head_bias=True)], ids=["tied", "untied-bias"])
@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_decoder_only_trains_fused_as_with_logits(preset, overrides, monkeypatch):
    model = seeded_model(preset, **overrides)
    tokens, valid, targets = batch()
    assert_same_step(model, lambda: model(tokens, valid=valid), targets, eps=0.1, monkeypatch=monkeypatch)


@pytest.mark.parametrize("padding_free", [False, True])
def test_encoder_decoder_trains_fused_as_with_logits(padding_free, monkeypatch):
    model = seeded_model("tiny", padding_free=padding_free)
    src, src_valid, _ = batch(seed=2)
    tgt, tgt_valid, targets = batch(seed=3)
    assert_same_step(model, lambda: model(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid),
                     targets, eps=0.1, monkeypatch=monkeypatch)


def test_a_quantised_output_layer_computes_logits(monkeypatch):
    """Only a plain linear output layer runs fused; any other head hands the loss its logits."""
    model = optimize(seeded_model("gpt-tiny", tie_output=False).eval(), mode="train")
    quantize_int8_(model)
    assert isinstance(model.lm_head, Int8Linear)
    tokens, valid, targets = batch()
    calls = count_calls(monkeypatch, fused_loss, "linear_cross_entropy")
    with torch.no_grad():
        out = model(tokens, valid=valid)
        loss = sequence_loss(out, targets)
    assert not calls
    assert isinstance(out, ModelOutput) and out.logits.shape == (3, 9, 99)
    assert_close(loss.loss, sequence_loss(out.logits, targets).loss)


# ---- bad input --------------------------------------------------------------------------------
def test_optimized_output_still_has_its_logits():
    """The fused output layer is used by the loss only: the output's logits are the plain model's."""
    model = seeded_model("gpt-tiny")
    tokens, valid, _ = batch()
    want = model(tokens, valid=valid).logits
    out = optimize(model, mode="train")(tokens, valid=valid)
    assert isinstance(out.head, FusedLossLinear)
    assert_close(out.logits, want)


def test_targets_of_another_shape_are_refused():
    model = optimize(seeded_model("gpt-tiny"), mode="train")
    tokens, valid, targets = batch()
    out = model(tokens, valid=valid)
    with pytest.raises(ValueError, match=r"targets must have the \(batch, seq\) shape of the model's input"):
        sequence_loss(out, targets[:, :-1])


def test_target_ids_outside_the_vocabulary_are_refused():
    hidden, weight, _, targets = rows(bias=False)
    targets[3] = 53
    with pytest.raises(ValueError, match=r"outside \[0, 53\).*mark positions that do not count with -100"):
        linear_cross_entropy(hidden, weight, None, targets)


@pytest.mark.parametrize(("shapes", "needle"), [
    (((5, 4), (7, 3), (5,)), "must share d"),
    (((5, 4), (7, 4), (4,)), r"targets must have shape \(5,\)"),
])
def test_mismatched_shapes_are_refused(shapes, needle):
    (h, w, t) = shapes
    with pytest.raises(ValueError, match=needle):
        linear_cross_entropy(torch.randn(h), torch.randn(w), None, torch.zeros(t, dtype=torch.long))


@pytest.mark.slow
def test_compiled_optimized_model_trains_as_eager():
    """``aiayn train --compile``: the compiled forward of the optimized model, then the fused loss,
    which runs eager; loss and gradients equal the eager model's."""
    eager = optimize(seeded_model("gpt-tiny"), mode="train")
    twin = optimize(seeded_model("gpt-tiny"), mode="train")
    compiled = torch.compile(twin)
    tokens, valid, targets = batch()
    outs = []
    for model, run in ((eager, eager), (twin, compiled)):
        out = sequence_loss(run(tokens, valid=valid), targets, label_smoothing=0.1)
        out.loss.backward()
        outs.append((out, {name: p.grad for name, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = outs
    assert_close(got.loss, want.loss)
    assert (got.n_tokens, got.n_correct) == (want.n_tokens, want.n_correct)
    for name, grad in got_grads.items():
        assert_close(grad, want_grads[name], msg=name)


def test_targets_of_another_dtype():
    """Integer ids of any width work (int32 as int64); float targets are refused."""
    hidden, weight, _, targets = rows(bias=False)
    want = linear_cross_entropy(hidden, weight, None, targets).nll_sum
    assert_close(linear_cross_entropy(hidden, weight, None, targets.int()).nll_sum, want)
    with pytest.raises(ValueError, match=r"targets must be integer class ids, got dtype torch\.float32"):
        linear_cross_entropy(hidden, weight, None, targets.float())
