"""Hugging Face checkpoints in and out: ``load_hf``, ``from_hf_model``, ``export_hf``.

Families: llama, mistral, qwen2, gpt2 -> ``DecoderOnly``; bert -> ``EncoderOnly``; bart, marian ->
``EncoderDecoder``. Weights: safetensors (sharded or not) or ``pytorch_model.bin`` (``weights_only=True``)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.interop.hf_decoders import GPT2Family, LlamaFamily
from aiayn.interop.hf_encoders import BartFamily, BertFamily, MarianFamily
from aiayn.interop.hf_families import Family, HFConfig
from aiayn.interop.mapping import InteropError, export_tensors, load_tensors
from aiayn.models import build_model

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

FAMILIES: tuple[Family, ...] = (LlamaFamily(), GPT2Family(), BertFamily(), BartFamily(), MarianFamily())


def family_for(hf_config: dict[str, Any], *, source: str = "checkpoint") -> Family:
    """The family that converts this config.json, from ``model_type`` and ``architectures``."""
    model_type = hf_config.get("model_type")
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is None:
        supported = "; ".join(f"{'/'.join(f.model_types)} ({', '.join(f.architectures)})" for f in FAMILIES)
        raise InteropError(f"{source}: model_type {model_type!r} (architectures {hf_config.get('architectures')}) "
                           f"is not supported; aiayn.interop converts {supported}")
    bad = [a for a in hf_config.get("architectures") or [] if a not in family.architectures]
    if bad:
        raise InteropError(f"{source}: architecture {', '.join(bad)} is not supported for model_type "
                           f"{model_type!r}; supported: {', '.join(family.architectures)}")
    return family


def _read_weight_file(path: Path) -> dict[str, Tensor]:
    if path.name.endswith(".index.json"):
        try:
            weight_map: dict[str, str] = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InteropError(f"{path}: not a shard index (a JSON object with 'weight_map')") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InteropError(f"{path}: 'weight_map' must map tensor names to shard file names")
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path.parent / shard
            # A weights file beside the index: no path out of the directory, no index (it could recurse).
            if (Path(shard).name != shard or shard in ("", ".", "..") or shard.endswith(".index.json")
                    or shard_path.resolve().parent != path.parent.resolve()):
                raise InteropError(f"{path}: shard {shard!r} is not a weights file name in {path.parent} "
                                   f"(paths out of the model directory and nested indexes are refused)")
            if not shard_path.is_file():
                raise InteropError(f"{path}: lists shard {shard}, which is not in {path.parent}")
            tensors.update(_read_weight_file(shard_path))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise InteropError(f"{path}: tensor(s) {', '.join(missing[:8])} listed in the index are "
                               f"in none of the shards")
        return tensors
    if path.suffix == ".safetensors":
        try:
            return load_file(path)
        except (SafetensorError, OSError) as exc:
            raise InteropError(f"{path}: not a readable safetensors file ({exc})") from exc
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError, ...: all mean "not a plain state dict"
        raise InteropError(
            f"{path}: cannot be read as a plain tensor state dict with torch.load(weights_only=True) "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); aiayn never "
            f"unpickles arbitrary objects — convert the checkpoint to safetensors"
        ) from exc
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise InteropError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    return state


def read_hf_checkpoint(path_or_dir: str | Path) -> tuple[dict[str, Any], dict[str, Tensor], str]:
    """(config.json, name -> tensor, a name for messages) of a model directory or a weights file in it."""
    path = Path(path_or_dir)
    weights = path if path.is_file() else None
    directory = path.parent if path.is_file() else path
    if not directory.is_dir():
        raise InteropError(f"{path}: no such model directory (expected config.json + model.safetensors)")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise InteropError(f"{directory}: no {CONFIG_FILE}; a Hugging Face model directory needs one")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InteropError(f"{config_path}: not valid JSON ({exc})") from exc
    check_config_types(config, config_path)
    if weights is None:
        weights = next((directory / f for f in WEIGHT_FILES if (directory / f).is_file()), None)
        if weights is None:
            raise InteropError(f"{directory}: no weights; looked for {', '.join(WEIGHT_FILES)}")
    return config, _read_weight_file(weights), str(directory)


def _canonical_tensors(family: Family, tensors: dict[str, Tensor], hf: HFConfig,
                       config: ModelConfig) -> dict[str, Tensor]:
    """Normalise names, fold tied copies onto one name (checking they are equal), ``prepare``."""
    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    for name, tensor in tensors.items():
        canon = family.normalize(name)
        if canon in out:
            raise InteropError(f"{hf.source}: tensors {origin[canon]} and {name} both mean {canon}")
        out[canon], origin[canon] = tensor, name
    for alias, canon in family.aliases(config).items():
        if alias not in out:
            continue
        tensor = out.pop(alias)
        if canon not in out:
            out[canon] = tensor
        elif out[canon].shape != tensor.shape or not torch.equal(out[canon], tensor):
            raise InteropError(f"{hf.source}: {alias} differs from {canon}, but the config ties them "
                               f"(tie_word_embeddings); set it to false in config.json if they are separate")
    family.prepare(out, config, hf.source)
    ignored = [re.compile(pattern) for pattern in family.ignore]  # buffers such as position_ids
    not_float = sorted(name for name, tensor in out.items() if not tensor.is_floating_point()
                       and not any(pattern.fullmatch(name) for pattern in ignored))
    if not_float:
        raise InteropError(f"{hf.source}: weight(s) {', '.join(not_float[:4])} hold {out[not_float[0]].dtype} "
                           f"values where floating-point weights belong; the checkpoint is damaged or "
                           f"quantised in a format aiayn does not read")
    return out


# config.json keys the families read, by the type they must have (a string "false" is truthy).
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "scale_embedding", "normalize_before",
              "add_final_layer_norm", "add_cross_attention", "is_decoder", "scale_attn_weights",
              "scale_attn_by_inverse_layer_idx", "use_sliding_window", "share_encoder_decoder_embeddings")
_INT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "max_position_embeddings", "n_positions", "n_inner",
             "head_dim", "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim", "decoder_vocab_size",
             "type_vocab_size", "sliding_window", "n_embd", "n_layer", "n_head", "d_model",
             "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim")
_FLOAT_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "dropout",
               "attention_dropout", "activation_dropout", "hidden_dropout_prob",
               "attention_probs_dropout_prob", "attn_pdrop", "resid_pdrop")


def check_config_types(config: Any, where: Path | str) -> None:
    """Type, then range, of every key above that ``config`` holds (null means "default")."""
    if not isinstance(config, dict):
        raise InteropError(f"{where}: must hold a JSON object, got {type(config).__name__}")
    checks = ((_BOOL_KEYS, "true or false", lambda v: isinstance(v, bool)),  # JSON: bool, int, float only
              (_INT_KEYS, "a whole number >= 0", lambda v: type(v) is int and v >= 0),
              (_FLOAT_KEYS, "a finite number >= 0", lambda v: type(v) in (int, float) and 0 <= v < math.inf))
    for keys, what, valid in checks:
        for key in keys:
            value = config.get(key)
            if value is not None and not valid(value):
                raise InteropError(f"{where}: {key} must be {what}, got {value!r}")


def from_hf_state(hf_config: dict[str, Any], tensors: dict[str, Tensor], *,
                  source: str = "checkpoint") -> tuple[nn.Module, ModelConfig]:
    """An aiayn model (eval mode, float32) from a config.json dict and its tensors."""
    family = family_for(hf_config, source=source)
    hf = HFConfig(hf_config, source)
    config = family.to_config(hf)
    model = build_model(config)
    load_tensors(model, _canonical_tensors(family, tensors, hf, config), family.rules(config),
                 source=source, ignore=family.ignore)
    return model.eval(), config


def load_hf(path_or_dir: str | Path, *, dtype: torch.dtype | None = None) -> tuple[nn.Module, ModelConfig]:
    """Load a Hugging Face model directory as ``(model, config)`` in eval mode, float32 unless ``dtype``."""
    hf_config, tensors, source = read_hf_checkpoint(path_or_dir)
    model, config = from_hf_state(hf_config, tensors, source=source)
    return (model if dtype is None else model.to(dtype)), config


def from_hf_model(hf_model: nn.Module) -> tuple[nn.Module, ModelConfig]:
    """Convert an in-memory transformers model (``PreTrainedModel``) without touching disk."""
    hf_config = hf_model.config.to_dict()  # type: ignore[union-attr]
    architecture = type(hf_model).__name__
    hf_config["architectures"] = [architecture]
    return from_hf_state(hf_config, dict(hf_model.state_dict()), source=f"{architecture} (in memory)")


def export_family(config: ModelConfig, family: str | None = None) -> tuple[Family, dict[str, Any]]:
    """(the first family that can represent ``config``, or ``family``; its config.json)."""
    candidates = [f for f in FAMILIES if family in (None, f.name)]
    if not candidates:
        raise InteropError(f"unknown family {family!r}; choose one of {', '.join(f.name for f in FAMILIES)}")
    reasons = []
    for fam in candidates:
        try:
            return fam, fam.export_config(config)
        except InteropError as exc:
            reasons.append(str(exc))
    raise InteropError("no Hugging Face family can hold this model: " + "; ".join(reasons))


def export_hf(model: nn.Module, config: ModelConfig, out_dir: str | Path, *,
              family: str | None = None) -> Path:
    """Write ``model`` as a Hugging Face directory (config.json + model.safetensors) of the first family that
    can represent ``config`` (or ``family``)."""
    fam, hf_config = export_family(config, family)
    tensors = {fam.export_name(k): v for k, v in export_tensors(model, fam.rules(config)).items()}
    fam.finish_export(tensors, config)
    dtype = next(iter(tensors.values())).dtype
    hf_config["torch_dtype"] = hf_config["dtype"] = str(dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
