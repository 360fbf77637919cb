"""A model to fine-tune: anything ``aiayn.load`` opens (a Hugging Face directory, a GGUF file, a
shipped model, a run directory), as trainable float32 modules with its text front end.

``load_source`` loads one; ``SourceOption`` is a task's ``init_from`` option, loaded on first use
and kept; ``save_text_front`` / ``read_text_front`` keep a source's tokenizer, chat template and
end-of-text id in a run directory, so the run generates without its source."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.models import build_model
from aiayn.train.checkpoint import ADAPTER_WEIGHTS, STATE_FILE, latest_checkpoint

FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF tensor types that hold floats, not quantised blocks
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE = (
    "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass
class Source:
    """A loaded starting point.

    ``name``: what the user gave (a run records it as its task's ``init_from`` option). ``kind``:
    "gguf", "hf", "release" or "run". ``model``: plain float32 modules on the CPU, train mode.
    ``text``: for a decoder-only model, its ``aiayn.textgen.TextModel`` (tokenizer, ``eos_id``,
    ``chat_template``); None otherwise. ``run``: for a run or a shipped release, its
    ``aiayn.tasks.trained.LoadedRun`` (the task that made it, with its tokenizers); None otherwise."""

    name: str
    path: Path
    kind: str
    model: nn.Module
    config: ModelConfig
    text: Any = None
    run: Any = None


def load_source(source: str | Path, *, echo: Callable[[str], None] = print) -> Source:
    """The model ``source`` names (a shipped model's name or a path), ready to train: float32 on the
    CPU, train mode, every parameter trainable. A GGUF file's quantised weights are dequantised
    (``echo`` says so once). Errors a user can fix raise ``aiayn.api.LoadError`` (or the loader's
    own one-line error)."""
    from aiayn.api import LoadError, source_kind
    from aiayn.tasks.shipped import resolve_model

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
    from aiayn.interop.gguf import open_gguf
    from aiayn.textgen import read_text_model

    types = Counter(t.tensor_type.name for t in open_gguf(path).tensors)
    quantised = {kind: n for kind, n in types.most_common() if kind not in FLOAT_TYPES}
    text = read_text_model(path, quantize="none", device="cpu")
    if quantised:
        stored = ", ".join(f"{n} {kind}" for kind, n in quantised.items())
        echo(f"{path.name}: quantised weights ({stored} tensors) dequantised to float32 for full fine-tuning")
    return Source(name, path, "gguf", text.model, text.model.config, text=text)


def _hf_source(name: str, path: Path) -> Source:
    from aiayn.interop import load_hf
    from aiayn.interop.hf import HFConfig, family_for
    from aiayn.textgen import read_text_model

    hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    arch = family_for(hf_config, source=str(path)).to_config(HFConfig(hf_config, str(path))).arch
    if arch == "decoder-only":
        text = read_text_model(path, device="cpu")
        return Source(name, path, "hf", text.model, text.model.config, text=text)
    model, config = load_hf(path)
    return Source(name, path, "hf", model, config)


def _run_source(name: str, path: Path, kind: str) -> Source:
    from aiayn.tasks.runs import run_text_model
    from aiayn.tasks.shipped import load_run_or_release

    run = load_run_or_release(path)
    text = run_text_model(run) if run.model_config.arch == "decoder-only" else None
    return Source(name, path, kind, run.model, run.model_config, text=text, run=run)


class SourceOption:
    """A task's ``init_from`` option: the ``Source`` it names, loaded once, on first use.

    ``injected``: a loaded ``Source`` to use instead (tests)."""

    def __init__(self, name: str | None, *, echo: Callable[[str], None] = print,
                 injected: Source | None = None) -> None:
        self.name = name if injected is None else injected.name
        self.echo = echo
        self._source = injected

    @property
    def given(self) -> bool:
        return self.name is not None

    def get(self) -> Source:
        """The loaded source (loading it the first time)."""
        if self.name is None:
            raise ValueError("no init_from was given")
        if self._source is None:
            self._source = load_source(self.name, echo=self.echo)
        return self._source

    def build_model(self, config: ModelConfig, run_dir: Path | None) -> nn.Module:
        """The model a task trains from: the source's weights in a new run (``run_dir`` set, no
        checkpoint yet) and under a LoRA run's checkpoints (they hold the adapters only); outside a
        run or under full checkpoints, the architecture alone (a checkpoint or a release fills it in
        next). ``config`` may differ from the source's only where the shapes do not (dropout): then a
        model of ``config`` gets the source's weights."""
        latest = None if run_dir is None else latest_checkpoint(run_dir / "checkpoints")
        if run_dir is None or (latest is not None and not _adapters_only(latest)):
            return build_model(config)
        source = self.get()
        if config == source.config:
            return source.model
        model = build_model(config)
        model.load_state_dict(source.model.state_dict())
        return model.train()


def _adapters_only(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` holds a LoRA run's adapters without the base they go on."""
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # (loading the checkpoint says what is wrong with it)
    return isinstance(state, dict) and state.get("weights") == ADAPTER_WEIGHTS


def save_text_front(text: Any, run_dir: Path) -> None:
    """Write a ``TextModel``'s tokenizer, chat template and end-of-text id into ``run_dir`` as a
    Hugging Face directory keeps them (tokenizer.json, tokenizer_config.json, generation_config.json)."""
    specials = dict(getattr(text.chat_template, "special_tokens", {}) or {})
    settings = {**specials, **({"chat_template": str(text.chat_template)} if text.chat_template is not None else {})}
    files = {TOKENIZER_CONFIG_FILE: settings, GENERATION_CONFIG_FILE: {"eos_token_id": text.eos_id}}
    for name, data in files.items():
        (run_dir / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    text.tokenizer.save(str(run_dir / TOKENIZER_FILE))


def read_text_front(run_dir: Path) -> tuple[Any, Any, int | None] | None:
    """(``tokenizers.Tokenizer``, chat template or None, end-of-text id or None) that
    ``save_text_front`` wrote into ``run_dir``; None when it holds none."""
    from tokenizers import Tokenizer

    from aiayn.textgen import hf_chat_settings

    if not (run_dir / TOKENIZER_FILE).is_file():
        return None
    tokenizer = Tokenizer.from_file(str(run_dir / TOKENIZER_FILE))
    template, eos_id = hf_chat_settings(run_dir, tokenizer)
    return tokenizer, template, eos_id
