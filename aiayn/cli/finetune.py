"""Fine-tuning: ``--lora-*`` of ``aiayn train``, ``--adapter`` of the commands that run a text model,
and ``aiayn merge``, ``adapter`` and ``chat-data``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from aiayn.cli.app import FiniteFloatRange, bad_value, check_writable, cli, options


def _targets(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    from aiayn.finetune.lora import TARGET_NAMES

    if value is None:
        return None
    targets = tuple(t.strip() for t in value.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGET_NAMES]
    if not targets or unknown:
        raise click.BadParameter(f"{', '.join(unknown) or 'no target'}: choose from {', '.join(TARGET_NAMES)}")
    return targets


# --lora-rank, --lora-alpha, --lora-dropout, --lora-targets (keywords ``lora_*``) and --quantize (keyword
# ``quantize``); turn them into train options with ``lora_train_options``.
lora_options = options(
    click.option("--lora-rank", type=click.IntRange(min=1),
                 help="Train LoRA adapters of this rank on the frozen model instead of the model itself."),
    click.option("--lora-alpha", type=FiniteFloatRange(min=0, min_open=True),
                 help="LoRA scale numerator: updates are scaled by alpha / rank.  [default: 16]"),
    click.option("--lora-dropout", type=FiniteFloatRange(min=0, max=1, max_open=True),
                 help="Dropout on the adapters' input.  [default: 0]"),
    click.option("--lora-targets", callback=_targets,
                 help="Projections to adapt, comma-separated: q, k, v, o (attention), gate, up, down (MLP); "
                      "qkv for GPT-2's fused c_attn.  [default: q,v]"),
    click.option("--quantize", type=click.Choice(["q4"]),
                 help="QLoRA: keep the frozen attention and MLP weights in 4-bit blocks (a GGUF file's "
                      "own 4-bit blocks as they are), the adapters float32; needs --lora-rank. Off the "
                      "CPU each layer is dequantised when it runs."),
)


def lora_train_options(options: dict[str, Any]) -> dict[str, Any]:
    """The TrainConfig fields ``lora`` (and ``quantize``) of the options given, or ``{}`` without
    ``--lora-rank``; the other ``--lora-*`` options and ``--quantize`` alone are a usage error."""
    given = {key.removeprefix("lora_"): value for key, value in options.items()
             if key.startswith("lora_") and value is not None}
    quantize = options.get("quantize")
    if "rank" not in given and quantize is not None:
        raise click.UsageError(f"--quantize {quantize} needs --lora-rank (QLoRA trains adapters over the "
                               f"4-bit base; the base itself cannot train in 4 bits)")
    if not given:
        return {}
    if "rank" not in given:
        raise click.UsageError(f"--lora-{next(iter(given))} needs --lora-rank (LoRA is off without it)")
    if "targets" in given:
        given["targets"] = list(given["targets"])
    return {"lora": given, **({"quantize": quantize} if quantize is not None else {})}


adapter_option = click.option(
    "--adapter", type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A LoRA adapter directory (PEFT's adapter_config.json + adapter_model.safetensors) merged into "
         "the model; without --model/--run, the model is the adapter's base_model_name_or_path. translate and "
         "evaluate take it with --prompt.")


def adapter_base(adapter: Path | None, run_dir: Path | None, model_path: Path | None) -> Path | None:
    """The model an adapter goes on: --model, or (without --run and --model) the base the adapter names."""
    from aiayn.finetune.peft_format import read_adapter_config

    if adapter is None or run_dir is not None or model_path is not None:
        return model_path
    base = read_adapter_config(adapter).get("base_model_name_or_path")
    if not base:
        raise click.UsageError(f"{adapter} names no base model (base_model_name_or_path); give --model")
    return Path(base)


@cli.command("merge")
@click.option("--adapter", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The LoRA adapter directory (PEFT's layout).")
@click.option("--base", "base", type=click.Path(path_type=Path),
              help="The model it adapts: a Hugging Face directory, a GGUF file or a shipped model "
                   "(default: the adapter's base_model_name_or_path).")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="A new directory for the merged model (Hugging Face layout, as `aiayn export --to hf`).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="Weight type of the written model.")
def merge_cmd(adapter: Path, base: Path | None, out_dir: Path, dtype: str) -> None:
    """Fold a LoRA adapter into its base model's weights and write the result as a Hugging Face
    directory (config.json, model.safetensors, tokenizer files) that needs no PEFT."""
    import torch

    from aiayn.tasks.runs import RunInputError, load_text_model
    from aiayn.tasks.trained import resolve_model
    from aiayn.textgen import TextModelError, export_text_model

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise click.BadParameter(f"{out_dir} exists and is not an empty directory; give a new one",
                                 param_hint="--out")
    base = adapter_base(adapter, None, base)
    assert base is not None
    with bad_value(None, RunInputError, TextModelError):
        lm = load_text_model(model_path=resolve_model(base), plain=True, device="cpu", adapter=adapter)
        lm.model = lm.model.to(getattr(torch, dtype))
        out = export_text_model(lm, out_dir)
    click.echo(f"merged {adapter} into {base} -> {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")


@cli.command("adapter")
@click.option("--run", "run_dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A LoRA run directory (trained with --lora-rank).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where the adapter goes (adapter_config.json + adapter_model.safetensors are replaced).")
def adapter_cmd(run_dir: Path, out_dir: Path) -> None:
    """Write a LoRA run's adapters in PEFT's layout, for PEFT (PeftModel.from_pretrained) or for
    `aiayn generate --adapter` on the run's base model."""
    import torch

    from aiayn.config import ModelConfig, TrainConfig
    from aiayn.finetune.lora import LoraConfig, apply_lora
    from aiayn.finetune.peft_format import save_adapter
    from aiayn.tasks.base import get_task
    from aiayn.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
    from aiayn.train.run_dir import read_run_config

    configs = read_run_config(run_dir)
    lora = TrainConfig.from_dict(configs["train"]).lora
    if lora is None:
        raise click.BadParameter(f"{run_dir} is not a LoRA run (it trained every weight); export it with "
                                 f"`aiayn export --to hf --run {run_dir}`", param_hint="--run")
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        raise CheckpointError(f"{run_dir} holds no checkpoint yet")
    config, options = ModelConfig.from_dict(configs["model"]), configs.get("task_options", {})
    # The adapters are named by the model's modules, not its weights: outside its run a task builds the
    # architecture alone (no base is loaded), on the meta device; only the checkpoint's tensors are read.
    with torch.device("meta"):
        model = apply_lora(get_task(configs["task"], **options).build_model(config), LoraConfig.from_dict(lora))
    load_checkpoint(checkpoint, model.to_empty(device="cpu"))
    out = save_adapter(model, config, out_dir, base=options.get("init_from"))
    click.echo(f"wrote {out} (adapter_config.json, adapter_model.safetensors)")


@cli.command("chat-data")
@click.option("--src", "src_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Source sentences, one per line.")
@click.option("--tgt", "tgt_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Their translations, aligned line by line.")
@click.option("--prompt", required=True,
              help="What the user asks, {src} standing for the sentence, e.g. 'Translate to German: {src}'.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The JSONL file to write.")
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N pairs.")
def chat_data_cmd(src_path: Path, tgt_path: Path, prompt: str, out_path: Path, limit: int | None) -> None:
    """Write parallel text as chat JSONL (OpenAI's fine-tuning format) for `aiayn train --task chat`:
    one conversation per pair, the user asking --prompt, the assistant answering with the translation."""
    from aiayn.data.parallel import read_parallel
    from aiayn.finetune.chat import conversations_jsonl, translation_conversations
    from aiayn.train.checkpoint import atomic_write_text

    check_writable(out_path, "--out")
    sources, targets = read_parallel(src_path, tgt_path)
    with bad_value("--prompt"):
        conversations = translation_conversations(sources[:limit], targets[:limit], prompt)
    atomic_write_text(out_path, conversations_jsonl(conversations))
    click.echo(f"{len(conversations)} conversations -> {out_path}")
