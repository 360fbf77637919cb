"""LoRA (Hu et al. 2021) as a converter applied to a built model, as ``aiayn.fast.optimize`` is.

``apply_lora`` freezes the model and adds to each targeted projection W x + (alpha / r) B A dropout(x),
A (r, in) kaiming-uniform as in PEFT, B (out, r) zeros; ``merge_lora`` folds them back into ``nn.Linear``.
A target on a stacked projection (``q`` of ``qkv_proj``, ``gate`` of ``fc_in``) adapts its own rows with
its own A and B, as a LoRA on a separate projection does."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ConfigError
from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.mlp import FeedForward

# The target names users give -> (projection, which of its stacked parts; None: all of it), by the kind of
# sublayer. "qkv" is GPT-2's fused c_attn; "up" of an ungated unit is its whole first projection.
TARGETS: dict[str, dict[str, tuple[str, int | None]]] = {
    "self-attention": {"q": ("qkv_proj", 0), "k": ("qkv_proj", 1), "v": ("qkv_proj", 2),
                       "qkv": ("qkv_proj", None), "o": ("out_proj", None)},
    "cross-attention": {"q": ("q_proj", None), "k": ("kv_proj", 0), "v": ("kv_proj", 1), "o": ("out_proj", None)},
    "gated-ffn": {"gate": ("fc_in", 0), "up": ("fc_in", 1), "down": ("fc_out", None)},
    "ffn": {"up": ("fc_in", None), "down": ("fc_out", None)},
}
TARGET_NAMES = ("q", "k", "v", "qkv", "o", "gate", "up", "down")
ADAPTER_PARAMETERS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoraConfig:
    """Rank, scale ``alpha / rank``, dropout on the adapters' input, targets (from ``TARGET_NAMES``)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = field(default=("q", "v"))

    def __post_init__(self) -> None:
        if isinstance(self.targets, str | list):
            targets = self.targets.split(",") if isinstance(self.targets, str) else self.targets
            object.__setattr__(self, "targets", tuple(t.strip() for t in targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora rank must be a whole number >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 < self.alpha < math.inf:
            raise ConfigError(f"lora alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ConfigError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in TARGET_NAMES]
        if not self.targets or unknown:
            raise ConfigError(f"lora targets {', '.join(unknown) or '(none)'} unknown; choose from "
                              f"{', '.join(TARGET_NAMES)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraConfig:
        unknown = sorted(set(data) - {"rank", "alpha", "dropout", "targets"})
        if unknown:
            raise ConfigError(f"lora has no field {', '.join(unknown)}; its fields are rank, alpha, dropout, targets")
        return cls(**data)


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` (same weight, bias and state-dict keys) whose output rows ``lora_rows[name] = (start,
    size)`` get ``scaling * lora_B[name] @ lora_A[name] @ dropout(x)``. The frozen product runs through
    ``base_kernel`` (``F.linear``, or ``aiayn.fast``'s kernel)."""

    lora_rows: dict[str, tuple[int, int]]
    scaling: float
    base_kernel: Callable[[Tensor, Tensor, Tensor | None], Tensor]

    def forward(self, x: Tensor) -> Tensor:
        return add_update(self, self.base_kernel(x, self.weight, self.bias), x)

    def delta(self) -> Tensor:
        """scaling * B @ A on each part's rows, the shape of ``weight``."""
        a, b = stacked_adapters(self)
        return (b @ a) * self.scaling


def stacked_adapters(layer: nn.Module) -> tuple[Tensor, Tensor]:
    """(A (parts x r, i): the parts' A's stacked, B (o, parts x r): their B's block-diagonal on their rows),
    so B @ A is the whole weight's update before scaling. ``layer`` holds adapters as ``LoraLinear`` does."""
    parts = sorted(layer.lora_rows.items(), key=lambda item: item[1])
    if len(parts) == 1 and parts[0][1] == (0, layer.out_features):
        return layer.lora_A[parts[0][0]], layer.lora_B[parts[0][0]]
    a = torch.cat([layer.lora_A[name] for name, _ in parts])
    blocks, at = [], 0
    for name, (start, size) in parts:
        b = layer.lora_B[name]
        if start > at:  # rows left alone: no columns (none between adjacent parts: fewer ops)
            blocks.append(b.new_zeros(start - at, 0))
        blocks.append(b)
        at = start + size
    if at < layer.out_features:
        blocks.append(b.new_zeros(layer.out_features - at, 0))
    return a, torch.block_diag(*blocks)


def add_update(layer: nn.Module, out: Tensor, x: Tensor) -> Tensor:
    """``out`` (..., o), the frozen product of ``x``, plus the adapters' update, added in one ``addmm``."""
    a, b = stacked_adapters(layer)
    low = F.linear(layer.lora_dropout(x), a)  # (..., parts x r)
    update = torch.addmm(out.reshape(-1, out.shape[-1]), low.reshape(-1, low.shape[-1]), b.t(),
                         alpha=layer.scaling)  # (m, o): out + scaling * low B^T
    return update.view(out.shape)


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, MultiHeadAttention):
        return "cross-attention" if module.cross else "self-attention"
    if isinstance(module, FeedForward):
        return "gated-ffn" if module.gated else "ffn"
    return None


def _part_rows(module: nn.Module, projection: str, part: int | None) -> tuple[int, int]:
    """(first row, rows) of one stacked part of ``module``'s ``projection`` (all rows for None)."""
    linear = getattr(module, projection)
    if part is None:
        return 0, linear.out_features
    if projection == "qkv_proj":
        q, kv = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
        sizes = [q, kv, kv]
    else:  # kv_proj [k; v], a gated fc_in [gate; up]: two halves
        sizes = [linear.out_features // 2] * 2
    return sum(sizes[:part]), sizes[part]


def projection_sites(model: nn.Module) -> Iterator[tuple[str, str, tuple[int, int]]]:
    """(projection path, target name, (first row, rows)) of every place a target can adapt in ``model``."""
    for path, module in model.named_modules():
        for target, (projection, part) in TARGETS.get(_kind(module) or "", {}).items():
            yield f"{path}.{projection}" if path else projection, target, _part_rows(module, projection, part)


def lora_sites(model: nn.Module, targets: Sequence[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """{projection path: {target: (first row, rows)}} of ``targets`` in ``model``, checked."""
    sites: dict[str, dict[str, tuple[int, int]]] = {}
    known: set[str] = set()
    for path, target, rows in projection_sites(model):
        known.add(target)
        if target in targets:
            sites.setdefault(path, {})[target] = rows
    missing = [t for t in targets if t not in known]
    if missing:
        raise ConfigError(f"lora target(s) {', '.join(missing)} match no projection of this model; it has "
                          f"{', '.join(sorted(known, key=TARGET_NAMES.index))}")
    for path, rows in sites.items():
        if "qkv" in rows and len(rows) > 1:
            raise ConfigError(f"lora targets qkv and {', '.join(r for r in rows if r != 'qkv')} overlap "
                              f"({path}); give qkv or its parts")
    return sites


def apply_lora(model: nn.Module, config: LoraConfig,
               sites: Mapping[str, Mapping[str, tuple[int, int]]] | None = None) -> nn.Module:
    """Freeze ``model`` and add ``config``'s adapters in place (at ``sites``, default ``lora_sites``')."""
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters; merge_lora it first")
    sites = lora_sites(model, config.targets) if sites is None else sites
    for p in model.parameters():
        p.requires_grad_(False)
    for path, rows in sites.items():
        linear = model.get_submodule(path)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{path} is a {type(linear).__name__}; LoRA adapts nn.Linear layers")
        _add_adapters(linear, config, dict(rows))
    return model


def _add_adapters(linear: nn.Linear, config: LoraConfig, rows: dict[str, tuple[int, int]]) -> None:
    """Turn ``linear`` into a ``LoraLinear`` with one (A, B) pair per part."""
    weight = linear.weight
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    linear.__class__ = LoraLinear
    a, b = nn.ParameterDict(), nn.ParameterDict()
    for name, (_, size) in rows.items():
        a[name] = nn.Parameter(torch.empty(config.rank, linear.in_features, dtype=dtype, device=weight.device))
        nn.init.kaiming_uniform_(a[name], a=math.sqrt(5))  # PEFT's init of lora_A
        b[name] = nn.Parameter(torch.zeros(size, config.rank, dtype=dtype, device=weight.device))
    linear.lora_A, linear.lora_B = a, b
    linear.lora_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
    linear.lora_rows, linear.scaling = rows, config.scaling
    linear.base_kernel = F.linear


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight, leaving plain ``nn.Linear`` layers (in place)."""
    for module in model.modules():
        if isinstance(module, LoraLinear):
            with torch.no_grad():
                module.weight += module.delta().to(module.weight.dtype)
            for name in (*ADAPTER_PARAMETERS, "lora_dropout"):
                delattr(module, name)
            del module.lora_rows, module.scaling, module.base_kernel
            module.__class__ = nn.Linear
    return model


def is_adapter_key(name: str) -> bool:
    """A state-dict key of an adapter parameter (``...qkv_proj.lora_A.q``)."""
    return any(f".{p}." in f".{name}" for p in ADAPTER_PARAMETERS)


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' parameters by state-dict key (what a LoRA checkpoint holds)."""
    return {name: p.detach() for name, p in model.named_parameters() if is_adapter_key(name)}


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """The adapted projections by path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoraLinear)}
