"""``aiayn train``, ``tasks``, ``average``, ``presets`` and ``kv-cache``: runs and model sizes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from aiayn.cli.app import (
    SEED_RANGE,
    FiniteFloatRange,
    bad_value,
    cli,
    device_option,
    is_main_process,
    options,
    place,
    plain_option,
    threads_option,
)
from aiayn.cli.finetune import lora_options, lora_train_options
from aiayn.config import ConfigError


@cli.command("kv-cache")
@click.option("--preset", help="Take the model sizes from a named preset (see `aiayn presets`).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences decoded at once.")
@click.option("--seq-len", type=click.IntRange(min=1), help="Tokens held per sequence (prompt + generated). Default: the preset's max_seq_len.")
@click.option("--src-len", type=click.IntRange(min=0),
              help="Encoder-decoder: source tokens per sequence, whose cross-attention keys/values every "
                   "decoder layer keeps. Default: --seq-len for an encoder-decoder preset, else 0.")
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
def kv_cache_cmd(preset: str | None, batch_size: int, dtype: str, group_size: int | None,
                 **given: int | None) -> None:
    """Estimate KV-cache memory: 2 x layers x kv_heads x head_dim x seq_len x batch x bytes
    (+ the same over --src-len source tokens for an encoder-decoder's cross-attention).

    Example (the seeds'): aiayn kv-cache --batch-size 32 --n-layers 32 --n-heads 32
    --d-model 4096 --seq-len 2048  ->  64 GiB
    """
    from aiayn.nn.kv_memory import describe_kv_cache

    sizes = _kv_sizes(preset, given)
    with bad_value("--group-size"):
        lines = describe_kv_cache(**sizes, batch_size=batch_size, dtype=dtype, group_size=group_size)
    for line in lines:
        click.echo(line)


def _kv_sizes(preset: str | None, given: dict[str, int | None]) -> dict[str, int]:
    """``kv-cache``'s sizes: those given, the rest from the preset; usage errors otherwise."""
    from aiayn.models.presets import get_preset
    from aiayn.nn.kv_memory import cache_sizes

    if preset is not None:  # the preset fills in what is not given
        with bad_value("--preset", ConfigError):
            from_preset = cache_sizes(get_preset(preset))
        if from_preset["src_len"] and given["src_len"] is None:  # encoder-decoder: as long as the target
            from_preset["src_len"] = given["seq_len"] or from_preset["seq_len"]
        given = {k: from_preset[k] if v is None and k in from_preset else v for k, v in given.items()}
    missing = [f"--{k.replace('_', '-')}" for k in ("n_layers", "n_heads", "seq_len") if given[k] is None]
    if given["d_model"] is None and given["head_dim"] is None:
        missing.append("--d-model (or --head-dim)")
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)}; give them or a --preset")
    n_heads = given["n_heads"]
    assert n_heads is not None
    n_kv_heads = given["n_kv_heads"] or n_heads
    if n_heads % n_kv_heads != 0:
        raise click.BadParameter(f"{n_kv_heads} does not divide --n-heads {n_heads}", param_hint="--n-kv-heads")
    head_dim, d_model = given["head_dim"], given["d_model"]
    if head_dim is None:
        assert d_model is not None
        if d_model % n_heads != 0:
            raise click.BadParameter(f"{d_model} is not divisible by --n-heads {n_heads}; "
                                     f"give --head-dim instead", param_hint="--d-model")
        head_dim = d_model // n_heads
    return dict(n_layers=given["n_layers"], n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                seq_len=given["seq_len"], src_len=given["src_len"] or 0)  # type: ignore[dict-item]


