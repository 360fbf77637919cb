"""Checkpoints that resume exactly and survive a kill mid-save: ``<run>/checkpoints/step-00000100/`` holds
model.safetensors (weights, tied tensors once; only LoRA adapters where state.json says ``"weights":
"adapters"``), optimizer.safetensors (moments and RNG states) and state.json (step, data position, optimiser
hyper-parameters, Python's RNG); ``latest`` names the newest. Each is written into a temporary directory and
renamed into place; nothing is unpickled on load."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from aiayn.device import rng_states, set_rng_states
from aiayn.finetune.lora import is_adapter_key
from aiayn.train.run_dir import CHECKPOINT_NAME, atomic_write_text, claim_output_dir, fsync_dir

FORMAT_VERSION = 1
MODEL_FILE, OPTIM_FILE, STATE_FILE, LATEST = "model.safetensors", "optimizer.safetensors", "state.json", "latest"
ADAPTER_WEIGHTS = "adapters"  # state.json's "weights" when model.safetensors holds only the adapters
STALE_TMP = re.compile(r"\.tmp-step-\d{8}-\d+")  # what save_checkpoint writes before its rename


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, truncated or from another model."""


def _flatten_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, entries in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entries)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(directory: Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    state: dict[str, Any], keep: int = 3, model_state: dict[str, torch.Tensor] | None = None,
                    optimizer_state: dict[str, Any] | None = None) -> Path:
    """Write ``directory/step-XXXXXXXX`` atomically and point ``latest`` at it; ``model_state`` and
    ``optimizer_state``: full state dicts to save instead (sharded training's)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final, tmp = directory / name, directory / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if model_state is None:
        save_model(model, str(tmp / MODEL_FILE))
    else:
        save_file({k: v.contiguous() for k, v in model_state.items()}, str(tmp / MODEL_FILE))
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state(), **rng_states()}
    meta: dict[str, Any] = {}
    if optimizer_state is None and optimizer is not None:
        optimizer_state = optimizer.state_dict()
    if optimizer_state is not None:
        opt_tensors, meta = _flatten_optimizer(optimizer_state)
        tensors.update(opt_tensors)
    save_file(tensors, str(tmp / OPTIM_FILE))
    py_state = random.getstate()
    payload = {"format_version": FORMAT_VERSION, "step": step, "optimizer": meta,
               "python_rng": [py_state[0], list(py_state[1]), py_state[2]], **state}
    (tmp / STATE_FILE).write_text(json.dumps(payload, indent=1), encoding="utf-8")
    for file in tmp.iterdir():  # flush the data before the rename makes it visible
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # a checkpoint of this step from an earlier, abandoned attempt
        if final.is_symlink() or not final.is_dir() or not _written_by_us(final):
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"refusing to replace {final}: it is not a checkpoint aiayn wrote; "
                                  f"move it out of {directory}")
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(directory)
    atomic_write_text(directory / LATEST, name + "\n")
    _prune(directory, keep)
    return final


def _written_by_us(path: Path) -> bool:
    """A checkpoint directory save_checkpoint wrote: its own files only, and a state.json of ours."""
    if not {p.name for p in path.iterdir()} <= {MODEL_FILE, OPTIM_FILE, STATE_FILE}:
        return False
    try:
        return "format_version" in json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return False


def _prune(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints this module wrote, and leftovers of a kill mid-save."""
    for old in list_checkpoints(directory)[:-keep]:
        if _written_by_us(old):
            shutil.rmtree(old, ignore_errors=True)
    for stale in directory.glob(".tmp-step-*"):
        if STALE_TMP.fullmatch(stale.name) and not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (``step-XXXXXXXX`` directories with a state.json), oldest first."""
    found = [p for p in directory.glob("step-*")
             if CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(directory: Path) -> Path | None:
    pointer = directory / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        # Only a checkpoint of this folder: a pointer such as ../../elsewhere is ignored.
        if CHECKPOINT_NAME.fullmatch(name) and (directory / name / STATE_FILE).is_file():
            return directory / name
    found = list_checkpoints(directory)
    return found[-1] if found else None


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    state: dict[str, Any]  # everything the trainer stored, plus format_version and step
    optimizer_state: dict[str, Any] | None
    rng_state: torch.Tensor
    cuda_rng_states: dict[str, torch.Tensor] = field(default_factory=dict)  # rng.cuda.N, if saved on a GPU


def _corrupt(path: Path, what: str, exc: Exception) -> CheckpointError:
    others = [p.name for p in list_checkpoints(path.parent) if p != path]
    hint = (f"earlier checkpoints in {path.parent}: {', '.join(others)}; delete {path.name} to resume "
            f"from the newest of them" if others else "no other checkpoint is available")
    return CheckpointError(f"checkpoint {path} is corrupt or truncated ({what}: {exc}); {hint}")


def load_checkpoint(path: Path, model: nn.Module) -> LoadedCheckpoint:
    """Load weights into ``model`` (strictly) and return the rest of the saved state."""
    for file in (MODEL_FILE, OPTIM_FILE, STATE_FILE):
        if not (path / file).is_file():
            raise CheckpointError(f"checkpoint {path} has no {file}; it is incomplete or not an aiayn checkpoint")
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _corrupt(path, STATE_FILE, exc) from None
    if not isinstance(state, dict):
        raise _corrupt(path, STATE_FILE, ValueError(f"a JSON {type(state).__name__}, not an object"))
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {state.get('format_version')!r}, "
                              f"this aiayn reads version {FORMAT_VERSION}")
    try:
        missing, unexpected = load_model(model, str(path / MODEL_FILE), strict=False)
    except (SafetensorError, OSError, ValueError) as exc:
        raise _corrupt(path, MODEL_FILE, exc) from None
    except RuntimeError as exc:  # shape mismatch
        raise CheckpointError(f"checkpoint {path} does not fit this model: {exc}") from None
    if state.get("weights") == ADAPTER_WEIGHTS:  # the frozen base is the model's own
        missing = [name for name in missing if is_adapter_key(name)]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit this model: missing {sorted(missing)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]}; was it saved from another model "
                              f"configuration?")
    try:
        tensors = load_file(str(path / OPTIM_FILE))
    except (SafetensorError, OSError, ValueError) as exc:
        raise _corrupt(path, OPTIM_FILE, exc) from None
    # A training checkpoint (not an averaged one) also says where to resume: resuming never meets a KeyError.
    needed = [("step", int), ("python_rng", list)]
    if "averaged" not in state:
        needed += [("epoch", int), ("batch_in_epoch", int)]
    bad = [key for key, kind in needed if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool)]
    if bad or "rng.torch" not in tensors:
        what = f"{STATE_FILE} lacks {', '.join(bad)} (or holds the wrong type)" if bad else f"{OPTIM_FILE} lacks rng.torch"
        raise _corrupt(path, STATE_FILE if bad else OPTIM_FILE, ValueError(what))
    meta = state.pop("optimizer", {})
    try:
        optimizer_state = _unflatten_optimizer(tensors, meta) if meta else None
    except (KeyError, TypeError, ValueError) as exc:
        raise _corrupt(path, OPTIM_FILE, exc) from None
    return LoadedCheckpoint(path=path, step=state["step"], state=state,
                            optimizer_state=optimizer_state, rng_state=tensors["rng.torch"],
                            cuda_rng_states={k: v for k, v in tensors.items() if k.startswith("rng.cuda.")})


def restore_rng(loaded: LoadedCheckpoint) -> None:
    """The CPU's, Python's and (where saved and present) the CUDA generators' states."""
    torch.set_rng_state(loaded.rng_state)
    set_rng_states(loaded.cuda_rng_states)
    version, internal, gauss = loaded.state["python_rng"]
    random.setstate((version, tuple(internal), gauss))


