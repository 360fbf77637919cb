"""Hugging Face model families (config.json <-> ModelConfig, tensor-name rules): ``Family`` and its helpers;
the families are in ``hf_decoders`` and ``hf_encoders``."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from aiayn.config import ConfigError, ModelConfig
from aiayn.interop.mapping import InteropError, Rule, copy_rule

# Hugging Face activation names -> aiayn's ("gelu" is erf GELU, "gelu_new" GPT-2's tanh approximation).
_HF_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                        "gelu_fast": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu"}


class HFConfig:
    """A config.json dict with lookups that fail with a message naming the field."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data, self.source = data, source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        if self.data.get(key) is None:
            raise InteropError(f"{self.source}: config.json has no {key!r}, which this model type needs")
        return self.data[key]


def hf_activation(hf: HFConfig, key: str, default: str) -> str:
    name = hf.get(key, default)
    if name not in _HF_ACTIVATION_NAMES:
        raise InteropError(
            f"{hf.source}: {key}={name!r} is not supported; aiayn has {', '.join(sorted(_HF_ACTIVATION_NAMES))}"
        )
    return _HF_ACTIVATION_NAMES[name]


def hf_pad_id(hf: HFConfig, vocab: int) -> int | None:
    pad = hf.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < vocab else None


def build_config(hf: HFConfig, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as exc:
        raise InteropError(f"{hf.source}: its config.json gives an invalid aiayn config: {exc}") from exc


class Family:
    """How one Hugging Face family maps onto aiayn (override the methods)."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    # Source tensors that are deliberately not loaded: buffers that are not weights.
    ignore: tuple[str, ...] = ()
    # The embedding a tied output layer is stored as.
    tied_head: str = ""

    def to_config(self, hf: HFConfig) -> ModelConfig:
        raise NotImplementedError

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        raise NotImplementedError

    def normalize(self, name: str) -> str:
        """A source tensor name in the canonical spelling the rules use."""
        return name

    def head_rules(self, cfg: ModelConfig) -> list[Rule]:
        """The untied LM head, which a bare body (LlamaModel, GPT2Model, BartModel) lacks."""
        return [] if cfg.tie_output else [copy_rule("lm_head.weight", "lm_head.weight", group="the LM head (lm_head)")]

    def aliases(self, cfg: ModelConfig) -> dict[str, str]:
        """Other names of tied tensors -> their canonical name (both may be stored)."""
        return {"lm_head.weight": self.tied_head} if cfg.tie_output and self.tied_head else {}

    def prepare(self, tensors: dict[str, Tensor], config: ModelConfig, source: str) -> None:
        """Adjust the normalised tensors in place before mapping (reshape, or drop non-parameters)."""

    def finish_export(self, tensors: dict[str, Tensor], config: ModelConfig) -> None:
        """The inverse of ``prepare`` for exported tensors (in place)."""

    def export_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """config.json for ``cfg``; InteropError if this family cannot represent it."""
        raise NotImplementedError

    def export_name(self, name: str) -> str:
        """A canonical tensor name as the exported checkpoint spells it."""
        return name


def check_export(cfg: ModelConfig, family: str, **expected: Any) -> None:
    """InteropError naming each field of ``cfg`` that is not what ``family`` needs (a value, or a tuple's)."""
    bad = [f"{key}={getattr(cfg, key)!r} (needs {want!r})" for key, want in expected.items()
           if not (getattr(cfg, key) in want if isinstance(want, tuple) else getattr(cfg, key) == want)]
    if bad:
        raise InteropError(f"a {family} checkpoint cannot hold this model: {', '.join(bad)}")
