"""A stream's inter-token latency beside a maximal embeddings request.

``aiayn serve`` (SmolLM2 by default) in a subprocess: one client streams ``--new-tokens`` greedy
tokens with the server idle, then while an embeddings request as large as the server's limits allow
is read (dropped once the stream ends). Printed: ITL p50, mean and p99, idle and beside, against the
goal (mean <= 2x idle), and the embedding tokens read meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from pathlib import Path

from benchmarks.common import footer, header, percentile, require, serving, smollm2
from benchmarks.serve import Run, make_prompts, one_request, openai_client


def serve_args(args: argparse.Namespace, model_path: Path) -> list[str]:
    """The benchmark's ``aiayn serve`` options (the port aside)."""
    return ["--model", str(model_path), "--name", "bench", "--max-batch", "4",
            "--context", str(args.prompt_tokens + args.new_tokens + 8), "--threads", str(args.threads),
            "--max-request-tokens", str(args.max_request_tokens), "--max-inputs", str(args.inputs),
            "--embed-share", str(args.embed_share), "--embed-chunk", str(args.embed_chunk)]


async def stream_gaps(client, prompt: list[int], new_tokens: int) -> list[float]:
    """The gaps (s) between a greedy streamed completion's chunks."""
    run = Run("stream")
    await one_request(client, "bench", prompt, new_tokens, run)
    return run.itl


def embedding_tokens(url: str) -> float:
    import httpx

    text = httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=30).text
    match = re.search(r"^aiayn_embedding_tokens_total (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


async def beside_embeddings(url: str, prompt: list[int], inputs: list[list[int]], args: argparse.Namespace
                            ) -> tuple[list[float], float]:
    """The stream's gaps while the embeddings request is read, and the embedding tokens read meanwhile."""
    import httpx

    async with httpx.AsyncClient(timeout=3600) as raw:
        embeddings = asyncio.create_task(raw.post(f"{url}/embeddings", json={"model": "bench", "input": inputs}))
        before = embedding_tokens(url)
        while embedding_tokens(url) == before:  # the request is read (tokens checked) and running
            if embeddings.done():
                raise SystemExit(f"the embeddings request ended early: {embeddings.result().text[:300]}")
            await asyncio.sleep(0.2)
        client = openai_client(url)
        start = embedding_tokens(url)
        gaps = await stream_gaps(client, prompt, args.new_tokens)
        read = embedding_tokens(url) - start
        still = not embeddings.done()
        embeddings.cancel()  # closes the connection: the server drops the job
        await client.close()
    if not still:
        print("  (the embeddings request finished before the stream: the overlap is partial)", flush=True)
    while True:  # the server drops the job within a poll of the gone client: idle again before the next run
        seen = embedding_tokens(url)
        await asyncio.sleep(1.0)
        if embedding_tokens(url) == seen:
            return gaps, read


def line(label: str, gaps: list[float], load: tuple[float, float]) -> str:
    mean = sum(gaps) / len(gaps)
    return (f"| {label} | {len(gaps) + 1} | {1000 * percentile(gaps, 50):.1f} | {1000 * mean:.1f} | "
            f"{1000 * percentile(gaps, 99):.1f} | {load[0]:.1f} -> {load[1]:.1f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64, help="the stream's tokens")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="the stream's prompt")
    parser.add_argument("--inputs", type=int, default=2048, help="inputs of the embeddings request (and --max-inputs)")
    parser.add_argument("--max-request-tokens", type=int, default=300_000,
                        help="the server's limit, which the embeddings request fills")
    parser.add_argument("--embed-share", type=float, default=0.5)
    parser.add_argument("--embed-chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="idle / beside pairs, alternated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8632)
    parser.add_argument("--model", type=Path, help="a GGUF file or Hugging Face directory (default: SmolLM2)")
    args = parser.parse_args(argv)
    require("openai")  # the stream's client
    from aiayn.textgen import read_text_model

    model_path = smollm2(args.model)
    encode = read_text_model(model_path).encode
    per_input = args.max_request_tokens // args.inputs
    source = make_prompts(encode, 1, max(per_input, args.prompt_tokens) * 8)[0]
    inputs = [source[i % 8 * per_input:][:per_input] for i in range(args.inputs)]
    prompt = source[: args.prompt_tokens]
    header(f"A stream beside a maximal embeddings request: {model_path.name}, {args.inputs:,} inputs x "
           f"{per_input} tokens = {args.inputs * per_input:,} tokens, --embed-share {args.embed_share}, "
           f"--embed-chunk {args.embed_chunk}; the stream: {args.new_tokens} greedy tokens", args)
    url = f"http://127.0.0.1:{args.port}/v1"
    rows, idle_all, beside_all, read_all = [], [], [], 0.0
    with serving(serve_args(args, model_path), port=args.port):
        async def warm_up() -> None:
            client = openai_client(url)
            await stream_gaps(client, prompt, 4)
            await client.embeddings.create(model="bench", input=inputs[:2])
            await client.close()

        asyncio.run(warm_up())
        for _ in range(args.repeats):
            load = os.getloadavg()[0]
            idle = asyncio.run(stream_gaps(openai_client(url), prompt, args.new_tokens))
            rows.append(line("idle", idle, (load, os.getloadavg()[0])))
            print(rows[-1], flush=True)
            load = os.getloadavg()[0]
            beside, read = asyncio.run(beside_embeddings(url, prompt, inputs, args))
            rows.append(line(f"beside the embeddings ({read:,.0f} of their tokens read meanwhile)", beside,
                             (load, os.getloadavg()[0])))
            print(rows[-1], flush=True)
            idle_all += idle
            beside_all += beside
            read_all += read
    print("\n| stream | chunks | ITL p50 (ms) | mean (ms) | p99 (ms) | load average |\n|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    mean = sum(beside_all) / len(beside_all) / (sum(idle_all) / len(idle_all))
    p50 = percentile(beside_all, 50) / percentile(idle_all, 50)
    verdict = "met" if mean <= 2 else f"MISSED by {mean / 2:.2f}x"
    print(f"\n* beside / idle, all repeats: mean ITL **{mean:.2f}x** (goal <= 2x: {verdict}), p50 {p50:.2f}x, "
          f"p99 {percentile(beside_all, 99) / percentile(idle_all, 99):.2f}x; {read_all:,.0f} embedding tokens "
          f"read beside the streams")
    footer()


if __name__ == "__main__":
    main()
