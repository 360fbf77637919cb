"""aiayn ``EncoderDecoder`` equals ``torch.nn.Transformer`` with the same weights.

The torch reference is: our embedding * sqrt(d_model) + our sinusoidal encoding -> torch
``nn.Transformer`` (weights copied from our blocks) -> our ``lm_head``. So the test covers the
blocks, their norms, the masks (source/target padding, causal target) and the final norms.

Weight mapping (torch layer -> our block):
  self_attn (in_proj q,k,v rows) -> self_attn.qkv_proj      multihead_attn q rows -> cross_attn.q_proj
  self_attn.out_proj -> self_attn.out_proj                   multihead_attn k,v rows -> cross_attn.kv_proj
  linear1 -> ffn.fc_in, linear2 -> ffn.fc_out
  encoder layer: norm1 -> self_attn_norm, norm2 -> ffn_norm
  decoder layer: norm1 -> self_attn_norm, norm2 -> cross_attn_norm, norm3 -> ffn_norm
  encoder.norm / decoder.norm -> encoder.final_norm / decoder.final_norm

``nn.Transformer`` always ends both stacks with a LayerNorm, so it is compared with our
``final_norm=True``; models without a final norm are compared with ``custom_encoder`` /
``custom_decoder`` stacks built with ``norm=None``.

Positions. Our stacks count real tokens only, so a trailing pad repeats the last real position;
the usual torch recipe uses 0..t-1. Real tokens get the same positions either way. With our
positions fed to the reference every position (pads included) must agree; with 0..t-1 only the
pad positions' own outputs may differ (their inputs differ), and real positions still agree
because padded keys are masked everywhere.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from aiayn.config import ModelConfig
from aiayn.models.encoder_decoder import EncoderDecoder

VOCAB, D, H, D_FF, PAD = 99, 48, 6, 37, 0
N_ENC, N_DEC = 2, 3

# Source (3, 7) and target (3, 6); rows 1 and 2 end in padding (id 0), row 0 has none.
SRC_LENGTHS = [7, 5, 3]
TGT_LENGTHS = [6, 2, 4]

# (norm_position, final_norm)
NORM_CASES = [("post", True), ("pre", True), ("post", False), ("pre", False)]
NORM_IDS = ["post_final", "pre_final", "post_nofinal", "pre_nofinal"]


def tokens(lengths: list[int], t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(1, VOCAB, (len(lengths), t), generator=g)
    for row, n in enumerate(lengths):
        out[row, n:] = PAD
    return out


SRC = tokens(SRC_LENGTHS, max(SRC_LENGTHS), seed=11)
TGT = tokens(TGT_LENGTHS, max(TGT_LENGTHS), seed=12)


def make_ours(norm_position: str, final_norm: bool, impl: str) -> EncoderDecoder:
    config = ModelConfig(arch="encoder-decoder", vocab_size=VOCAB, d_model=D, n_heads=H,
                         n_layers=N_ENC, n_decoder_layers=N_DEC, d_ff=D_FF, dropout=0.0,
                         norm_position=norm_position, final_norm=final_norm,
                         positional="sinusoidal", pad_id=PAD, max_seq_len=64, attn_impl=impl)
    torch.manual_seed(0)
    model = EncoderDecoder(config)
    # The initialisation zeroes biases and sets norms to identity; randomise them so that a
    # misplaced bias or norm cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    return model.eval()


def make_torch(norm_first: bool, final_norm: bool) -> nn.Transformer:
    common = dict(dim_feedforward=D_FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    if final_norm:
        with warnings.catch_warnings():  # "enable_nested_tensor is True, but ... norm_first"
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            tf = nn.Transformer(D, H, N_ENC, N_DEC, **common)
        # nn.Transformer does not expose enable_nested_tensor; turn it off as the constructor would
        # (nested tensors zero the encoder output at padded positions; see the test below).
        tf.encoder.enable_nested_tensor = tf.encoder.use_nested_tensor = False
    else:
        enc_layer = nn.TransformerEncoderLayer(D, H, **common)
        dec_layer = nn.TransformerDecoderLayer(D, H, **common)
        tf = nn.Transformer(
            D, H, dim_feedforward=D_FF, dropout=0.0, batch_first=True, norm_first=norm_first,
            custom_encoder=nn.TransformerEncoder(enc_layer, N_ENC, norm=None,
                                                 enable_nested_tensor=False),
            custom_decoder=nn.TransformerDecoder(dec_layer, N_DEC, norm=None),
        )
    return tf.eval()


def torch_names_to_ours(model: EncoderDecoder, tf: nn.Transformer) -> dict[str, torch.Tensor]:
    """Every parameter of ``tf`` by name -> the tensor of ours that it must equal."""
    mapping: dict[str, torch.Tensor] = {}

    def linear(prefix: str, lin: nn.Linear) -> None:
        mapping[f"{prefix}.weight"] = lin.weight
        mapping[f"{prefix}.bias"] = lin.bias

    def norm(prefix: str, ln: nn.Module) -> None:
        mapping[f"{prefix}.weight"] = ln.weight
        mapping[f"{prefix}.bias"] = ln.bias

    for i, blk in enumerate(model.encoder.blocks):
        p = f"encoder.layers.{i}"
        mapping[f"{p}.self_attn.in_proj_weight"] = blk.self_attn.qkv_proj.weight
        mapping[f"{p}.self_attn.in_proj_bias"] = blk.self_attn.qkv_proj.bias
        linear(f"{p}.self_attn.out_proj", blk.self_attn.out_proj)
        linear(f"{p}.linear1", blk.ffn.fc_in)
        linear(f"{p}.linear2", blk.ffn.fc_out)
        norm(f"{p}.norm1", blk.self_attn_norm)
        norm(f"{p}.norm2", blk.ffn_norm)
    for i, blk in enumerate(model.decoder.blocks):
        p = f"decoder.layers.{i}"
        mapping[f"{p}.self_attn.in_proj_weight"] = blk.self_attn.qkv_proj.weight
        mapping[f"{p}.self_attn.in_proj_bias"] = blk.self_attn.qkv_proj.bias
        linear(f"{p}.self_attn.out_proj", blk.self_attn.out_proj)
        mapping[f"{p}.multihead_attn.in_proj_weight"] = torch.cat(
            [blk.cross_attn.q_proj.weight, blk.cross_attn.kv_proj.weight])
        mapping[f"{p}.multihead_attn.in_proj_bias"] = torch.cat(
            [blk.cross_attn.q_proj.bias, blk.cross_attn.kv_proj.bias])
        linear(f"{p}.multihead_attn.out_proj", blk.cross_attn.out_proj)
        linear(f"{p}.linear1", blk.ffn.fc_in)
        linear(f"{p}.linear2", blk.ffn.fc_out)
        norm(f"{p}.norm1", blk.self_attn_norm)
        norm(f"{p}.norm2", blk.cross_attn_norm)
        norm(f"{p}.norm3", blk.ffn_norm)
    if model.encoder.final_norm is not None:
        norm("encoder.norm", model.encoder.final_norm)
    if model.decoder.final_norm is not None:
        norm("decoder.norm", model.decoder.final_norm)
    return mapping


def make_pair(norm_position: str, final_norm: bool, device: torch.device, impl: str = "fused"):
    """(ours, torch's) with the same weights, built on the CPU and moved to ``device``."""
    model = make_ours(norm_position, final_norm, impl)
    tf = make_torch(norm_position == "pre", final_norm)
    mapping = torch_names_to_ours(model, tf)
    params = dict(tf.named_parameters())
    assert set(mapping) == set(params), "the weight mapping must cover every torch parameter"
    with torch.no_grad():
        for name, value in mapping.items():
            assert params[name].shape == value.shape, name
            params[name].copy_(value)
    return model.to(device), tf.to(device)


def our_positions(tok: torch.Tensor) -> torch.Tensor:
    """The stacks' convention: count real tokens, so a trailing pad repeats the last position."""
    valid = tok != PAD
    return (valid.long().cumsum(dim=1) - 1).clamp(min=0)


def plain_positions(tok: torch.Tensor) -> torch.Tensor:
    return torch.arange(tok.shape[1], device=tok.device).expand_as(tok)


def embed(model: EncoderDecoder, stack: nn.Module, tok: torch.Tensor,
          positions: torch.Tensor) -> torch.Tensor:
    return stack.embedding(tok) * math.sqrt(D) + model.encoder.absolute(positions)


def reference(model: EncoderDecoder, tf: nn.Transformer, src: torch.Tensor, tgt: torch.Tensor,
              positions=our_positions) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (memory (b, s, d), logits (b, t, v)) through torch's transformer."""
    src_x = embed(model, model.encoder, src, positions(src))
    tgt_x = embed(model, model.decoder, tgt, positions(tgt))
    t = tgt.shape[1]
    # generate_square_subsequent_mask gives -inf above the diagonal; as bool: True = not allowed,
    # the same type as the key padding masks.
    tgt_mask = torch.isinf(nn.Transformer.generate_square_subsequent_mask(t, device=tgt.device))
    src_kpm, tgt_kpm = src == PAD, tgt == PAD
    memory = tf.encoder(src_x, src_key_padding_mask=src_kpm)
    out = tf.decoder(tgt_x, memory, tgt_mask=tgt_mask, tgt_key_padding_mask=tgt_kpm,
                     memory_key_padding_mask=src_kpm, tgt_is_causal=True)
    full = tf(src_x, tgt_x, tgt_mask=tgt_mask, src_key_padding_mask=src_kpm,
              tgt_key_padding_mask=tgt_kpm, memory_key_padding_mask=src_kpm, tgt_is_causal=True)
    assert_close(full, out)  # nn.Transformer.forward is encoder then decoder
    return memory, model.lm_head(out)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize(("norm_position", "final_norm"), NORM_CASES, ids=NORM_IDS)
def test_logits_match_torch_transformer(norm_position, final_norm, impl, grad, device):
    """All positions, pads included, with the positions our stacks use. Under no_grad torch takes
    its fused "fast path" kernels for the encoder; with grad it runs the Python layers."""
    model, tf = make_pair(norm_position, final_norm, device, impl)
    src, tgt = SRC.to(device), TGT.to(device)
    with torch.set_grad_enabled(grad):
        memory_ref, logits_ref = reference(model, tf, src, tgt)
        encoded = model.encode(src)
        out = model.decode(tgt, encoded)
    assert out.logits.shape == (3, max(TGT_LENGTHS), VOCAB)
    assert_close(encoded.memory, memory_ref)
    assert_close(out.logits, logits_ref)
    assert_close(model(src, tgt).logits, out.logits)


@pytest.mark.parametrize(("norm_position", "final_norm"), NORM_CASES, ids=NORM_IDS)
def test_real_positions_match_with_plain_positions(norm_position, final_norm, device):
    """With the usual 0..t-1 positions only pad positions get other inputs; every real position
    (encoder memory and decoder logits) must still agree."""
    model, tf = make_pair(norm_position, final_norm, device)
    src, tgt = SRC.to(device), TGT.to(device)
    with torch.no_grad():
        memory_ref, logits_ref = reference(model, tf, src, tgt, positions=plain_positions)
        encoded = model.encode(src)
        logits = model.decode(tgt, encoded).logits
    src_real, tgt_real = src != PAD, tgt != PAD
    assert_close(encoded.memory[src_real], memory_ref[src_real])
    assert_close(logits[tgt_real], logits_ref[tgt_real])


def test_unpadded_batch_matches_torch(device):
    """No padding at all: no masks but the causal one, positions 0..t-1 on both sides."""
    model, tf = make_pair("post", True, device)
    g = torch.Generator().manual_seed(3)
    src = torch.randint(1, VOCAB, (2, 8), generator=g).to(device)
    tgt = torch.randint(1, VOCAB, (2, 5), generator=g).to(device)
    with torch.no_grad():
        _, logits_ref = reference(model, tf, src, tgt, positions=plain_positions)
        logits = model(src, tgt).logits
    assert_close(logits, logits_ref)


def test_torch_nested_tensor_fast_path_zeroes_padded_memory_only(device):
    """torch's default nn.Transformer (enable_nested_tensor) drops padded encoder positions and
    pads its output back with zeros before the final norm, so there the memory is
    LayerNorm(0) = the norm's bias, not what the layers compute. Those positions are masked keys
    of the cross-attention, so the decoder logits agree at every target position regardless."""
    model, tf = make_pair("post", True, device)
    tf.encoder.enable_nested_tensor = tf.encoder.use_nested_tensor = True
    src, tgt = SRC.to(device), TGT.to(device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
        memory_ref, logits_ref = reference(model, tf, src, tgt)
        encoded = model.encode(src)
        logits = model.decode(tgt, encoded).logits
    src_pad = src == PAD
    norm_bias = model.encoder.final_norm.bias.detach()
    assert torch.equal(memory_ref[src_pad], norm_bias.expand_as(memory_ref[src_pad]))
    assert not torch.allclose(encoded.memory[src_pad], memory_ref[src_pad])
    assert_close(encoded.memory[~src_pad], memory_ref[~src_pad])
    assert_close(logits, logits_ref)


@pytest.mark.parametrize(("norm_position", "final_norm"), [("post", True), ("pre", False)],
                         ids=["post_final", "pre_nofinal"])
def test_gradients_match_torch_transformer(norm_position, final_norm, device):
    """Same loss, same gradient for every block parameter, in float64 (the forward tests above hold
    in float32). A weight's gradient sums over every position of the batch, terms larger than the
    result: float32 summed in another order (a GPU's kernels) moves it by more than float32's
    rounding of the result, while float64 leaves no doubt which computation each side did."""
    model, tf = make_pair(norm_position, final_norm, device)
    model, tf = model.double(), tf.double()
    src, tgt = SRC.to(device), TGT.to(device)
    _, logits_ref = reference(model, tf, src, tgt)
    logits = model(src, tgt).logits
    assert logits.dtype == logits_ref.dtype == torch.float64
    w = torch.randn(logits.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).to(device)
    (logits_ref * w).sum().backward()
    model.zero_grad()  # the reference also ran through our embedding and lm_head
    (logits * w).sum().backward()
    mapping = torch_names_to_ours(model, tf)  # rebuilt: the grads of the cat()s are not ours
    ours_by_id = {id(p): p for p in model.parameters()}
    for name, p in tf.named_parameters():
        ours = mapping[name]
        if id(ours) in ours_by_id:
            assert_close(ours.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    for i, blk in enumerate(model.decoder.blocks):
        ref = dict(tf.decoder.layers[i].multihead_attn.named_parameters())
        assert_close(torch.cat([blk.cross_attn.q_proj.weight.grad, blk.cross_attn.kv_proj.weight.grad]),
                     ref["in_proj_weight"].grad)
        assert_close(torch.cat([blk.cross_attn.q_proj.bias.grad, blk.cross_attn.kv_proj.bias.grad]),
                     ref["in_proj_bias"].grad)
