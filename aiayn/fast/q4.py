"""Block-quantised weights kept packed: 4-bit (and 8-bit) linear layers and embeddings, one format for
every GGUF block type aiayn reads (docs/q4.md): w[n, k] = scale[n, b] * (q[n, k] - offset) + min[n, b],
b = k // block. ``BlockLinear`` multiplies with ``q4_kernel.cpp`` (activations quantised per block to
int8, as llama.cpp does). Shape letters: n out, k in, b blocks, m rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.fast import q4_build, switch
from aiayn.fast.onednn import onednn_linear, use_onednn

GROUP = 16  # rows interleaved together in memory: the 16 int32 lanes of an AVX-512 vector
Q4_BLOCK = 32  # the block of quantize_q4_ (Q4_1's)


@dataclass
class BlockWeight:
    """An (n, k) matrix in blocks (``kind``: its source, e.g. "Q4_1"), laid out for the kernel: rows
    interleaved by 16 (n padded); ``q`` in units of 64 bytes = 16 rows x 4 inputs (a nibble unit u holds
    inputs 4u..4u+3 low and 4(u + block/8).. high); ``scale``, ``mins`` (n/16, k/block * 16)."""

    q: Tensor
    scale: Tensor
    mins: Tensor | None
    offset: int
    block: int
    nibbles: bool
    n: int
    k: int
    kind: str

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.mins) if t is not None)

    @property
    def groups(self) -> int:
        return self.q.shape[0]

    @classmethod
    def from_values(cls, values: Tensor, scale: Tensor, mins: Tensor | None, *, offset: int, block: int,
                    kind: str, nibbles: bool | None = None) -> BlockWeight:
        """values (n, k) integers in [0, 256) ([0, 16) for nibbles), scale and mins (n, k / block)."""
        n, k = values.shape
        if block not in (16, 32) or k % block or k == 0:
            raise ValueError(f"blocks of {block} inputs cannot tile rows of {k}; aiayn packs blocks of 16 or 32")
        if scale.shape != (n, k // block) or (mins is not None and mins.shape != scale.shape):
            raise ValueError(f"scales of shape {tuple(scale.shape)} do not match {n} rows of {k // block} blocks")
        top = int(values.max()) if values.numel() else 0
        if nibbles is None:
            nibbles = top < 16
        if top >= (16 if nibbles else 256) or (values.numel() and int(values.min()) < 0):
            raise ValueError(f"block values must lie in [0, {16 if nibbles else 256}), got max {top}")
        groups, nb, quads = -(-n // GROUP), k // block, block // 4
        pad = groups * GROUP - n
        v = F.pad(values.to(torch.uint8), (0, 0, 0, pad)).reshape(groups, GROUP, nb, quads, 4)
        v = v.permute(0, 2, 3, 1, 4)  # (groups, blocks, quads, 16 rows, 4 inputs)
        if nibbles:
            v = v[:, :, : quads // 2] | (v[:, :, quads // 2:] << 4)

        # float16 where every scale and min is one exactly (fewer bytes to read), else float32.
        exact16 = all(torch.equal(t.float().half().float(), t.float()) for t in (scale, mins) if t is not None)
        kept = torch.float16 if exact16 else torch.float32

        def grouped(t: Tensor) -> Tensor:  # (n, nb) -> (groups, nb * 16)
            t = F.pad(t.float(), (0, 0, 0, pad)).reshape(groups, GROUP, nb)
            return t.transpose(1, 2).reshape(groups, nb * GROUP).to(kept).contiguous()

        return cls(v.reshape(groups, -1).contiguous(), grouped(scale), None if mins is None else grouped(mins),
                   int(offset), block, bool(nibbles), n, k, kind)

    def values(self) -> Tensor:
        """The integers q (n, k) as uint8, in row order."""
        nb, quads = self.k // self.block, self.block // 4
        units = quads // 2 if self.nibbles else quads
        v = self.q.reshape(self.groups, nb, units, GROUP, 4)
        if self.nibbles:
            v = torch.cat((v & 0x0F, v >> 4), dim=2)  # (groups, nb, quads, 16, 4)
        return v.permute(0, 3, 1, 2, 4).reshape(self.groups * GROUP, self.k)[: self.n]

    def row_scales(self) -> tuple[Tensor, Tensor | None]:
        """scale and mins as (n, k / block), in row order."""
        nb = self.k // self.block

        def rows(t: Tensor) -> Tensor:
            return t.float().reshape(self.groups, nb, GROUP).transpose(1, 2).reshape(-1, nb)[: self.n]

        return rows(self.scale), None if self.mins is None else rows(self.mins)

    def dequantize_rows(self, rows: Tensor | None = None) -> Tensor:
        """Float32 w (n, k) (or rows (r,) -> (r, k)), in the ``gguf`` package's order (the same floats)."""
        ops = q4_build.OPS if switch.enabled() else None
        if ops is not None and self.q.device.type == "cpu":
            return ops.dequantize(self.q, self.scale, self.mins, self.offset, self.block, self.nibbles, self.n,
                                  self.k, rows)
        values, (scale, mins) = self.values(), self.row_scales()
        if rows is not None:
            values, scale, mins = values[rows], scale[rows], None if mins is None else mins[rows]
        w = scale.repeat_interleave(self.block, dim=1) * (values.float() - self.offset)  # exact: small integers
        if mins is not None:
            w = w + mins.repeat_interleave(self.block, dim=1)
        return w


