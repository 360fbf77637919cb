"""``aiayn serve`` as a user runs it: a subprocess that says what it serves and how many requests
its KV-cache budget allows, shuts down gracefully on SIGTERM (a running request that finishes
within the grace period finishes; one that does not is told, then ``[DONE]``; the process ends),
and refuses bad settings with one line and exit code 2."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import free_port, tiny_text_model

from aiayn.cli import main
from aiayn.textgen import export_text_model

ROOT = Path(__file__).resolve().parents[2]


def read_stream(url: str, body: dict, out: list, started: threading.Event) -> None:
    """Collect the data lines of a streamed chat answer into ``out``; set ``started`` at the first token."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                out.append(line[5:].strip())
                if len(out) >= 2:
                    started.set()


def test_sigterm_lets_short_requests_finish_and_tells_long_ones(tmp_path):
    model = export_text_model(tiny_text_model(context=8192), tmp_path / "tiny-long")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", "--model", str(model), "--port", str(port),
                             "--max-batch", "2", "--context", "8192", "--shutdown-grace", "3", "--threads", "1"],
                            env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the server exited before it answered: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "the server did not answer /health within 60 s"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        messages = [{"role": "user", "content": "hello"}]
        long, short = [], []
        long_started, short_started = threading.Event(), threading.Event()
        readers = [threading.Thread(target=read_stream, args=(url, {"model": "tiny-long", "messages": messages,
                                                                     "max_tokens": 8000, "stream": True, "temperature": 0}, long,
                                                               long_started)),
                   threading.Thread(target=read_stream, args=(url, {"model": "tiny-long", "messages": messages,
                                                                     "max_tokens": 40, "stream": True, "temperature": 0}, short,
                                                               short_started))]
        readers[0].start()
        assert long_started.wait(30)
        readers[1].start()
        assert short_started.wait(30)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        for reader in readers:
            reader.join(30)
        assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
        assert long[-1] == "[DONE]" and json.loads(long[-2]).get("error", {}).get("code") == "shutting_down", (len(long), long[-3:])
        assert 3 <= time.monotonic() - sent < 20
        # uvicorn re-raises the signal once shut down, so the exit status says "stopped by SIGTERM"
        assert proc.wait(15) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = proc.stderr.read()
    assert "KV cache (paged): 1024 blocks x 16 tokens (float32)" in log and "up to 2 concurrent requests" in log
    assert "Traceback" not in log and "Finished server process" in log


@pytest.mark.parametrize(("args", "needle"), [
    (["--kv-budget", "lots"], "'lots' is not a size"),
    (["--kv-budget", "1KiB"], "more than the budget of 1 KiB"),
    (["--context", "5000"], "more than the model's 256"),
    (["--run", "somewhere"], "--run and --model name two models"),
    (["--shutdown-grace", "nan"], "not a finite number"),
])
def test_bad_settings_are_refused_with_one_line(tiny_dir, capsys, args, needle):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tiny_dir), "--port", str(free_port()), *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and err.count("\n") == 1, err


def test_a_port_in_use_is_named(tiny_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as info:
            main(["serve", "--model", str(tiny_dir), "--port", str(taken.getsockname()[1])])
    assert info.value.code == 1 and "choose another --port" in capsys.readouterr().err


def test_listening_beyond_loopback_without_a_key_is_warned():
    from aiayn.serve.server import exposure_warning

    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None and exposure_warning("0.0.0.0", "key") is None
    assert "without --api-key" in exposure_warning("0.0.0.0", None)
    assert "without --api-key" in exposure_warning("example.org", None)
