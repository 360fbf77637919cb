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
    assert "2 clients / one at a time:" in out and "TTFT p99 at 2 clients" in out


def test_the_serve_benchmark_passes_quantize_to_the_server(tiny_dir, capsys):
    """--quantize q4: the server subprocess gets the option (its command line and the header say so)."""
    serve.main(["--model", str(tiny_dir), "--port", str(free_port()), "--clients", "2", "--sequential", "1",
                "--prompt-tokens", "8", "--new-tokens", "4", "--threads", "1", "--no-hf", "--quantize", "q4"])
    out = capsys.readouterr().out
    assert "--quantize q4" in out.splitlines()[0]  # the header
    assert any(line.startswith("server: ") and line.endswith("--quantize q4") for line in out.splitlines())
    assert "| aiayn serve, continuous batching | 2 | 2 | 8 |" in out
