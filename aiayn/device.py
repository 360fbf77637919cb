"""Where a model runs and in what precision: the one place that decides it (no other code names a
device by hand). ``auto`` is the first CUDA GPU, else the CPU; on CUDA, bfloat16 autocast over
float32 weights and TF32 matmuls; on the CPU, float32 unless bfloat16 is asked for."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, TypeVar

import torch

DEVICE_HELP = ("Where to run: auto (the first CUDA GPU, else the CPU), cpu, cuda, cuda:N or mps.  "
               "[default: auto]")
CHOICES = ("auto", "cpu", "cuda", "cuda:N", "mps")

T = TypeVar("T")


class DeviceError(ValueError):
    """A device that this machine does not have, or a name that is not a device."""


def resolve(spec: str | torch.device | None = "auto") -> torch.device:
    """The device that ``spec`` names on this machine (``auto``/None: the first CUDA GPU, else the CPU),
    checked to exist (``DeviceError``)."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    name = (spec or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {spec!r} is not a device; give one of {', '.join(CHOICES)}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"--device {name}: this machine has no CUDA GPU that torch {torch.__version__} "
                              f"can use; give --device cpu (or auto)")
        index = 0 if device.index is None else device.index
        if index >= count:
            raise DeviceError(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to "
                              f"cuda:{count - 1}; give one of those")
        return torch.device("cuda", index)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"--device {name}: this machine has no Apple GPU (MPS) that torch can use; "
                              f"give --device cpu (or auto)")
        return torch.device("mps")
    raise DeviceError(f"--device {spec!r} is not a device aiayn runs on; give one of {', '.join(CHOICES)}")


def local_gpu(local_rank: int) -> torch.device:
    """The GPU of a torchrun process (its ``LOCAL_RANK``), prepared; DeviceError past this machine's GPUs."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        raise DeviceError(f"process {local_rank} of this machine has no GPU of its own ({count} GPU(s)); "
                          f"start at most that many processes per machine (torchrun --nproc-per-node)")
    return prepare(torch.device("cuda", local_rank))


def prepare(device: torch.device) -> torch.device:
    """``device``, with its process-wide switches set: on CUDA, TF32 matmuls and convolutions, and
    ``device`` as the current GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device


def autocast_dtype(device: torch.device, *, bf16: bool | None = None) -> torch.dtype | None:
    """The autocast dtype on ``device`` (None: float32): bfloat16 on CUDA unless ``bf16`` is False,
    elsewhere only when it is True."""
    if device.type == "cuda":
        return None if bf16 is False else torch.bfloat16
    return torch.bfloat16 if bf16 else None


def autocast(device: torch.device, *, bf16: bool | None = None) -> contextlib.AbstractContextManager[Any]:
    """The precision context of a forward on ``device`` (``autocast_dtype``); weights stay float32."""
    dtype = autocast_dtype(device, bf16=bf16)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def to_device(value: T, device: torch.device) -> T:
    """``value`` (a tensor, or tuples, lists, dicts and dataclasses of them) on ``device``; CPU tensors
    bound for CUDA are pinned and copied without waiting."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value  # type: ignore[return-value]
        if device.type == "cuda" and value.device.type == "cpu":
            return value.pin_memory().to(device, non_blocking=True)  # type: ignore[return-value]
        return value.to(device)  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: to_device(getattr(value, f.name), device)
                   for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)  # type: ignore[return-value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(to_device(v, device) for v in value))  # type: ignore[return-value]
    if isinstance(value, tuple | list):
        return type(value)(to_device(v, device) for v in value)  # type: ignore[return-value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}  # type: ignore[return-value]
    return value


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter or buffer (the CPU for one that has neither)."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def fused_optimizer(device: torch.device) -> bool:
    """Whether Adam/AdamW take ``fused=True`` here: on CUDA."""
    return device.type == "cuda"


def distributed_backend(device: torch.device) -> str:
    """torch.distributed's backend for processes on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def rng_states() -> dict[str, torch.Tensor]:
    """The states of the CUDA generators (one per GPU; none without CUDA), for a checkpoint."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {f"rng.cuda.{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())}


def set_rng_states(tensors: dict[str, torch.Tensor]) -> None:
    """Restore what ``rng_states`` saved, for the GPUs this machine has."""
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if (state := tensors.get(f"rng.cuda.{i}")) is not None:
            torch.cuda.set_rng_state(state.to("cpu", torch.uint8), i)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (before reading a clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
