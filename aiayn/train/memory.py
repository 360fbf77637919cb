"""How much memory a training step takes, checked before anything is allocated, and the one line a step that
runs out of memory anyway ends with.

The peak is weights + Adam's moments + the largest of activations, gradients + the optimizer's temporaries, and
a checkpoint save's copy (the backward frees activations as it fills the gradients; a save follows the step;
tests/robustness/test_memory.py measures it). Only trainable parameters have gradients and moments. Shape
letters: b sequences, t positions (s: a source), n = b t, d ``d_model``, f ``d_ff``, h heads, h_kv key/value
heads, d_h head width, v vocabulary."""

from __future__ import annotations

import copy
import itertools
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from torch import Tensor, nn

from aiayn import device as devices
from aiayn.config import ConfigError, ModelConfig, TrainConfig
from aiayn.models import build_model
from aiayn.models.size import available_memory, check_fits, estimated_values
from aiayn.nn.kv_memory import format_bytes
from aiayn.train.checkpoint import latest_checkpoint
from aiayn.train.run_dir import RunLocation
from aiayn.train.task import Task

try:
    import resource
except ImportError:  # not POSIX: no process limits to read
    resource = None  # type: ignore[assignment]

F32 = 4  # bytes of a float32: weights, gradients, moments, the loss's logits, norms' statistics
# How far under the measured peak the estimate may be: a run may need estimate / (1 - MARGIN).
MARGIN = 0.25
# What a training process holds on the CPU besides its tensors: thread stacks, kernels' buffers, free lists.
PROCESS_OVERHEAD = 128 * 2**20
CGROUP_ROOT, PROC_CGROUP = Path("/sys/fs/cgroup"), Path("/proc/self/cgroup")  # cgroup v2's tree; ours in it


class TrainingMemoryError(ConfigError):
    """A run whose training step would not fit in the memory available."""


class TrainingOutOfMemory(MemoryError):
    """Training ran out of memory during a step or an evaluation; nothing saved was touched."""


@dataclass(frozen=True)
class BatchShape:
    """b sequences of t positions (s: an encoder-decoder's source)."""

    sequences: int
    length: int
    source_length: int = 0


@dataclass(frozen=True)
class ModelCounts:
    """Bytes of a built model's weights, trainable weights, matmul weights (autocast copies them), largest
    trainable tensor and largest tensor; whether a fused loss applies and some weights are frozen."""

    weights: int
    trainable: int
    matmul: int
    largest: int
    fused_head: bool
    largest_weight: int
    frozen: bool = False


@dataclass(frozen=True)
class Execution:
    """How the step runs: bfloat16 autocast, aiayn.fast's CPU kernels, the device's type, torch's threads."""

    autocast: bool = False
    fast: bool = False
    device_type: str = "cpu"
    threads: int = 1


@dataclass(frozen=True)
class TrainingMemory:
    """The estimate, in bytes."""

    weights: int
    gradients: int
    optimizer: int  # the moments
    step_temporary: int  # after the backward: two copies of the largest parameter
    activations: int
    checkpoint: int = 0  # what a save adds, once the step has freed the gradients

    @property
    def peak(self) -> int:
        return self.weights + self.optimizer + max(self.activations, self.gradients + self.step_temporary,
                                                   self.checkpoint)

    def describe(self) -> str:
        """'2.10 GiB (weights ... + Adam's moments ... + the larger of activations ... and gradients ...)'."""
        activations, gradients = format_bytes(self.activations), format_bytes(self.gradients + self.step_temporary)
        rest = f"the larger of activations {activations} and gradients {gradients}"
        if self.checkpoint > max(self.activations, self.gradients + self.step_temporary):
            rest = (f"the largest of activations {activations}, gradients {gradients} and a checkpoint save's "
                    f"copy {format_bytes(self.checkpoint)}")
        return (f"{format_bytes(self.peak)} (weights {format_bytes(self.weights)} + Adam's moments "
                f"{format_bytes(self.optimizer)} + {rest})")