def error_bound(x: Tensor, weight: BlockWeight) -> Tensor:
    """The bound on |kernel(x) - x W^T| (m, n) from quantising x per block: sum over blocks of dx / 2 *
    sum |w|, dx = max |x| / 127 over the block (float32 rounding on top)."""
    m, k, block = x.shape[0], weight.k, weight.block
    dx = x.reshape(m, k // block, block).abs().amax(-1) / 127  # (m, b)
    absw = weight.dequantize_rows().abs().reshape(weight.n, k // block, block).sum(-1)  # (n, b)
    return (dx / 2) @ absw.T


def block_matmul(x: Tensor, weight: BlockWeight) -> Tensor:
    """x (m, k) float32 -> (m, n) float32: the C++ kernel, or the dequantised matrix (``plain_torch``)."""
    ops = q4_build.OPS if switch.enabled() else None
    if ops is None or x.device.type != "cpu":
        w = weight.dequantize_rows().to(x.device)
        return onednn_linear(x, w) if use_onednn(x, w) else F.linear(x, w)
    return ops.matmul(x.contiguous(), weight.q, weight.scale, weight.mins, weight.offset, weight.block,
                      weight.nibbles, weight.n, weight.k)


class _BlockStorage(nn.Module):
    """A ``BlockWeight`` held as a module: buffers ``q``, ``scale``, ``mins`` and its format."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.offset, self.block, self.nibbles, self.kind = weight.offset, weight.block, weight.nibbles, weight.kind
        # The format in one tuple attribute: a compiled graph guards on every attribute it reads.
        self.spec = (weight.offset, weight.block, weight.nibbles, weight.n, weight.k)
        self.register_buffer("q", weight.q)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("mins", weight.mins)

    @property
    def weight_blocks(self) -> BlockWeight:
        offset, block, nibbles, n, k = self.spec
        return BlockWeight(self.q, self.scale, self.mins, offset, block, nibbles, n, k, self.kind)


class BlockLinear(_BlockStorage):
    """y = x W^T + b with W a ``BlockWeight`` (buffers ``q``, ``scale``, ``mins``; float32 bias)."""

    def __init__(self, weight: BlockWeight, bias: Tensor | None = None) -> None:
        super().__init__(weight)
        q4_build.kernel_ops()  # built (or found in the cache) now, not inside a compiled graph
        self.in_features, self.out_features = weight.k, weight.n
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BlockLinear:
        """A float layer quantised to 4 bits (``quantize_blocks_q4``)."""
        return cls(quantize_blocks_q4(linear.weight.detach()), linear.bias)

    def dequantized(self) -> Tensor:
        """The float32 weight (n, k) this layer stands for."""
        return self.weight_blocks.dequantize_rows()

    def forward(self, x: Tensor) -> Tensor:
        """x (..., k) -> (..., n), in x's dtype (computed in float32)."""
        offset, block, nibbles, n, k = self.spec  # one attribute read (see _BlockStorage)
        shape = x.shape
        x2 = x.reshape(-1, k).float()
        ops = q4_build.OPS if switch.enabled() else None
        if ops is not None and x.device.type == "cpu":
            y = ops.matmul(x2.contiguous(), self.q, self.scale, self.mins, offset, block, nibbles, n, k)
        else:
            y = block_matmul(x2, self.weight_blocks)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], n)

    def extra_repr(self) -> str:
        bits = 4 if self.nibbles else 8
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}: {bits}-bit, "
                f"blocks of {self.block}")


class BlockEmbedding(_BlockStorage):
    """An embedding table kept in blocks: looks up rows and dequantises only those (float32)."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__(weight)
        self.num_embeddings, self.embedding_dim = weight.n, weight.k

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (...) long -> (..., d) float32."""
        offset, block, nibbles, n, k = self.spec
        ops = q4_build.OPS if switch.enabled() else None
        if ops is not None and tokens.device.type == "cpu":
            rows = ops.dequantize(self.q, self.scale, self.mins, offset, block, nibbles, n, k, tokens.reshape(-1))
        else:
            rows = self.weight_blocks.dequantize_rows(tokens.reshape(-1))
        return rows.reshape(*tokens.shape, k)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} blocks of {self.block}"


def quantize_blocks_q4(weight: Tensor, block: int = Q4_BLOCK) -> BlockWeight:
    """A float matrix (n, k) in 4-bit blocks, Q4_1's scheme: per 32 inputs, scale = (max - min) / 15,
    q = round((w - min) / scale)."""
    n, k = weight.shape
    if k % block:
        raise ValueError(f"a {k}-input layer cannot be cut into 4-bit blocks of {block}")
    w = weight.detach().float().reshape(n, k // block, block)
    low, high = w.amin(-1), w.amax(-1)  # (n, b)
    scale = (high - low) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.floor((w - low[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
    return BlockWeight.from_values(q.reshape(n, k), scale, low, offset=0, block=block, kind="q4", nibbles=True)


def quantize_q4_(model: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` whose input width is a multiple of 32 made a 4-bit ``BlockLinear``, in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and child.in_features % Q4_BLOCK == 0:
            setattr(model, name, BlockLinear.from_linear(child))
        else:
            quantize_q4_(child)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (each storage once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


__all__ = ["BlockEmbedding", "BlockLinear", "BlockWeight", "block_matmul", "error_bound",
           "quantize_blocks_q4", "quantize_q4_", "weight_bytes"]
