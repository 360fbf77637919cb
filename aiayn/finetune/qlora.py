"""QLoRA (Dettmers et al. 2023): LoRA adapters trained over a base kept in 4-bit blocks.

``apply_qlora`` is ``apply_lora`` with every attention and MLP projection's frozen weight in ``aiayn.fast.q4``
blocks (a GGUF file's own, or quantised); embeddings, norms, the output layer and the adapters stay float32.
The q4 kernel has no backward: ``FrozenBlockProduct``'s gives grad_x = grad_y W, W dequantised for that one
layer. Shape letters: m rows, k in, n out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.fast.q4 import (
    GROUP,
    Q4_BLOCK,
    BlockLinear,
    BlockWeight,
    block_matmul,
    quantize_blocks_q4,
)
from aiayn.finetune.lora import LoraConfig, LoraLinear, add_update, apply_lora, projection_sites
from aiayn.interop.gguf import GGUF_MAGIC, load_gguf


class FrozenBlockProduct(torch.autograd.Function):
    """x (m, k) float32 -> x W^T (m, n) through the 4-bit kernel, with the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: BlockLinear) -> Tensor:
        ctx.layer = layer
        return block_matmul(x, layer.weight_blocks)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        w = ctx.layer.dequantized().to(grad.device)  # (n, k), this layer's only: freed on return
        return grad.float() @ w, None


class FrozenBlockLinear(BlockLinear):
    """A ``BlockLinear`` whose input gets a gradient (its weight and bias none)."""

    def forward(self, x: Tensor) -> Tensor:
        y = FrozenBlockProduct.apply(x.reshape(-1, self.in_features).float(), self)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class QLoraLinear(FrozenBlockLinear):
    """A frozen 4-bit layer plus a ``LoraLinear``'s adapters and update (``lora.add_update``)."""

    lora_rows: dict[str, tuple[int, int]]
    scaling: float

    def forward(self, x: Tensor) -> Tensor:
        return add_update(self, super().forward(x), x)


def apply_qlora(model: nn.Module, config: LoraConfig, blocks: Mapping[str, BlockWeight] | None = None) -> nn.Module:
    """``apply_lora``, then each projection in 4-bit blocks: ``blocks[path]`` where given, else quantised (one
    whose input width is not a multiple of 32 stays float)."""
    apply_lora(model, config)
    for path in dict.fromkeys(path for path, _, _ in projection_sites(model)):
        layer = model.get_submodule(path)
        if isinstance(layer, nn.Linear) and layer.in_features % Q4_BLOCK == 0:
            parent, _, child = path.rpartition(".")
            given = None if blocks is None else blocks.get(path)
            setattr(model.get_submodule(parent) if parent else model, child, four_bit(layer, given))
    return model


def four_bit(layer: nn.Linear, blocks: BlockWeight | None = None) -> FrozenBlockLinear:
    """``layer`` (``nn.Linear`` or ``LoraLinear``) with its weight in blocks, its bias and adapters kept."""
    if blocks is None:
        blocks = _meta_blocks(layer.weight) if layer.weight.is_meta else quantize_blocks_q4(layer.weight)
    if (blocks.n, blocks.k) != tuple(layer.weight.shape):
        raise ValueError(f"blocks of shape ({blocks.n}, {blocks.k}) for a weight of {tuple(layer.weight.shape)}")
    if not isinstance(layer, LoraLinear):
        return FrozenBlockLinear(blocks, layer.bias)
    new = QLoraLinear(blocks, layer.bias)
    new.lora_A, new.lora_B, new.lora_dropout = layer.lora_A, layer.lora_B, layer.lora_dropout
    new.lora_rows, new.scaling = layer.lora_rows, layer.scaling
    return new


def _meta_blocks(weight: Tensor) -> BlockWeight:
    """Blocks of ``quantize_blocks_q4``'s sizes on the meta device, for the memory check's meta build."""
    n, k = weight.shape
    groups = -(-n // GROUP)

    def empty(width: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(groups, width, dtype=dtype, device="meta")

    scale, mins = empty(k // Q4_BLOCK * GROUP, torch.float32), empty(k // Q4_BLOCK * GROUP, torch.float32)
    return BlockWeight(empty(k * GROUP // 2, torch.uint8), scale, mins, 0, Q4_BLOCK, True, n, k, "q4")


def gguf_blocks(path: Path) -> dict[str, BlockWeight]:
    """A GGUF file's weight matrices in 4-bit blocks by module path (its own 4-bit blocks as they are)."""
    packed = load_gguf(path, tokenizer=False, quantize="q4").model
    return {name: m.weight_blocks for name, m in packed.named_modules() if isinstance(m, BlockLinear)}


def qlora_adapt(config: LoraConfig, source: Path | None) -> Callable[[nn.Module], nn.Module]:
    """The trainer's ``apply_qlora`` step, with ``source``'s blocks when it is a GGUF file (not read for the
    memory check's meta copy)."""
    gguf = _gguf_file(source)

    def adapt(model: nn.Module) -> nn.Module:
        real = not any(p.is_meta for p in model.parameters())
        return apply_qlora(model, config, gguf_blocks(gguf) if gguf is not None and real else None)

    return adapt


def _gguf_file(path: Path | None) -> Path | None:
    """``path`` when it is a GGUF file (its magic bytes), else None."""
    if path is None or not path.is_file():
        return None
    with path.open("rb") as handle:
        return path if handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC else None
