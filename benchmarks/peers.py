"""The models compared, built at equal size with random weights, plain float32, each with the
fastest CPU attention it offers. Encoder-decoder peers take ``(src, tgt_in, src_valid, tgt_valid)``,
decoder-only peers ``tokens`` (b, t); both return logits (b, t, v), aiayn's its ``ModelOutput``.

Differences at "equal size" (the printed parameter counts show them): torch.nn.Transformer adds a
final LayerNorm per stack; BART has learned positions and a LayerNorm on the embeddings;
x-transformers is set post-norm (``pre_norm=False``), keeps learned positions and GELU, and its
output projection is tied by hand; GPT-2 and x-transformers' decoder use learned positions, as
aiayn's GPT config does.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import ModelConfig, build_model
from aiayn.fast import optimize
from aiayn.models import ModelOutput
from aiayn.nn.positional import sinusoidal_encoding
from benchmarks.common import quiet_transformers


@dataclass(frozen=True)
class Seq2SeqSize:
    name: str
    vocab: int
    d_model: int
    n_heads: int
    n_layers: int  # encoder layers = decoder layers
    d_ff: int
    batch: int = 32
    src_len: int = 32
    tgt_len: int = 32


SEQ2SEQ_SIZES = {
    "small": Seq2SeqSize("small", vocab=8000, d_model=256, n_heads=4, n_layers=3, d_ff=1024),
    "paper-base": Seq2SeqSize("paper-base", vocab=37000, d_model=512, n_heads=8, n_layers=6, d_ff=2048),
}


@dataclass(frozen=True)
class LMSize:
    vocab: int = 8000
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 1024
    max_len: int = 512


@dataclass(frozen=True)
class Dropouts:
    """Dropout of each kind; each peer gets the kinds it has."""

    residual: float = 0.0  # sublayer outputs and embeddings
    attention: float = 0.0  # attention weights
    activation: float = 0.0  # after the feed-forward activation


class Seq2SeqPeer(nn.Module):
    """An encoder-decoder (``.model``) called the way the benchmarks call every peer:
    ``(src, tgt, src_valid, tgt_valid)``, handed to ``call(model, ...)``."""

    def __init__(self, model: nn.Module, call: Callable[..., Tensor | ModelOutput]) -> None:
        super().__init__()
        self.model, self.call = model, call

    def forward(self, src: Tensor, tgt: Tensor, src_valid: Tensor, tgt_valid: Tensor) -> Tensor | ModelOutput:
        return self.call(self.model, src, tgt, src_valid, tgt_valid)


def aiayn_seq2seq(s: Seq2SeqSize, drop: Dropouts, *, padding_free: bool = True) -> nn.Module:
    """aiayn with ``ModelConfig.padding_free`` on (``aiayn train --padding-free``; off by default),
    plain PyTorch (``optimize_aiayn`` gives it the CPU kernels, as ``aiayn train`` does)."""
    cfg = ModelConfig(arch="encoder-decoder", vocab_size=s.vocab, d_model=s.d_model, n_heads=s.n_heads,
                      n_layers=s.n_layers, d_ff=s.d_ff, dropout=drop.residual,
                      attention_dropout=drop.attention, activation_dropout=drop.activation,
                      positional="sinusoidal", norm_position="post", share_embeddings=True,
                      tie_output=True, max_seq_len=max(s.src_len, s.tgt_len) + 8, pad_id=0,
                      padding_free=padding_free)
    # The model's ModelOutput: what aiayn train hands sequence_loss.
    return Seq2SeqPeer(build_model(cfg), lambda m, src, tgt, sv, tv: m(src, tgt, src_valid=sv, tgt_valid=tv))


def optimize_aiayn(model: nn.Module, mode: str) -> nn.Module:
    """``aiayn.fast.optimize`` of an aiayn peer, in place (given the aiayn model inside a
    ``Seq2SeqPeer``, so that it finds the ``lm_head`` to fuse with the loss)."""
    optimize(model.model if isinstance(model, Seq2SeqPeer) else model, mode=mode)
    return model


class TorchTransformerLM(nn.Module):
    """torch.nn.Transformer with the paper's embeddings (x sqrt(d) + sinusoids), tied output."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, layers: tuple[int, int], d_ff: int, max_len: int,
                 dropout: float) -> None:
        super().__init__()
        # nn.Transformer has one dropout for residuals, attention weights and the FFN activation.
        self.embedding = nn.Embedding(vocab, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model**-0.5)
        self.register_buffer("pe", sinusoidal_encoding(torch.arange(max_len), d_model), persistent=False)
        self.scale = math.sqrt(d_model)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(d_model, n_heads, *layers, d_ff, dropout=dropout, batch_first=True)

    def _embed(self, tokens: Tensor) -> Tensor:
        return self.dropout(self.embedding(tokens) * self.scale + self.pe[: tokens.shape[1]])

    def forward(self, src: Tensor, tgt: Tensor, src_valid: Tensor | None = None,
                tgt_valid: Tensor | None = None) -> Tensor:
        """src (b, s), tgt (b, t) ids, their valid masks (None: no padding) -> logits (b, t, v)."""
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        pad = lambda valid: None if valid is None else ~valid  # noqa: E731
        out = self.transformer(self._embed(src), self._embed(tgt), tgt_mask=causal,
                               src_key_padding_mask=pad(src_valid), tgt_key_padding_mask=pad(tgt_valid),
                               memory_key_padding_mask=pad(src_valid), tgt_is_causal=True)
        return F.linear(out, self.embedding.weight)


