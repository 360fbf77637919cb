"""Data-parallel (DDP) and sharded (FSDP2) training under ``torchrun --nproc_per_node=N -m aiayn train``
(NCCL on CUDA, gloo on CPUs, or ``AIAYN_DIST_BACKEND``). Each window of ``world_size x grad_accum`` batches is
dealt out rank by rank; each rank's loss is weighted by its share of the step's target tokens, so the gradient
is the token-mean. Rank 0 writes full state dicts, loadable under any world size."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from aiayn import device as devices

T = TypeVar("T")


class DistributedError(ValueError):
    """Options that cannot work together, or a world size the data cannot feed (``reported``: printed)."""

    reported: bool = False


@dataclass(frozen=True)
class ParallelOptions:
    """How to spread training over processes (never stored: a run may resume under another world size)."""

    fsdp: bool = False  # shard parameters, gradients and optimiser state (FSDP2) instead of DDP


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    fsdp: bool = False
    owns_group: bool = False  # setup() created the process group (and the trainer destroys it)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where this process trains

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(options: ParallelOptions | None = None, device: torch.device | None = None) -> DistContext:
    """The process's place in torchrun's job (one process without it), initialising the process group; a
    CUDA ``device`` means this ``LOCAL_RANK``'s GPU."""
    options = options or ParallelOptions()
    device = device or torch.device("cpu")
    world = env_world_size()
    if world <= 1:
        return DistContext(device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        try:
            device = devices.local_gpu(local_rank)
        except devices.DeviceError as exc:
            raise DistributedError(str(exc)) from None
    owns = not dist.is_initialized()
    if owns:
        backend = os.environ.get("AIAYN_DIST_BACKEND", devices.distributed_backend(device))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), fsdp=options.fsdp,
                       owns_group=owns, device=device)


def check_options(options: ParallelOptions | None, *, world_size: int, compile: bool,
                  average_last: int = 0) -> None:
    """Refuse unsupported combinations before anything is built."""
    options = options or ParallelOptions()
    if options.fsdp and world_size <= 1:
        raise DistributedError("--fsdp shards over several processes; launch with torchrun "
                               "--nproc_per_node=N (N >= 2) -m aiayn train --fsdp ...")
    if options.fsdp and average_last:
        raise DistributedError("average_last is not supported with --fsdp (the model is sharded); "
                               "train without it and run aiayn average --run RUN afterwards")
    if compile and world_size > 1:
        raise DistributedError("--compile is not supported with multi-process training yet; "
                               "drop --compile or train in one process")


def check_world_size(ctx: DistContext, *, batches_per_epoch: int, grad_accum: int) -> None:
    need = ctx.world_size * grad_accum
    if need <= batches_per_epoch:
        return
    error = DistributedError(
        f"{ctx.world_size} processes x grad_accum {grad_accum} need {need} batches per step, but "
        f"an epoch has only {batches_per_epoch} batches; use fewer processes, a smaller "
        f"--batch-size or --grad-accum")
    if ctx.enabled and dist.is_initialized():
        # torchrun stops the others as soon as one rank exits: rank 0 says it before any leaves.
        if ctx.is_main:
            print(f"Error: {error}", file=sys.stderr, flush=True)
        dist.barrier()
        error.reported = True
    raise error


def shard(window: Sequence[T], ctx: DistContext) -> list[T]:
    """This rank's batches of one step's window."""
    return list(window[ctx.rank :: ctx.world_size])


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Sum a few numbers over all ranks (one collective, on the device: NCCL reduces GPU tensors only)."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=ctx.device)
    return all_reduce_tensor(tensor, ctx).tolist()


def all_reduce_tensor(value: Tensor, ctx: DistContext) -> Tensor:
    """A 0-dim float64 sum of ``value`` over all ranks, on the device (nothing read back)."""
    total = value.detach().to(torch.float64, copy=True)
    if ctx.enabled:
        dist.all_reduce(total)
    return total


def token_share(n_tokens: Tensor, ctx: DistContext) -> Tensor:
    """This rank's micro-batch weight, world_size x its counted tokens / all ranks' (0-dim float64), so the
    ranks' mean of weighted losses is the token-mean."""
    local = n_tokens.to(torch.float64)
    return local * ctx.world_size / all_reduce_tensor(local, ctx).clamp(min=1.0)


def run_on_main(ctx: DistContext, fn: Callable[[], T]) -> T | None:
    """Run ``fn`` on rank 0 only; an exception there is raised on every rank (no rank hangs)."""
    if not ctx.enabled:
        return fn()
    error: list[Any] = [None]
    result = None
    if ctx.is_main:
        try:
            result = fn()
        except Exception as exc:
            error[0] = exc
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise error[0]
    return result


def from_main(ctx: DistContext, value: T) -> T:
    """``value`` as rank 0 has it, on every rank (a broadcast; itself when not distributed)."""
    if not ctx.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DDP around the model, or FSDP2 applied in place; call ``freeze_unused`` first."""
    if not ctx.enabled:
        return model
    if ctx.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        from aiayn.models.blocks import TransformerBlock

        for module in model.modules():
            if isinstance(module, TransformerBlock):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel

    gpus = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=gpus)


def freeze_unused(model: nn.Module, loss_of_one_batch: Callable[[], torch.Tensor]) -> list[str]:
    """Freeze the parameters the loss never reaches (DDP would wait forever for their gradients) and return
    their names; one forward/backward on the same batch on every rank, the RNG state restored."""
    rng, cuda_rng = torch.get_rng_state(), devices.rng_states()
    model.zero_grad(set_to_none=True)
    loss_of_one_batch().backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    devices.set_rng_states(cuda_rng)
    for name, param in model.named_parameters():
        if name in unused:
            param.requires_grad_(False)
    return unused


@contextlib.contextmanager
def thawed(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """``freeze_unused``'s parameters trainable inside the block: the optimiser gets one process's groups."""
    params = [p for n, p in model.named_parameters() if n in set(names)]
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(False)


@contextlib.contextmanager
def no_sync(model: nn.Module, last: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce on all but the last micro-batch of an accumulation group."""
    if last or not hasattr(model, "no_sync"):
        yield
        return
    with model.no_sync():
        yield


def _param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Each optimiser parameter's name, in param_groups order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
               ctx: DistContext) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An FSDP model's full model and optimiser state dicts on rank 0, {} elsewhere (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts)
    # Tied weights once, under the name safetensors' save_model keeps (the first in sorted order).
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    for names in tied.values():
        for name in sorted(names)[1:]:
            model_sd.pop(name, None)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not ctx.is_main:  # with cpu_offload the full state lands on rank 0 only
        return {}, {}
    names = _param_names(optimizer, model)
    index = {name: i for i, name in enumerate(names)}
    state = {index[name]: value for name, value in optim_sd["state"].items()}
    groups = [{**group, "params": [index[n] for n in group["params"]]} for group in optim_sd["param_groups"]]
    return model_sd, {"state": state, "param_groups": groups}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                              state_dict: dict[str, Any]) -> None:
    """Load one process's optimiser state dict into an FSDP model's optimiser (every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _param_names(optimizer, model)
    by_name = {"state": {names[i]: v for i, v in state_dict["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                for g in state_dict["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
