"""Writing the trained models shipped inside the package (``scripts/ship_model.py``); reading them is
``aiayn.tasks.trained``'s.

A release, ``aiayn/pretrained/<name>/``, holds ``release.json`` (name, task, source run, dtype, parameters,
scores), ``config.json``, ``model.safetensors`` (float16 or bfloat16), the run's tokenizer file(s) and
``record/``. An ensemble release names its ``members``, each a release inside it, and has no weights."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from aiayn.tasks.runs import load_ensemble_translator
from aiayn.tasks.trained import (
    RECORD_FILES,
    RELEASE_DTYPES,
    RELEASE_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    is_ensemble_release,
    is_release,
    load_run,
    release_members,
    resolve_checkpoint,
)
from aiayn.train.checkpoint import atomic_write_text

__all__ = ["MAX_RELEASE_BYTES", "write_ensemble_release", "write_release"]

MAX_RELEASE_BYTES = 10 * 2**20  # a shipped model's weights stay under 10 MB (the repository carries them)


def write_release(run_dir: Path, out_dir: Path, *, checkpoint: Path | None = None, dtype: str = "float16",
                  name: str | None = None, recipe: Path | None = None,
                  extra: dict[str, Any] | None = None) -> Path:
    """Write the release of a finished run (or copy a release) to ``out_dir``, built beside it and renamed
    into place; returns ``out_dir``."""
    if dtype not in RELEASE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(RELEASE_DTYPES)}")
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if is_ensemble_release(run_dir):
        raise ValueError(f"{run_dir} is an ensemble release itself; give its members "
                         f"({', '.join(m.name for m in release_members(run_dir))}) one by one")
    if is_release(run_dir):  # a release again (a kept member shipped, or renamed): copied as it is
        with _building(out_dir) as tmp:
            _copy_release(run_dir, tmp, checkpoint=checkpoint, dtype=dtype, name=name or out_dir.name, extra=extra)
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
    with _building(out_dir) as tmp:
        (tmp / "record").mkdir()
        save_file(weights, str(tmp / WEIGHTS_FILE),
                  metadata={"format": "pt", "dtype": dtype, "tied": json.dumps(tied)})
        for file_name in ("config.json", *TOKENIZER_FILES):
            if (run_dir / file_name).is_file():
                shutil.copy2(run_dir / file_name, tmp / file_name)
        copied = [f.name for f in (*[run_dir / n for n in RECORD_FILES],
                                   *sorted(run_dir.glob("score.*.json"))) if f.is_file()]
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
        saved, run_path, saved_name = run.checkpoint.resolve(), run_dir.resolve(), run.checkpoint.name
        _write_record(tmp, {
            "name": name or out_dir.name,
            "task": run.task.name,
            "checkpoint": str(saved.relative_to(run_path)) if saved.is_relative_to(run_path) else saved_name,
            "step": int(saved_name.split("-")[-1]) if saved_name.startswith("step-") else None,
            "dtype": dtype,
            "parameters": sum(t.numel() for t in weights.values()),  # tied weights counted once
            "tied": tied,
            "weight_bytes": n_bytes,
            "record": copied,
            **(extra or {}),
        })
    return out_dir


def write_ensemble_release(members: Sequence[tuple[Path, Path | None, str]], out_dir: Path, *,
                           dtype: str = "float16", name: str | None = None, recipe: Path | None = None,
                           extra: dict[str, Any] | None = None,
                           member_scores: Sequence[dict[str, Any]] | None = None) -> Path:
    """Write each (run, checkpoint or None, member name) as a release in ``out_dir/<member name>`` and a
    release.json naming them in order; the members must form an ensemble. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    names = [member_name for _, _, member_name in members]
    if len(members) < 2:
        raise ValueError("an ensemble release needs at least two members")
    if len(set(names)) != len(names) or any(Path(n).name != n or n in (".", "..", "") for n in names):
        raise ValueError(f"member names must be distinct folder names; got {names}")
    if member_scores is not None and len(member_scores) != len(members):
        raise ValueError(f"{len(member_scores)} member_scores for {len(members)} members; give one per member")
    with _building(out_dir) as tmp:
        records = []
        for i, (run_dir, checkpoint, member_name) in enumerate(members):
            own = {"scores": member_scores[i]} if member_scores is not None else {}
            write_release(run_dir, tmp / member_name, checkpoint=checkpoint, dtype=dtype, name=member_name,
                          recipe=recipe, extra={"member_of": name or out_dir.name, **own})
            records.append(json.loads((tmp / member_name / RELEASE_FILE).read_text(encoding="utf-8")))
        load_ensemble_translator([(tmp / member_name, None) for member_name in names])  # they form one
        _write_record(tmp, {
            "name": name or out_dir.name,
            "task": records[0]["task"],
            "members": names,
            "dtype": dtype,
            "parameters": sum(r["parameters"] for r in records),  # all members together
            "member_parameters": [r["parameters"] for r in records],
            "weight_bytes": sum(r["weight_bytes"] for r in records),
            **(extra or {}),
        })
    return out_dir


def _copy_release(source: Path, target: Path, *, checkpoint: Path | None, dtype: str, name: str,
                  extra: dict[str, Any] | None) -> None:
    """Copy the release ``source`` into ``target`` as it is, its release.json given ``name`` and ``extra``."""
    record = json.loads((source / RELEASE_FILE).read_text(encoding="utf-8"))
    record.pop("member_of", None)  # a former member shipped alone is no one's member (extra may say again)
    if checkpoint is not None:
        raise ValueError(f"{source} is a release (one set of weights); give no checkpoint for it")
    if record.get("dtype") != dtype:
        raise ValueError(f"{source} is stored in {record.get('dtype')}, not {dtype}; ship it in {record.get('dtype')} "
                         f"or write it again from its run")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(RELEASE_FILE), dirs_exist_ok=True)
    _write_record(target, {**record, "name": name, **(extra or {})})


def _write_record(release: Path, record: dict[str, Any]) -> None:
    atomic_write_text(release / RELEASE_FILE, json.dumps(record, indent=1, ensure_ascii=False) + "\n")


@contextmanager
def _building(out_dir: Path) -> Iterator[Path]:
    """An empty ``out_dir.tmp`` (an interrupted write's leftover cleared) to build a release in: renamed to
    ``out_dir`` when done, replacing an existing one whole; removed on failure."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        if old.exists():  # left by a replacement interrupted after its first rename
            shutil.rmtree(old)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
