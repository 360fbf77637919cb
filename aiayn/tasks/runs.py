"""Run directories as the commands use them: a run's configs (``setup_run``), and a trained run as a
translator or a text model, on ``device`` (None: the first CUDA GPU, else the CPU) through ``aiayn.fast``
unless ``plain=True``. They need the task registry, so they live above ``aiayn.train``."""

from __future__ import annotations

import difflib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aiayn.config import ConfigError, ModelConfig, TrainConfig
from aiayn.finetune.lora import merge_lora
from aiayn.finetune.peft_format import load_adapter
from aiayn.tasks.base import TASKS, get_task
from aiayn.tasks.base import task_options as task_options_of
from aiayn.tasks.trained import (
    LoadedRun,  # noqa: F401  (re-exported: aiayn.tasks.runs.LoadedRun)
    RunInputError,
    is_ensemble_release,
    is_release,
    load_run,  # noqa: F401  (re-exported: aiayn.tasks.runs.load_run)
    load_run_or_release,
    release_members,
    run_text_model,
    shipped_name,
)
from aiayn.tasks.translation import SOURCE_TOKENIZER_FILE, TARGET_TOKENIZER_FILE, TranslationTask
from aiayn.train.run_dir import read_run_config
from aiayn.train.task import Task
from aiayn.translate import Translator

if TYPE_CHECKING:
    from aiayn.textgen import TextModel

DEFAULT_TASK = "reverse"
RECIPE_KEYS = frozenset({"task", "task_options", "model", "train", "description"})
# Model options that leave the shapes of a loaded model's weights as they are (allowed with init_from).
SHAPE_FREE = frozenset({"dropout", "attention_dropout", "padding_free"})


class RunSetupError(ConfigError):
    """Options a run cannot be set up with; ``about``: the input at fault (recipe, task_options, option, max_tokens)."""

    def __init__(self, message: str, about: str) -> None:
        super().__init__(message)
        self.about = about


def for_inference(model: nn.Module, *, plain: bool = False,
                  device: torch.device | str | None = None) -> nn.Module:
    """``model`` in eval mode on ``device`` (None: where it is), through aiayn.fast unless ``plain``."""
    if device is not None:
        model.to(device)  # before optimize: it swaps in its CPU kernels only for a CPU model
    model.eval()
    if not plain:
        from aiayn.fast import optimize

        optimize(model, mode="inference")
    return model


def load_translator(run_dir: Path, checkpoint: Path | None = None, *, plain: bool = False,
                    device: torch.device | str | None = None) -> tuple[TranslationTask, Translator]:
    """(the translation task, a ``Translator`` of its trained model) from a run directory; ``checkpoint``: one
    (or a folder of them) instead of the latest."""
    from aiayn.device import resolve

    where = resolve(device)  # before loading: a missing device fails at once
    if not run_dir.is_dir():
        raise RunInputError(f"{run_dir} does not exist; train one with "
                            f"aiayn train --recipe recipes/multi30k-en-de.yaml")
    if is_ensemble_release(run_dir):  # a shipped ensemble: its members as one translator
        return load_ensemble_translator([(run_dir, checkpoint)], plain=plain, device=where)
    run = load_run_or_release(run_dir, checkpoint=checkpoint)
    if not isinstance(run.task, TranslationTask):
        raise RunInputError(f"{run_dir} holds a {run.task.name} run; translation needs a run of "
                            f"the translation task")
    return run.task, run.task.translator(for_inference(run.model, plain=plain, device=where))


def load_ensemble_translator(members: Sequence[tuple[Path, Path | None]], *, plain: bool = False,
                             device: torch.device | str | None = None) -> tuple[TranslationTask, Translator]:
    """(the first member's task, a ``Translator`` of an ``aiayn.generate.Ensemble``) from (run or release,
    checkpoint or None) pairs, the first member's recipe setting the search. Members must share tokenizers,
    output width and language pair, else a ``RunInputError(about="members")``."""
    from aiayn.generate import Ensemble

    if not members:
        raise ValueError("an ensemble needs at least one member")
    given, members = members, []
    for run_dir, checkpoint in given:
        if not is_ensemble_release(run_dir):
            members.append((run_dir, checkpoint))
        elif checkpoint is not None:
            raise RunInputError(f"{run_dir} is a shipped ensemble (one set of weights per member); drop "
                                f"--checkpoint", about="checkpoint")
        else:
            members.extend((member, None) for member in release_members(run_dir))
    loaded = [load_translator(run_dir, checkpoint, plain=plain, device=device) for run_dir, checkpoint in members]
    if len(loaded) == 1:
        return loaded[0]
    (task, first), first_name = loaded[0], _member_name(*members[0])
    vocabularies = _vocabularies(first)
    for (run_dir, checkpoint), (other_task, other) in zip(members[1:], loaded[1:], strict=True):
        name = _member_name(run_dir, checkpoint)
        pair, other_pair = f"{task.src_lang}->{task.tgt_lang}", f"{other_task.src_lang}->{other_task.tgt_lang}"
        if other_pair != pair:
            raise RunInputError(f"{first_name} translates {pair} but {name} {other_pair}; an ensemble's "
                                f"members translate one language pair in one direction", about="members")
        other_vocabularies = _vocabularies(other)
        if other_vocabularies != vocabularies:
            source_differs = other_vocabularies[0] != vocabularies[0]
            raise RunInputError(_vocabulary_mismatch(first_name, task, name, other_task, source_differs),
                                about="members")
    try:
        ensemble = Ensemble([translator.model for _, translator in loaded])
    except ValueError as exc:  # output widths or pad ids differ
        raise RunInputError(str(exc), about="members") from None
    return task, Translator(ensemble, first.tokenizer, target_tokenizer=first.target_tokenizer,
                            max_tokens=first.max_tokens, max_sentences=first.max_sentences, options=first.options)


