"""What a fine-tune starts from: anything ``aiayn.load`` opens (a Hugging Face directory, a GGUF file, a
shipped model, a run) as trainable float32 modules with its text front end, which a run keeps
(``save_text_front``) so that it generates without its source."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from aiayn.config import ConfigError, ModelConfig
from aiayn.finetune.source import Source, TextFront
from aiayn.interop import load_hf
from aiayn.interop.gguf import open_gguf
from aiayn.interop.hf import HFConfig, family_for
from aiayn.models import build_model
from aiayn.tasks.trained import (
    is_ensemble_release,
    is_release,
    load_run_or_release,
    resolve_model,
    run_text_model,
)
from aiayn.textgen import hf_chat_settings, is_gguf, read_text_model
from aiayn.train.checkpoint import ADAPTER_WEIGHTS, STATE_FILE, latest_checkpoint
from aiayn.train.run_dir import CONFIG_FILE, read_run_config

FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF tensor types that hold floats, not quantised blocks
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE = (
    "tokenizer.json", "tokenizer_config.json", "generation_config.json")


class LoadError(ConfigError):
    """A source ``aiayn.load`` cannot open: what it is, and what it takes instead."""


def source_kind(path: Path) -> str:
    """What ``path`` holds: "gguf", "release", "run", "sentence-transformers" or "hf", read from its
    files without loading weights; LoadError otherwise."""
    if is_gguf(path):
        return "gguf"
    if is_release(path) or is_ensemble_release(path):
        return "release"
    if not path.is_dir():
        what = "a file that is not GGUF" if path.is_file() else "not found"
        raise LoadError(f"{path}: {what}; aiayn.load takes a shipped model's name, a run directory, a GGUF "
                        f"file or a Hugging Face model directory")
    if (path / "modules.json").is_file():
        return "sentence-transformers"
    config = path / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoadError(f"{config} cannot be read as JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("task"), str) and "model" in data:
        return "run"
    if isinstance(data, dict) and ("model_type" in data or "architectures" in data):
        return "hf"
    raise LoadError(f"{path} holds neither an aiayn run (config.json with task, model, train) nor a Hugging "
                    f"Face model (config.json with model_type)")


def load_source(source: str | Path, *, echo: Callable[[str], None] = print) -> Source:
    """The model ``source`` names (a shipped model's name or a path), ready to train: float32 on the CPU,
    every parameter trainable (a GGUF file's quantised weights dequantised, ``echo`` says so)."""
    path = resolve_model(source)
    kind = source_kind(path)
    with torch.device("cpu"):  # whatever default device the caller builds under (a meta-device count)
        if kind == "gguf":
            source_obj = _gguf_source(str(source), path, echo)
        elif kind == "hf":
            source_obj = _hf_source(str(source), path)
        elif kind in ("run", "release"):
            source_obj = _run_source(str(source), path, kind)
        else:
            raise LoadError(f"{path} is a {kind} model; --init-from takes a language model or a translation "
                            f"model (a Hugging Face directory, a GGUF file, a shipped model or a run)")
    source_obj.model.float().train()
    for parameter in source_obj.model.parameters():
        parameter.requires_grad_(True)
    return source_obj


def _gguf_source(name: str, path: Path, echo: Callable[[str], None]) -> Source:
    types = Counter(t.tensor_type.name for t in open_gguf(path).tensors)
    quantised = {kind: n for kind, n in types.most_common() if kind not in FLOAT_TYPES}
    text = read_text_model(path, quantize="none", device="cpu")
    if quantised:
        stored = ", ".join(f"{n} {kind}" for kind, n in quantised.items())
        echo(f"{path.name}: quantised weights ({stored} tensors) dequantised to float32 for training")
    return Source(name, path, "gguf", text.model, text.model.config, text=text)


def _hf_source(name: str, path: Path) -> Source:
    hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    arch = family_for(hf_config, source=str(path)).to_config(HFConfig(hf_config, str(path))).arch
    if arch == "decoder-only":
        text = read_text_model(path, device="cpu")
        return Source(name, path, "hf", text.model, text.model.config, text=text)
    model, config = load_hf(path)
    return Source(name, path, "hf", model, config)


def _run_source(name: str, path: Path, kind: str) -> Source:
    run = load_run_or_release(path)
    text = run_text_model(run) if run.model_config.arch == "decoder-only" else None
    return Source(name, path, kind, run.model, run.model_config, text=text, run=run)


class SourceOption:
    """A task's ``init_from`` option: the ``Source`` it names, loaded on first use (or ``injected``)."""

    def __init__(self, name: str | None, *, echo: Callable[[str], None] = print,
                 injected: Source | None = None) -> None:
        self.name = name if injected is None else injected.name
        self.echo = echo
        self._source = injected
        self._front: tuple[Path | None, TextFront] | None = None

    @property
    def given(self) -> bool:
        return self.name is not None

    def get(self) -> Source:
        if self.name is None:
            raise ValueError("no init_from was given")
        if self._source is None:
            self._source = load_source(self.name, echo=self.echo)
        return self._source

    def text(self) -> Any:
        """The source's ``TextModel``; a ConfigError when it is not a language model with a tokenizer."""
        source = self.get()
        if source.text is None or source.text.tokenizer is None:
            raise ConfigError(f"{source.name} is not a decoder-only language model with a tokenizer (its "
                              f"architecture: {source.config.arch}); this task fine-tunes one")
        return source.text

    def front(self, run_dir: Path | None) -> TextFront:
        """The loaded model's tokenizer, chat template and end-of-text id: kept in ``run_dir``, else the
        source's; read once per run directory."""
        if self._front is None or self._front[0] != run_dir:
            kept = read_text_front(run_dir) if run_dir is not None else None
            if kept is None:
                text = self.text()
                kept = TextFront(text.tokenizer, text.chat_template, text.eos_id)
            self._front = run_dir, kept
        return self._front[1]

    def context(self, run_dir: Path | None) -> int:
        """The model's context: the run's own (it resumes without its source), else the source's."""
        if run_dir is not None and (run_dir / CONFIG_FILE).is_file():
            saved = read_run_config(run_dir)["model"].get("max_seq_len")
            if isinstance(saved, int):
                return saved
        return self.get().config.max_seq_len

    def keep_front(self, run_dir: Path) -> None:
        """Write the source's text front end into a new run's directory (nothing when it is there)."""
        if read_text_front(run_dir) is None:
            save_text_front(self.text(), run_dir)

    def build_model(self, config: ModelConfig, run_dir: Path | None) -> nn.Module:
        """The source's weights where ``needs_source``, else the architecture alone; ``config`` may differ
        from the source's only where shapes do not (dropout)."""
        if not needs_source(run_dir):
            return build_model(config)
        source = load_starting_point(self.get, str(self.name), run_dir)
        if config == source.config:
            return source.model
        model = build_model(config)
        model.load_state_dict(source.model.state_dict())
        return model.train()


def needs_source(run_dir: Path | None) -> bool:
    """Whether the run in ``run_dir`` needs its source's weights: a new run (no checkpoint yet) or a LoRA run
    (its checkpoints hold adapters only). Elsewhere a checkpoint or release fills the model in, so a run
    resumes after its source has moved."""
    if run_dir is None:
        return False
    latest = latest_checkpoint(run_dir / "checkpoints")
    return latest is None or _adapters_only(latest)


def load_starting_point(load: Callable[[], Source], name: str, run_dir: Path) -> Source:
    """``load()``; a run with checkpoints that cannot load its source says which model it resumes on."""
    try:
        return load()
    except LoadError as exc:
        if latest_checkpoint(run_dir / "checkpoints") is None:
            raise
        raise LoadError(f"{exc}. This run's checkpoints hold only its LoRA adapters: it resumes on the model "
                        f"they go on, {name}; put it back there") from None


def _adapters_only(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` holds a LoRA run's adapters without the base they go on."""
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # (loading the checkpoint says what is wrong with it)
    return isinstance(state, dict) and state.get("weights") == ADAPTER_WEIGHTS


def save_text_front(text: Any, run_dir: Path) -> None:
    """Write a ``TextModel``'s tokenizer, chat template and end-of-text id into ``run_dir`` as a Hugging
    Face directory keeps them."""
    specials = dict(getattr(text.chat_template, "special_tokens", {}) or {})
    settings = {**specials, **({"chat_template": str(text.chat_template)} if text.chat_template is not None else {})}
    files = {TOKENIZER_CONFIG_FILE: settings, GENERATION_CONFIG_FILE: {"eos_token_id": text.eos_id}}
    for name, data in files.items():
        (run_dir / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    text.tokenizer.save(str(run_dir / TOKENIZER_FILE))


def read_text_front(run_dir: Path) -> TextFront | None:
    """What ``save_text_front`` wrote into ``run_dir``; None when it holds none."""
    if not (run_dir / TOKENIZER_FILE).is_file():
        return None
    tokenizer = Tokenizer.from_file(str(run_dir / TOKENIZER_FILE))
    template, eos_id = hf_chat_settings(run_dir, tokenizer)
    return TextFront(tokenizer, template, eos_id)
