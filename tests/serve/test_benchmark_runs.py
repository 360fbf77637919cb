"""benchmarks/serve.py still runs (the tiny model, tiny settings; its figures are not checked)."""

from __future__ import annotations

from serve_helpers import free_port

from benchmarks import serve


def test_the_serve_benchmark_runs(tiny_dir, capsys):
    serve.main(["--model", str(tiny_dir), "--port", str(free_port()), "--clients", "1", "2", "--sequential", "2",
                "--prompt-tokens", "8", "--new-tokens", "4", "--threads", "1", "--no-hf"])
    out = capsys.readouterr().out
    assert "| aiayn serve, one at a time | 1 | 2 | 8 |" in out
    assert "| aiayn serve, continuous batching | 2 | 2 | 8 |" in out
    assert "| aiayn serve, prompts served before | 2 | 2 | 8 |" in out
    assert "2 clients / one at a time:" in out and "TTFT p99 at 2 clients" in out


def test_the_serve_benchmark_passes_quantize_to_the_server(tiny_dir, capsys):
    """--quantize q4: the server subprocess gets the option (its command line and the header say so)."""
    serve.main(["--model", str(tiny_dir), "--port", str(free_port()), "--clients", "2", "--sequential", "1",
                "--prompt-tokens", "8", "--new-tokens", "4", "--threads", "1", "--no-hf", "--quantize", "q4"])
    out = capsys.readouterr().out
    assert "--quantize q4" in out.splitlines()[0]  # the header
    assert any(line.startswith("server: ") and line.endswith("--quantize q4") for line in out.splitlines())
    assert "| aiayn serve, continuous batching | 2 | 2 | 8 |" in out


def test_the_fairness_benchmark_runs(tiny_dir, capsys):
    """benchmarks/serve_fairness.py on the tiny model: both rows, the ratio line, the overlap counted."""
    from benchmarks import serve_fairness

    serve_fairness.main(["--model", str(tiny_dir), "--port", str(free_port()), "--inputs", "1000",
                         "--max-request-tokens", "20000", "--embed-chunk", "8", "--new-tokens", "8",
                         "--prompt-tokens", "8", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| idle | " in out and "| beside the embeddings (" in out
    assert "beside / idle, all repeats: mean ITL **" in out and "(goal <= 2x: " in out
    line = next(line for line in out.splitlines() if "embedding tokens read" in line)
    read = float(line.split("; ")[-1].split(" embedding tokens")[0].replace(",", ""))
    assert read > 0  # the embeddings ran beside the stream


def test_the_serve_benchmark_measures_each_kv_layout(tiny_dir, capsys):
    """--kv-layout paged slots: a server per layout (its command line says which), rows for each,
    each layout's ratio lines and paged / slots."""
    serve.main(["--model", str(tiny_dir), "--port", str(free_port()), "--clients", "2", "--sequential", "1",
                "--prompt-tokens", "8", "--new-tokens", "4", "--threads", "1", "--no-hf", "--kv-layout", "paged",
                "slots"])
    out = capsys.readouterr().out
    servers = [line for line in out.splitlines() if line.startswith("server: ")]
    assert len(servers) == 2 and "--kv-layout paged" in servers[0] and "--kv-layout slots" in servers[1]
    for layout in ("paged", "slots"):
        assert f"| aiayn serve ({layout}), continuous batching | 2 | 2 | 8 |" in out
        assert f"2 clients / one at a time ({layout}):" in out and f"TTFT p99 at 2 clients ({layout})" in out
    assert "* paged / slots at 2 clients: " in out


def test_each_serve_benchmark_run_has_prompts_the_server_has_not_seen():
    """The paged server keeps a prefix cache: a run reusing an earlier run's prompts would measure
    cache hits (its 16-client TTFT p99 read 0.81 s that way). Every set is disjoint from the others,
    no two prompts share a first block of 16 tokens, and the warm-up is no measured prompt's prefix."""
    pool = serve.make_prompts(lambda text: [ord(c) for c in text], 2 + 1 + 4 + 16 + 1, 64)
    warm_up, sequential, sets = serve.prompt_sets(pool, 2, [1, 4, 16])
    measured = [*sequential, *(p for n in (1, 4, 16) for p in sets[n])]
    assert [len(sets[n]) for n in (1, 4, 16)] == [1, 4, 16] and len(sequential) == 2
    assert len({tuple(p[:16]) for p in measured}) == len(measured) == 23
    assert all(p[:8] != warm_up[0] for p in measured)