def activation_bytes(c: ModelConfig, shape: BatchShape, path: Execution, *, fused_head: bool = False) -> int:
    """What one forward keeps for its backward, and the loss's logits, in bytes: per layer and token the
    sublayers' residual inputs and norm outputs, q, k, v, attention outputs (and weights where written out),
    feed-forward activations, dropout masks. Matmuls give bfloat16 under autocast, the residual float32."""
    a = 2 if path.autocast else F32
    b, t = shape.sequences, shape.length
    s = shape.source_length or t
    n, n_s = b * t, b * s
    d, f = c.d_model, c.d_ff
    h, h_kv, d_h = c.n_heads, c.n_kv_heads, c.head_dim
    # A dropout mask: bool on CUDA, a scale of the tensor's dtype on the CPU.
    mask_bytes = 1 if path.device_type == "cuda" else a
    cpu_fast = path.fast and path.device_type == "cpu"
    # torch's RMSNorm off CUDA is written out: it also keeps x / rms (n, d) for the gain's gradient.
    norm_extra = F32 if c.norm == "rmsnorm" else 0

    def dropped(values: int, p: float) -> int:
        return mask_bytes * values if p > 0 else 0

    def sublayer(tokens: int) -> int:  # residual input + norm output + residual dropout
        return (F32 + norm_extra + a) * tokens * d + dropped(tokens * d, c.dropout)

    def self_attention(tokens: int, length: int, causal: bool) -> int:
        kept = sublayer(tokens) + a * tokens * (2 * h + 2 * h_kv) * d_h + F32 * b * h * length
        block_causal = cpu_fast and causal and _block_causal(c, b, length, path)
        if c.positional == "rope" and not block_causal:  # the rotated q, k beside the (n, 3 d) projection
            kept += a * tokens * (h + h_kv) * d_h  # (block-causal copies q, k, v and lets it go)
        scores = _scores_bytes(c, b, length, length, path, block_causal=block_causal)
        if causal and c.pad_id is not None:  # SDPA keeps the (b, 1, t, t) causal mask as float
            scores = max(scores, F32 * b * length * length)
        if c.positional in ("alibi", "t5") and causal:  # the bias with the causal mask filled in,
            scores += F32 * b * h * length * length  # (b, h, t, t), a new tensor per layer
        return kept + scores

    def cross_attention() -> int:
        kept = sublayer(n) + a * n * 2 * h * d_h + a * n_s * 2 * h_kv * d_h + F32 * b * h * t
        return kept + _scores_bytes(c, b, t, s, path, block_causal=False)

    def feed_forward(tokens: int) -> int:
        gated = c.activation in ("swiglu", "geglu")
        factor = 4 if gated else 1 if c.activation == "relu" else 2
        return sublayer(tokens) + a * tokens * f * factor + dropped(tokens * f, c.activation_dropout)

    def stack(tokens: int, length: int, layers: int, *, causal: bool, cross: bool) -> int:
        layer = self_attention(tokens, length, causal) + feed_forward(tokens)
        if cross:
            layer += cross_attention()
        # embedding dropout, the last block's output (f32) and the final norm's (a)
        return layers * layer + dropped(tokens * d, c.dropout) + (F32 + norm_extra + a) * tokens * d

    if c.arch == "encoder-decoder":
        kept = (stack(n_s, s, c.n_layers, causal=False, cross=False)
                + stack(n, t, c.n_decoder_layers, causal=True, cross=True))
        vocab = c.tgt_vocab_size or c.vocab_size
    else:
        kept = stack(n, t, c.n_layers, causal=c.arch == "decoder-only", cross=False)
        vocab = c.vocab_size
        if c.arch == "encoder-only":  # BERT's MLM transform: dense, activation, norm outputs
            kept += 3 * a * n * d
    return kept + _logits_bytes(n, d, vocab, path, fused=fused_head and cpu_fast)


