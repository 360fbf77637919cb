"""``--device`` on every verb that runs a model for inference (generate, embed, translate, evaluate,
serve, explore), and the ``device`` keyword of the library loaders under them.

* ``--device cpu`` gives exactly what the default (``auto``: the CPU on a machine without a GPU)
  gives; the shipped tiny models keep each case to a few seconds.
* A device this machine lacks (``cuda`` without a GPU, ``cuda:7``, ``mps``) or a name that is no
  device (``banana``) is one line ``Error: ...`` on stderr, exit code 2, no traceback, nothing on
  stdout and no file written, before any model loads.
* The loaders put the model on the device given (the ``device`` fixture: ``AIAYN_TEST_DEVICES``,
  the CPU in CI) and its outputs come back to the CPU; int8 / q4 weights (aiayn.fast's CPU
  kernels) choose the CPU under ``auto`` and are refused, in one line, on another device.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.cli import main
from aiayn.device import model_device, resolve
from aiayn.generate import SamplingConfig
from aiayn.tasks.trained import shipped_path

PROMPT = "ROMEO:"
SENTENCES = ["A man is riding a bike.", "Two dogs play in the snow."]
REFERENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *(f"w{i}" for i in range(4, 40))]


def missing_devices() -> list[str]:
    """Device names this machine lacks: ``cuda`` (a GPU beyond the last where there are GPUs),
    ``cuda:7``-like, ``mps``, and a name that is no device."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cuda" if count == 0 else f"cuda:{count}", f"cuda:{max(7, count)}",
            "no-such-device" if torch.backends.mps.is_available() else "mps", "banana"]


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``aiayn ARGS`` run in this process."""
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return int(info.value.code or 0), out, err


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT in a plain Hugging Face directory with a word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    path = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=32, num_attention_heads=4,
                                     num_hidden_layers=2, intermediate_size=37, max_position_embeddings=64,
                                     pad_token_id=0)
    transformers.BertModel(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))
    return path


# ---- the command line: --device cpu is the default's output --------------------------------------
@pytest.mark.parametrize("sampling", [["--temperature", "0"], ["--temperature", "0.8", "--seed", "3"]],
                         ids=["greedy", "seeded"])
def test_generate_on_cpu_is_the_default(sampling, capsys):
    args = ["generate", "--model", "shakespeare-char", "--prompt", PROMPT, "--max-new-tokens", "24", *sampling]
    code, default, _ = run_main(args, capsys)
    assert code == 0
    code, on_cpu, err = run_main([*args, "--device", "cpu"], capsys)
    assert code == 0, err
    assert on_cpu == default and len(on_cpu) > len(PROMPT) + 10


def test_translate_on_cpu_is_the_default(capsys):
    code, default, _ = run_main(["translate", "--beam", "2", *SENTENCES], capsys)
    assert code == 0
    code, on_cpu, err = run_main(["translate", "--beam", "2", "--device", "cpu", *SENTENCES], capsys)
    assert code == 0, err
    assert on_cpu == default and len(on_cpu.splitlines()) == 2


def test_evaluate_on_cpu_is_the_default(tmp_path, capsys):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    ref.write_text("\n".join(REFERENCES) + "\n", encoding="utf-8")
    outputs = {}
    for name, extra in (("default", []), ("cpu", ["--device", "cpu"])):
        out = tmp_path / f"{name}.de"
        code, printed, err = run_main(["evaluate", "--src", str(src), "--ref", str(ref), "--beam", "2",
                                       "--out", str(out), *extra], capsys)
        assert code == 0, err
        # every line but the last (the timing) is a score, the same on both
        outputs[name] = (printed.splitlines()[:-1], out.read_text(encoding="utf-8"))
    assert outputs["cpu"] == outputs["default"]
    assert "BLEU" in outputs["cpu"][0][0]


def test_embed_on_cpu_is_the_default(bert_dir, capsys):
    args = ["embed", "--model", str(bert_dir), "w5 w6 w7", "w9"]
    code, default, _ = run_main(args, capsys)
    assert code == 0
    code, on_cpu, err = run_main([*args, "--device", "cpu"], capsys)
    assert code == 0, err
    assert on_cpu == default
    assert [json.loads(line)["text"] for line in on_cpu.splitlines()] == ["w5 w6 w7", "w9"]


def start(args: list[str], marker: str, seconds: float = 120.0) -> tuple[subprocess.Popen[str], str]:
    """``aiayn ARGS`` in a subprocess, read (stdout and stderr together) until ``marker``."""
    process = subprocess.Popen([sys.executable, "-m", "aiayn", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    seen, deadline = "", time.monotonic() + seconds
    while marker not in seen:
        line = process.stdout.readline()
        if not line or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"`aiayn {' '.join(args)}` stopped before {marker!r}:\n{seen}")
        seen += line
    return process, seen


def post(url: str, body: dict, seconds: float = 60.0) -> Any:
    """POST ``body`` to ``url`` once the server there accepts connections (it prints its address
    just before it binds)."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            return httpx.post(url, json=body, timeout=seconds)
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_serve_on_cpu_answers_as_the_default_engine():
    """The server started with --device cpu says where it runs and answers a greedy completion
    with what the engine over the default-loaded model gives (one thread each: the same sums)."""
    from aiayn.explore.server import free_port
    from aiayn.serve import Request, SamplingParams, build_state, load_served_model

    port = free_port()
    process, seen = start(["serve", "--model", "shakespeare-char", "--device", "cpu", "--port", str(port),
                           "--threads", "1", "--max-batch", "2", "--kv-budget", "64MiB"], "listening on")
    try:
        assert "on cpu" in seen, seen
        reply = post(f"http://127.0.0.1:{port}/v1/completions",
                     {"model": "shakespeare-char", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    finally:
        stop(process)
    assert reply.status_code == 200, reply.text
    served = load_served_model(shipped_path("shakespeare-char"))  # the default device
    assert model_device(served.lm.model) == resolve("auto")
    state, _ = build_state(served, max_batch=2, kv_budget=64 << 20, threads=1)
    events = []
    state.engine.start()
    try:
        greedy = SamplingParams(max_tokens=16, sampling=SamplingConfig(temperature=0))
        request = Request(served.lm.encode(PROMPT), greedy, events.append)
        state.engine.submit(request)
        deadline = time.monotonic() + 60
        while not (events and events[-1].finish_reason) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        state.engine.stop()
    assert "".join(e.text for e in events) == reply.json()["choices"][0]["text"]


def test_explore_on_cpu_decodes_as_the_default():
    from aiayn.explore import load_explorable
    from aiayn.explore.decoding import decode_steps
    from aiayn.explore.server import free_port

    port = free_port()
    process, _ = start(["explore", "--model", "shakespeare-char", "--device", "cpu", "--port", str(port),
                        "--no-open"], "open http")
    try:
        reply = post(f"http://127.0.0.1:{port}/api/generate", {"text": PROMPT, "steps": 12})
    finally:
        stop(process)
    assert reply.status_code == 200, reply.text
    expected = decode_steps(load_explorable(model_path=shipped_path("shakespeare-char")), PROMPT, steps=12)
    assert reply.json()["text"] == expected["text"] and len(expected["steps"]) == 12


# ---- the command line: a device this machine lacks is one usage line ----------------------------
def verb_args(verb: str, tmp_path: Path) -> list[str]:
    """Arguments that would run ``verb`` (its output file, if any, under ``tmp_path``)."""
    src = tmp_path / "src.en"
    src.write_text(SENTENCES[0] + "\n", encoding="utf-8")
    return {
        "generate": ["generate", "--model", "shakespeare-char", "--prompt", PROMPT, "--max-new-tokens", "4"],
        "embed": ["embed", "--model", str(tmp_path), "hello"],
        "translate": ["translate", SENTENCES[0]],
        "evaluate": ["evaluate", "--src", str(src), "--ref", str(src), "--out", str(tmp_path / "out.de")],
        "serve": ["serve", "--model", "shakespeare-char", "--port", "0"],
        "explore": ["explore", "--model", "shakespeare-char", "--port", "0", "--no-open"],
        "plot": ["plot", "attention", "--model", "multi30k-en-de", "--out", str(tmp_path / "out.de")],
    }[verb]


@pytest.mark.parametrize("name", missing_devices())
@pytest.mark.parametrize("verb", ["generate", "embed", "translate", "evaluate", "serve", "explore", "plot"])
def test_a_missing_device_is_one_usage_line(verb, name, tmp_path, capsys):
    code, out, err = run_main([*verb_args(verb, tmp_path), "--device", name], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "--device" in lines[0], err
    assert out == ""
    assert not (tmp_path / "out.de").exists()


def test_cpu_kernels_are_refused_on_another_device(monkeypatch, capsys):
    """int8 / q4 weights on an accelerator: one line naming --quantize (the device is pretended:
    this test runs without a GPU)."""
    import aiayn.cli.generate as generate_cli
    import aiayn.textgen as textgen

    monkeypatch.setattr(generate_cli, "resolve_device", lambda name: torch.device(name))
    monkeypatch.setattr(textgen, "resolve", lambda spec: torch.device(spec))
    for quantize in ("q4", "int8"):
        code, out, err = run_main(["generate", "--model", "shakespeare-char", "--prompt", PROMPT,
                                   "--device", "cuda:0", "--quantize", quantize], capsys)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: Invalid value for --quantize: "), err
        assert f"{quantize} weights run on aiayn.fast's CPU kernels only" in lines[0]


def test_placement_of_quantised_weights(monkeypatch):
    import aiayn.textgen as textgen
    from aiayn.textgen import placement

    cpu = torch.device("cpu")
    assert placement("cpu", "q4") == (cpu, "q4")
    assert placement(None, "int8") == (cpu, "int8") and placement("auto", "q4") == (cpu, "q4")
    assert placement(None, "auto") == (resolve("auto"), "auto" if resolve("auto").type == "cpu" else "none")
    monkeypatch.setattr(textgen, "resolve", lambda spec: torch.device(spec))  # pretend a GPU
    gpu = torch.device("cuda", 0)
    assert placement(gpu, "auto") == (gpu, "none")  # a GGUF file's blocks dequantised: floats
    assert placement(gpu, "bf16") == (gpu, "bf16")
    with pytest.raises(ValueError, match=r"q4 weights run on aiayn\.fast's CPU kernels only; on cuda:0"):
        placement(gpu, "q4")


# ---- the library: each loader puts the model on the device asked for -----------------------------
def test_load_text_model_and_stream_text(device):
    from aiayn.tasks.runs import load_text_model
    from aiayn.textgen import stream_text

    lm = load_text_model(model_path=shipped_path("shakespeare-char"), device=device)
    assert model_device(lm.model) == device
    ids = lm.prompt_ids(PROMPT)
    assert ids.device == device  # made where the model is
    pieces: list[str] = []
    stats = stream_text(lm, ids, on_text=pieces.append, max_new_tokens=8, sampling=SamplingConfig(temperature=0))
    assert stats.tokens == 8 and "".join(pieces)


def test_read_text_model_of_a_hf_directory(device, tmp_path):
    from aiayn.tasks.runs import load_text_model
    from aiayn.textgen import export_text_model, read_text_model

    exported = export_text_model(load_text_model(model_path=shipped_path("shakespeare-char"), plain=True,
                                                 device="cpu"), tmp_path / "hf")
    lm = read_text_model(exported, device=device)
    assert model_device(lm.model) == device
    assert model_device(read_text_model(exported).model) == resolve("auto")  # None: auto


def test_load_translator(device):
    from aiayn.tasks.runs import load_translator
    from aiayn.translate import DecodeOptions

    _, translator = load_translator(shipped_path("multi30k-en-de"), device=device)
    assert model_device(translator.model) == device
    out = translator.translate(SENTENCES[:1], DecodeOptions(beam_size=2))
    assert len(out) == 1 and out[0].strip()


def test_load_sentence_encoder(device, bert_dir):
    from aiayn.embed import load_sentence_encoder

    encoder = load_sentence_encoder(bert_dir, device=device)
    assert model_device(encoder.model) == device
    vectors = encoder.encode(["w5 w6", "w7"])
    assert vectors.device.type == "cpu" and vectors.shape == (2, 32)  # back on the CPU


def test_load_served_model_and_decoder_embeddings(device, bert_dir):
    from aiayn.serve import load_served_model
    from aiayn.serve.embedding import EmbeddingJob

    served = load_served_model(shipped_path("shakespeare-char"), device=device)
    assert model_device(served.lm.model) == device
    vectors = EmbeddingJob(served.lm, [served.lm.encode("To be")]).run()
    assert vectors.device.type == "cpu" and vectors.shape[0] == 1
    encoder = load_served_model(bert_dir, device=device).encoder
    assert encoder is not None and model_device(encoder.model) == device


@pytest.mark.parametrize("name", ["shakespeare-char", "multi30k-en-de"])
def test_load_explorable_and_its_views(device, name):
    from aiayn.explore import load_explorable
    from aiayn.explore.decoding import decode_steps
    from aiayn.explore.positions import model_positions
    from aiayn.explore.probes import compute_attention
    from aiayn.explore.search_tree import beam_tree

    ex = load_explorable(model_path=shipped_path(name), device=device)
    assert ex.device == device
    text = "ROMEO:" if name == "shakespeare-char" else SENTENCES[0]
    assert len(decode_steps(ex, text, steps=3)["steps"]) == 3
    probe = compute_attention(ex, text)
    assert all(w.device.type == "cpu" for stack in probe.stacks.values() for w in stack.layers)
    assert beam_tree(ex, text, beam=2, steps=3)["nbest"]
    assert model_positions(ex)["scheme"] in ("learned", "sinusoidal")
