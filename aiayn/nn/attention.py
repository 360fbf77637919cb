"""Scaled dot-product attention, the paper's equation (1), and multi-head attention (section 3.2.2).
``attention`` is equation (1) written out; ``attend`` prepares the masks and runs it (or torch's
fused kernel when no weights are asked for); ``scaled_dot_product_attention`` checks, then attends.

Shape letters: b batch, h query heads, h_kv key/value heads, t / t_q queries, t_k keys, s source
length, d_h head width, d model width. Masks: ``aiayn.nn.masks`` (True = may attend)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.nn.kv_layer import LayerKVCache, Slots
from aiayn.nn.masks import AttentionMasks, attention_masks
from aiayn.nn.packing import Packing
from aiayn.nn.positional import apply_rotary


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, bias: Tensor | None = None,
              scale: float | None = None, dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Equation (1), written out: softmax(Q K^T / sqrt(d_k) + bias, masked) V -> (output (b, h, t_q, d_h),
    weights (b, h, t_q, t_k) before dropout). Unchecked: a query that sees no key gets NaN here."""
    if q.shape[1] != k.shape[1]:  # GQA: each group of h / h_kv query heads shares one k/v head
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # 1 / sqrt(d_k)
    scores = q @ k.transpose(-2, -1) * scale  # (b, h, t_q, t_k)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # float32 softmax
    return F.dropout(weights, dropout_p) @ v, weights  # (b, h, t_q, d_h), (b, h, t_q, t_k)


def _dispatch(q: Tensor, k: Tensor, v: Tensor, masks: AttentionMasks, dropout_p: float,
              scale: float | None, need_weights: bool) -> tuple[Tensor, Tensor | None]:
    """Equation (1) on prepared masks: ``attention`` for the weights, else torch's fused kernel."""
    if need_weights:
        return attention(q, k, v, masks.mask, masks.bias, scale, dropout_p)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.combined, dropout_p=dropout_p,
                                         is_causal=masks.is_causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out, None


def attend(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, bias: Tensor | None = None,
           causal: bool = False, dropout_p: float = 0.0, scale: float | None = None,
           need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """``scaled_dot_product_attention`` without the input checks (its caller has checked once)."""
    masks = attention_masks(mask, bias, causal, q.shape[2], k.shape[2], q.dtype, q.device,
                            fused=not need_weights)
    out, weights = _dispatch(q, k, v, masks, dropout_p, scale, need_weights)
    return _zero_rows(out, masks.row_valid), _zero_rows(weights, masks.row_valid)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None,
                                 bias: Tensor | None = None, causal: bool = False,
                                 dropout_p: float = 0.0, scale: float | None = None,
                                 need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """Equation (1), checked. q: (b, h, t_q, d_h); k, v: (b, h_kv, t_k, d_h), h a multiple of h_kv
    (GQA/MQA). mask (bool) and bias (float: ALiBi, T5) broadcast to (b, h, t_q, t_k); 3-D ones are
    (b, t_q, t_k), shared by the heads. causal: right-aligned. A query with no visible key outputs zeros."""
    _check_attention_inputs(q, k, v, mask, bias)
    return attend(q, k, v, mask=mask, bias=bias, causal=causal, dropout_p=dropout_p, scale=scale,
                  need_weights=need_weights)


def _zero_rows(x: Tensor | None, row_valid: Tensor | None) -> Tensor | None:
    """x (.., t_q, f) with the rows of queries that see no key (row_valid False) set to zero."""
    return x if row_valid is None or x is None else x.masked_fill(~row_valid, 0.0)


def _check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                            bias: Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must have 4 dimensions (batch, heads, seq, head_dim), "
                             f"got shape {tuple(t.shape)}")
    b, h, t_q, d_h = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"attention: batch sizes differ: q has {b}, k has {k.shape[0]}, v has {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"attention: k and v must agree in heads and length, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    if k.shape[3] != d_h:
        raise ValueError(f"attention: q and k head_dim differ: q has {d_h}, k has {k.shape[3]}")
    if h % k.shape[1] != 0:
        raise ValueError(f"attention: q heads ({h}) must be a multiple of k/v heads ({k.shape[1]}) for "
                         f"grouped-query attention")
    scores_shape = (b, h, t_q, k.shape[2])
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None:
            continue
        if name == "mask" and t.dtype != torch.bool:
            raise TypeError(f"attention: mask must be a bool tensor (True = may attend), got dtype {t.dtype}; "
                            f"for an additive float mask pass it as bias=")
        if name == "bias" and not t.is_floating_point():
            raise TypeError(f"attention: bias must be a float tensor, got dtype {t.dtype}")
        shape = (t.shape[0], 1, *t.shape[1:]) if t.dim() == 3 else t.shape  # 3-D: (b, t_q, t_k)
        try:
            ok = t.dim() <= 4 and torch.broadcast_shapes(shape, scores_shape) == scores_shape
        except RuntimeError:
            ok = False
        if not ok and t.dim() == 3:
            raise ValueError(f"attention: a 3-D {name} is (batch, q_len, k_len), the same for every head; shape "
                             f"{tuple(t.shape)} does not fit batch {b}, q_len {t_q}, k_len {k.shape[2]} (for a "
                             f"mask per head give 4 dimensions: (batch or 1, heads, q_len, k_len))")
        if not ok:
            raise ValueError(f"attention: {name} of shape {tuple(t.shape)} does not broadcast to the scores' "
                             f"shape (batch, heads, q_len, k_len) = {scores_shape}")