def _vocabularies(translator: Translator) -> tuple[str, str]:
    return translator.tokenizer.tokenizer.to_str(), translator.target_tokenizer.tokenizer.to_str()


def _vocabulary_mismatch(first_name: str, first: TranslationTask, name: str, other: TranslationTask,
                         source_differs: bool) -> str:
    """The one line that refuses ``other`` beside ``first`` for their vocabularies."""
    if first.vocabulary != other.vocabulary:
        kinds = {"joint": "one joint vocabulary", "separate": "separate source and target vocabularies"}
        return (f"{first_name} has {kinds[first.vocabulary]} but {name} {kinds[other.vocabulary]}; an "
                f"ensemble's members share their vocabularies")
    if first.separate:
        side, file = ("source", SOURCE_TOKENIZER_FILE) if source_differs else ("target", TARGET_TOKENIZER_FILE)
        return (f"{name} has another {side} vocabulary than {first_name} (their {file} files differ); an "
                f"ensemble's members share one")
    return (f"{name} has another vocabulary than {first_name} (their tokenizer.json files differ); an "
            f"ensemble's members share one")


def _member_name(run_dir: Path, checkpoint: Path | None) -> str:
    """A member as a message names it: a shipped model by its name, a run by its path."""
    name = shipped_name(run_dir) or str(run_dir)
    return name if checkpoint is None else f"{name} (checkpoint {checkpoint})"


def load_text_model(run_dir: Path | None = None, model_path: Path | None = None, *,
                    plain: bool = False, quantize: str = "none",
                    device: torch.device | str | None = None, adapter: Path | None = None) -> TextModel:
    """A decoder-only model with its text functions, from a run or shipped release (``run_dir``), or a GGUF
    file / Hugging Face directory (``model_path``). ``adapter``: a LoRA adapter directory (PEFT's layout)
    merged into the weights before any quantisation, as a LoRA run's own adapters are."""
    from aiayn.textgen import placement, read_text_model

    if (run_dir is None) == (model_path is None):
        raise ValueError("load_text_model takes one of run_dir and model_path")
    where, quantize = placement(device, quantize)  # before loading: a refusal comes at once
    if model_path is not None and is_ensemble_release(model_path):
        raise RunInputError(f"{model_path.name} is an ensemble of translation models; generation needs a "
                            f"decoder-only language model such as shakespeare-char")
    if model_path is not None and is_release(model_path):
        run_dir, model_path = model_path, None
    if model_path is not None:
        # Float weights to merge an adapter into; quantised after.
        lm = read_text_model(model_path, quantize=quantize if adapter is None else "none", device=where)
        _merge_adapter(lm.model, adapter)
        lm.model = _lower(for_inference(lm.model, plain=plain, device=where), quantize)
        return lm
    assert run_dir is not None
    run = load_run_or_release(run_dir)
    if run.model_config.arch != "decoder-only" or getattr(run.task, "tokenizer", None) is None:
        raise RunInputError(f"{run_dir} holds a {run.task.name} run ({run.model_config.arch}); "
                            f"generation needs a decoder-only language model such as shakespeare-char")
    _merge_adapter(merge_lora(run.model), adapter)
    lm = run_text_model(run)
    lm.model = _lower(for_inference(run.model, plain=plain, device=where), quantize)
    return lm


def _merge_adapter(model: nn.Module, adapter: Path | None) -> None:
    if adapter is not None:
        load_adapter(model, model.config, adapter)
        merge_lora(model)


def _lower(model: nn.Module, quantize: str) -> nn.Module:
    if quantize == "none":
        return model
    from aiayn.fast.quantize import lower_precision

    return lower_precision(model, quantize)


def read_recipe(path: Path) -> dict[str, Any]:
    """A recipe file: YAML with ``task``, ``task_options``, ``model`` and ``train`` mappings."""
    import yaml

    if not path.is_file():
        raise RunSetupError(f"{path} not found", about="recipe")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise RunSetupError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}", about="recipe") from None
    if not isinstance(data, dict) or not set(data) <= RECIPE_KEYS:
        extra = "not a mapping" if not isinstance(data, dict) else ", ".join(
            f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, RECIPE_KEYS, n=1))
            else key for key in sorted(map(str, set(data) - RECIPE_KEYS)))
        raise RunSetupError(f"{path}: a recipe is a mapping with keys {', '.join(sorted(RECIPE_KEYS))}; "
                            f"got {extra}", about="recipe")
    for key in ("task_options", "model", "train"):
        if not isinstance(data.get(key, {}), dict):
            raise RunSetupError(f"{path}: {key} must be a mapping", about="recipe")
    return data


