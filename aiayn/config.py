"""Model and training configuration, validated on construction: each error says which field is wrong,
what it holds and what to change. No torch here: a config is read and checked without a model."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHITECTURES = ("encoder-decoder", "decoder-only", "encoder-only")
POSITIONAL_SCHEMES = ("sinusoidal", "learned", "rope", "alibi", "t5", "none")
# Gated units (Shazeer 2020) and the function of their gate: SwiGLU (LLaMA) = silu, GeGLU = gelu.
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", *GATED_ACTIVATIONS)  # the one table of names
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("post", "pre")
SINUSOIDAL_LAYOUTS = ("interleaved", "split")
ATTENTION_IMPLS = ("fused", "reference")


# ModelConfig fields that may be left None, and how each is derived (in order: attn_out_bias after attn_bias).
DERIVED_FIELDS: dict[str, Callable[[ModelConfig], Any]] = {
    "tgt_vocab_size": lambda c: c.vocab_size, "n_kv_heads": lambda c: c.n_heads,
    "head_dim": lambda c: c.d_model // c.n_heads, "n_decoder_layers": lambda c: c.n_layers,
    "final_norm": lambda c: c.norm_position == "pre", "attn_bias": lambda c: c.bias,
    "attn_out_bias": lambda c: c.attn_bias, "mlp_bias": lambda c: c.bias}
# Older names of the same fields: configs and recipes written with them still load, with a warning.
OLD_FIELD_NAMES = {"kv_heads": "n_kv_heads", "head_size": "head_dim", "decoder_layers": "n_decoder_layers",
                   "target_vocab_size": "tgt_vocab_size", "use_final_norm": "final_norm",
                   "qkv_bias": "attn_bias", "out_proj_bias": "attn_out_bias", "ffn_bias": "mlp_bias"}


def _rename_old_fields(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with old field names mapped to today's (with a DeprecationWarning); unknown ones refused."""
    data = dict(data)
    for old, new in OLD_FIELD_NAMES.items():
        if old in data:
            if new in data and data[new] is not None and data[new] != data[old]:
                raise ConfigError(f"{old}={data[old]!r} (the old name of {new}) disagrees with "
                                  f"{new}={data[new]!r}; keep only {new}")
            warnings.warn(f"model config field {old!r} is now called {new!r}; rename it",
                          DeprecationWarning, stacklevel=3)
            data[new] = data.pop(old)
    _check_known_fields(ModelConfig, data)
    return data


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the field and the fix."""


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not known; choose one of {', '.join(allowed)}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _probability(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be a probability in [0, 1), got {value!r}")


def _number(name: str, value: Any, *, low: float | None = None, low_open: bool = False,
            high: float | None = None, high_open: bool = False) -> None:
    """A finite real number (not a bool, not a string) within the bounds: type first, then range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if ((low is not None and (value < low or (low_open and value == low)))
            or (high is not None and (value > high or (high_open and value == high)))):
        bounds = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, " \
                 f"{high if high is not None else 'inf'}{')' if high_open or high is None else ']'}"
        raise ConfigError(f"{name} must be in {bounds}, got {value!r}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")


def _check_known_fields(cls: type, data: dict[str, Any]) -> None:
    """Unknown keys are refused, each with the closest known one: a typo must not train the default."""
    if not isinstance(data, dict):
        raise ConfigError(f"a {cls.__name__} must be a mapping of field names to values, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(key) for key in set(data) - known)
    if unknown:
        guesses = [f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, known, n=1))
                   else key for key in unknown]
        raise ConfigError(f"unknown {cls.__name__} field(s): {', '.join(guesses)}; known fields are "
                          f"{', '.join(sorted(known))}")


