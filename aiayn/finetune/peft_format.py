"""LoRA adapters in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.<Hugging Face module>.lora_A.weight``; A: (r, in), B: (out, r)), read and written. Module
names follow ``aiayn export --to hf``'s rules: LLaMA's q rows of ``qkv_proj`` -> ``q_proj``, GPT-2's whole
``qkv_proj`` -> ``c_attn``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.finetune.lora import TARGET_NAMES, LoraConfig, apply_lora, lora_layers, projection_sites
from aiayn.interop.hf import export_family
from aiayn.interop.hf_families import Family
from aiayn.interop.mapping import InteropError
from aiayn.train.run_files import atomic_write_text

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TASK_TYPES = {"decoder-only": "CAUSAL_LM", "encoder-decoder": "SEQ_2_SEQ_LM", "encoder-only": "FEATURE_EXTRACTION"}
Site = tuple[str, int, int]  # (aiayn projection path, first row, rows)


def _hf_modules(model: nn.Module, family: Family, config: ModelConfig) -> dict[Site, str]:
    """Each row range of an aiayn projection that is one Hugging Face module -> that module's name."""
    out: dict[Site, str] = {}
    for rule in family.rules(config):
        path = rule.ours.removesuffix(".weight")
        if not rule.ours.endswith(".weight") or not isinstance(model.get_submodule(path), nn.Linear):
            continue
        sizes = rule.split or (model.get_submodule(path).out_features,)
        start = 0
        for name, size in zip(rule.theirs, sizes, strict=True):
            out[(path, start, size)] = family.export_name(name).removesuffix(".weight")
            start += size
    return out


def save_adapter(model: nn.Module, config: ModelConfig, out_dir: str | Path, *, base: str | None = None) -> Path:
    """Write ``model``'s adapters into ``out_dir`` in PEFT's layout (files replaced atomically); ``base``:
    ``base_model_name_or_path``. InteropError for an adapter on part of a fused Hugging Face projection."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("this model has no LoRA adapters to save (apply_lora first)")
    family, _ = export_family(config)
    modules = _hf_modules(model, family, config)
    tensors: dict[str, Tensor] = {}
    for path, layer in layers.items():
        for target, (start, size) in layer.lora_rows.items():
            name = modules.get((path, start, size))
            if name is None:
                raise InteropError(f"the LoRA adapter on {target} ({path}) has no module of its own in a "
                                   f"{family.name} checkpoint (its rows are part of a fused projection), so "
                                   f"PEFT cannot hold it; adapt the whole projection (target qkv) instead")
            tensors[f"{PREFIX}{name}.lora_A.weight"] = layer.lora_A[target].detach().contiguous().cpu()
            tensors[f"{PREFIX}{name}.lora_B.weight"] = layer.lora_B[target].detach().contiguous().cpu()
    first = next(iter(layers.values()))
    rank = first.lora_A[next(iter(first.lora_rows))].shape[0]
    adapted = {key.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for key in tensors}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_FILE)
    peft_config = {
        "peft_type": "LORA", "task_type": TASK_TYPES[config.arch], "base_model_name_or_path": base,
        "r": rank, "lora_alpha": first.scaling * rank, "lora_dropout": getattr(first.lora_dropout, "p", 0.0),
        "target_modules": _target_modules(adapted, set(modules.values())), "bias": "none",
        "fan_in_fan_out": family.name == "gpt2", "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    atomic_write_text(out / CONFIG_FILE, json.dumps(peft_config, indent=2) + "\n")
    return out


def _target_modules(adapted: set[str], every: set[str]) -> list[str]:
    """PEFT's ``target_modules``: the modules' last names when they pick out exactly the adapted ones
    (``q_proj``, ``v_proj``), else the full names (GPT-2's ``c_proj`` is in both attention and MLP)."""
    leaves = {name.rpartition(".")[2] for name in adapted}
    if {name for name in every if name.rpartition(".")[2] in leaves} == adapted:
        return sorted(leaves)
    return sorted(adapted)


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of a LoRA adapter aiayn can apply; InteropError naming what it cannot."""
    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise InteropError(f"{adapter_dir}: no {CONFIG_FILE}; an adapter directory holds {CONFIG_FILE} and "
                           f"{WEIGHTS_FILE} (PEFT's save_pretrained)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InteropError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("peft_type") != "LORA":
        got = data.get("peft_type") if isinstance(data, dict) else type(data).__name__
        raise InteropError(f"{path}: peft_type {got!r}; aiayn applies LoRA adapters (peft_type LORA)")
    unsupported = [key for key in ("use_dora", "use_rslora", "lora_bias", "modules_to_save", "rank_pattern",
                                   "alpha_pattern") if data.get(key)]
    if data.get("bias", "none") != "none":
        unsupported.append(f"bias={data['bias']!r}")
    if unsupported:
        raise InteropError(f"{path}: {', '.join(unsupported)} is not supported; aiayn applies plain LoRA "
                           f"(scale lora_alpha / r, no trained biases or extra modules)")
    return data


def load_adapter(model: nn.Module, config: ModelConfig, adapter_dir: str | Path) -> LoraConfig:
    """Apply the adapter in ``adapter_dir`` to ``model`` in place; return its LoraConfig."""
    peft = read_adapter_config(adapter_dir)
    weights = Path(adapter_dir) / WEIGHTS_FILE
    if not weights.is_file():
        raise InteropError(f"{adapter_dir}: no {WEIGHTS_FILE} (aiayn reads adapters as safetensors only)")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise InteropError(f"{weights}: not a readable safetensors file ({exc})") from None
    family, _ = export_family(config)
    by_name = {name: site for site, name in _hf_modules(model, family, config).items()}
    targets = {(path, start, size): target for path, target, (start, size) in projection_sites(model)}
    sites: dict[str, dict[str, tuple[int, int]]] = {}
    found: dict[str, tuple[Tensor, str]] = {}
    for key, tensor in tensors.items():
        module, _, which = key.removeprefix(PREFIX).rpartition(".lora_")
        which = which.replace(".default", "")  # a name saved with PEFT's adapter name
        name = family.export_name(family.normalize(f"{module}.weight")).removesuffix(".weight")
        site = by_name.get(name)
        if site is None or site not in targets or which not in ("A.weight", "B.weight"):
            raise InteropError(f"{weights}: tensor {key} fits no projection aiayn can adapt in this "
                               f"{family.name} model (is the adapter for another base model?)")
        path, start, size = site
        sites.setdefault(path, {})[targets[site]] = (start, size)
        found[key] = (tensor, f"{path}.lora_{which[0]}.{targets[site]}")
    lora = LoraConfig(rank=int(peft.get("r", 8)), alpha=float(peft.get("lora_alpha", 8)),
                      dropout=float(peft.get("lora_dropout", 0.0)),
                      targets=tuple(sorted({t for rows in sites.values() for t in rows}, key=TARGET_NAMES.index)))
    apply_lora(model, lora, sites)
    params = dict(model.named_parameters())
    for key, (tensor, ours) in found.items():
        if tensor.shape != params[ours].shape:
            raise InteropError(f"{weights}: tensor {key} has shape {tuple(tensor.shape)}, but this model's "
                               f"{ours} needs {tuple(params[ours].shape)} (another base model, or r differs)")
        params[ours].data.copy_(tensor)
    missing = sorted(set(n for n in params if ".lora_" in n) - {ours for _, ours in found.values()})
    if missing:
        raise InteropError(f"{weights}: no tensor for {', '.join(missing[:4])}; each adapted module needs "
                           f"its lora_A and lora_B")
    return lora