@dataclass
class RunSetup:
    """What ``aiayn.train.trainer.train`` is called with: the task (built) and the two configs."""

    task_name: str
    task: Task
    model_config: ModelConfig
    train_config: TrainConfig


def setup_run(task: str | None = None, *, resume_dir: Path | None = None, recipe: Path | None = None,
              max_tokens: int | None = None, model_options: Mapping[str, Any] | None = None,
              train_options: Mapping[str, Any] | None = None,
              task_options: Mapping[str, Any] | None = None) -> RunSetup:
    """The task and configs of a run, from (lowest precedence first) the task's defaults (its LoRA ones when
    LoRA is on), a recipe file, and the ``*_options``; a resumed run's saved configs replace the first two.
    ``task``: None takes the recipe's (or the resumed run's), else ``DEFAULT_TASK``. Command-line
    ``task_options`` are refused when resuming or by a task that does not take them."""
    saved = None
    if resume_dir is not None and (resume_dir / "config.json").is_file():
        saved = read_run_config(resume_dir, hint="cannot resume it")
    recipe_fields = read_recipe(recipe) if recipe is not None and saved is None else {}
    name = task or (saved or recipe_fields).get("task") or DEFAULT_TASK
    given_options = _command_line_options(name, task_options or {}, resuming=resume_dir is not None)
    task_options = {**(saved or recipe_fields).get("task_options", {}), **given_options}
    if max_tokens is not None:
        if name in TASKS and "max_tokens" not in task_options_of(TASKS[name]):
            raise RunSetupError(f"task {name!r} batches by examples (--batch-size); --max-tokens is "
                                f"for token-count batching (translation)", about="max_tokens")
        task_options = {**task_options, "max_tokens": max_tokens}
    if saved is None and task_options.get("init_from") is not None:
        _refuse_shape_changes(task_options["init_from"], recipe_fields.get("model", {}), model_options or {})
    try:
        task_obj = get_task(name, **task_options)
    except TypeError as exc:  # an option the task does not take
        raise RunSetupError(f"task {name!r} does not take that option: {exc}", about="task_options") from None
    if saved is not None:
        model_fields, train_fields = saved["model"], saved["train"]
    else:
        model_fields = {**task_obj.model_config().to_dict(), **recipe_fields.get("model", {})}
        lora = {**recipe_fields.get("train", {}), **(train_options or {})}.get("lora") is not None
        train_fields = {**TrainConfig(task=name).to_dict(), **task_obj.train_overrides(),
                        **(task_obj.lora_overrides() if lora else {}), **recipe_fields.get("train", {}), "task": name}
    model_fields.update(model_options or {})
    train_fields.update(train_options or {})
    model_config = ModelConfig.from_dict(model_fields)
    if isinstance(task_obj, TranslationTask):  # e.g. shared embeddings asked of separate vocabularies: now,
        task_obj.check_model_config(model_config)  # not after the BPE is learned
    return RunSetup(name, task_obj, model_config, TrainConfig.from_dict(train_fields))


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _command_line_options(name: str, options: Mapping[str, Any], *, resuming: bool) -> dict[str, Any]:
    """``options`` if task ``name`` takes each of them and the run is new; a RunSetupError otherwise."""
    if options and resuming:
        raise RunSetupError(f"{_flag(next(iter(options)))} cannot change when resuming (the run keeps its "
                            f"task options); drop it", about="option")
    for option in options:
        if name in TASKS and option not in task_options_of(TASKS[name]):
            takers = sorted(task for task, cls in TASKS.items() if option in task_options_of(cls))
            raise RunSetupError(f"task {name!r} does not take {_flag(option)}; tasks that do: "
                                f"{', '.join(takers) or 'none'}", about="option")
    return dict(options)


def _refuse_shape_changes(source: str, recipe_model: Mapping[str, Any], model_options: Mapping[str, Any]) -> None:
    """A RunSetupError naming the first model option, outside ``SHAPE_FREE``, that would change the shape of
    the model ``source`` names."""
    free = ", ".join(_flag(option) for option in sorted(SHAPE_FREE))
    refused = [(_flag(option), "drop it", "option") for option in model_options if option not in SHAPE_FREE]
    refused += [(f"the recipe's model.{option}", "remove it from the recipe", "recipe")
                for option in recipe_model if option not in SHAPE_FREE]
    if refused:
        what, fix, about = refused[0]
        raise RunSetupError(f"{what} would change the shape of the model --init-from {source} loads (its weights "
                            f"set it); {fix} (with --init-from only {free} may change)", about=about)


def default_run_dir(task: str) -> Path:
    """runs/<task>-<date>-<time>, where a run goes when no directory is given."""
    return Path("runs") / f"{task}-{time.strftime('%Y%m%d-%H%M%S')}"