# ``--name`` options of TrainConfig and ModelConfig fields, given or left to the task and recipe (None).
_TRAIN_OPTIONS: dict[str, tuple[Any, str]] = {
    "epochs": (click.IntRange(min=1), "Passes over the training split."),
    "max_steps": (click.IntRange(min=1), "Stop after this many optimiser steps."),
    "batch_size": (click.IntRange(min=1), "Examples per batch."),
    "lr": (FiniteFloatRange(min=0, min_open=True),
           "Peak learning rate (for --schedule noam: the factor in front of the formula)."),
    "schedule": (click.Choice(["noam", "cosine", "constant", "linear"]),
                 "Learning-rate schedule; all warm up linearly."),
    "warmup_steps": (click.IntRange(min=0), "Warmup length in steps."),
    "optimizer": (click.Choice(["adam", "adamw"]), "Adam (paper betas/eps) or AdamW."),
    "weight_decay": (FiniteFloatRange(min=0), "AdamW decoupled weight decay."),
    "label_smoothing": (FiniteFloatRange(min=0, max=1, max_open=True), "Label smoothing epsilon (paper: 0.1)."),
    "clip_grad_norm": (FiniteFloatRange(min=0, min_open=True), "Gradient-norm clip."),
    "grad_accum": (click.IntRange(min=1), "Batches accumulated per optimiser step."),
    "seed": (SEED_RANGE, "Random seed (data, initialisation, dropout), 0 to 2**32 - 1."),
    "bf16": (bool, "bfloat16 autocast over float32 weights.  [default: on with CUDA, off on the CPU, unless the task sets it]"),
    "compile": (bool, "torch.compile each step's forward and loss as one graph (for GPUs; on a CPU the eager step "
                      "with aiayn.fast's kernels is faster: a graph cannot skip padding)."),
    "eval_every": (click.IntRange(min=0), "Steps between validations (0: each epoch)."),
    "save_every": (click.IntRange(min=0), "Steps between checkpoints (0: each epoch)."),
    "keep_checkpoints": (click.IntRange(min=1), "How many of the newest checkpoints to keep."),
    "average_last": (click.IntRange(min=0),
                     "At the end, average the last N checkpoints (paper, section 6.1) into RUN/averaged-lastK "
                     "(K: those kept, at most N) and score the test split with the better of them and the last "
                     "checkpoint on val (0: off)."),
}
_MODEL_OPTIONS: dict[str, tuple[Any, str]] = {
    "d_model": (click.IntRange(min=1), "Model width."),
    "n_layers": (click.IntRange(min=1), "Layers per stack."),
    "n_heads": (click.IntRange(min=1), "Attention heads."),
    "d_ff": (click.IntRange(min=1), "Feed-forward width."),
    "dropout": (FiniteFloatRange(min=0, max=1, max_open=True), "Residual/embedding dropout."),
    "attention_dropout": (FiniteFloatRange(min=0, max=1, max_open=True), "Dropout on the attention weights."),
    "positional": (click.Choice(["sinusoidal", "learned", "rope", "alibi", "t5", "none"]), "Positional scheme."),
    "padding_free": (bool, "Skip padding: the token-wise layers and the loss run on the real tokens only "
                           "(same results; faster on padded batches)."),
}


