"""The one residual block and the one stack every model of the family is built from.

A block is self-attention, optional cross-attention and a feed-forward network, each a residual
sublayer: post-norm (paper, section 3.1) x = Norm(x + Dropout(Sublayer(x))), or pre-norm (GPT-2,
LLaMA) x = x + Dropout(Sublayer(Norm(x))). A stack is embeddings -> N blocks -> optional final norm;
it turns token validity and the KV cache into masks, positions and biases.

Shape letters: b batch, t new tokens, t_k keys (cached + new), s source length, d d_model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.device import to_device
from aiayn.nn import data_checks
from aiayn.nn.attention import AttentionInputs, MultiHeadAttention
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.kv_layer import LayerKVCache, Slots
from aiayn.nn.masks import combine_masks, key_mask, position_causal_mask, valid_tokens
from aiayn.nn.mlp import FeedForward
from aiayn.nn.norm import make_norm
from aiayn.nn.packing import Packing
from aiayn.nn.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    T5RelativeBias,
)


class TransformerBlock(nn.Module):
    """Self-attention [+ cross-attention] + feed-forward, each a residual sublayer."""

    def __init__(self, config: ModelConfig, *, cross_attention: bool) -> None:
        super().__init__()
        c = config
        attn_kwargs = dict(n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, bias=c.attn_bias,
                           out_bias=c.attn_out_bias, dropout=c.attention_dropout, impl=c.attn_impl)
        self.pre_norm = c.norm_position == "pre"
        self.self_attn = MultiHeadAttention(c.d_model, c.n_heads, **attn_kwargs)
        self.self_attn_norm = make_norm(c.norm, c.d_model, c.norm_eps)
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_attn_norm: nn.Module | None = None
        if cross_attention:
            self.cross_attn = MultiHeadAttention(c.d_model, c.n_heads, cross=True, **attn_kwargs)
            self.cross_attn_norm = make_norm(c.norm, c.d_model, c.norm_eps)
        self.ffn = FeedForward(c.d_model, c.d_ff, activation=c.activation, bias=c.mlp_bias,
                               dropout=c.activation_dropout)
        self.ffn_norm = make_norm(c.norm, c.d_model, c.norm_eps)
        self.dropout = nn.Dropout(c.dropout)  # residual dropout, P_drop in the paper

    def forward(self, x: Tensor, inputs: StackInputs | None = None, *,
                cache: LayerKVCache | None = None,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (b, t, d), or packed (n, d) with ``inputs.packing`` -> (x, self-attention weights, cross-attention
        weights). The attention layers trust x and ``inputs``: the stack's ``prepare`` checked them."""
        h = self.self_attn_norm(x) if self.pre_norm else x
        self_inputs = inputs.self_attn if inputs is not None else None
        h, self_weights = self.self_attn(h, inputs=self_inputs, cache=cache, need_weights=need_weights,
                                         checked=True)
        x = self._add(x, h, self.self_attn_norm)

        cross_weights = None
        if self.cross_attn is not None:
            assert self.cross_attn_norm is not None and inputs is not None, "cross-attention needs inputs"
            h = self.cross_attn_norm(x) if self.pre_norm else x
            h, cross_weights = self.cross_attn(h, inputs.memory, inputs=inputs.cross_attn, cache=cache,
                                               need_weights=need_weights, checked=True)
            x = self._add(x, h, self.cross_attn_norm)
        return self._feed_forward(x), self_weights, cross_weights

    def forward_ragged(self, x: Tensor, batches: Sequence[tuple[AttentionInputs, LayerKVCache]]) -> Tensor:
        """Several batches' real tokens packed in x (n, d) (``TransformerStack.forward_ragged``): every
        sublayer but the attention core runs once over all of them (decoder-only: no cross-attention)."""
        h = self.self_attn_norm(x) if self.pre_norm else x
        x = self._add(x, self.self_attn.forward_ragged(h, batches), self.self_attn_norm)
        return self._feed_forward(x)

    def _add(self, x: Tensor, h: Tensor, norm: nn.Module) -> Tensor:
        return x + self.dropout(h) if self.pre_norm else norm(x + self.dropout(h))

    def _feed_forward(self, x: Tensor) -> Tensor:
        h = self.ffn_norm(x) if self.pre_norm else x
        return self._add(x, self.ffn(h), self.ffn_norm)


