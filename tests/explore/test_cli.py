"""``aiayn explore`` through a subprocess: it serves on 127.0.0.1 and prints the URL, warns when
bound elsewhere, and refuses bad options in one line (exit code 2) before loading anything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from aiayn.explore.server import free_port, is_loopback

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "aiayn", "explore", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_usage_errors_are_one_line(tmp_path, char_run):
    cases = [
        (["--run", str(char_run), "--model", "x.gguf"], "--run and --model name two models; give one"),
        (["--run", str(tmp_path / "none")], "is not a run directory"),
        (["--model", str(REPO / "README.md")], "is neither a GGUF file nor a Hugging Face model directory"),
        (["--run", str(char_run), "--port", "70000"], "70000 is not in the range 0<=x<=65535"),
    ]
    for args, needle in cases:
        result = run_cli(*args, "--no-open")
        assert result.returncode == 2, (args, result.stderr)
        assert needle in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_taken_port_is_refused_before_the_model_loads(char_run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--run", str(char_run), "--port", str(port), "--no-open")
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "give another --port" in result.stderr


def test_serves_prints_the_url_and_warns_off_loopback(char_run):
    """Bound to 0.0.0.0 it warns; the page and the API answer on 127.0.0.1."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "aiayn", "explore", "--run", str(char_run), "--host", "0.0.0.0",
                                "--port", str(port), "--no-open"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("open http"):
                break
        output = "".join(lines)
        assert f"open http://0.0.0.0:{port}/" in output, output
        assert "Warning: listening on 0.0.0.0, not 127.0.0.1" in output
        with httpx.Client(timeout=10) as http:
            for _ in range(100):  # uvicorn binds just after the line is printed
                try:
                    model = http.get(f"http://127.0.0.1:{port}/api/model").json()
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert model["kind"] == "decoder" and model["context"] == 64
            assert "aiayn explore" in http.get(f"http://127.0.0.1:{port}/").text
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=20)


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.4", "::", "example.org"))
