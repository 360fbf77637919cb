"""``aiayn explore``: through a subprocess, it serves on 127.0.0.1 and prints the URL, warns when
bound elsewhere; in this process (``run_aiayn``), it refuses bad options in one line (exit code 2)
before loading anything."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from aiayn.explore.server import free_port, is_loopback

REPO = Path(__file__).resolve().parents[2]


def test_usage_errors_are_one_line(tmp_path, char_run, run_aiayn):
    cases = [
        (["--run", str(char_run), "--model", "x.gguf"], "--run and --model name two models; give one"),
        (["--run", str(tmp_path / "none")], "is not a run directory"),
        (["--model", str(REPO / "README.md")], "is neither a GGUF file nor a Hugging Face model directory"),
        (["--run", str(char_run), "--port", "70000"], "70000 is not in the range 0<=x<=65535"),
    ]
    for args, needle in cases:
        code, _, err = run_aiayn("explore", *args, "--no-open")  # run_aiayn fails the test on a traceback
        assert code == 2, (args, err)
        assert needle in err
        assert len(err.strip().splitlines()) == 1


def test_a_taken_port_is_refused_before_the_model_loads(char_run, run_aiayn):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_aiayn("explore", "--run", str(char_run), "--port", str(port), "--no-open")
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err and "give another --port" in err


def read_until(process: subprocess.Popen, marker: str, seconds: float) -> str:
    """The process's output up to the line starting with ``marker`` (or all it printed within
    ``seconds``): read by a thread, so a silent process cannot hang the test."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(marker):
            break
    return "".join(seen)


def test_serves_prints_the_url_opens_the_browser_and_warns_off_loopback(char_run, tmp_path):
    """Bound to 0.0.0.0 it warns; it opens the browser at the URL once serving (Python's webbrowser
    runs $BROWSER: here a script that prints the URL it is given); the page and the API answer on
    127.0.0.1."""
    browser = tmp_path / "browser"
    browser.write_text('#!/bin/sh\necho "browser-opened:$1"\n')
    browser.chmod(0o755)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "BROWSER": str(browser)}
    process = subprocess.Popen([sys.executable, "-m", "aiayn", "explore", "--run", str(char_run), "--host", "0.0.0.0",
                                "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    try:
        output = read_until(process, "browser-opened:", 60)
        assert f"open http://127.0.0.1:{port}/" in output, output
        assert f"browser-opened:http://127.0.0.1:{port}/" in output, output
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
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.4", "::", "example.org"))