def average_last_checkpoints(checkpoint_dir: Path, last: int, model: nn.Module, out_dir: Path) -> Path:
    """Average the newest ``last`` checkpoints into ``model`` and save that weights-only in ``out_dir``."""
    found = list_checkpoints(checkpoint_dir)
    if not found:
        raise CheckpointError(f"{checkpoint_dir} holds no checkpoints to average")
    if len(found) < last:
        raise CheckpointError(f"{checkpoint_dir} keeps {len(found)} checkpoint(s), fewer than the {last} "
                              f"to average; average fewer or train with a larger keep_checkpoints")
    claim_output_dir(out_dir, source=str(checkpoint_dir))
    chosen = found[-last:]
    average_checkpoints(chosen, model)
    step = int(chosen[-1].name.removeprefix("step-"))
    return save_checkpoint(out_dir, step=step, model=model, optimizer=None, keep=1,
                           state={"averaged": [p.name for p in chosen]})


def average_checkpoints(paths: list[Path], model: nn.Module) -> nn.Module:
    """Load the float64 mean of checkpoints' weights into ``model`` (Vaswani et al. 2017, sec. 6.1)."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        load_checkpoint(path, model)  # checks completeness and shapes, with clear errors
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                total[name] = total.get(name, 0) + tensor.double()
    averaged = {name: (value / len(paths)).to(model.state_dict()[name].dtype) for name, value in total.items()}
    model.load_state_dict(averaged, strict=False)
    return model
