"""Trained models shipped inside the package: a new user translates or generates in the first
minute, with no training run of their own.

A shipped model is a *release* directory, ``aiayn/pretrained/<name>/``:

    release.json        what it is: name, task, the run it came from (step, checkpoint), dtype,
                        parameter count, scores (the record of the run that made it)
    config.json         the run's configs (task, task_options, model, train) as training wrote them
    model.safetensors   the weights, float16 or bfloat16 (loaded back as float32)
    tokenizer.json      the run's tokenizer, for tasks that keep one in the run directory (a
                        translation run of separate vocabularies: tokenizer.src.json and
                        tokenizer.tgt.json instead)
    record/             the run's recipe, metrics.csv, summary.json and scores

An *ensemble release* ships several models that translate as one (``aiayn.generate.Ensemble``):
its release.json names its ``members``, each a release directory of its own inside it
(``aiayn/pretrained/<name>/<member>/``, with its run's record), and it has no weights of its own.

``write_release`` makes one from a finished run and ``write_ensemble_release`` one from several
(``scripts/ship_model.py`` calls them); ``load_release`` loads a single release as a
``LoadedRun``, ``release_members`` lists an ensemble's members (``aiayn.tasks.runs.load_translator``
loads them as one translator); ``resolve_model`` turns a ``--model`` argument (a shipped name or a
path) into a release, a run directory or a file.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from aiayn.config import ModelConfig, TrainConfig
from aiayn.tasks.base import get_task
from aiayn.tasks.runs import LoadedRun, RunInputError, load_run, resolve_checkpoint
from aiayn.tasks.translation import SOURCE_TOKENIZER_FILE, TARGET_TOKENIZER_FILE, TOKENIZER_FILE
from aiayn.train.checkpoint import atomic_write_text
from aiayn.train.run_dir import read_run_config

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "pretrained"
RELEASE_FILE, WEIGHTS_FILE = "release.json", "model.safetensors"
# The tokenizer files a run may keep (a translation run: one joint, or a source and a target).
TOKENIZER_FILES = (TOKENIZER_FILE, SOURCE_TOKENIZER_FILE, TARGET_TOKENIZER_FILE)
RECORD_FILES = ("metrics.csv", "summary.json", "curves.png")
RELEASE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_TRANSLATION_MODEL = "multi30k-en-de"  # what `aiayn translate` runs without --run/--model
MAX_RELEASE_BYTES = 10 * 2**20  # a shipped model's weights stay under 10 MB (the repository carries them)
LEFTOVER_SUFFIXES = (".tmp", ".old")  # NAME.tmp being built, NAME.old being replaced (_put_in_place)


def shipped_models() -> dict[str, dict[str, Any]]:
    """{name: its release.json} of every model shipped in the package, sorted by name."""
    found = {}
    if SHIPPED_DIR.is_dir():
        for directory in sorted(SHIPPED_DIR.iterdir()):
            if directory.suffix in LEFTOVER_SUFFIXES:  # an interrupted write's, not a release
                continue
            if (directory / RELEASE_FILE).is_file():
                found[directory.name] = json.loads((directory / RELEASE_FILE).read_text(encoding="utf-8"))
    return found


def shipped_path(name: str) -> Path:
    """The release directory of the shipped model ``name``; an unknown name lists the known ones."""
    models = shipped_models()
    if name not in models:
        known = ", ".join(models) or "none (this installation ships no models)"
        raise RunInputError(f"no shipped model is called {name!r}; the shipped models are: {known}",
                            about="model")
    return SHIPPED_DIR / name


def is_release(path: Path) -> bool:
    """A single model's release: release.json and the weights beside it."""
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
    """The member release directories of an ensemble release, in its order (the first is the
    member that views of a single model show: ``single_model``). A ``RunInputError`` for a member
    that is not a plain name or not a release."""
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
    """(``path``, None), or for an ensemble release (its first member, a note that says so): what
    views of one model (attention maps, ``aiayn explore``) show of an ensemble."""
    if not is_ensemble_release(path):
        return path, None
    members = release_members(path)
    return members[0], (f"{path.name} is an ensemble of {len(members)} models; showing its first member, "
                        f"{members[0].name}")


