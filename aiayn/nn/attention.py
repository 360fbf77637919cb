"""Scaled dot-product attention (a pure function) and the one multi-head attention module.

Shape letters: b batch, h query heads, h_kv key/value heads, t_q queries, t_k keys,
d_h head width, d model width. Mask convention: see ``aiayn.nn.masks`` (True = may attend).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.nn.block_causal import block_causal_attention, use_block_causal
from aiayn.nn.dropout import dropout
from aiayn.nn.kv_cache import LayerKVCache, StaticKV
from aiayn.nn.masks import causal_mask
from aiayn.nn.matvec import Linear
from aiayn.nn.packing import Packing
from aiayn.nn.positional import apply_rotary


def _check_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must have 4 dimensions (batch, heads, seq, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
    b, h, t_q, d_h = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            f"attention: batch sizes differ: q has {b}, k has {k.shape[0]}, v has {v.shape[0]}"
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"attention: k and v must agree in heads and length, got k {tuple(k.shape)} and "
            f"v {tuple(v.shape)}"
        )
    if k.shape[3] != d_h:
        raise ValueError(f"attention: q and k head_dim differ: q has {d_h}, k has {k.shape[3]}")
    if h % k.shape[1] != 0:
        raise ValueError(
            f"attention: q heads ({h}) must be a multiple of k/v heads ({k.shape[1]}) for "
            f"grouped-query attention"
        )
    scores_shape = (b, h, t_q, k.shape[2])
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None:
            continue
        if name == "mask" and t.dtype != torch.bool:
            raise TypeError(
                f"attention: mask must be a bool tensor (True = may attend), got dtype {t.dtype}; "
                f"for an additive float mask pass it as bias="
            )
        if name == "bias" and not t.is_floating_point():
            raise TypeError(f"attention: bias must be a float tensor, got dtype {t.dtype}")
        try:
            ok = t.dim() <= 4 and torch.broadcast_shapes(t.shape, scores_shape) == scores_shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"attention: {name} of shape {tuple(t.shape)} does not broadcast to the scores' "
                f"shape (batch, heads, q_len, k_len) = {scores_shape}"
            )


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    impl: str = "fused",
) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T * scale + bias, masked) v, the paper's equation (1).

    Args:
        q: (b, h, t_q, d_h). k, v: (b, h_kv, t_k, d_h) with h a multiple of h_kv (GQA/MQA).
        mask: bool, broadcastable to (b, h, t_q, t_k); True = may attend.
        bias: float, broadcastable to (b, h, t_q, t_k); added to the scores.
        causal: also apply a right-aligned causal mask (queries are the last t_q keys).
        dropout_p: dropout on the attention weights (pass 0.0 in eval).
        scale: multiplies the scores; default 1 / sqrt(d_h).
        need_weights: return the (b, h, t_q, t_k) softmax weights (before dropout). This uses the
            reference path, since the fused kernel never materialises them.
        impl: "fused" (``F.scaled_dot_product_attention``) or "reference" (the equation written
            out). Both give the same result; see tests/parity/test_attention_paths.py.

    Returns:
        (output (b, h, t_q, d_h), weights or None). Queries with no visible key output zeros.
    """
    _check_attention_inputs(q, k, v, mask, bias)
    _b, h, t_q, d_h = q.shape
    h_kv, t_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d_h) if scale is None else scale

    # Only a caller's mask can leave a query with no visible key: a right-aligned causal mask
    # always shows each query at least its own position.
    may_empty_rows = mask is not None
    if causal and t_q == 1:
        causal = False  # one query is the last key: right-aligned, it sees every key (decode step)
    # A single query on the CPU (a decode step, eager or compiled): the written-out path's two
    # batched matrix-vector products read the cached keys and values once each, faster than SDPA's
    # CPU kernels at that shape. Profiled in the decode loop of ``python -m benchmarks.decode`` at
    # batch 16 (4 heads, ~150 cached keys): ~195 us per layer against ~250 us for SDPA's flash
    # kernel and ~290 us for its math path (which the decode step's layouts select; it scales a
    # copy of the keys). Compiled, the same products ran 256 batch-16 steps in 0.75 s against
    # 0.89 s through SDPA.
    single_query_cpu = (t_q == 1 and impl == "fused" and q.device.type == "cpu" and not need_weights
                        and bias is None and dropout_p == 0.0
                        and (mask is None or (mask.dim() == 4 and mask.shape[1:3] == (1, 1))))
    if (t_q == 1 and h != h_kv and impl == "fused" and not need_weights and bias is None
            and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1))):
        # A single-query decode step under GQA: the h / h_kv query heads that share a key/value
        # head become that head's queries, (b, h_kv, g, d_h), so k and v are never repeated.
        out, _ = scaled_dot_product_attention(q.reshape(_b, h_kv, h // h_kv, d_h), k, v, mask=mask,
                                              dropout_p=dropout_p, scale=scale,
                                              impl="reference" if single_query_cpu else impl)
        return out.reshape(_b, h, 1, d_h), None
    if single_query_cpu:
        impl = "reference"
    if causal:
        # Fast path: plain square causal attention needs no materialised mask.
        if (impl == "fused" and not need_weights and mask is None and bias is None and t_q == t_k
                and not (dropout_p > 0 and q.device.type == "cpu")):
            if use_block_causal(q, k, v, dropout_p):  # the CPU: see aiayn.nn.block_causal
                return block_causal_attention(q, k, v, scale), None
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=h != h_kv
            )
            return out, None
        mask_c = causal_mask(t_q, t_k, device=q.device)
        mask = mask_c if mask is None else mask & mask_c

    # Rows with no visible key: remember them, let them attend everywhere (finite softmax, finite
    # gradients), and zero their output afterwards.
    row_valid = None
    if mask is not None and may_empty_rows:
        row_valid = mask.any(dim=-1, keepdim=True)  # (.., t_q, 1)
        mask = mask | ~row_valid

    # With dropout on the weights, SDPA on the CPU runs its unfused math path with a slow
    # Bernoulli mask; the reference path is the same computation with the faster mask.
    fused = impl == "fused" and not need_weights and not (dropout_p > 0 and q.device.type == "cpu")
    if fused:
        attn_mask: Tensor | None = mask
        if bias is not None:
            attn_mask = bias.to(q.dtype)
            if mask is not None:
                attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=h != h_kv
        )
        weights = None
    else:
        if h != h_kv:  # each group of h / h_kv query heads shares one key/value head
            k = k.repeat_interleave(h // h_kv, dim=1)
            v = v.repeat_interleave(h // h_kv, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (b, h, t_q, t_k)
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        # Softmax in float32 for half-precision inputs; the weights go back to q's dtype.
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        if row_valid is not None:
            weights = weights.masked_fill(~row_valid, 0.0)
        dropped = dropout(weights, dropout_p) if dropout_p > 0 else weights
        out = torch.matmul(dropped, v)  # (b, h, t_q, d_h)

    if row_valid is not None:
        out = out.masked_fill(~row_valid, 0.0)
    return out, weights if need_weights else None


class MultiHeadAttention(nn.Module):
    """Multi-head attention (paper section 3.2.2), self or cross, MHA / GQA / MQA.

    Self-attention projects q, k, v with one fused matrix; cross-attention projects q from the
    decoder stream and k, v (fused) from the encoder memory. ``n_kv_heads`` < ``n_heads`` shares
    each key/value head among ``n_heads / n_kv_heads`` query heads (GQA; 1 = MQA).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        cross: bool = False,
        bias: bool = True,
        out_bias: bool | None = None,
        dropout: float = 0.0,
        impl: str = "fused",
    ) -> None:
        """``bias`` switches the biases of the q/k/v projections, ``out_bias`` that of the output
        projection (None = same as ``bias``; Qwen2 has q/k/v biases but none on the output)."""
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
            self.q_proj = Linear(d_model, q_width, bias=bias)
            self.kv_proj = Linear(d_model, 2 * kv_width, bias=bias)
        else:
            self.qkv_proj = Linear(d_model, q_width + 2 * kv_width, bias=bias)
        self.out_proj = Linear(q_width, d_model, bias=out_bias)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        """(b, t, n * d_h) -> (b, n, t, d_h)"""
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def _check_input(self, name: str, x: Tensor, packing: Packing | None = None) -> None:
        if packing is not None:
            if x.dim() != 2 or x.shape != (packing.n_tokens, self.d_model):
                raise ValueError(
                    f"MultiHeadAttention: packed {name} must be (real tokens={packing.n_tokens}, "
                    f"d_model={self.d_model}), got shape {tuple(x.shape)}"
                )
        elif x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"MultiHeadAttention: {name} must be (batch, seq, d_model={self.d_model}), "
                f"got shape {tuple(x.shape)}"
            )

    def project_kv(self, memory: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of the encoder memory (b, s, d), or of its real tokens
        (n_s, d) packed by ``packing``, -> 2 x (b, h_kv, s, d_h) (zeros at padding if packed)."""
        self._check_input("memory", memory, packing)
        kv = self.kv_proj(memory)  # (b, s, 2 kv) or (n_s, 2 kv)
        k, v = (packing.unpack(kv) if packing is not None else kv).chunk(2, dim=-1)
        return self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        causal: bool = False,
        rotary: tuple[Tensor, Tensor] | None = None,
        kv_cache: LayerKVCache | StaticKV | None = None,
        cache_pos: int | Tensor = 0,
        need_weights: bool = False,
        packing: Packing | None = None,
        memory_packing: Packing | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from x (b, t, d) to itself (self) or to ``memory`` (b, s, d) (cross).

        Args:
            mask, bias: over the keys *including* cached ones, broadcastable to (b, h, t, t_k).
            causal: right-aligned causal masking (decoder self-attention).
            rotary: (cos, sin) of shape (b or 1, t, d_h) for RoPE, applied to q and new k.
            kv_cache: self-attention: a ``LayerKVCache``; the new k, v are written at
                ``cache_pos`` and attention runs over positions [0, cache_pos + t). A (t,) tensor
                ``cache_pos`` is the compiled decode step: attention runs over the buffer's first
                t_k slots, t_k = ``mask``'s last dimension (the filled prefix), which ``mask``
                describes.
                Cross-attention: a ``StaticKV``; memory's k, v are computed on first use and reused.
            need_weights: also return the (b, h, t, t_k) attention weights.
            packing, memory_packing: x (or memory) is packed, (n, d) real tokens only
                (``aiayn.nn.packing``): the projections run on the real tokens, attention on the
                padded layout, and the output is packed (n, d) too. No cache then.

        Returns:
            (output (b, t, d) or packed (n, d), weights or None)
        """
        self._check_input("x", x, packing)
        if packing is not None and kv_cache is not None:
            raise ValueError("MultiHeadAttention: packed inputs (packing=) do not go with a KV cache")
        b, t = (packing.batch, packing.length) if packing is not None else x.shape[:2]
        if self.cross:
            q = self.q_proj(x)  # (b, t, h * d_h) or packed (n, h * d_h)
            q = self._heads(packing.unpack(q) if packing is not None else q, self.n_heads)
            if isinstance(kv_cache, StaticKV) and kv_cache.k is not None:
                k, v = kv_cache.k, kv_cache.v
            else:
                if memory is None:
                    raise ValueError("MultiHeadAttention(cross=True) needs memory= (the encoder output)")
                k, v = self.project_kv(memory, memory_packing)
                if isinstance(kv_cache, StaticKV):
                    kv_cache.k, kv_cache.v = k, v
        else:
            if memory is not None:
                raise ValueError("self-attention got memory=; build MultiHeadAttention(cross=True)")
            q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            qkv = self.qkv_proj(x)  # (b, t, q + 2 kv) or packed (n, q + 2 kv)
            q, k, v = (packing.unpack(qkv) if packing is not None else qkv).split([q_width, kv_width, kv_width], dim=-1)
            q, k, v = self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)
            if rotary is not None:
                cos, sin = rotary
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if isinstance(kv_cache, LayerKVCache):
                k, v = kv_cache.write(k, v, cache_pos)  # (b, h_kv, cache_pos + t, d_h)
                if isinstance(cache_pos, Tensor):  # the compiled step: the prefix the mask covers
                    if mask is None:
                        raise ValueError("a tensor cache_pos (the compiled decode step) needs mask= over the "
                                         "filled cache slots")
                    k, v = k[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]]
        out, weights = scaled_dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            impl=self.impl,
        )
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (b, t, h * d_h)
        if packing is not None:
            out = packing.pack(out)  # (n, h * d_h): the output projection on real tokens only
        return self.out_proj(out), weights
