"""What ``python -m benchmarks.gpu`` runs: its rows' sizes, the models (built on the CPU with a fixed
seed, then moved), each peer's step or decode call, the card's peak FLOPs and the recipe row. aiayn's
are trained the library's way (``autocast``, ``sequence_loss``, AdamW fused where the device allows).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import ModelConfig
from aiayn.device import autocast, fused_optimizer
from aiayn.generate import greedy_decoder_only
from aiayn.models import get_preset
from aiayn.train.losses import sequence_loss
from benchmarks.common import hf_greedy
from benchmarks.peers import TorchTransformerLM


@dataclass(frozen=True)
class Plan:
    """The sizes of every row: the issue's (``FULL``) or seconds on a CPU (``SMOKE``)."""

    gpt: tuple[int, int, int, int, int]  # vocab, d_model, heads, layers, context (GPT-2 124M)
    train_batch: tuple[int, int]  # (a): sequences x tokens
    seq2seq: str  # (b): aiayn preset, the same shape for torch.nn.Transformer
    seq2seq_batch: tuple[int, int, int]  # (b): sequences, source tokens, target tokens
    decode_batches: tuple[int, ...]  # (c)
    prompt_len: int  # (c)
    new_tokens: int  # (c)


FULL = Plan(gpt=(50257, 768, 12, 12, 1024), train_batch=(8, 1024), seq2seq="paper-base",
            seq2seq_batch=(128, 100, 100), decode_batches=(1, 16), prompt_len=16, new_tokens=256)
SMOKE = Plan(gpt=(199, 32, 2, 2, 64), train_batch=(2, 32), seq2seq="tiny", seq2seq_batch=(4, 12, 10),
             decode_batches=(1, 2), prompt_len=4, new_tokens=6)

# Dense bf16 peaks (NVIDIA's datasheets), TFLOP/s, by a piece of the device name; the first match wins.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_flops(device: torch.device, override_tflops: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s or None, where it comes from) for MFU."""
    name = device_name(device)
    if override_tflops is not None:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops) for {name}"
    for piece, tflops in PEAK_BF16_TFLOPS:
        if device.type == "cuda" and piece in name:
            return tflops * 1e12, f"{tflops:g} TFLOP/s dense bf16 ({name}, NVIDIA datasheet; --peak-tflops overrides)"
    return None, f"no known peak for {name}: give --peak-tflops for MFU"


# ---- (a) and (c): GPT-2 124M ------------------------------------------------------------------
def gpt2_config(plan: Plan) -> ModelConfig:
    """GPT-2's layout in aiayn's terms (what aiayn.interop makes of a GPT2LMHeadModel), dropout 0."""
    vocab, d, heads, layers, context = plan.gpt
    return ModelConfig(arch="decoder-only", vocab_size=vocab, d_model=d, n_heads=heads, n_layers=layers,
                       d_ff=4 * d, activation="gelu_tanh", norm="layernorm", norm_eps=1e-5, norm_position="pre",
                       final_norm=True, positional="learned", max_seq_len=context, bias=True,
                       scale_embeddings=False, tie_output=True, pad_id=None, dropout=0.0)


def hf_gpt2(transformers, plan: Plan) -> nn.Module:
    """transformers' GPT2LMHeadModel built from its config (random init), SDPA attention, dropout 0."""
    vocab, d, heads, layers, context = plan.gpt
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=context, n_embd=d, n_layer=layers, n_head=heads,
                                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_train_flops(plan: Plan, tokens: int) -> float:
    """Model FLOPs of a training step (forward + backward) of ``tokens`` tokens of context T:
    PaLM's 6 N + 12 L d T per token (nanoGPT's estimate_mfu), N the parameters without the position
    table (the output layer is tied to the token embedding, so counted once)."""
    vocab, d, _, layers, context = plan.gpt
    n = vocab * d + layers * (12 * d * d + 13 * d) + 2 * d  # embedding, blocks (weights + biases + norms), ln_f
    return (6 * n + 12 * layers * d * context) * tokens