@dataclass
class StackInputs:
    """One forward's inputs besides the token ids, computed once (``TransformerStack.prepare``, or the
    compiled decode step) and shared by every block."""

    positions: Tensor  # (b, t) long position ids of the new tokens
    valid: Tensor  # (b, t) bool, True at real tokens
    self_attn: AttentionInputs  # key mask over cached + new keys, causal, rotary/bias, cache slots
    segments: Tensor | None = None  # (b, t) segment ids (BERT token types)
    memory: Tensor | None = None  # encoder output (b, s, d) or packed (n_s, d), for cross-attention
    cross_attn: AttentionInputs | None = None  # memory mask, packing (a decoder of an encoder-decoder)

    @property
    def packing(self) -> Packing | None:
        return self.self_attn.packing


@dataclass
class RaggedBatch:
    """One batch of a ragged forward: right-padded rows, row i's real tokens its first ``counts[i]`` (host
    ints: nothing read back), continuing ``cache`` (per row, or a view of its rows)."""

    tokens: Tensor  # (b, t) long
    counts: list[int]  # b ints, each in [1, t]
    cache: KVCache  # per row


@dataclass
class StackOutput:
    hidden: Tensor  # (b, t, d), after the final norm if the config has one; (n, d) if packed
    valid: Tensor  # (b, t) bool, True at real tokens
    packing: Packing | None = None  # set when hidden is packed: the real tokens only
    attentions: list[Tensor] = field(default_factory=list)  # per layer (b, h, t, t_k), on request
    cross_attentions: list[Tensor] = field(default_factory=list)  # per layer (b, h, t, s)


