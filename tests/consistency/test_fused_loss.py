"""The output layer fused with the cross-entropy (``aiayn.fast.fused_loss``, what a model
given ``targets`` runs) computes what the logits + loss path does: the loss, the reported NLL and
accuracies, and every gradient, equal at ``assert_close``'s default tolerances (float32), chunk
sizes that do and do not divide the rows, ignored rows, label smoothing, bias, tied weights,
padded and padding-free models; under bfloat16 autocast equal at bfloat16's tolerances.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from random_weights import randomize_
from torch.testing import assert_close

from aiayn.models import build_model, get_preset
from aiayn.models.base import LossModelOutput, ModelOutput
from aiayn.fast.fused_loss import HeadLoss, linear_cross_entropy
from aiayn.fast.quantize import quantize_int8_
from aiayn.train.losses import IGNORE, logits_tensor, loss_logits, sequence_loss


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
    out = sequence_loss(HeadLoss(**{**head.__dict__, "batch_shape": (37, 1)}), targets[:, None])
    assert out.n_tokens == 0 and torch.isnan(out.loss)
    grads = torch.autograd.grad(logits_tensor(head) * 0.0, [hidden, weight])
    assert all(torch.all(grad == 0) for grad in grads)


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
    """A preset model with seeded weights, train mode, no dropout."""
    return randomize_(build_model(get_preset(preset, dropout=0.0, **overrides)), seed=0).train()


def batch(b: int = 3, t: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 99, (b, t), generator=g)
    targets = torch.randint(1, 99, (b, t), generator=g)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 6:] = False
    valid[2, 3:] = False
    return tokens.masked_fill(~valid, 0), valid, targets.masked_fill(~valid, IGNORE)


def assert_same_step(model, run, targets, eps: float) -> None:
    """sequence_loss of the fused forward == of the logits forward, and so do the gradients."""
    plain = run(None)
    assert isinstance(plain, ModelOutput)
    want = sequence_loss(loss_logits(plain), targets, label_smoothing=eps)
    want.loss.backward()
    want_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    fused = run(targets)
    assert isinstance(fused, LossModelOutput)
    got = sequence_loss(loss_logits(fused), targets, label_smoothing=eps)
    got.loss.backward()
    assert_close(got.loss, want.loss)
    assert_close(got.nll_sum, want.nll_sum)
    assert (got.n_tokens, got.n_correct, got.n_seq_correct, got.n_seqs) == \
        (want.n_tokens, want.n_correct, want.n_seq_correct, want.n_seqs)
    assert_close(fused.hidden, plain.hidden)
    got_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        assert_close(grad, want_grads[name], msg=name)


@pytest.mark.parametrize("overrides", [dict(), dict(tie_output=False, lm_head_bias=True)], ids=["tied", "untied-bias"])
@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_decoder_only_given_targets_trains_as_with_logits(preset, overrides):
    model = seeded_model(preset, **overrides)
    tokens, valid, targets = batch()
    assert_same_step(model, lambda t: model(tokens, valid=valid, targets=t), targets, eps=0.1)


@pytest.mark.parametrize("padding_free", [False, True])
def test_encoder_decoder_given_targets_trains_as_with_logits(padding_free):
    model = seeded_model("tiny", padding_free=padding_free)
    src, src_valid, _ = batch(seed=2)
    tgt, tgt_valid, targets = batch(seed=3)
    assert_same_step(model, lambda t: model(src, tgt, src_valid=src_valid, tgt_valid=tgt_valid, targets=t),
                     targets, eps=0.1)


def test_a_quantised_output_layer_computes_logits():
    """Only a plain linear output layer runs fused; any other head hands the loss its logits."""
    model = seeded_model("gpt-tiny", tie_output=False).eval()
    quantize_int8_(model)
    tokens, valid, targets = batch()
    with torch.no_grad():
        out = model(tokens, valid=valid, targets=targets)
    assert isinstance(out, ModelOutput) and out.logits.shape == (3, 9, 99)


# ---- bad input --------------------------------------------------------------------------------
def test_fused_output_has_no_logits_and_says_why():
    model = seeded_model("gpt-tiny")
    tokens, valid, targets = batch()
    out = model(tokens, valid=valid, targets=targets)
    with pytest.raises(AttributeError, match="call the model without targets"):
        _ = out.logits


def test_targets_of_another_shape_are_refused():
    model = seeded_model("gpt-tiny")
    tokens, valid, targets = batch()
    with pytest.raises(ValueError, match=r"targets must have the \(batch, seq\) shape of the model's input"):
        model(tokens, valid=valid, targets=targets[:, :-1])


def test_target_ids_outside_the_vocabulary_are_refused():
    hidden, weight, _, targets = rows(bias=False)
    targets[3] = 53
    with pytest.raises(ValueError, match=r"outside \[0, 53\).*mark positions that do not count with -100"):
        linear_cross_entropy(hidden, weight, None, targets)


def test_loss_of_other_targets_is_refused():
    model = seeded_model("gpt-tiny")
    tokens, valid, targets = batch()
    out = model(tokens, valid=valid, targets=targets)
    other = targets.clone()
    other[0, 0] = (other[0, 0] + 1) % 99
    with pytest.raises(ValueError, match="differ from the ones the model's forward fused"):
        sequence_loss(loss_logits(out), other)


@pytest.mark.parametrize(("shapes", "needle"), [
    (((5, 4), (7, 3), (5,)), "must share d"),
    (((5, 4), (7, 4), (4,)), r"targets must have shape \(5,\)"),
])
def test_mismatched_shapes_are_refused(shapes, needle):
    (h, w, t) = shapes
    with pytest.raises(ValueError, match=needle):
        linear_cross_entropy(torch.randn(h), torch.randn(w), None, torch.zeros(t, dtype=torch.long))


@pytest.mark.slow
def test_compiled_model_given_targets_trains_as_eager():
    """``aiayn train --compile``: the compiled forward breaks its graph at the fused loss, which
    runs eager; loss and gradients equal the eager model's."""
    eager = seeded_model("gpt-tiny")
    twin = seeded_model("gpt-tiny")
    compiled = torch.compile(twin)
    tokens, valid, targets = batch()
    outs = []
    for model, run in ((eager, eager), (twin, compiled)):
        out = sequence_loss(loss_logits(run(tokens, valid=valid, targets=targets)), targets, label_smoothing=0.1)
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
