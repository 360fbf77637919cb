"""What the three model classes share: their output type, weight initialisation, cache factory."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.models.blocks import StackOutput
from aiayn.nn.kv_cache import KVCache
from aiayn.nn.linear_cross_entropy import HeadLoss, linear_cross_entropy
from aiayn.nn.packing import Packing


@dataclass
class ModelOutput:
    logits: Tensor  # (b, t, v)
    hidden: Tensor  # (b, t, d), the last stack's output (after its final norm)
    attentions: list[Tensor] = field(default_factory=list)  # decoder/encoder self-attn, per layer
    cross_attentions: list[Tensor] = field(default_factory=list)  # decoder cross-attn, per layer
    encoder_attentions: list[Tensor] = field(default_factory=list)  # encoder self-attn (enc-dec)


class PackedModelOutput(ModelOutput):
    """A padding-free forward's output (``ModelConfig.padding_free``): computed for the real tokens
    only. ``packed_logits`` (n, v) and ``packed_hidden`` (n, d) are those rows, in row-major order
    of the (b, t) batch (``packing.index``); ``logits`` and ``hidden`` unpack them to (b, t, ...),
    zeros at padding, on first access. A loss over real tokens can take ``packed_logits`` with
    ``targets.reshape(-1)[packing.index]`` and skip the padded rows altogether.
    """

    def __init__(self, packing: Packing, packed_logits: Tensor, packed_hidden: Tensor) -> None:
        self.packing, self.packed_logits, self.packed_hidden = packing, packed_logits, packed_hidden
        self.attentions, self.cross_attentions, self.encoder_attentions = [], [], []

    @functools.cached_property
    def logits(self) -> Tensor:  # type: ignore[override]
        return self.packing.unpack(self.packed_logits)

    @functools.cached_property
    def hidden(self) -> Tensor:  # type: ignore[override]
        return self.packing.unpack(self.packed_hidden)


@dataclass
class LossModelOutput:
    """A forward given ``targets``: the output layer ran fused with the cross-entropy
    (``aiayn.nn.linear_cross_entropy``), so there are no logits; ``head_loss`` feeds
    ``aiayn.train.losses.sequence_loss`` (through ``loss_logits``). ``stack_hidden`` is the last
    stack's output, (b, t, d) or packed (n, d); ``hidden`` is always (b, t, d).

    A plain dataclass whose fields hold the graph's tensors (the loss sums inside ``head_loss``):
    wrappers that hook a module's outputs (FSDP's pre-backward) find them there."""

    head_loss: HeadLoss
    stack_hidden: Tensor
    packing: Packing | None = None
    attentions: list[Tensor] = field(default_factory=list)
    cross_attentions: list[Tensor] = field(default_factory=list)
    encoder_attentions: list[Tensor] = field(default_factory=list)

    @property
    def logits(self) -> Tensor:
        raise AttributeError("this forward was given targets and fused the output layer into the loss, so it "
                             "computed no logits; call the model without targets to get them")

    @functools.cached_property
    def hidden(self) -> Tensor:
        return self.packing.unpack(self.stack_hidden) if self.packing is not None else self.stack_hidden


def fuses_loss(head: nn.Module) -> bool:
    """Whether the output layer can run fused with the loss: a plain (unquantised, unsharded)
    linear layer; any other head computes its logits and the loss takes them."""
    return isinstance(head, nn.Linear) and type(head.weight.data) is Tensor


def model_output(out: StackOutput, head: nn.Module,
                 targets: Tensor | None = None) -> ModelOutput | LossModelOutput:
    """A stack's output and the output head applied to it, packed if the stack ran padding-free.

    With ``targets`` (b, t) (``IGNORE`` where nothing counts) and a head that ``fuses_loss``, the
    head runs fused with the cross-entropy instead and no logits are made (``LossModelOutput``)."""
    if targets is not None and fuses_loss(head):
        return LossModelOutput(head_loss(out, head, targets), out.hidden, out.packing, out.attentions)
    if out.packing is not None:
        return PackedModelOutput(out.packing, head(out.hidden), out.hidden)
    return ModelOutput(logits=head(out.hidden), hidden=out.hidden, attentions=out.attentions)


def head_loss(out: StackOutput, head: nn.Linear, targets: Tensor) -> HeadLoss:
    """The fused output layer + cross-entropy over a stack's rows: every (b, t) position, or the
    real tokens of a padding-free stack (``packing.index``)."""
    packing = out.packing
    batch_shape = (packing.batch, packing.length) if packing is not None else tuple(out.hidden.shape[:2])
    if tuple(targets.shape) != batch_shape:
        raise ValueError(f"targets must have the (batch, seq) shape of the model's input, {batch_shape}; "
                         f"got {tuple(targets.shape)}")
    if packing is not None:
        hidden, flat_targets = out.hidden, packing.pack(targets)  # (n, d), (n,)
    else:
        hidden, flat_targets = out.hidden.reshape(-1, out.hidden.shape[-1]), targets.reshape(-1)  # (b t, d)
    return linear_cross_entropy(hidden, head.weight, head.bias, flat_targets, packing=packing,
                                batch_shape=(batch_shape[0], batch_shape[1]))


def init_weights(model: nn.Module, config: ModelConfig) -> None:
    """Post-norm models (the paper's): Xavier-uniform projections, as the reference implementations
    do, and N(0, d^-1/2) embeddings, which the sqrt(d) embedding scale brings to unit size.
    Pre-norm models (GPT-2 style): N(0, 0.02) everywhere. Biases start at zero, norms at identity.
    """
    pre = config.norm_position == "pre"
    emb_std = 0.02 if pre or not config.scale_embeddings else config.d_model**-0.5
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if pre:
                nn.init.normal_(module.weight, std=0.02)
            else:
                nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=emb_std)


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def make_cache(config: ModelConfig, *, n_layers: int, batch_size: int, max_len: int | None,
               dtype: torch.dtype, device: torch.device, cross_attention: bool,
               quantize: str | None = None, group_size: int | None = None) -> KVCache:
    max_len = config.max_seq_len if max_len is None else max_len
    return KVCache(n_layers=n_layers, batch_size=batch_size, n_kv_heads=config.n_kv_heads,
                   head_dim=config.head_dim, max_len=max_len, dtype=dtype, device=device,
                   cross_attention=cross_attention, quantize=quantize, group_size=group_size)


def check_arch(config: ModelConfig, expected: str, cls: str) -> None:
    if config.arch != expected:
        raise ValueError(f"{cls} needs config.arch={expected!r}, got {config.arch!r}; "
                         f"use aiayn.models.build_model(config) to pick the class")