def torch_seq2seq(s: Seq2SeqSize, drop: Dropouts) -> nn.Module:
    return TorchTransformerLM(s.vocab, s.d_model, s.n_heads, (s.n_layers, s.n_layers), s.d_ff,
                              max(s.src_len, s.tgt_len) + 8, drop.residual)


def bart_seq2seq(s: Seq2SeqSize, drop: Dropouts) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=s.vocab, d_model=s.d_model, encoder_layers=s.n_layers,
                     decoder_layers=s.n_layers, encoder_attention_heads=s.n_heads,
                     decoder_attention_heads=s.n_heads, encoder_ffn_dim=s.d_ff, decoder_ffn_dim=s.d_ff,
                     activation_function="relu", dropout=drop.residual,
                     attention_dropout=drop.attention, activation_dropout=drop.activation,
                     max_position_embeddings=max(s.src_len, s.tgt_len) + 8, scale_embedding=True,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                     forced_eos_token_id=None, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"

    def call(m: nn.Module, src: Tensor, tgt: Tensor, src_valid: Tensor, tgt_valid: Tensor) -> Tensor:
        return m(input_ids=src, attention_mask=src_valid.long(), decoder_input_ids=tgt,
                 decoder_attention_mask=tgt_valid.long(), use_cache=False).logits

    return Seq2SeqPeer(BartForConditionalGeneration(cfg), call)


def xtransformers_seq2seq(s: Seq2SeqSize, drop: Dropouts) -> nn.Module:
    from x_transformers import XTransformer

    max_len = max(s.src_len, s.tgt_len) + 8
    common = dict(depth=s.n_layers, heads=s.n_heads, ff_mult=s.d_ff // s.d_model, attn_flash=True,
                  pre_norm=False, attn_dropout=drop.attention, ff_dropout=drop.activation,
                  emb_dropout=drop.residual, max_seq_len=max_len, num_tokens=s.vocab)
    xt = XTransformer(dim=s.d_model, tie_token_emb=True, pad_value=0,
                      **{f"enc_{k}": v for k, v in common.items()},
                      **{f"dec_{k}": v for k, v in common.items()})
    # Tie the output projection to the shared embedding too (XTransformer ties only the embeddings).
    xt.decoder.net.to_logits.weight = xt.encoder.token_emb.emb.weight

    def call(m: nn.Module, src: Tensor, tgt: Tensor, src_valid: Tensor, tgt_valid: Tensor) -> Tensor:
        enc = m.encoder(src, mask=src_valid, return_embeddings=True)
        return m.decoder.net(tgt, mask=tgt_valid, context=enc, context_mask=src_valid)

    return Seq2SeqPeer(xt, call)


# The same aiayn model computing its padding too, as the other peers do (the training benchmark
# takes its (b, t, v) logits to the peers' F.cross_entropy).
aiayn_padded_seq2seq = functools.partial(aiayn_seq2seq, padding_free=False)


SEQ2SEQ_PEERS = {
    "aiayn": aiayn_seq2seq,
    "aiayn padded": aiayn_padded_seq2seq,
    "torch.nn.Transformer": torch_seq2seq,
    "HF BART": bart_seq2seq,
    "x-transformers": xtransformers_seq2seq,
}


def aiayn_lm_config(s: LMSize, drop: Dropouts) -> ModelConfig:
    """GPT-2's layout: pre-norm, learned positions, GELU, tied output, no padding id."""
    return ModelConfig(arch="decoder-only", vocab_size=s.vocab, d_model=s.d_model, n_heads=s.n_heads,
                       n_layers=s.n_layers, d_ff=s.d_ff, activation="gelu", norm_position="pre",
                       positional="learned", scale_embeddings=False, tie_output=True, pad_id=None,
                       max_seq_len=s.max_len, dropout=drop.residual, attention_dropout=drop.attention,
                       activation_dropout=drop.activation)


def aiayn_lm(s: LMSize, drop: Dropouts) -> nn.Module:
    return build_model(aiayn_lm_config(s, drop))


def gpt2_lm(s: LMSize, drop: Dropouts) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2 has no dropout after the FFN activation (its resid_pdrop covers the sublayer outputs).
    cfg = GPT2Config(vocab_size=s.vocab, n_positions=s.max_len, n_embd=s.d_model, n_layer=s.n_layers,
                     n_head=s.n_heads, n_inner=s.d_ff, activation_function="gelu",
                     resid_pdrop=drop.residual, embd_pdrop=drop.residual, attn_pdrop=drop.attention,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def xtransformers_lm(s: LMSize, drop: Dropouts) -> nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    # x-transformers has no residual dropout; its ff_dropout sits after the activation.
    return TransformerWrapper(num_tokens=s.vocab, max_seq_len=s.max_len, tie_embedding=True,
                              emb_dropout=drop.residual,
                              attn_layers=Decoder(dim=s.d_model, depth=s.n_layers, heads=s.n_heads,
                                                  ff_mult=s.d_ff // s.d_model, attn_flash=True,
                                                  attn_dropout=drop.attention,
                                                  ff_dropout=drop.activation))


def lm_logits(name: str, model: nn.Module, tokens: Tensor) -> Tensor:
    """One forward of a decoder-only peer -> logits (b, t, v) (aiayn's: its ``ModelOutput.logits``)."""
    if name == "HF GPT-2":
        return model(input_ids=tokens, use_cache=False).logits
    if name == "x-transformers":
        return model(tokens)
    return model(tokens).logits


LM_PEERS = {"aiayn": aiayn_lm, "HF GPT-2": gpt2_lm, "x-transformers": xtransformers_lm}


def quiet() -> None:
    """Silence peers' advisory warnings (they would interleave with the tables)."""
    warnings.filterwarnings("ignore")
    with contextlib.suppress(ImportError):
        quiet_transformers()
