"""Checkpoint conversion by name rules: each ``Rule`` makes one aiayn parameter from source tensors (copied,
transposed or stacked), and the same rules export."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


class InteropError(ValueError):
    """A checkpoint that cannot be converted; the message names the tensor or field and the fix."""


@dataclass(frozen=True)
class Rule:
    """aiayn parameter ``ours`` = cat([t(s) for s in ``theirs``], dim 0), t = transpose or identity.

    ``split``: the parts' dim-0 sizes (to export); ``group``: an optional block a checkpoint may lack."""

    ours: str
    theirs: tuple[str, ...]
    transpose: bool = False
    split: tuple[int, ...] | None = None
    group: str | None = None

    def __post_init__(self) -> None:
        if len(self.theirs) > 1 and (self.split is None or len(self.split) != len(self.theirs)):
            raise ValueError(f"Rule for {self.ours}: {len(self.theirs)} parts need {len(self.theirs)} split sizes")


def copy_rule(ours: str, theirs: str, *, transpose: bool = False, group: str | None = None) -> Rule:
    return Rule(ours, (theirs,), transpose=transpose, group=group)


def linear_rules(ours: str, theirs: str, *, bias: bool, transpose: bool = False,
                 group: str | None = None) -> list[Rule]:
    """``{ours}.weight`` <- ``{theirs}.weight`` [and the biases]."""
    rules = [copy_rule(f"{ours}.weight", f"{theirs}.weight", transpose=transpose, group=group)]
    if bias:
        rules.append(copy_rule(f"{ours}.bias", f"{theirs}.bias", group=group))
    return rules


def fused_linear_rules(ours: str, parts: list[str], sizes: list[int], *, bias: bool,
                       group: str | None = None) -> list[Rule]:
    """``{ours}`` = rows of the ``parts`` projections stacked in order (weights and biases)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return [Rule(f"{ours}.{kind}", tuple(f"{p}.{kind}" for p in parts), split=tuple(sizes), group=group)
            for kind in kinds]


norm_rules = linear_rules  # LayerNorm has weight and bias; RMSNorm only a weight


def sublayer_rules(module: str, first: str | list[str], second: str, norm: str, *,
                   sizes: list[int] | None = None, bias: bool = True, second_bias: bool | None = None,
                   norm_bias: bool = True, transpose: bool = False) -> list[Rule]:
    """A block's sublayer ``module`` (``...self_attn`` or ``...ffn``): its two projections (the first
    stacked from parts when ``first`` is a list) and its norm ``{module}_norm``."""
    into, out = ("qkv_proj", "out_proj") if module.endswith("attn") else ("fc_in", "fc_out")
    if isinstance(first, list):
        rules = fused_linear_rules(f"{module}.{into}", first, sizes or [], bias=bias)
    else:
        rules = linear_rules(f"{module}.{into}", first, bias=bias, transpose=transpose)
    rules += linear_rules(f"{module}.{out}", second, bias=bias if second_bias is None else second_bias,
                          transpose=transpose)
    return rules + norm_rules(f"{module}_norm", norm, bias=norm_bias)


def model_parameters(model: nn.Module) -> dict[str, Tensor]:
    """Name -> tensor of every distinct parameter and persistent buffer (tied weights once)."""
    out: dict[str, Tensor] = dict(model.named_parameters())
    seen = {id(t) for t in out.values()}
    for name, buf in model.named_buffers():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if leaf not in module._non_persistent_buffers_set and id(buf) not in seen:
            out[name] = buf
    return out


def _check_rules(rules: list[Rule], params: dict[str, Tensor]) -> None:
    """A converter bug, not a checkpoint problem: rules must cover each parameter exactly once."""
    targets = [r.ours for r in rules]
    sources = [s for r in rules for s in r.theirs]
    dup_t = sorted({t for t in targets if targets.count(t) > 1})
    dup_s = sorted({s for s in sources if sources.count(s) > 1})
    unknown = sorted(set(targets) - set(params))
    uncovered = sorted(set(params) - set(targets))
    problems = [f"{what}: {', '.join(names)}" for what, names in (
        ("aiayn parameters written twice", dup_t), ("source tensors used twice", dup_s),
        ("rules name parameters the model lacks", unknown),
        ("aiayn parameters no rule writes", uncovered)) if names]
    if problems:
        raise AssertionError("converter rules are inconsistent (a bug in aiayn.interop): " + "; ".join(problems))


def _short_list(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_tensors(model: nn.Module, tensors: dict[str, Tensor], rules: list[Rule], *, source: str,
                 ignore: Iterable[str] = ()) -> None:
    """Copy ``tensors`` (but names ``ignore`` matches) into ``model`` through ``rules``; ``InteropError`` for
    a missing tensor, a shape mismatch or a leftover tensor; a warning names the optional groups left out."""
    params = model_parameters(model)
    _check_rules(rules, params)
    patterns = [re.compile(p) for p in ignore]
    available = {name for name in tensors if not any(p.fullmatch(name) for p in patterns)}

    needed: dict[str | None, set[str]] = {}
    for rule in rules:
        needed.setdefault(rule.group, set()).update(rule.theirs)
    # The optional blocks of which the checkpoint has no tensor at all are left out.
    skipped = [group for group, names in needed.items() if group is not None and not names & available]
    missing = [name for group, names in needed.items() if group not in skipped for name in names - available]
    if missing:
        raise InteropError(f"{source}: missing tensor(s) {_short_list(missing)}; the checkpoint does not match "
                           f"its config.json (wrong architecture, or a truncated / partial download?)")

    used: set[str] = set()
    with torch.no_grad():
        for rule in rules:
            if rule.group in skipped:
                continue
            parts = [tensors[s].t() if rule.transpose else tensors[s] for s in rule.theirs]
            shapes = [tuple(p.shape) for p in parts]
            try:
                value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            except RuntimeError:
                value = None
            target = params[rule.ours]
            if value is None or value.shape != target.shape:
                got = shapes[0] if len(shapes) == 1 else " + ".join(map(str, shapes))
                raise InteropError(f"{source}: tensor {' + '.join(rule.theirs)} has shape {got}"
                                   f"{' (transposed)' if rule.transpose else ''}, but aiayn's {rule.ours} needs "
                                   f"{tuple(target.shape)}; config.json and the weights disagree")
            target.copy_(value)
            used.update(rule.theirs)
    left = available - used
    if left:
        raise InteropError(f"{source}: unexpected tensor(s) {_short_list(left)}; the converter does not know "
                           f"where they go (an unsupported variant of the architecture, or a task head aiayn "
                           f"has no module for)")
    if skipped:
        warnings.warn(
            f"{source}: no tensors for {', '.join(skipped)}; those aiayn modules keep their "
            f"initial weights", stacklevel=3)


def export_tensors(model: nn.Module, rules: list[Rule]) -> dict[str, Tensor]:
    """The inverse of ``load_tensors``: source name -> contiguous tensor, for every rule."""
    params = model_parameters(model)
    _check_rules(rules, params)
    out: dict[str, Tensor] = {}
    for rule in rules:
        value = params[rule.ours].detach()
        parts = [value] if len(rule.theirs) == 1 else list(value.split(list(rule.split or ()), dim=0))
        for name, part in zip(rule.theirs, parts, strict=True):
            out[name] = (part.t() if rule.transpose else part).contiguous().clone()
    return out