AttentionKernel = Callable[..., tuple[Tensor, Tensor | None]]  # ``attend``'s signature (checked inputs)
# (q, k, v, cache, inputs) -> output read from the cache's own storage (k, v written there), or None.
CacheAttentionKernel = Callable[..., Tensor | None]


@dataclass
class AttentionInputs:
    """What a stack's forward computes once for every attention layer."""

    mask: Tensor | None = None  # bool (b, 1, 1 or t, t_k), True = may attend
    bias: Tensor | None = None  # float (b or 1, h, t, t_k), added to the scores (ALiBi, T5)
    causal: bool = False  # right-aligned causal masking on top of ``mask``
    rotary: tuple[Tensor, Tensor] | None = None  # RoPE (cos, sin), each (b or 1, t, d_h)
    slots: Slots | None = None  # self-attention over a KV cache: the cache's ``reserve``
    packing: Packing | None = None  # x is packed: (n, d), its real tokens only (aiayn.nn.packing)
    memory_packing: Packing | None = None  # cross-attention: the memory is packed, (n_s, d)


_NO_INPUTS = AttentionInputs()  # no mask, bias, rotation, cache slots or packing (never modified)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (paper section 3.2.2), self or cross, MHA / GQA / MQA (``n_kv_heads`` <
    ``n_heads``: each key/value head serves ``n_heads / n_kv_heads`` query heads)."""

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 head_dim: int | None = None, cross: bool = False, bias: bool = True,
                 out_bias: bool | None = None, dropout: float = 0.0, impl: str = "fused") -> None:
        """``bias``: the q/k/v projections' biases; ``out_bias``: the output projection's (None = ``bias``)."""
        super().__init__()
        out_bias = bias if out_bias is None else out_bias
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        head_dim = d_model // n_heads if head_dim is None else head_dim
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.cross, self.dropout, self.impl = cross, dropout, impl
        q_width, kv_width = n_heads * head_dim, n_kv_heads * head_dim
        if cross:
            self.q_proj = nn.Linear(d_model, q_width, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * kv_width, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, q_width + 2 * kv_width, bias=bias)
        self.out_proj = nn.Linear(q_width, d_model, bias=out_bias)
        # Equation (1) on checked inputs; aiayn.fast may swap in a faster kernel with the same signature.
        self.kernel: AttentionKernel = attend

    # None: the cache returns its keys and values and ``kernel`` attends; aiayn.fast may set one.
    cache_kernel: CacheAttentionKernel | None = None

    def _heads(self, x: Tensor, n: int, packing: Packing | None = None) -> Tensor:
        """(b, t, n * d_h), or packed (n_tokens, n * d_h) -> (b, n, t, d_h) (zeros at padding)"""
        x = packing.unpack(x) if packing is not None else x
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def check_input(self, name: str, x: Tensor, packing: Packing | None = None) -> None:
        if packing is not None:
            if x.dim() != 2 or x.shape != (packing.n_tokens, self.d_model):
                raise ValueError(f"MultiHeadAttention: packed {name} must be (real tokens={packing.n_tokens}, "
                                 f"d_model={self.d_model}), got shape {tuple(x.shape)}")
        elif x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"MultiHeadAttention: {name} must be (batch, seq, d_model={self.d_model}), "
                             f"got shape {tuple(x.shape)}")

    def project_kv(self, memory: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of the memory (b, s, d), or packed (n_s, d) -> 2 x (b, h_kv, s, d_h)."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)  # (b, s, kv) or packed (n_s, kv) each
        return self._heads(k, self.n_kv_heads, packing), self._heads(v, self.n_kv_heads, packing)

    def forward(self, x: Tensor, memory: Tensor | None = None, *,
                inputs: AttentionInputs | None = None, cache: LayerKVCache | tuple[Tensor, Tensor] | None = None,
                need_weights: bool = False, checked: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attend from x (b, t, d), or packed (n, d), to itself or to ``memory`` (b, s, d) -> (output like
        x, weights (b, h, t, t_k) or None). cache: a ``LayerKVCache`` (self-attention: written at
        ``inputs.slots``) or a (k, v) pair (cross). checked: skip the input checks (a stack checks once)."""
        inputs = inputs or _NO_INPUTS
        packing = inputs.packing
        if not checked:
            self._check_inputs(x, memory, inputs)
        if self.cross:
            q = self._heads(self.q_proj(x), self.n_heads, packing)  # (b, h, t, d_h)
            k, v = self._memory_kv(memory, inputs.memory_packing, cache)  # (b, h_kv, s, d_h) each
            out, weights = self._kernel(q, k, v, inputs, need_weights, checked)  # (b, h, t, d_h)
        else:
            out, weights = self._attend_self(self.qkv_proj(x), inputs, cache, need_weights, checked)
        return self.out_proj(self._merge_heads(out, packing)), weights if need_weights else None

    def _check_inputs(self, x: Tensor, memory: Tensor | None, inputs: AttentionInputs) -> None:
        self.check_input("x", x, inputs.packing)
        if memory is not None and not self.cross:
            raise ValueError("self-attention got memory=; build MultiHeadAttention(cross=True)")
        if memory is not None:
            self.check_input("memory", memory, inputs.memory_packing)

    def _kernel(self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, need_weights: bool,
                checked: bool = True) -> tuple[Tensor, Tensor | None]:
        if not checked:
            _check_attention_inputs(q, k, v, inputs.mask, inputs.bias)
        return self.kernel(
            q, k, v, mask=inputs.mask, bias=inputs.bias, causal=inputs.causal,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights or self.impl == "reference",
        )  # (b, h, t, d_h), weights

    def forward_ragged(self, x: Tensor, batches: Sequence[tuple[AttentionInputs, LayerKVCache]]) -> Tensor:
        """Self-attention of several batches' real tokens packed in x (n_1 + ... + n_g, d): the projections
        once over all of them (one read of the weights), the core per batch over its own cache. Its caller,
        ``TransformerStack.forward_ragged``, checked the batches: each has its packing."""
        sizes = [inputs.packing.n_tokens for inputs, _ in batches]  # type: ignore[union-attr]
        parts = self.qkv_proj(x).split(sizes)  # (n_i, q + 2 kv) each: one pass over the weights
        outs = [self._merge_heads(self._attend_self(part, inputs, cache, False)[0], inputs.packing)
                for part, (inputs, cache) in zip(parts, batches, strict=True)]  # (n_i, h * d_h) each
        return self.out_proj(torch.cat(outs))  # (sum n_i, d)

    def _attend_self(self, qkv: Tensor, inputs: AttentionInputs, cache: LayerKVCache | tuple[Tensor, Tensor] | None,
                     need_weights: bool, checked: bool = True) -> tuple[Tensor, Tensor | None]:
        """Self-attention from the projected qkv (b, t, q + 2 kv) or (n, q + 2 kv)."""
        packing = inputs.packing
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)  # (b, t, .) or (n, .)
        q = self._heads(q, self.n_heads, packing)  # (b, h, t, d_h)
        k, v = self._heads(k, self.n_kv_heads, packing), self._heads(v, self.n_kv_heads, packing)
        if inputs.rotary is not None:  # RoPE rotates the new queries and keys by their positions
            q, k = apply_rotary(q, *inputs.rotary), apply_rotary(k, *inputs.rotary)
        plain_only = need_weights or self.impl == "reference" or (self.training and self.dropout > 0)
        if cache is not None and self.cache_kernel is not None and not plain_only:
            out = self.cache_kernel(q, k, v, cache, inputs)  # (b, h, t, d_h), or None: not here
            if out is not None:
                return out, None
        if cache is not None:
            k, v = self._cached_kv(cache, k, v, inputs)  # (b, h_kv, t_k, d_h): cached + new
        return self._kernel(q, k, v, inputs, need_weights, checked)  # (b, h, t, d_h), weights

    def _merge_heads(self, out: Tensor, packing: Packing | None) -> Tensor:
        """The heads' outputs (b, h, t, d_h) -> (b, t, h * d_h), or (n, h * d_h) packed."""
        b, t = out.shape[0], out.shape[2]
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (b, t, h * d_h)
        return packing.pack(out) if packing is not None else out

    def _memory_kv(self, memory: Tensor | None, memory_packing: Packing | None,
                   cache: LayerKVCache | tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """Cross-attention k, v (b, h_kv, s, d_h): a given pair, the cache layer's, or projected (and cached)."""
        if isinstance(cache, tuple):
            return cache
        if cache is not None and cache.cross is not None:
            return cache.cross
        if memory is None:
            raise ValueError("MultiHeadAttention(cross=True) needs memory= (the encoder output)")
        kv = self.project_kv(memory, memory_packing)
        if cache is not None:
            cache.cross = kv
        return kv

    @staticmethod
    def _cached_kv(cache: LayerKVCache | tuple[Tensor, Tensor], k: Tensor, v: Tensor,
                   inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
        """Write the new k, v (b, h_kv, t, d_h) into the cache; the keys attention runs over."""
        if not isinstance(cache, LayerKVCache):
            raise ValueError("self-attention takes a LayerKVCache (a (k, v) pair is for cross-attention)")
        if inputs.slots is None:
            raise ValueError("self-attention over a cache needs inputs.slots (the cache's reserve)")
        return cache.write(k, v, inputs.slots)  # (b, h_kv, slots.end, d_h)
