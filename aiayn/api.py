"""``aiayn.load``: a shipped model, a run, a GGUF file or a Hugging Face directory in one call, as the
object the command line uses for it (``Translator``, ``TextModel``, ``SentenceEncoder``,
``LoadedRun`` or ``LoadedModel``); ``generate_text`` and ``train_run`` for the rest of a Python
session (docs/python-api.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.device import resolve
from aiayn.embed import SentenceEncoder, load_sentence_encoder
from aiayn.generate.sampling import SamplingConfig
from aiayn.interop import load_hf
from aiayn.interop.hf import HFConfig, family_for
from aiayn.tasks.runs import (
    LoadedRun,
    default_run_dir,
    for_inference,
    load_text_model,
    load_translator,
    setup_run,
)
from aiayn.tasks.sources import LoadError, source_kind
from aiayn.tasks.translation import TranslationTask
from aiayn.textgen import TextModel, stream_text
from aiayn.translate import Translator

if TYPE_CHECKING:
    from aiayn.train.trainer import TrainResult


@dataclass
class LoadedModel:
    """A model with no text front end here (a Hugging Face encoder-decoder), eval mode, and its config."""

    model: nn.Module
    config: ModelConfig


@dataclass
class Generation:
    """What ``generate_text`` produced; ``stop_reason``: "length", "eos", "stop" (the stop string not in
    ``text``) or "context" (with ``slide=False``)."""

    text: str
    tokens: int
    stop_reason: str
    slides: int = 0


def load(source: str | Path, *, checkpoint: str | Path | None = None, device: torch.device | str | None = None,
         quantize: str = "none", plain: bool = False) -> Translator | TextModel | SentenceEncoder | LoadedRun | LoadedModel:
    """The model at ``source`` (a shipped model's name, a run directory, a GGUF file, or a Hugging Face /
    sentence-transformers directory), ready to use. ``checkpoint``: a run's, instead of its latest;
    ``quantize``: ``aiayn generate``'s ``--quantize``, for text models only (else a LoadError);
    ``plain``: the plain PyTorch modules instead of ``aiayn.fast``'s CPU kernels."""
    from aiayn.tasks.trained import resolve_model

    path = resolve_model(source)
    kind = source_kind(path)
    if checkpoint is not None and kind != "run":
        raise LoadError(f"{path} is not a run directory (it is a {kind}); checkpoint= is for runs")
    if kind in ("run", "release"):
        return _load_run(path, None if checkpoint is None else Path(checkpoint), quantize=quantize, device=device,
                         plain=plain)
    if kind == "hf":  # by the architecture its config.json converts to
        hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        arch = family_for(hf_config, source=str(path)).to_config(HFConfig(hf_config, str(path))).arch
    else:
        arch = "decoder-only" if kind == "gguf" else "encoder-only"  # a sentence-transformers directory
    if arch == "decoder-only":
        return load_text_model(model_path=path, quantize=quantize, device=device, plain=plain)
    if arch == "encoder-only":
        refuse_quantize(quantize, path, "a sentence encoder")
        return load_sentence_encoder(path, device=device)
    refuse_quantize(quantize, path, f"an {arch} model")
    where = resolve(device)
    model, config = load_hf(path)
    return LoadedModel(for_inference(model, plain=plain, device=where), config)


def refuse_quantize(quantize: str, path: Path, what: str) -> None:
    """A LoadError unless ``quantize`` is "none": a model silently loaded at full precision would mislead."""
    if quantize != "none":
        raise LoadError(f"quantize={quantize!r} applies to text models only (a language-model run, a GGUF file, "
                        f"a Hugging Face decoder-only directory); {path} holds {what}: leave quantize='none'")


def _load_run(path: Path, checkpoint: Path | None, *, quantize: str, device: torch.device | str | None,
              plain: bool) -> Translator | TextModel | LoadedRun:
    """A run or release by its task: translation, a language model, or any other task's run."""
    from aiayn.tasks.trained import is_ensemble_release, load_run_or_release

    where = resolve(device)  # before loading: a missing device fails at once
    if is_ensemble_release(path):  # a shipped ensemble (of translation models): one Translator
        refuse_quantize(quantize, path, "an ensemble of translation models")
        return load_translator(path, checkpoint, plain=plain, device=where)[1]
    run = load_run_or_release(path, checkpoint=checkpoint)
    if isinstance(run.task, TranslationTask):
        refuse_quantize(quantize, path, "a translation model")
        return load_translator(path, checkpoint, plain=plain, device=where)[1]
    if run.model_config.arch == "decoder-only" and getattr(run.task, "tokenizer", None) is not None:
        if checkpoint is not None:
            raise LoadError(f"{path} holds a language model; generation loads its latest checkpoint (drop "
                            f"checkpoint=, or load the run with aiayn.tasks.runs.load_run)")
        return load_text_model(run_dir=path, quantize=quantize, device=where, plain=plain)
    refuse_quantize(quantize, path, f"a {run.task.name} model")
    run.model = for_inference(run.model, plain=plain, device=where)
    return run


def generate_text(lm: TextModel, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0,
                  seed: int | None = None, chat: bool = False, stop: Sequence[str] = (),
                  compile: bool = False, slide: bool = True) -> Generation:
    """Continue ``prompt`` with ``lm`` as ``aiayn generate`` does, but greedy by default (``temperature``
    0); ``chat`` wraps the prompt in the chat template. ValueError for a prompt the model cannot take."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              repetition_penalty=repetition_penalty, seed=seed)
    pieces: list[str] = []
    stats = stream_text(lm, lm.prompt_ids(prompt, chat=chat), on_text=pieces.append, max_new_tokens=max_new_tokens,
                        sampling=sampling, stops=tuple(stop), compile=compile, slide=slide)
    return Generation("".join(pieces), stats.tokens, stats.stop, stats.slides)


def train_run(task: str | None = None, run_dir: str | Path | None = None, *, recipe: str | Path | None = None,
              model: dict[str, Any] | None = None, train: dict[str, Any] | None = None, resume: bool = False,
              overwrite: bool = False, device: torch.device | str | None = None, progress: bool = True,
              plots: bool = True, plain: bool = False) -> TrainResult:
    """Train as ``aiayn train`` does: ``task`` (None: the recipe's, else the default) into ``run_dir``
    (None: ``runs/<task>-<date>-<time>``), configured by the task's defaults, then ``recipe`` (YAML),
    then the ``model`` / ``train`` fields."""
    from aiayn.train.trainer import train as train_task

    where = resolve(device)  # before anything is built: a missing device fails at once
    directory = None if run_dir is None else Path(run_dir)
    if resume and directory is None:
        raise ValueError("resume=True needs run_dir (the run to continue)")
    setup = setup_run(task, resume_dir=directory if resume else None,
                      recipe=None if recipe is None else Path(recipe), model_options=model, train_options=train)
    directory = directory or default_run_dir(setup.task_name)
    return train_task(setup.task, setup.model_config, setup.train_config, directory, resume=resume,
                      overwrite=overwrite, progress=progress, make_plots=plots, device=where, fast=not plain)