def make_adamw(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The same AdamW for every peer (nanoGPT's GPT-2 settings), fused where aiayn fuses it (CUDA)."""
    return torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                             fused=fused_optimizer(device))


def aiayn_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple[Tensor, ...], targets: Tensor,
               device: torch.device, *, compiled: bool) -> Callable[[], None]:
    """aiayn's training step as ``aiayn train`` takes it: ``sequence_loss`` of the model's output
    under autocast, with the trainer's metrics; ``compiled``: model and loss as one ``torch.compile``
    graph, as ``aiayn train --compile`` does."""

    def forward_loss(*batch: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        with autocast(device):
            out = sequence_loss(model(*batch), targets)
        return out.loss, out.nll_sum, out.n_tokens, out.n_correct

    forward = torch.compile(forward_loss) if compiled else forward_loss

    def step() -> None:
        forward(*inputs)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def logits_step(forward: Callable[[Tensor, Tensor], Tensor], opt: torch.optim.Optimizer, batch: tuple[Tensor, ...],
                device: torch.device) -> Callable[[], None]:
    """A peer's training step: its logits (b, t, v), float32 cross-entropy, the same autocast."""
    *inputs, targets = batch

    def step() -> None:
        with autocast(device):
            logits = forward(*inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# ---- (b): the paper's base encoder-decoder --------------------------------------------------------
def seq2seq_config(plan: Plan, dropout: float) -> ModelConfig:
    _, src_len, tgt_len = plan.seq2seq_batch
    return get_preset(plan.seq2seq, dropout=dropout, attention_dropout=dropout, activation_dropout=dropout,
                      max_seq_len=max(src_len, tgt_len, 64))


def torch_seq2seq(config: ModelConfig) -> nn.Module:
    """torch.nn.Transformer of the same shape as aiayn's ``config`` (``peers.TorchTransformerLM``:
    embedding x sqrt(d) + sinusoids, post-norm stacks with nn.Transformer's final LayerNorms, tied)."""
    return TorchTransformerLM(config.vocab_size, config.d_model, config.n_heads,
                              (config.n_layers, config.n_decoder_layers), config.d_ff, config.max_seq_len,
                              config.dropout)


# ---- (c): greedy decoding -------------------------------------------------------------------------
def aiayn_decode(model: nn.Module, prompt: Tensor, new_tokens: int, *, compile: bool) -> Callable[[], Tensor]:
    return lambda: greedy_decoder_only(model, prompt, max_new_tokens=new_tokens, compile=compile).tokens


def hf_decode(transformers, model: nn.Module, prompt: Tensor, new_tokens: int, *, static: bool) -> Callable[[], Tensor]:
    """transformers' greedy generate: its dynamic cache, or its static cache, whose decode step
    generate compiles (torch.compile, mode reduce-overhead: CUDA graphs) on CUDA."""
    extra = {"cache_implementation": "static", "compile_config": transformers.CompileConfig()} if static else {}
    return lambda: hf_greedy(model, prompt, new_tokens, min_new_tokens=new_tokens, eos_token_id=None, **extra)


# ---- (d): the Multi30k recipe ---------------------------------------------------------------------
RECIPE = "recipes/multi30k-en-de.yaml"
CPU_RECIPE_BLEU = 39.56  # test2016 BLEU of the shipped CPU run of the recipe (docs/translation.md)
SEED_SPREAD = 0.84  # the larger of the en->de two-seed spreads there (val 0.84, test2016 0.29)
RECIPE_MINUTES = 5.0  # the goal for the recipe on a GPU


@dataclass
class RecipeResult:
    seconds: float
    returncode: int
    bleu: float | None
    tail: str  # the last lines of the command's output, for a failure


def run_recipe(command: list[str], run_dir: Path, timeout: float) -> RecipeResult:
    """Run the recipe's training command; its test2016 BLEU from ``run_dir/score.test2016.json``."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = 124, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}"
    seconds = time.perf_counter() - start
    score = run_dir / "score.test2016.json"
    bleu = json.loads(score.read_text())["bleu"] if rc == 0 and score.is_file() else None
    return RecipeResult(seconds, rc, bleu, "\n".join(str(output).strip().splitlines()[-5:]))