def _logits_bytes(n: int, d: int, v: int, path: Execution, *, fused: bool) -> int:
    """(n, v) float32 log-probabilities and their gradient; aiayn.fast's fused loss holds chunks of rows."""
    if not fused:
        return (10 if path.autocast else 8) * n * v
    from aiayn.fast.fused_loss import rows_per_chunk

    chunk = min(n, rows_per_chunk(v))
    chunks = -(-n // chunk)
    cv, vd = chunk * v, v * d
    in_loop = (2 if chunks == 1 else 3) * cv + min(chunks - 1, 2) * vd
    at_end = cv + (2 if chunks == 1 else 3) * vd
    return F32 * (n * d + max(in_loop, at_end))


def _scores_bytes(c: ModelConfig, b: int, t_q: int, t_k: int, path: Execution, *, block_causal: bool) -> int:
    """The (b, h, t_q, t_k) attention weights kept for the backward: none for SDPA's fused kernels."""
    square, a = b * c.n_heads * t_q * t_k, 2 if path.autocast else F32
    if c.attn_impl == "reference" or (c.attention_dropout > 0 and path.device_type != "cuda"):
        dropout = (1 if path.device_type == "cuda" else a) + a if c.attention_dropout > 0 else 0
        return square * (F32 + dropout)
    if block_causal:
        from aiayn.fast.block_causal import BLOCK

        blocks = -(-t_q // BLOCK)
        return F32 * square * (blocks + 1) // (2 * blocks)
    return 0


def _block_causal(c: ModelConfig, b: int, t: int, path: Execution) -> bool:
    """Whether aiayn.fast's block-causal attention runs this training attention (no padding assumed)."""
    from aiayn.fast.block_causal import MAX_LENGTH, MIN_LENGTH_ONE_THREAD, MIN_WORK

    return (not path.autocast and c.n_kv_heads == c.n_heads and c.attention_dropout == 0
            and c.positional not in ("alibi", "t5") and 2 <= t <= MAX_LENGTH
            and (t >= MIN_LENGTH_ONE_THREAD or path.threads > 1)
            and b * c.n_heads * t * t * c.head_dim >= MIN_WORK)


def model_counts(task: Task | None, config: ModelConfig, *,
                 adapt: Callable[[nn.Module], Any] | None = None) -> ModelCounts:
    """The bytes of the model ``task`` builds for ``config``, counted on the meta device (from the config
    alone, erring high, if that fails). ``adapt``: the trainer's in-place change (LoRA), on a meta copy."""
    try:
        with torch.device("meta"):
            model = task.build_model(config) if task is not None else build_model(config)
            if adapt is not None:  # a copy: a task's model, loaded once and kept, stays as it is
                model = _meta_copy(model)
                adapt(model)
    except Exception:  # a task whose model cannot be built on the meta device
        values = estimated_values(config) * F32
        largest = F32 * config.d_model * max(config.vocab_size, config.tgt_vocab_size or 0, config.d_ff)
        return ModelCounts(values, values, values, largest, fused_head=False, largest_weight=largest)
    params = list(model.parameters())
    weights = sum(_nbytes(p) for p in params) + sum(_nbytes(b) for b in model.buffers())
    trainable = sum(_nbytes(p) for p in params if p.requires_grad)
    matmul = sum(_nbytes(m.weight) for m in model.modules() if isinstance(m, nn.Linear))
    largest = max((_nbytes(p) for p in params if p.requires_grad), default=0)
    fused_head = isinstance(getattr(model, "lm_head", None), nn.Linear) and config.arch != "encoder-only"
    return ModelCounts(weights, trainable, matmul, largest, fused_head,
                       largest_weight=max((_nbytes(p) for p in params), default=0),
                       frozen=any(not p.requires_grad for p in params))


def _meta_copy(model: nn.Module) -> nn.Module:
    """``model`` with its parameters and buffers on the meta device (nothing allocated, tied weights kept)."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = (nn.Parameter(meta, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else meta)
    return copy.deepcopy(model, memo)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def estimate_training_memory(config: ModelConfig, shape: BatchShape, path: Execution, *, counts: ModelCounts,
                             ddp: bool = False, shards: int = 1) -> TrainingMemory:
    """The memory of a training step. ``ddp``: DDP's gradient buckets, a second copy of the gradients;
    ``shards``: FSDP shards weights, gradients and moments over this many processes."""
    activations = activation_bytes(config, shape, path, fused_head=counts.fused_head)
    if path.autocast:  # bfloat16 copies of the matmul weights, kept for the backward
        activations += counts.matmul // 2
    gradients = counts.trainable * (2 if ddp else 1)
    return TrainingMemory(weights=counts.weights // shards, gradients=gradients // shards,
                          optimizer=2 * counts.trainable // shards,
                          step_temporary=2 * counts.largest,
                          activations=activations, checkpoint=checkpoint_bytes(counts, path))


def checkpoint_bytes(counts: ModelCounts, path: Execution) -> int:
    """What a save adds on the device: the finiteness check's mask of the largest tensor; on the CPU, with a
    safetensors lacking the zero-copy ``TensorSpec`` writer, the larger file's bytes (weights or moments)."""
    mask = counts.largest_weight // F32
    if path.device_type != "cpu" or hasattr(safetensors, "TensorSpec"):
        return mask
    saved = counts.trainable if counts.frozen else counts.weights
    return mask + max(saved, 2 * counts.trainable)


def batch_shape(batch: Any) -> BatchShape:
    """A collated batch's b sequences and its longest t positions; a source is taken as long (errs high)."""
    tensors = [v for v in (batch.values() if isinstance(batch, dict) else [batch])
               if isinstance(v, Tensor) and v.dim() >= 1]
    b = max((v.shape[0] for v in tensors), default=1)
    t = max((v.shape[1] for v in tensors if v.dim() >= 2), default=1)
    return BatchShape(b, t, t)


def training_execution(device: torch.device, cfg: TrainConfig, *, fast: bool) -> Execution:
    """How the trainer runs a step on ``device`` (``fast``: with aiayn.fast's CPU kernels)."""
    return Execution(autocast=devices.autocast_dtype(device, bf16=cfg.bf16) is not None, fast=fast,
                device_type=device.type, threads=torch.get_num_threads())


def available_bytes(device: torch.device, *, local_processes: int = 1) -> tuple[int | None, str]:
    """Bytes free for training on ``device`` now, and where (None: unknown). On the CPU the least of
    MemAvailable and the cgroup's room (shared by the local processes) and the RLIMIT_AS/RLIMIT_DATA room."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    if device.type != "cpu":  # MPS shares the host's memory; its own limit is not known here
        return None, str(device)
    host, group = available_memory(), cgroup_room()
    each = f" to each of this machine's {local_processes} processes" if local_processes > 1 else ""
    found = list(rlimit_rooms())
    if host is not None:
        found.append((host // local_processes, "available" + (each or " here")))
    if group is not None:
        found.append((group // local_processes, f"left{each} under this cgroup's memory.max"))
    return min(found) if found else (None, "here")


def cgroup_room() -> int | None:
    """The least room cgroup v2's memory.max leaves in this process's group or one above it (inactive page
    cache counts as free: the kernel reclaims it first)."""
    try:
        lines = PROC_CGROUP.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    group, rooms = CGROUP_ROOT / path.lstrip("/"), []
    while True:
        try:
            limit = (group / "memory.max").read_text(encoding="ascii").strip()
            if limit != "max":
                used = int((group / "memory.current").read_text(encoding="ascii"))
                stat = dict(line.split() for line in (group / "memory.stat").read_text(encoding="ascii").splitlines())
                rooms.append(int(limit) - used + int(stat.get("inactive_file", 0)))
        except (OSError, ValueError):
            pass
        if group in (CGROUP_ROOT, group.parent):
            return min(rooms, default=None)
        group = group.parent


def rlimit_rooms() -> Iterator[tuple[int, str]]:
    """The room under each set RLIMIT_AS and RLIMIT_DATA: the limit less VmSize or VmData."""
    if resource is None:
        return
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            mapped = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in status)
                      if k in ("VmSize", "VmData")}
    except (OSError, ValueError):
        return
    for name, field in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _hard = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY and field in mapped:
            yield max(0, soft - mapped[field]), f"left under this process's {name}"


def check_training_memory(task: Task, model_config: ModelConfig, cfg: TrainConfig, device: torch.device, *,
                          fast: bool, resume: bool = False, world_size: int = 1, fsdp: bool = False,
                          adapt: Callable[[nn.Module], Any] | None = None,
                          echo: Callable[[str], None] | None = None) -> TrainingMemory | None:
    """Refuse a run whose step or save would not fit with the estimate's margin (``TrainingMemoryError``),
    warn through ``echo`` near that; after ``task.prepare``. The largest batch's estimate (None: unknown)."""
    check_fits(model_config)  # an absurd config fails fast, before even a meta build of it
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    available, where = available_bytes(device, local_processes=local)
    if available is None:
        return None
    batches = task.train_batches(0, cfg.batch_size, cfg.seed)
    shapes = [batch_shape(task.collate("train", indices)) for indices in task.memory_batches(batches)]
    if not shapes:
        return None
    counts = model_counts(task, model_config, adapt=adapt)
    path = training_execution(device, cfg, fast=fast and device.type == "cpu")
    ddp = world_size > 1 and not fsdp
    estimates = [(estimate_training_memory(model_config, shape, path, counts=counts, ddp=ddp,
                                           shards=world_size if fsdp else 1), shape) for shape in shapes]
    estimate, shape = max(estimates, key=lambda pair: pair[0].peak)
    overhead = PROCESS_OVERHEAD if device.type == "cpu" else 0
    needed = needed_bytes(estimate, device)
    allowing = f"up to {format_bytes(needed)} with the estimate's {MARGIN:.0%} margin" + (
        f" and the process's own {format_bytes(overhead)}" if overhead else "")
    if needed > available:
        usable = int((available - overhead) * (1 - MARGIN))  # what the estimate may reach
        lora = bool(task.options.get("init_from")) and not counts.frozen
        raise TrainingMemoryError(
            f"training would need about {estimate.describe()} for batches of {shape.sequences} x "
            f"{shape.length} tokens, {allowing}, more than the {format_bytes(available)} {where}; "
            f"{_advice(estimate, usable, cfg, path, task.options.get('max_tokens'), resume=resume, lora=lora)}")
    if echo is not None and available - needed < (needed - estimate.peak) // 2:  # within half a margin
        echo(f"warning: training may need about {format_bytes(estimate.peak)}, {allowing}, close to the "
             f"{format_bytes(available)} {where}; memory other processes take meanwhile can stop it")
    return estimate


def needed_bytes(estimate: TrainingMemory, device: torch.device) -> int:
    """The most a run may take: the estimate with its allowed error, and the process's own on the CPU."""
    return int(estimate.peak / (1 - MARGIN)) + (PROCESS_OVERHEAD if device.type == "cpu" else 0)


def _advice(estimate: TrainingMemory, available: int, cfg: TrainConfig, path: Execution, max_tokens: Any, *,
            resume: bool, lora: bool = False) -> str:
    """What to change: k times smaller batches with k times the accumulation, bfloat16 on a GPU, LoRA for a
    loaded model trained whole, a smaller model."""
    if resume:
        return ("a resumed run keeps its batch and precision, so free memory (other processes), or "
                "resume on a machine with more")
    fixes = []
    room = available - estimate.weights - estimate.optimizer  # for activations, at any batch
    if room > max(estimate.gradients + estimate.step_temporary, estimate.checkpoint):
        k = -(-estimate.activations // room)
        accum = f"--grad-accum {cfg.grad_accum * k}"
        if isinstance(max_tokens, int):
            fixes.append(f"--max-tokens {max(1, max_tokens // k)} {accum}")
        elif cfg.batch_size >= k:
            fixes.append(f"--batch-size {cfg.batch_size // k} {accum}")
        else:
            fixes.append("shorter sequences")
        if path.device_type == "cuda" and not path.autocast:  # halves most activations
            fixes.append("--bf16")
    if lora:  # only the adapters have gradients and moments
        fixes.append("--lora-rank 8")
    fixes.append("a smaller model")
    return "try " + ", or ".join(fixes)


# What torch's allocators say in the RuntimeError they raise off CUDA (CUDA's is OutOfMemoryError).
ALLOCATOR_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "MPS backend out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's out-of-memory error (CUDA's, or the CPU's or MPS's allocator's), or Python's."""
    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or (
        isinstance(exc, RuntimeError) and any(text in str(exc) for text in ALLOCATOR_FAILURES))


def out_of_memory(exc: BaseException, location: RunLocation, task: Task, cfg: TrainConfig,
                  device: torch.device) -> TrainingOutOfMemory:
    """The one line an out-of-memory error during training becomes; call it before ``location.abandon()``."""
    text = str(exc)
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ \w?i?B|\d+ bytes)", text)
    free = re.search(r"of which ([\d.]+ \w?i?B) is free", text)
    amount = asked.group(1) if asked else ""
    if amount.endswith(" bytes"):  # the CPU allocator's
        amount = format_bytes(int(amount.split()[0]))
    what = ", ".join(part for part in (
        f"tried to allocate {amount}" if asked else "",
        f"{free.group(1)} free" if free else "") if part)
    latest = latest_checkpoint(location.path / "checkpoints")
    kept = (f"the latest checkpoint, {latest.name} in {latest.parent}, is intact" if latest is not None
            else location.nothing_saved())
    max_tokens = task.options.get("max_tokens")
    smaller = (f"--max-tokens {max(1, max_tokens // 2)}" if isinstance(max_tokens, int)
               else f"--batch-size {max(1, cfg.batch_size // 2)}")
    fixes = f"{smaller} --grad-accum {cfg.grad_accum * 2} (the same batch per step)"
    if device.type == "cuda" and cfg.bf16 is False:
        fixes += ", --bf16"
    again = "free memory and --resume, or start again with --overwrite and " if latest is not None else "start again with "
    return TrainingOutOfMemory(f"out of memory on {device} during training" + (f" ({what})" if what else "")
                               + f"; {kept}. A run keeps its batch when resumed: {again}{fixes}, or a smaller model")
