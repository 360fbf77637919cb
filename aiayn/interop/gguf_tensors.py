"""A GGUF LLaMA's tensors one by one: Hugging Face names, PyTorch shapes and float values."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from aiayn.interop.gguf_text import GGUFError

if TYPE_CHECKING:
    from gguf import ReaderTensor

# llama.cpp's tensor names -> Hugging Face LlamaForCausalLM's (gguf's tensor_mapping, LLaMA part).
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PER_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
# Stored by some old converters, derived from the config (aiayn computes its own RoPE tables).
IGNORED = re.compile(r"blk\.\d+\.attn_rot_embd")
BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face's LLaMA name for a llama.cpp tensor name (None: not a LLaMA tensor)."""
    base, _, kind = gguf_name.rpartition(".")
    if base in TOP_LEVEL and kind in ("weight", "bias"):
        return f"{TOP_LEVEL[base]}.{kind}"
    m = BLOCK_NAME.fullmatch(gguf_name)
    if m and m[2] in PER_BLOCK:
        return f"model.layers.{m[1]}.{PER_BLOCK[m[2]]}.{m[3]}"
    return None


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-first."""
    return tuple(int(n) for n in reversed(tensor.shape))


def rope_heads(gguf_name: str, hf_config: dict[str, Any]) -> int | None:
    """The heads of a q or k projection (whose rows llama.cpp permuted for RoPE); None for other tensors."""
    m = BLOCK_NAME.fullmatch(gguf_name)
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    return heads.get(m[2]) if m else None


def float_tensor(tensor: ReaderTensor, hf_config: dict[str, Any]) -> Tensor:
    """One GGUF tensor as a float32 torch tensor, q/k rows in Hugging Face's RoPE order."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)  # float32, or a view of the memory map: copied
    value = torch.from_numpy(np.array(values, dtype=np.float32, copy=True).reshape(torch_shape(tensor)))
    heads = rope_heads(tensor.name, hf_config)
    return value if heads is None else unpermute_rope_rows(value, heads)


def unpermute_rope_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's per-head row interleaving of a q or k projection (for ggml's adjacent-pair RoPE;
    aiayn, like Hugging Face, rotates halves). weight (n_heads * d_h, ...) -> same shape."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"a q/k projection with {rows} rows cannot be split into {n_heads} heads of even width")
    half = rows // n_heads // 2
    # (h, d_h/2, 2, ...) pairs -> (h, 2, d_h/2, ...) halves
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
