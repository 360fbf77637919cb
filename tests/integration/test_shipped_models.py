"""The models shipped in aiayn/pretrained load and do their job: every shipped model is checked here
against a band on its validation split (a model added without an entry below fails the test).

The bands sit a little below what each shipped model measured (its release.json), so a model that
loads wrongly (a transposed weight, a wrong tokenizer, float16 damage) falls far outside them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.tasks.trained import load_release, shipped_models, shipped_path

# name -> (what is measured, the band it must reach)
EXPECTED = {
    # the whole val split (1,800 windows of 64): 1.7455 with the run's float32 weights and with the
    # shipped float16 ones alike
    "shakespeare-char": ("val NLL per character", 1.76),
    # greedy cased sacreBLEU of the first 200 val sentences: 42.55 for the shipped float16 ensemble (41.38 for
    # its first member alone, the model shipped before it)
    "multi30k-en-de": ("greedy val BLEU, 200 sentences", 40.0),
    "multi30k-de-en": ("greedy val BLEU, 200 sentences", 40.0),  # 41.62 shipped (seed 2; 42.89 for the seed-1 model shipped before it)
}


def test_every_shipped_model_is_checked() -> None:
    assert shipped_models(), "aiayn/pretrained ships no model"
    assert set(shipped_models()) == set(EXPECTED)


def test_shakespeare_char_reaches_its_val_loss() -> None:
    import torch

    run = load_release(shipped_path("shakespeare-char"), prepare=True)  # reads Tiny Shakespeare's val split
    with torch.no_grad():
        nll = run.task.evaluate(run.model, "val", batch_size=100)["nll"]
    assert nll <= EXPECTED["shakespeare-char"][1], nll


def test_generate_with_the_shipped_char_model(tmp_path: Path, run_aiayn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # from a folder that holds no run
    code, text, err = run_aiayn("generate", "--model", "shakespeare-char", "--prompt", "ROMEO:", "--max-new-tokens",
                                "40", "--seed", "1")
    assert code == 0, err
    assert text.startswith("ROMEO:") and len(text) >= 40
    words = [w for w in text.split() if w.isalpha() and w.islower()]
    assert len(words) >= 3  # English-looking words, not noise

    code, listed, _ = run_aiayn("models")
    assert code == 0 and "shakespeare-char" in listed


def test_plot_attention_of_a_shipped_model_writes_here_not_into_the_package(tmp_path: Path, run_aiayn,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    release = shipped_path("shakespeare-char")
    before = sorted(p.name for p in release.rglob("*"))
    monkeypatch.chdir(tmp_path)  # "here": the working folder of the command
    code, _, err = run_aiayn("plot", "attention", "--model", "shakespeare-char", "--input", "ROMEO:")
    assert code == 0, err
    assert (tmp_path / "attention.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in release.rglob("*")) == before
    for argv, needle in ((["--model", "no-such-model"], "neither a shipped model"),
                         ([], "give one of --run"),
                         (["--model", "shakespeare-char", "--run", str(tmp_path)], "name two models")):
        code, _, err = run_aiayn("plot", "attention", *argv)  # refused before writing anything; no traceback
        assert code == 2 and needle in err, err


# The translation models: greedy decoding of the first 200 validation sentences, cased sacreBLEU.
TRANSLATION_SENTENCES = 200


def _val_bleu(name: str) -> float:
    from aiayn.data.parallel import read_parallel, split_paths
    from aiayn.tasks.runs import load_translator
    from aiayn.tasks.translation import corpus_score
    from aiayn.translate import decode_options

    task, translator = load_translator(shipped_path(name))
    sources, references = read_parallel(*split_paths(task.root(), "val", task.src_lang, task.tgt_lang))
    sources, references = sources[:TRANSLATION_SENTENCES], references[:TRANSLATION_SENTENCES]
    hypotheses = translator.translate(sources, decode_options(task.decode, beam_size=1))
    return corpus_score(hypotheses, references)["bleu"]


@pytest.mark.parametrize("name", [name for name in EXPECTED if name.startswith("multi30k-")])
def test_translation_models_reach_their_val_bleu(name: str) -> None:
    bleu = _val_bleu(name)
    assert bleu >= EXPECTED[name][1], (name, bleu)


def test_translate_right_after_installation_needs_no_run(tmp_path: Path, run_aiayn,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`aiayn translate "..."` with no --run or --model: the shipped en->de model, from any folder
    (in this process; docs/translation.md's first console block runs the same commands as a shell
    does and compares their whole output)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_aiayn("translate", "A man is riding a bike.")
    assert code == 0, err
    german = out.strip().lower()
    assert german.startswith("ein mann") and "fahrrad" in german, german
    code, out, err = run_aiayn("translate", "--model", "multi30k-de-en", "Ein Mann fährt Fahrrad.")
    assert code == 0 and out.strip().lower().startswith("a man"), (out, err)
