"""aiayn explore's responsiveness: how long the page waits for what it asks the server.

The model loaded as ``aiayn explore`` loads it, then through the application in process (no
network): ``--tokens`` tokens to ``/api/attention``, one layer of it, ``--steps`` decode steps, and
a translation model's beam tree. No peer: the figures say whether the page stays responsive.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import footer, header, median_seconds, smollm2, table


def main(argv: list[str] | None = None) -> None:
    import torch
    from fastapi.testclient import TestClient

    from aiayn.explore import create_app, load_explorable

    parser = argparse.ArgumentParser(prog="python -m benchmarks.explore", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF file or Hugging Face directory (default: SmolLM2)")
    parser.add_argument("--run", type=Path, help="a run directory instead")
    parser.add_argument("--tokens", type=int, default=255)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    ex = load_explorable(run_dir=args.run) if args.run else load_explorable(model_path=smollm2(args.model))
    load = time.perf_counter() - start
    api = TestClient(create_app(ex))
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * (args.tokens // 4 + 2)).split()
    text = " ".join(words[:1])
    for word in words[1:]:  # the longest prefix of whole words within --tokens tokens
        if len(ex.encode(f"{text} {word}")) > min(args.tokens, ex.limit):
            break
        text = f"{text} {word}"
    n_tokens = len(ex.encode(text))
    stack = {"translation": "cross", "task": "task"}.get(ex.kind, "self")
    forward, probe = median_seconds(lambda: api.post("/api/attention", json={"text": text}).json(), args.repeats)
    layers = probe["stacks"][-1]["layers"]
    one, response = median_seconds(lambda: api.get(f"/api/attention/{probe['key']}/{stack}/{layers - 1}"),
                                    args.repeats)
    rows = [("load the model", load, ""), (f"attention of {n_tokens} tokens, all {layers} layers", forward, ""),
            ("one layer for the page", one, f"{len(response.content) / 1e6:.2f} MB")]
    if ex.kind in ("decoder", "translation"):
        decode, data = median_seconds(lambda: api.post("/api/generate", json={
            "text": " ".join(words[:6]), "steps": args.steps}).json(), args.repeats)
        rows.append((f"{len(data['steps'])} decode steps with their figures", decode, ""))
    if ex.kind == "translation":
        beam, tree = median_seconds(lambda: api.post("/api/beam", json={"text": " ".join(words[:8]), "beam": 4}).json(),
                                     args.repeats)
        rows.append((f"beam 4 tree ({len(tree['nodes'])} nodes)", beam, ""))
    header(f"aiayn explore: {ex.name} ({ex.kind}), the median of {args.repeats} calls", args)
    print(table(["request", "seconds", "size"], [[what, f"{seconds:.3f}", size] for what, seconds, size in rows]))
    footer()


if __name__ == "__main__":
    main()