@dataclass
class ModelConfig:
    """Everything that defines a model of the family.

    Shape letters used in docstrings throughout the package: b batch, t/s target/source length,
    d ``d_model``, h ``n_heads``, h_kv ``n_kv_heads``, d_h ``head_dim``, v vocabulary.
    """

    arch: str = "encoder-decoder"
    vocab_size: int = 1000
    # Target vocabulary of an encoder-decoder; None = same as vocab_size (one shared vocabulary).
    tgt_vocab_size: int | None = None
    d_model: int = 512
    n_heads: int = 8
    # Key/value heads: n_heads = multi-head, 1 = multi-query, in between = grouped-query attention.
    n_kv_heads: int | None = None
    # Per-head width; None = d_model // n_heads (the paper's d_k = d_v = d_model / h).
    head_dim: int | None = None
    # Encoder layers (encoder-decoder, encoder-only) or decoder layers (decoder-only).
    n_layers: int = 6
    # Decoder layers of an encoder-decoder; None = n_layers.
    n_decoder_layers: int | None = None
    d_ff: int = 2048
    activation: str = "relu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    # "post": x = norm(x + sublayer(x)) as in the paper; "pre": x = x + sublayer(norm(x)) as in GPT.
    norm_position: str = "post"
    # A norm after the last block of each stack; None = yes for pre-norm, no for post-norm.
    final_norm: bool | None = None
    positional: str = "sinusoidal"
    max_seq_len: int = 512
    rope_base: float = 10000.0
    # Learned positions: position p reads row p + position_offset of the table, which has
    # max_seq_len + position_offset rows (BART keeps 2 unused rows in front).
    position_offset: int = 0
    # Sinusoidal positions: "interleaved" (paper: sin at even, cos at odd dimensions) or "split"
    # (Marian: the sines in the first half, the cosines in the second, same frequencies).
    sinusoidal_layout: str = "interleaved"
    # T5-style relative bias: number of buckets and the distance beyond which all share one bucket.
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # Dropout on sublayer outputs and on embeddings + positions (the paper's P_drop).
    dropout: float = 0.0
    # Dropout on the attention weights and after the feed-forward activation.
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    # Bias terms on the attention and feed-forward projections.
    bias: bool = True
    # Finer bias switches, None = follow ``bias`` (attn_out_bias: ``attn_bias``); Qwen2 biases q/k/v only.
    attn_bias: bool | None = None
    attn_out_bias: bool | None = None
    mlp_bias: bool | None = None
    # A bias on the output projection to the vocabulary (BART/Marian ``final_logits_bias``).
    lm_head_bias: bool = False
    # Multiply token embeddings by sqrt(d_model) (paper, section 3.4).
    scale_embeddings: bool = True
    # Encoder-decoder: one embedding matrix for source and target (needs one vocabulary).
    share_embeddings: bool = True
    # Output projection tied to the (target) embedding matrix.
    tie_output: bool = True
    pad_id: int | None = 0
    # Encoder-only (BERT): number of segment types; 0 disables segment embeddings.
    type_vocab_size: int = 2
    # Encoder-only (BERT): a norm right after the embeddings.
    embedding_norm: bool = False
    attn_impl: str = "fused"
    # Padding-free forward passes (aiayn.nn.packing): without a cache, the token-wise layers skip
    # padding, where logits and hidden states are zeros.
    padding_free: bool = False
    # Free-form name (the preset it came from), kept in saved configs.
    name: str = field(default="custom")
    # Which of DERIVED_FIELDS were left None and filled in (see _resolve_derived).
    _derived: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _choice("arch", self.arch, ARCHITECTURES)
        _choice("positional", self.positional, POSITIONAL_SCHEMES)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("norm", self.norm, NORMS)
        _choice("norm_position", self.norm_position, NORM_POSITIONS)
        _choice("attn_impl", self.attn_impl, ATTENTION_IMPLS)
        _choice("sinusoidal_layout", self.sinusoidal_layout, SINUSOIDAL_LAYOUTS)
        for name in ("attn_bias", "attn_out_bias", "mlp_bias"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name} must be True, False or None (= follow bias), got {value!r}")
        if not isinstance(self.lm_head_bias, bool):
            raise ConfigError(f"lm_head_bias must be True or False, got {self.lm_head_bias!r}")
        if (not isinstance(self.position_offset, int) or isinstance(self.position_offset, bool)
                or self.position_offset < 0):
            raise ConfigError(f"position_offset must be an integer >= 0, got {self.position_offset!r}")
        if self.position_offset and self.positional != "learned":
            raise ConfigError(f"position_offset={self.position_offset} only applies to positional='learned' "
                              f"(got positional={self.positional!r}); set position_offset=0")
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len",
                     "relative_buckets", "relative_max_distance"):
            _positive(name, getattr(self, name))
        for name in ("tgt_vocab_size", "n_kv_heads", "head_dim", "n_decoder_layers"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            _probability(name, getattr(self, name))
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; choose "
                              f"n_heads among the divisors of d_model or set head_dim explicitly")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                              f"n_kv_heads must divide n_heads (1 = multi-query, n_heads = multi-head)")
        head_dim = self.d_model // self.n_heads if self.head_dim is None else self.head_dim
        if self.positional == "rope" and head_dim % 2 != 0:
            raise ConfigError(f"positional='rope' needs an even head_dim, got {head_dim}; "
                              f"change d_model/n_heads or head_dim")
        if self.positional == "sinusoidal" and self.d_model % 2 != 0:
            raise ConfigError(f"positional='sinusoidal' needs an even d_model (sin/cos pairs), got {self.d_model}")
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps must be positive, got {self.norm_eps!r}")
        if self.rope_base <= 1:
            raise ConfigError(f"rope_base must be greater than 1, got {self.rope_base!r}")
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError(f"pad_id={self.pad_id} is outside the vocabulary [0, {self.vocab_size}); "
                              f"use an id below vocab_size or pad_id=None")
        if (self.arch == "encoder-decoder" and self.share_embeddings
                and self.tgt_vocab_size not in (None, self.vocab_size)):
            raise ConfigError(f"share_embeddings=True needs one vocabulary, but vocab_size={self.vocab_size} and "
                              f"tgt_vocab_size={self.tgt_vocab_size}; set share_embeddings=False or equal sizes")
        if self.type_vocab_size < 0:
            raise ConfigError(f"type_vocab_size must be >= 0, got {self.type_vocab_size}")
        self._resolve_derived()

    def _resolve_derived(self) -> None:
        """Fill in the fields left None once, so that every reader sees a concrete value; ``to_dict``
        and ``replace`` still treat them as derived (a ``replace(d_model=...)`` re-derives ``head_dim``)."""
        self._derived = frozenset(name for name in DERIVED_FIELDS if getattr(self, name) is None)
        for name, rule in DERIVED_FIELDS.items():
            if name in self._derived:
                setattr(self, name, rule(self))

    # ---- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as given: derived ones (left None) stay None."""
        return {f.name: None if f.name in self._derived else getattr(self, f.name)
                for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**_rename_old_fields(data))

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> ModelConfig:
        path = Path(text_or_path)
        is_file = not str(text_or_path).lstrip().startswith("{") and path.is_file()
        text = path.read_text(encoding="utf-8") if is_file else str(text_or_path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            where = str(path) if is_file else "the given text"
            raise ConfigError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"a ModelConfig JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again); derived fields are derived again."""
        return ModelConfig.from_dict({**self.to_dict(), **changes})


OPTIMIZERS = ("adam", "adamw")
SCHEDULES = ("noam", "cosine", "constant", "linear")


@dataclass
class TrainConfig:
    """How to train: optimiser, schedule, loss, batching, checkpoints. Task-independent."""

    task: str = "reverse"
    seed: int = 0
    # Length of training: epochs over the task's training split, or a fixed number of steps.
    epochs: int = 10
    max_steps: int | None = None
    batch_size: int = 128
    grad_accum: int = 1
    optimizer: str = "adam"
    # Peak learning rate (cosine/constant/linear); for "noam" the factor in front of the formula.
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)  # the paper's Adam betas
    eps: float = 1e-9  # the paper's Adam epsilon
    weight_decay: float = 0.0
    # AdamW: also decay norms, biases and embeddings (off: the usual practice).
    decay_all: bool = False
    schedule: str = "cosine"
    warmup_steps: int = 100
    label_smoothing: float = 0.0
    clip_grad_norm: float | None = 1.0
    # bfloat16 autocast over float32 weights; None = the device's default (aiayn.device.autocast_dtype).
    bf16: bool | None = None
    compile: bool = False
    eval_every: int = 0  # steps between validation runs; 0 = once per epoch
    save_every: int = 0  # steps between checkpoints; 0 = once per epoch
    keep_checkpoints: int = 3
    # At the end, average the last N checkpoints (section 6.1; 0 = off) into RUN/averaged-lastK and
    # score the test split with the better of them and the last on val. Needs keep_checkpoints >= N.
    average_last: int = 0
    log_every: int = 10
    # LoRA adapters on the frozen model (aiayn.finetune.lora.LoraConfig's fields); None: every weight trains.
    lora: dict[str, Any] | None = None
    # QLoRA: "q4" keeps a LoRA run's frozen projections in 4-bit blocks (aiayn.finetune.qlora); None: float.
    quantize: str | None = None

    def __post_init__(self) -> None:
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("schedule", self.schedule, SCHEDULES)
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)  # JSON gives lists
        for name in ("epochs", "batch_size", "grad_accum", "keep_checkpoints", "log_every"):
            _positive(name, getattr(self, name))
        if self.max_steps is not None:
            _positive("max_steps", self.max_steps)
        for name in ("eval_every", "save_every", "warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        _number("lr", self.lr, low=0, low_open=True)
        _number("eps", self.eps, low=0, low_open=True)
        _number("weight_decay", self.weight_decay, low=0)
        _number("label_smoothing", self.label_smoothing, low=0, high=1, high_open=True)
        if self.clip_grad_norm is not None:
            _number("clip_grad_norm", self.clip_grad_norm, low=0, low_open=True)
        for name in ("decay_all", "compile"):
            _flag(name, getattr(self, name))
        if self.bf16 is not None:
            _flag("bf16", self.bf16)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        for beta in self.betas:
            _number("each of betas", beta, low=0, high=1, high_open=True)
        if not isinstance(self.average_last, int) or self.average_last < 0:
            raise ConfigError(f"average_last must be an integer >= 0, got {self.average_last!r}")
        if self.average_last > self.keep_checkpoints:
            raise ConfigError(f"average_last={self.average_last} needs at least that many checkpoints "
                              f"kept, but keep_checkpoints={self.keep_checkpoints}; raise keep_checkpoints")
        if self.schedule == "noam" and self.warmup_steps == 0:
            raise ConfigError("schedule='noam' needs warmup_steps > 0 (the formula divides by it)")
        if self.lora is not None and not isinstance(self.lora, dict):
            raise ConfigError(f"lora must be a mapping (rank, alpha, dropout, targets) or null, got {self.lora!r}")
        if self.quantize is not None:
            _choice("quantize", self.quantize, ("q4",))
            if self.lora is None:
                raise ConfigError("quantize='q4' needs lora: QLoRA trains adapters over the 4-bit base")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        _check_known_fields(cls, data)
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)
