"""Translation end to end on a small corpus: BPE, bucketed training, greedy/beam decoding, BLEU,
checkpoint averaging and the translate / evaluate / average commands with their errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.config import TrainConfig
from aiayn.data import data_dir
from aiayn.data.parallel import read_lines
from aiayn.tasks import get_task
from aiayn.tasks.runs import load_run
from aiayn.tasks.translation import corpus_score
from aiayn.train.trainer import train
from aiayn.translate import DecodeOptions

MULTI30K = data_dir() / "multi30k"
pytestmark = pytest.mark.skipif(not (MULTI30K / "train.en").is_file(),
                                reason="Multi30k not found (set AIAYN_DATA_DIR)")
N_PAIRS = 200


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 200 Multi30k training pairs as train, val and test (the task is to memorise them)."""
    root = tmp_path_factory.mktemp("corpus")
    for lang in ("en", "de"):
        lines = read_lines(MULTI30K / f"train.{lang}")[:N_PAIRS]
        for split in ("train", "val", "test"):
            (root / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tiny_run(corpus, tmp_path_factory) -> Path:
    """A small en->de model trained for about a minute (2 cores) on the 200 pairs, padding-free
    (ModelConfig.padding_free: packed token-wise layers and loss), which must learn as well."""
    task = get_task("translation", corpus_dir=str(corpus), test_split="test", vocab_size=1000,
                    max_tokens=1024, beam_size=4, val_bleu=False)
    model_config = task.model_config().replace(d_model=128, n_heads=4, n_layers=2, n_decoder_layers=2,
                                               d_ff=256, dropout=0.0, attention_dropout=0.0,
                                               activation_dropout=0.0, padding_free=True)
    train_config = TrainConfig(**{**task.train_overrides(), "epochs": 40, "schedule": "cosine",
                                  "lr": 2e-3, "warmup_steps": 50, "label_smoothing": 0.0,
                                  "keep_checkpoints": 3, "save_every": 0,
                                  "clip_grad_norm": None, "average_last": 0})
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    train(task, model_config, train_config, run_dir, progress=False, make_plots=False)
    return run_dir


@pytest.mark.slow
def test_tiny_model_reproduces_its_200_training_pairs(tiny_run):
    summary = json.loads((tiny_run / "summary.json").read_text(encoding="utf-8"))
    assert summary["test"]["bleu"] >= 90, summary  # beam search on the memorised pairs
    score = json.loads((tiny_run / "score.test.json").read_text(encoding="utf-8"))
    assert score["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    hypotheses = (tiny_run / "hypotheses.test.de").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == N_PAIRS


@pytest.mark.slow
def test_greedy_and_beam_both_reproduce_and_tokenizer_is_saved(tiny_run, corpus):
    assert (tiny_run / "tokenizer.json").is_file()
    run = load_run(tiny_run, prepare=False)
    translator = run.task.translator(run.model)
    sources = read_lines(corpus / "test.en")[:50]
    references = read_lines(corpus / "test.de")[:50]
    greedy = translator.translate(sources, DecodeOptions(beam_size=1))
    beam = translator.translate(sources, DecodeOptions(beam_size=5))
    assert corpus_score(greedy, references)["bleu"] >= 90
    assert corpus_score(beam, references)["bleu"] >= 90
    assert translator.translate(["", "   "]) == ["", ""]  # empty input, empty output


@pytest.mark.slow
def test_cli_translate_compiled_gives_the_eager_translations(tiny_run, corpus, run_aiayn, run_aiayn_process):
    """``--compile``: the beam search's steps through the compiled decode step, the same output
    (compiled in a child process of its own: torch.compile's caches stay out of this one)."""
    sources = read_lines(corpus / "test.en")[:2]
    code, eager, _ = run_aiayn("translate", "--run", str(tiny_run), "--beam", "3", *sources)
    compiled = run_aiayn_process("translate", "--run", str(tiny_run), "--beam", "3", "--compile", *sources)
    assert code == compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == eager and len(compiled.stdout.splitlines()) == 2


@pytest.mark.slow
def test_cli_translate_evaluate_average(tiny_run, corpus, tmp_path, run_aiayn, run_aiayn_process):
    """The commands in this process, but for stdin and one evaluate: real child processes."""
    sources = read_lines(corpus / "test.en")
    references = read_lines(corpus / "test.de")
    code, out, err = run_aiayn("translate", "--run", str(tiny_run), "--beam", "3", sources[0], sources[1])
    assert code == 0, err
    assert out.splitlines() == references[:2]
    streamed = run_aiayn_process("translate", "--run", str(tiny_run), "--beam", "1",
                                 stdin="\n".join(sources[2:5]) + "\n")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.splitlines() == references[2:5]

    code, _, err = run_aiayn("average", "--run", str(tiny_run), "--last", "2")
    assert code == 0, err
    assert (tiny_run / "averaged-last2").is_dir()
    hypotheses = tmp_path / "hyp.de"
    scored = run_aiayn_process("evaluate", "--run", str(tiny_run), "--checkpoint", str(tiny_run / "averaged-last2"),
                               "--src", str(corpus / "test.en"), "--ref", str(corpus / "test.de"), "--beam", "2",
                               "--out", str(hypotheses))
    assert scored.returncode == 0, scored.stderr
    assert "BLEU = " in scored.stdout and "nrefs:1|case:mixed" in scored.stdout and "chrF2 = " in scored.stdout
    bleu = float(scored.stdout.split("BLEU = ")[1].split()[0])
    assert bleu >= 90
    assert len(hypotheses.read_text(encoding="utf-8").splitlines()) == N_PAIRS
    assert "beam 2, length penalty 0.6" in scored.stdout

    # without --beam / --length-penalty the run's recipe values are used (tiny_run: beam_size=4)
    code, out, err = run_aiayn("evaluate", "--run", str(tiny_run), "--src", str(corpus / "test.en"),
                               "--ref", str(corpus / "test.de"))
    assert code == 0, err
    assert "beam 4, length penalty 0.6" in out


@pytest.mark.slow
def test_cli_translate_truncates_a_too_long_sentence_with_a_warning(tiny_run, run_aiayn_process):
    """In a child process: the warning as a user sees it (pytest records warnings in this one)."""
    long_sentence = " ".join(["A man in a blue shirt is standing on a ladder."] * 30)
    result = run_aiayn_process("translate", "--run", str(tiny_run), "--beam", "1", long_sentence)
    assert result.returncode == 0, result.stderr
    assert "warning: source of" in result.stderr and "longer than the model's maximum" in result.stderr


def test_cli_bad_input(tmp_path, corpus, run_aiayn):
    (tmp_path / "a.en").write_text("one\ntwo\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eins\n", encoding="utf-8")
    (tmp_path / "bad.de").write_bytes(b"eins\nzw\xe4i\n")
    cases = [
        (["translate", "--run", str(tmp_path / "nope"), "hello"], "does not exist"),
        (["evaluate", "--run", str(tmp_path / "nope"), "--src", str(tmp_path / "a.en"), "--ref",
          str(tmp_path / "a.de")], "a.en has 2 lines but"),
        (["evaluate", "--run", str(tmp_path / "nope"), "--src", str(tmp_path / "a.en"), "--ref",
          str(tmp_path / "bad.de")], "bad.de, line 2: not UTF-8"),
        (["translate", "--run", str(tmp_path), "hello"], "is not a run directory"),
        (["translate", "--run", str(tmp_path), "--beam", "0", "hello"], "Invalid value for '--beam'"),
        (["average", "--run", str(tmp_path)], "holds no checkpoints"),
        (["train", "--recipe", str(tmp_path / "missing.yaml")], "missing.yaml not found"),
        (["train", "--recipe", str(tmp_path / "a.en")], "a recipe is a mapping"),
        (["train", "--task", "reverse", "--max-tokens", "100"], "--max-tokens is for token-count batching"),
    ]
    typo = tmp_path / "typo.yaml"
    typo.write_text("task: translation\ntask_options:\n  vocab_sise: 100\n", encoding="utf-8")
    cases.append((["train", "--recipe", str(typo)], "has no option vocab_sise (did you mean vocab_size?)"))
    for args, needle in cases:
        code, out, err = run_aiayn(*args)  # run_aiayn fails the test on a traceback
        assert code == 2, (args, out, err)
        assert needle in err, (args, err)


def test_training_data_errors_are_one_line(tmp_path, corpus, run_aiayn):
    bad = tmp_path / "corpus"
    bad.mkdir()
    for name in ("train", "val", "test"):
        for lang in ("en", "de"):
            (bad / f"{name}.{lang}").write_text((corpus / f"{name}.{lang}").read_text(encoding="utf-8"),
                                                encoding="utf-8")
    (bad / "val.de").write_text("nur eine Zeile\n", encoding="utf-8")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"task: translation\ntask_options:\n  corpus_dir: {bad}\n  test_split: test\n"
                      f"train:\n  epochs: 1\n", encoding="utf-8")
    code, out, err = run_aiayn("train", "--recipe", str(recipe), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert code == 2, out + err
    assert "val.en has 200 lines but" in err


@pytest.mark.parametrize("name", ["multi30k-en-de", "multi30k-de-en"])
def test_committed_recipes_build_valid_configs(name):
    """The recipes the README runs parse into a task, a model config and a training config."""
    import yaml

    from aiayn.config import ModelConfig

    recipe = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / f"{name}.yaml").read_text())
    task = get_task(recipe["task"], **recipe["task_options"])
    model = ModelConfig.from_dict({**task.model_config().to_dict(), **recipe["model"]})
    trainer = TrainConfig.from_dict({**TrainConfig().to_dict(), **task.train_overrides(), **recipe["train"]})
    src, tgt = name.removeprefix("multi30k-").split("-")
    assert (task.src_lang, task.tgt_lang) == (src, tgt)
    assert model.share_embeddings and model.tie_output and model.arch == "encoder-decoder"
    assert trainer.label_smoothing == 0.1


def test_stdin_that_is_not_utf8_is_named_by_line_and_byte(tiny_run):
    """translate streams stdin line by line: a line of odd bytes stops it with the line and byte."""
    result = subprocess.run([sys.executable, "-m", "aiayn", "translate", "--run", str(tiny_run), "--beam", "1"],
                            capture_output=True, input=b"a dog\na d\xe4g\n", timeout=300)
    assert result.returncode == 2 and b"Traceback" not in result.stderr, result.stderr
    assert b"standard input, line 2: not UTF-8 (byte 0xe4 at column 4)" in result.stderr
    assert len(result.stdout.decode().splitlines()) == 1  # the first line was translated before it


def test_lower_cased_bleu_ignores_case_only():
    hyps = ["Ein Mann fährt Fahrrad .", "zwei hunde spielen im schnee ."]
    refs = ["Ein Mann fährt Fahrrad .", "Zwei Hunde spielen im Schnee ."]
    score = corpus_score(hyps, refs)
    assert score["bleu_lc"] == pytest.approx(100.0) and score["bleu"] < 90
    assert "case:lc" in score["bleu_lc_signature"] and "tok:13a" in score["bleu_lc_signature"]