def check_tokens(name: str, tokens: Tensor, vocab_size: int) -> None:
    """Token ids must be a (batch, seq) integer tensor with ids in [0, vocab_size); the range is read only
    where ``reads_data`` allows (elsewhere the device asserts it without waiting)."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, seq), got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.shape[1] == 0:
        raise ValueError(f"{name} is empty (seq length 0); give at least one token")
    if not data_checks.reads_data(tokens):
        if not torch.compiler.is_compiling():
            torch._assert_async(((tokens >= 0) & (tokens < vocab_size)).all(),
                                f"{name} holds a token id outside the vocabulary [0, {vocab_size})")
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size}); "
                         f"check the tokenizer matches the model's vocab_size")


def padding_mask(valid: Tensor) -> Tensor | None:
    """The key mask (b, 1, 1, t_k) of ``valid`` (b, t_k), or None (the faster mask-free paths) when every
    key is real and the data may be read (``reads_data``); elsewhere always the mask: the same attention."""
    if data_checks.reads_data(valid) and bool(valid.all()):
        return None
    return key_mask(valid)


class TransformerStack(nn.Module):
    """Embeddings -> N ``TransformerBlock`` -> optional final norm: an encoder (``causal=False``), a
    decoder (``causal=True``, with ``cross_attention`` an encoder-decoder's) or BERT (``segments=True``).
    ``embedding`` may be shared with another stack."""

    def __init__(self, config: ModelConfig, *, n_layers: int, embedding: nn.Embedding, causal: bool,
                 cross_attention: bool = False, segments: bool = False) -> None:
        super().__init__()
        c = self.config = config
        self.causal, self.has_cross = causal, cross_attention
        self.embedding = embedding
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embeddings else 1.0
        self.absolute: nn.Module | None = None
        self.rotary: RotaryEmbedding | None = None
        self.relative: nn.Module | None = None
        if c.positional == "sinusoidal":
            self.absolute = SinusoidalPositionalEncoding(c.d_model, c.max_seq_len,
                                                         layout=c.sinusoidal_layout)
        elif c.positional == "learned":
            self.absolute = LearnedPositionalEmbedding(c.max_seq_len, c.d_model,
                                                       offset=c.position_offset)
        elif c.positional == "rope":
            self.rotary = RotaryEmbedding(c.head_dim, c.max_seq_len, base=c.rope_base)
        elif c.positional == "alibi":
            self.relative = ALiBi(c.n_heads)
        elif c.positional == "t5":
            self.relative = T5RelativeBias(c.n_heads, num_buckets=c.relative_buckets,
                                           max_distance=c.relative_max_distance,
                                           bidirectional=not causal)
        self.segment_embedding = (
            nn.Embedding(c.type_vocab_size, c.d_model) if segments and c.type_vocab_size > 0 else None
        )
        self.embedding_norm = make_norm(c.norm, c.d_model, c.norm_eps) if c.embedding_norm else None
        self.dropout = nn.Dropout(c.dropout)  # on embeddings + positions (paper section 5.4)
        self.blocks = nn.ModuleList(
            TransformerBlock(c, cross_attention=cross_attention) for _ in range(n_layers)
        )
        self.final_norm = make_norm(c.norm, c.d_model, c.norm_eps) if c.final_norm else None

    def embed(self, tokens: Tensor, positions: Tensor, segments: Tensor | None = None) -> Tensor:
        """tokens, positions (b, t) -> token embedding x embed_scale [+ positions] [+ segments] [-> norm]."""
        x = self.embedding(tokens) * self.embed_scale
        if self.absolute is not None:
            x = x + self.absolute(positions).to(x.dtype)
        if self.segment_embedding is not None:
            x = x + self.segment_embedding(torch.zeros_like(tokens) if segments is None else segments)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return x

    def forward(self, tokens: Tensor, *, valid: Tensor | None = None,
                positions: Tensor | None = None, segments: Tensor | None = None,
                memory: Tensor | None = None, memory_valid: Tensor | None = None,
                memory_packing: Packing | None = None, cache: KVCache | None = None,
                need_weights: bool = False, pack: bool = False) -> StackOutput:
        """tokens (b, t) -> hidden (b, t, d): ``prepare`` (its arguments), then ``run``."""
        inputs = self.prepare(tokens, valid=valid, positions=positions, segments=segments, memory=memory,
                              memory_valid=memory_valid, memory_packing=memory_packing, cache=cache,
                              need_weights=need_weights, pack=pack)
        return self.run(tokens, inputs, cache=cache, need_weights=need_weights)

    def prepare(self, tokens: Tensor, *, valid: Tensor | None = None,
                positions: Tensor | None = None, segments: Tensor | None = None,
                memory: Tensor | None = None, memory_valid: Tensor | None = None,
                memory_packing: Packing | None = None, cache: KVCache | None = None,
                need_weights: bool = False, pack: bool = False) -> StackInputs:
        """The inputs ``run`` takes for tokens (b, t): checks, validity (``valid_tokens``), positions
        (default: real tokens counted, after the cache's), the cache's new slots, masks, positional
        bias or rotation. memory (b, s, d), or packed (n_s, d) with ``memory_packing``, and
        memory_valid (b, s): cross-attention's. ``pack``: run the blocks on the real tokens only
        (not with a cache or weights)."""
        if pack and (cache is not None or need_weights):
            raise ValueError("pack=True (padding-free) does not go with a cache or need_weights")
        c = self.config
        check_tokens("tokens", tokens, self.embedding.num_embeddings)
        valid = valid_tokens(tokens, c.pad_id, valid)  # (b, t)
        positions = self._positions(valid, positions, cache)  # (b, t)
        if segments is not None and segments.shape != tokens.shape:
            raise ValueError(f"segments must have the tokens' shape {tuple(tokens.shape)}, "
                             f"got {tuple(segments.shape)}")

        self_attn = self._self_attention_inputs(valid, positions, cache, pack=pack)
        packing = self_attn.packing

        cross_attn = None
        if self.has_cross:
            if memory is None and (cache is None or cache.cross is None):
                raise ValueError("the decoder needs memory= (the encoder output) for cross-attention")
            if memory is not None:  # once here: the blocks' cross-attention does not check it
                self._check_memory(tokens, memory, memory_valid, memory_packing)
            memory_mask = None if memory_valid is None else padding_mask(memory_valid)  # (b, 1, 1, s)
            cross_attn = AttentionInputs(mask=memory_mask, packing=packing, memory_packing=memory_packing)
        if memory_packing is not None and memory is None:
            raise ValueError("memory_packing= needs the packed memory=")
        return StackInputs(positions=positions, valid=valid, self_attn=self_attn, segments=segments,
                           memory=memory, cross_attn=cross_attn)

    def _check_memory(self, tokens: Tensor, memory: Tensor, memory_valid: Tensor | None,
                      memory_packing: Packing | None) -> None:
        """The memory (b, s, d) or packed (n_s, d) and its validity (b, s), checked once for every layer."""
        cross = self.blocks[0].cross_attn
        assert isinstance(cross, MultiHeadAttention)
        cross.check_input("memory", memory, memory_packing)
        if memory_packing is None and memory.shape[0] != tokens.shape[0]:
            raise ValueError(f"memory batch size {memory.shape[0]} differs from the tokens' {tokens.shape[0]}")
        fits = memory_valid is None or (memory_valid.dim() == 2 and memory_valid.shape[0] in (1, memory.shape[0])
                                        and memory_valid.shape[1] == memory.shape[1])
        if memory_packing is None and not fits:
            raise ValueError(f"memory_valid must be (batch, seq) = {tuple(memory.shape[:2])} like the memory, "
                             f"got {tuple(memory_valid.shape)}")  # type: ignore[union-attr]

    def forward_ragged(self, batches: Sequence[RaggedBatch]) -> tuple[Tensor, list[Packing]]:
        """Several batches through the stack in one pass -> (hidden (n, d), each batch's packing).

        The batches' real tokens are packed one after another: everything but the attention core runs
        once over them all, so a step that decodes some rows and prefills others reads the weights once
        (vLLM's mixed prefill/decode step). Decoder-only stacks over per-row caches; each batch's results
        equal ``forward`` on it alone (tests/consistency/test_ragged_forward.py).
        """
        if self.has_cross or self.segment_embedding is not None:
            raise ValueError("forward_ragged is for decoder-only stacks (no cross-attention, no segments)")
        xs, parts = [], []
        for batch in batches:
            check_tokens("tokens", batch.tokens, self.embedding.num_embeddings)
            b, t = batch.tokens.shape
            if not batch.cache.per_row:
                raise TypeError("forward_ragged needs per-row caches (per_row=True or PagedKVCache, or views of "
                                f"their rows), got {type(batch.cache).__name__}")
            if len(batch.counts) != b or min(batch.counts, default=1) < 1:
                raise ValueError(f"a ragged batch of {b} rows needs {b} counts, each in [1, {t}], got {batch.counts}")
            device = batch.tokens.device
            packing = Packing.of_counts(batch.counts, t, device)
            steps = torch.arange(t)[None, :] < torch.tensor(batch.counts)[:, None]  # (b, t), on the host
            valid = to_device(steps, device)
            positions = self._positions(valid, None, batch.cache)  # (b, t)
            batch.cache.expect(batch.counts)
            inputs = self._self_attention_inputs(valid, positions, batch.cache, packing=packing)
            xs.append(packing.pack(self.dropout(self.embed(batch.tokens, positions))))  # (n_i, d)
            parts.append(inputs)
        x = torch.cat(xs)  # (n, d)
        for i, block in enumerate(self.blocks):
            layer_batches = [(inputs, batch.cache.layers[i]) for inputs, batch in zip(parts, batches, strict=True)]
            x = block.forward_ragged(x, layer_batches)
        hidden = self.final_norm(x) if self.final_norm is not None else x
        return hidden, [inputs.packing for inputs in parts]  # type: ignore[misc]

    def _positions(self, valid: Tensor, positions: Tensor | None, cache: KVCache | None) -> Tensor:
        """(b, t) position ids: ``positions``, else real tokens counted after the cache's; checked."""
        if positions is None:
            start = cache.next_positions()[:, None] if cache is not None else 0
            positions = (start + valid.long().cumsum(dim=1) - 1).clamp(min=0)
        elif positions.shape != valid.shape:
            raise ValueError(f"positions must have the tokens' shape {tuple(valid.shape)}, "
                             f"got {tuple(positions.shape)}")
        return self.check_positions(positions)

    def check_positions(self, positions: Tensor) -> Tensor:
        """``positions`` (b, t) checked against ``max_seq_len``, here or (``reads_data`` False) on the device."""
        if not data_checks.reads_data(positions):
            if not torch.compiler.is_compiling():
                torch._assert_async((positions < self.config.max_seq_len).all(),
                                    f"sequence too long for max_seq_len={self.config.max_seq_len}")
            return positions
        top = int(positions.max())
        if top >= self.config.max_seq_len:
            raise ValueError(f"sequence too long: position {top} needs max_seq_len > {top}, but the "
                             f"model has max_seq_len={self.config.max_seq_len}; shorten the input (or "
                             f"truncate it) or use a model with a larger max_seq_len")
        return positions

    def _self_attention_inputs(self, valid: Tensor, positions: Tensor, cache: KVCache | None, *,
                               pack: bool = False, packing: Packing | None = None) -> AttentionInputs:
        """The self-attention inputs of new tokens (b, t): their slots in ``cache`` (reserved here), the key
        mask over cached + new keys, causality, rotation or bias, and ``packing`` (or, with ``pack``,
        found from ``valid`` where it may be read)."""
        slots = None
        if cache is not None:
            slots = cache.reserve(valid, positions)
            keys_valid, key_positions = cache.valid[:, : cache.length], cache.positions[:, : cache.length]
        else:
            keys_valid, key_positions = valid, positions  # (b, t_k)
        mask = padding_mask(keys_valid)  # (b, 1, 1, t_k), or None: no padding
        # Per-row slots do not line up: causality from positions (one new token per row needs none).
        per_row = slots is not None and slots.per_row
        if per_row and self.causal and valid.shape[1] > 1:
            mask = combine_masks(mask, position_causal_mask(positions, key_positions))  # (b, 1, t, t_k)
        # The real tokens' count sets the packed shapes: learnt only where the data may be read.
        if packing is None and pack and mask is not None and data_checks.reads_data(valid):
            packing = Packing.of(valid)
        return self.attention_inputs(positions, key_positions, mask, slots=slots,
                                     packing=packing, causal=self.causal and not per_row)

    def attention_inputs(self, positions: Tensor, key_positions: Tensor, mask: Tensor | None, *,
                         slots: Slots | None = None, packing: Packing | None = None,
                         causal: bool | None = None) -> AttentionInputs:
        """Self-attention inputs for queries at ``positions`` (b, t) over keys at ``key_positions`` (b, t_k)
        under ``mask``: the bias (ALiBi, T5: (b or 1, h, t, t_k)) or RoPE's (cos, sin), and ``causal``
        (default the stack's own; False when ``mask`` holds causality)."""
        bias = self.relative(positions, key_positions) if self.relative is not None else None
        rotary = self.rotary(positions) if self.rotary is not None else None
        causal = self.causal if causal is None else causal
        return AttentionInputs(mask=mask, bias=bias, causal=causal, rotary=rotary, slots=slots,
                               packing=packing)

    def run(self, tokens: Tensor, inputs: StackInputs, *, cache: KVCache | None = None,
            need_weights: bool = False) -> StackOutput:
        """Embeddings -> blocks -> final norm on prepared inputs: tensor work only, so ``torch.compile``
        traces it whole."""
        x = self.dropout(self.embed(tokens, inputs.positions, inputs.segments))  # (b, t, d)
        if inputs.packing is not None:
            x = inputs.packing.pack(x)  # (n, d): the real tokens only
        out = StackOutput(hidden=x, valid=inputs.valid, packing=inputs.packing)
        for i, block in enumerate(self.blocks):
            x, self_weights, cross_weights = block(
                x, inputs, cache=cache.layers[i] if cache is not None else None, need_weights=need_weights)
            if need_weights:
                out.attentions.append(self_weights)
                if cross_weights is not None:
                    out.cross_attentions.append(cross_weights)
        out.hidden = self.final_norm(x) if self.final_norm is not None else x
        return out