def resolve_model(value: str | Path) -> Path:
    """A ``--model`` argument as a path: an existing path as given (a release, a run directory, a
    GGUF file, a Hugging Face directory), else a shipped model's name (``multi30k-en-de``). A bare
    name that is neither is refused with the list of shipped models."""
    path = Path(value)
    if path.exists():
        return path
    text = str(value)
    if text in shipped_models():
        return shipped_path(text)
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
    configs = read_run_config(release)
    task = get_task(configs["task"], **configs.get("task_options", {}))
    model_config = ModelConfig.from_dict(configs["model"])
    train_config = TrainConfig.from_dict(configs["train"])
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
    if prepare:
        task.prepare(train_config.seed)
    return LoadedRun(task=task, model=model.eval(), model_config=model_config,
                     train_config=train_config, checkpoint=release)


def load_run_or_release(path: Path, *, checkpoint: Path | None = None, prepare: bool = False) -> LoadedRun:
    """``load_release`` for a release directory, else ``load_run`` (a run directory). An ensemble
    release is refused (one model is asked for here): translate with it through
    ``aiayn.tasks.runs.load_translator``, or take one member (``single_model``)."""
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


def write_release(run_dir: Path, out_dir: Path, *, checkpoint: Path | None = None, dtype: str = "float16",
                  name: str | None = None, recipe: Path | None = None,
                  extra: dict[str, Any] | None = None) -> Path:
    """Write the release of a finished run: its (averaged) checkpoint's weights in ``dtype``, its
    configs, tokenizer and record. ``out_dir`` is built beside itself and renamed into place, so an
    existing release is replaced whole or not at all. ``run_dir`` may be a release instead (one kept
    in results/, or a shipped one): it is copied byte for byte, its release.json given ``name`` and
    ``extra`` (``_copy_release``). Returns ``out_dir``."""
    if dtype not in RELEASE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(RELEASE_DTYPES)}")
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if is_ensemble_release(run_dir):
        raise ValueError(f"{run_dir} is an ensemble release itself; give its members "
                         f"({', '.join(m.name for m in release_members(run_dir))}) one by one")
    if is_release(run_dir):  # a release again (a kept member shipped, or renamed): copied as it is
        tmp = _fresh_tmp(out_dir)
        try:
            _copy_release(run_dir, tmp, checkpoint=checkpoint, dtype=dtype, name=name or out_dir.name, extra=extra)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _put_in_place(tmp, out_dir)
        return out_dir
    run = load_run(run_dir, checkpoint=resolve_checkpoint(checkpoint), prepare=False)
    weights: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}  # alias -> the key its tensor is stored under (safetensors stores no aliases)
    stored_as: dict[int, str] = {}
    for key, tensor in run.model.state_dict().items():
        if tensor.data_ptr() in stored_as:
            tied[key] = stored_as[tensor.data_ptr()]
            continue
        stored_as[tensor.data_ptr()] = key
        weights[key] = (tensor.detach().to(RELEASE_DTYPES[dtype]) if tensor.is_floating_point() else tensor.detach()).contiguous()
    n_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    if n_bytes > MAX_RELEASE_BYTES:
        raise ValueError(f"{n_bytes / 2**20:.1f} MiB of {dtype} weights: over the {MAX_RELEASE_BYTES // 2**20} "
                         f"MiB a shipped model may take")
    tmp = _fresh_tmp(out_dir)
    (tmp / "record").mkdir()
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "dtype": dtype, "tied": json.dumps(tied)})
    shutil.copy2(run_dir / "config.json", tmp / "config.json")
    for tokenizer_file in TOKENIZER_FILES:
        if (run_dir / tokenizer_file).is_file():
            shutil.copy2(run_dir / tokenizer_file, tmp / tokenizer_file)
    copied = [f.name for f in (*[run_dir / n for n in RECORD_FILES], *sorted(run_dir.glob("score.*.json")))
              if f.is_file()]
    for file_name in copied:
        if file_name.endswith(".json"):  # paths inside the run become relative: no local folder ships
            text = (run_dir / file_name).read_text(encoding="utf-8")
            for prefix in sorted({str(run_dir.resolve()), str(run_dir)}, key=len, reverse=True):
                text = text.replace(json.dumps(prefix + os.sep)[1:-1], "")
            (tmp / "record" / file_name).write_text(text, encoding="utf-8")
        else:
            shutil.copy2(run_dir / file_name, tmp / "record" / file_name)
    if recipe is not None:
        shutil.copy2(recipe, tmp / "record" / recipe.name)
        copied.append(recipe.name)
    record = {
        "name": name or out_dir.name,
        "task": run.task.name,
        "checkpoint": str(run.checkpoint.resolve().relative_to(run_dir.resolve()))
        if run.checkpoint.resolve().is_relative_to(run_dir.resolve()) else run.checkpoint.name,
        "step": int(run.checkpoint.name.split("-")[-1]) if run.checkpoint.name.startswith("step-") else None,
        "dtype": dtype,
        "parameters": sum(t.numel() for t in weights.values()),  # tied weights counted once
        "tied": tied,
        "weight_bytes": n_bytes,
        "record": copied,
        **(extra or {}),
    }
    atomic_write_text(tmp / RELEASE_FILE, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    _put_in_place(tmp, out_dir)
    return out_dir


def write_ensemble_release(members: Sequence[tuple[Path, Path | None, str]], out_dir: Path, *,
                           dtype: str = "float16", name: str | None = None, recipe: Path | None = None,
                           extra: dict[str, Any] | None = None,
                           member_scores: Sequence[dict[str, Any]] | None = None) -> Path:
    """Write an ensemble release: each (run directory, checkpoint or None, member name) as a
    release of its own in ``out_dir/<member name>`` (``write_release``: its weights, configs,
    tokenizer and record; each under the size limit; a member given as a release is copied as it
    is), and a release.json that names them in order; ``member_scores``: each member's own
    measured scores (its release.json's ``scores``), in the same order. The members must form an ensemble (one language pair and direction, one vocabulary:
    ``aiayn.tasks.runs.load_ensemble_translator``'s checks, a ``RunInputError`` otherwise). Built
    beside ``out_dir`` and renamed into place, as ``write_release``. Returns ``out_dir``."""
    from aiayn.tasks.runs import load_ensemble_translator

    out_dir = Path(out_dir)
    names = [member_name for _, _, member_name in members]
    if len(members) < 2:
        raise ValueError("an ensemble release needs at least two members")
    if len(set(names)) != len(names) or any(Path(n).name != n or n in (".", "..", "") for n in names):
        raise ValueError(f"member names must be distinct folder names; got {names}")
    if member_scores is not None and len(member_scores) != len(members):
        raise ValueError(f"{len(member_scores)} member_scores for {len(members)} members; give one per member")
    tmp = _fresh_tmp(out_dir)
    try:
        records = []
        for i, (run_dir, checkpoint, member_name) in enumerate(members):
            own = {"scores": member_scores[i]} if member_scores is not None else {}
            write_release(run_dir, tmp / member_name, checkpoint=checkpoint, dtype=dtype, name=member_name,
                          recipe=recipe, extra={"member_of": name or out_dir.name, **own})
            records.append(json.loads((tmp / member_name / RELEASE_FILE).read_text(encoding="utf-8")))
        load_ensemble_translator([(tmp / member_name, None) for member_name in names])  # they form one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    record = {
        "name": name or out_dir.name,
        "task": records[0]["task"],
        "members": names,
        "dtype": dtype,
        "parameters": sum(r["parameters"] for r in records),  # all members together
        "member_parameters": [r["parameters"] for r in records],
        "weight_bytes": sum(r["weight_bytes"] for r in records),
        **(extra or {}),
    }
    atomic_write_text(tmp / RELEASE_FILE, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    _put_in_place(tmp, out_dir)
    return out_dir


def _copy_release(source: Path, target: Path, *, checkpoint: Path | None, dtype: str, name: str,
                  extra: dict[str, Any] | None) -> None:
    """Copy the release ``source`` into ``target`` (absent or empty) byte for byte, its
    release.json updated with ``name`` and ``extra`` (a new ``scores`` replaces the old): a kept
    release becomes a shipped model or an ensemble's member without a second rounding of its
    weights. A release has one set of weights, so ``checkpoint`` must be None, and ``dtype`` must be
    the one it is stored in (float16 weights are not rounded again to bfloat16)."""
    record = json.loads((source / RELEASE_FILE).read_text(encoding="utf-8"))
    record.pop("member_of", None)  # a former member shipped alone is no one's member (extra may say again)
    if checkpoint is not None:
        raise ValueError(f"{source} is a release (one set of weights); give no checkpoint for it")
    if record.get("dtype") != dtype:
        raise ValueError(f"{source} is stored in {record.get('dtype')}, not {dtype}; ship it in {record.get('dtype')} "
                         f"or write it again from its run")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(RELEASE_FILE), dirs_exist_ok=True)
    atomic_write_text(target / RELEASE_FILE,
                      json.dumps({**record, "name": name, **(extra or {})}, indent=1, ensure_ascii=False) + "\n")


def _fresh_tmp(out_dir: Path) -> Path:
    """An empty ``out_dir.tmp`` to build a release in (an interrupted write's leftover cleared)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _put_in_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` to ``out_dir``, replacing an existing one whole."""
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        if old.exists():  # left by a replacement interrupted after its first rename
            shutil.rmtree(old)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