def _config_options(fields: dict[str, tuple[Any, str]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The click options of ``fields``, in their order; a bool field is a ``--name/--no-name`` switch."""
    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for name, (kind, text) in reversed(fields.items()):
            flag = name.replace("_", "-")
            declared = f"--{flag}/--no-{flag}" if kind is bool else f"--{flag}"
            func = click.option(declared, type=None if kind is bool else kind, default=None, help=text)(func)
        return func
    return apply


_SETUP_HINTS = {"recipe": "--recipe", "task_options": "--recipe (task_options)"}  # RunSetupError.about
# Task options given on the command line: what to start from, the data (files, as lists where repeatable)
# and, for translation, its languages.
_TASK_OPTIONS = ("init_from", "data", "val_data", "src", "tgt", "src_lang", "tgt_lang")
_FILE = click.Path(dir_okay=False)
_task_options = options(
    click.option("--init-from", type=str, default=None, metavar="SOURCE",
                 help="Start from this model and continue training it, with its tokenizer: a shipped model, "
                      "a run directory, a GGUF file (dequantised) or a Hugging Face directory."),
    click.option("--data", type=click.Path(), multiple=True, default=(),
                 help="Training data file (repeat for several); the format is the task's (--task text: "
                      "plain text). Translation: one folder of train.SRC and train.TGT files."),
    click.option("--val-data", type=_FILE, multiple=True, default=(),
                 help="Validation data file (repeat for several). Default: a seeded share of --data."),
    click.option("--src", type=_FILE, default=None,
                 help="Source-side file of your own parallel data (translation)."),
    click.option("--tgt", type=_FILE, default=None,
                 help="Target-side file of your own parallel data (translation), line i translating line i "
                      "of --src."),
    click.option("--src-lang", default=None, metavar="CODE",
                 help="Source language (translation), the suffix of a --data folder's files. Default: the "
                      "--init-from model's, else en."),
    click.option("--tgt-lang", default=None, metavar="CODE",
                 help="Target language (translation). Default: the --init-from model's, else de."),
)


@cli.command("train")
@click.option("--task", default="reverse", show_default=True,  # aiayn.tasks.runs.DEFAULT_TASK
              help="What to learn: reverse, copy, set-anomaly, ... (see `aiayn tasks`).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the run is written. Default: runs/<task>-<date>-<time>.")
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir from its latest checkpoint.")
@click.option("--overwrite", is_flag=True,
              help="Replace the aiayn run in --run-dir with a new one (the old run is deleted only once the "
                   "new one has saved its first checkpoint; folders that are not aiayn runs are refused).")
@_config_options(_TRAIN_OPTIONS)
@_config_options(_MODEL_OPTIONS)
@_task_options
@lora_options
@click.option("--max-tokens", type=click.IntRange(min=1),
              help="Token-count batching (translation): padded tokens per batch, e.g. 4096.")
@click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path),
              help="A YAML recipe (task, task_options, model, train); options given here override it.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@click.option("--fsdp", is_flag=True, help="Under torchrun: shard parameters, gradients and optimiser "
              "state over the processes (FSDP2) instead of replicating them (DDP, the default).")
@plain_option
@device_option
@threads_option
@click.pass_context
def train_cmd(ctx: click.Context, task: str, run_dir: Path | None, resume: bool, overwrite: bool,
              recipe: Path | None, max_tokens: int | None, progress: bool, fsdp: bool, plain: bool,
              device: str, threads: int | None, **options: Any) -> None:
    """Train a task and write a run directory (checkpoint, metrics.csv, plots).

    With no arguments: the reverse task, in under 3 minutes on a 2-core CPU.
    """
    from aiayn.tasks.runs import default_run_dir
    from aiayn.train.distributed import ParallelOptions
    from aiayn.train.trainer import TrainingDiverged, train

    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite contradict each other; choose one")
    if resume and run_dir is None:
        raise click.UsageError("--resume needs --run-dir (the run to continue)")
    if resume and max_tokens is not None:
        raise click.UsageError("--max-tokens cannot change when resuming (the batches would differ)")
    where = place(device, threads)
    setup = _setup_run(ctx, task, run_dir if resume else None, recipe, max_tokens, options)
    run_dir = run_dir or default_run_dir(setup.task_name)
    if is_main_process():
        click.echo(f"task {setup.task_name}: {setup.task.description}")
        for note in getattr(setup.task, "setup_notes", lambda seed: [])(setup.train_config.seed):
            click.echo(note)  # what the task does that the options did not spell out (a split it makes)
        click.echo(f"run directory: {run_dir}")
    try:
        result = train(setup.task, setup.model_config, setup.train_config, run_dir, resume=resume,
                       overwrite=overwrite, progress=progress, echo=click.echo,
                       parallel=ParallelOptions(fsdp=fsdp), fast=not plain, device=where)
    except TrainingDiverged as exc:  # a failure, not a usage error: exit code 1
        if is_main_process():
            click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
    if result.interrupted:
        raise SystemExit(130)
    if is_main_process():  # under torchrun, rank 0 reports
        _report(result, run_dir)


def _setup_run(ctx: click.Context, task: str, resume_dir: Path | None, recipe: Path | None,
               max_tokens: int | None, options: dict[str, Any]) -> Any:
    """``aiayn.tasks.runs.setup_run`` with the options given on the command line (not defaulted)."""
    from aiayn.tasks.runs import RunSetupError, setup_run

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT

    chosen = {k: v for k, v in options.items() if v is not None and given(k)}
    task_options = {k: list(v) if isinstance(v, tuple) else v for k, v in chosen.items() if k in _TASK_OPTIONS}
    try:
        return setup_run(task if given("task") else None, resume_dir=resume_dir, recipe=recipe,
                         max_tokens=max_tokens,
                         model_options={k: v for k, v in chosen.items() if k in _MODEL_OPTIONS},
                         train_options={**{k: v for k, v in chosen.items() if k in _TRAIN_OPTIONS},
                                        **lora_train_options(chosen)},
                         task_options=task_options)
    except RunSetupError as exc:
        if exc.about not in _SETUP_HINTS:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=_SETUP_HINTS[exc.about]) from None


def _report(result: Any, run_dir: Path) -> None:
    from aiayn.train.averaging import describe_choice

    choice = describe_choice(result.test_checkpoint) if result.test_checkpoint else None
    scored_with = f", scored with {choice}" if choice else ""
    click.echo(f"\nfinished {result.step} steps. Test split{scored_with}: "
               + ", ".join(f"{k} {v:.4%}" if "acc" in k or "exact" in k else f"{k} {v:.4g}"
                           for k, v in result.test_metrics.items()))
    if result.examples:
        click.echo("examples (input -> prediction):")
        for line in result.examples:
            click.echo(f"  {line}")
    click.echo(f"run directory {run_dir}: config.json, checkpoints/, metrics.csv, summary.json"
               + "".join(f", {p.name}" for p in result.plots))


@cli.command("tasks")
def tasks_cmd() -> None:
    """List the tasks `aiayn train --task` knows."""
    from aiayn.tasks import TASKS

    width = max(map(len, TASKS))  # the longest name (shakespeare-char-long) sets the column
    for name in sorted(TASKS):
        click.echo(f"{name:{width}s}  {TASKS[name].description}")


@cli.command("average")
@click.option("--run", "run_dir", required=True, type=click.Path(path_type=Path), help="A run directory.")
@click.option("--last", type=click.IntRange(min=1), default=5, show_default=True,
              help="Average this many of the newest checkpoints (fewer kept: those, with a warning).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the averaged checkpoint goes. Default: RUN/averaged-lastK, K the checkpoints averaged.")
def average_cmd(run_dir: Path, last: int, out_dir: Path | None) -> None:
    """Average the weights of the last N checkpoints (the paper's trick, section 6.1).

    The rule of ``average_last`` at the end of training (aiayn.train.averaging.plan_average): fewer
    than N kept averages those, with a warning; a single checkpoint is not averaged (nothing written).
    """
    from aiayn.tasks.runs import load_run
    from aiayn.train.averaging import plan_average
    from aiayn.train.checkpoint import CheckpointError, average_last_checkpoints

    try:
        plan = plan_average(run_dir / "checkpoints", last)
    except CheckpointError:
        raise click.BadParameter(f"{run_dir} holds no checkpoints", param_hint="--run") from None
    if (warning := plan.warning()) is not None:
        click.echo(warning, err=True)
    if not plan.averages:
        return
    run = load_run(run_dir, checkpoint=plan.last, prepare=False)
    path = average_last_checkpoints(run_dir / "checkpoints", plan.count, run.model,
                                    out_dir or run_dir / plan.folder_name)
    averaged = json.loads((path / "state.json").read_text(encoding="utf-8"))["averaged"]
    click.echo(f"averaged {', '.join(averaged)} -> {path}")


@cli.command("presets")
def presets_cmd() -> None:
    """List the named model configurations and their parameter counts."""
    from aiayn.models import build_model, count_parameters, get_preset, preset_names

    for name in preset_names():
        cfg = get_preset(name)
        n = count_parameters(build_model(cfg))
        click.echo(f"{name:12s} {cfg.arch:16s} d_model={cfg.d_model:<5d} layers={cfg.n_layers:<3d} "
                   f"heads={cfg.n_heads:<3d} d_ff={cfg.d_ff:<5d} vocab={cfg.vocab_size:<6d} params={n:,}")
