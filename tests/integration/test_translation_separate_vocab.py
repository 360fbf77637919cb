"""Translation with separate source and target vocabularies (task option ``vocabulary: separate``)
end to end, on a run trained here (40 Multi30k pairs, 60 steps: far enough to copy part of its
training set and not all of it, so that equal outputs mean something; the whole file took 20 s of
CPU time on one thread, 52 s wall on a machine at load 10):

* the run keeps tokenizer.src.json and tokenizer.tgt.json (no tokenizer.json), each exactly the BPE
  of its own side of train (a BPE learned here on that side alone is the same), with the model's
  embeddings apart: source 200 rows, target 260, the output layer tied to the target's;
* ``aiayn evaluate`` gives the run's own test hypotheses (beam, written by training) byte for byte
  and its own greedy val BLEU; ``aiayn translate`` gives evaluate's greedy translations;
* ``aiayn train --resume`` from the checkpoint before the last ends on the run's final weights, bit for
  bit, with the tokenizers read back (not learned again);
* an ensemble of the run with itself, and of its two checkpoints, works, and the run twice
  translates as the run alone; a second separate run with the same corpus and sizes (so the
  same tokenizers) makes an ensemble with it; a joint run, or a separate run with another target
  size, is refused in one line;
* a shipped-model release of the run holds both tokenizer files and translates as the run's
  weights rounded to float16 do;
* the explorer, and the attention example of `aiayn plot attention`, label source tokens with the
  source vocabulary and target tokens with the target's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn.config import TrainConfig
from aiayn.data import data_dir
from aiayn.data.parallel import read_lines
from aiayn.tasks import get_task
from aiayn.tasks.runs import load_run
from aiayn.tokenizers import BPETokenizer
from aiayn.train.trainer import train
from aiayn.translate import DecodeOptions, Translator

MULTI30K = data_dir() / "multi30k"
pytestmark = pytest.mark.skipif(not (MULTI30K / "train.en").is_file(),
                                reason="Multi30k not found (set AIAYN_DATA_DIR)")
N_PAIRS, SRC_VOCAB, TGT_VOCAB = 40, 200, 260
STEPS, MIDDLE = 60, 50  # the run's steps, and its checkpoint before the last (the two it keeps)


def train_run(run_dir: Path, corpus: Path, *, steps: int, d_model: int = 64, seed: int = 0,
              val_bleu: bool = True, **task_options: object) -> Path:
    """A translation run on ``corpus`` (beam 2 on test; its last two checkpoints, STEPS - MIDDLE
    steps apart, kept). The runs beside the main one skip val BLEU: they only need to exist."""
    options = dict(vocabulary="separate", vocab_size=SRC_VOCAB, tgt_vocab_size=TGT_VOCAB) | task_options
    task = get_task("translation", corpus_dir=str(corpus), test_split="test", max_tokens=1024, max_len=48,
                    beam_size=2, val_bleu=val_bleu, **options)
    model_config = task.model_config().replace(d_model=d_model, n_heads=4, n_layers=2, n_decoder_layers=2,
                                               d_ff=2 * d_model, dropout=0.0, attention_dropout=0.0,
                                               activation_dropout=0.0)
    train_config = TrainConfig(**{**task.train_overrides(), "max_steps": steps, "schedule": "constant",
                                  "lr": 3e-3, "warmup_steps": min(10, steps), "save_every": min(steps, STEPS - MIDDLE),
                                  "keep_checkpoints": 2, "average_last": 0, "eval_every": steps,
                                  "label_smoothing": 0.0, "clip_grad_norm": None, "seed": seed})
    train(task, model_config, train_config, run_dir, progress=False, make_plots=False, echo=lambda _: None)
    return run_dir


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 40 Multi30k training pairs as train; its first 10 as val, first 6 as test."""
    root = tmp_path_factory.mktemp("separate-corpus")
    for lang in ("en", "de"):
        lines = read_lines(MULTI30K / f"train.{lang}")[:N_PAIRS]
        for split, chosen in (("train", lines), ("val", lines[:10]), ("test", lines[:6])):
            (root / f"{split}.{lang}").write_text("\n".join(chosen) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_run(tmp_path_factory.mktemp("separate") / "run", corpus, steps=STEPS)


def test_each_side_has_its_own_bpe_and_embedding(run: Path, corpus: Path) -> None:
    assert (run / "tokenizer.src.json").is_file() and (run / "tokenizer.tgt.json").is_file()
    assert not (run / "tokenizer.json").exists()
    source, target = (BPETokenizer.load(run / f"tokenizer.{side}.json") for side in ("src", "tgt"))
    assert (source.vocab_size, target.vocab_size) == (SRC_VOCAB, TGT_VOCAB)
    # Each is the BPE of its own side of train and of nothing else: learned again here, the same.
    for tokenizer, lang, size in ((source, "en", SRC_VOCAB), (target, "de", TGT_VOCAB)):
        alone = BPETokenizer.train(read_lines(corpus / f"train.{lang}"), vocab_size=size)
        assert tokenizer.tokenizer.to_str() == alone.tokenizer.to_str(), lang
    # German letters are the target's only; English words the source's, German words the target's.
    source_types, target_types = set(source.tokenizer.get_vocab()), set(target.tokenizer.get_vocab())
    assert {"ä", "ü"} <= target_types and not {"ä", "ü"} & source_types
    assert {"▁the", "▁and"} <= source_types and not {"▁the", "▁and"} & target_types
    assert {"▁ein", "▁und"} <= target_types and not {"▁ein", "▁und"} & source_types

    loaded = load_run(run, prepare=False)
    config, model = loaded.model_config, loaded.model
    assert (config.vocab_size, config.tgt_vocab_size, config.share_embeddings) == (SRC_VOCAB, TGT_VOCAB, False)
    source_embedding, target_embedding = model.encoder.embedding.weight, model.decoder.embedding.weight
    assert source_embedding.shape == (SRC_VOCAB, 64) and target_embedding.shape == (TGT_VOCAB, 64)
    assert model.lm_head.weight is target_embedding  # tie_output: the target's embedding


def test_evaluate_and_translate_give_the_runs_own_decoding(run: Path, corpus: Path, tmp_path: Path,
                                                           run_aiayn) -> None:
    # Test: the run's beam-2 hypotheses, written by training, byte for byte (beam 2 is its recipe's).
    code, out, err = run_aiayn("evaluate", "--run", str(run), "--src", str(corpus / "test.en"),
                               "--ref", str(corpus / "test.de"), "--out", str(tmp_path / "test.de"))
    assert code == 0 and "beam 2" in out, err
    written = (run / "hypotheses.test.de").read_text(encoding="utf-8")
    assert (tmp_path / "test.de").read_text(encoding="utf-8") == written
    references = read_lines(corpus / "test.de")
    hypotheses = written.splitlines()
    # it learned part of its training set, not all of it: equal outputs are not empty or copied ones
    assert 0 < sum(h == r for h, r in zip(hypotheses, references, strict=True)) < len(references)

    # Val: the greedy BLEU the run logged at its last step (its last checkpoint) is evaluate --beam 1's.
    rows = (run / "metrics.csv").read_text(encoding="utf-8").splitlines()
    header, last = rows[0].split(","), rows[-1].split(",")
    logged = float(last[header.index("val_bleu")])
    code, out, err = run_aiayn("evaluate", "--run", str(run), "--beam", "1", "--src", str(corpus / "val.en"),
                               "--ref", str(corpus / "val.de"), "--out", str(tmp_path / "val.de"))
    assert code == 0, err
    assert float(f"{float(out.split('BLEU = ')[1].split()[0]):.6g}") == pytest.approx(logged, abs=0.005)
    assert logged > 10

    greedy = (tmp_path / "val.de").read_text(encoding="utf-8").splitlines()
    code, out, err = run_aiayn("translate", "--run", str(run), "--beam", "1", *read_lines(corpus / "val.en"))
    assert code == 0, err
    assert out.splitlines() == greedy


def test_resume_reads_the_tokenizers_back_and_ends_on_the_same_weights(run: Path, tmp_path: Path,
                                                                      run_aiayn) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / f"step-{STEPS:08d}")  # back to the checkpoint before the last
    stamps = {name: (copy / name).stat().st_mtime_ns for name in ("tokenizer.src.json", "tokenizer.tgt.json")}
    code, out, err = run_aiayn("train", "--run-dir", str(copy), "--resume", "--no-progress")
    assert code == 0 and f"from step-{MIDDLE:08d} (step {MIDDLE}," in out, out + err
    assert {name: (copy / name).stat().st_mtime_ns for name in stamps} == stamps  # read, not learned again
    straight, resumed = (load_file(r / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors")
                         for r in (run, copy))
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def test_ensembles_of_separate_runs(run: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory,
                                    run_aiayn, capsys: pytest.CaptureFixture[str]) -> None:
    sentences = read_lines(corpus / "val.en")[:4]
    code, alone, err = run_aiayn("translate", "--run", str(run), *sentences)
    assert code == 0, err
    code, twice, err = run_aiayn("translate", "--run", str(run), "--run", str(run), *sentences)
    assert code == 0 and twice == alone, err  # an ensemble of one model is the model
    middle = run / "checkpoints" / f"step-{MIDDLE:08d}"
    code, out, err = run_aiayn("translate", "--run", str(run), "--checkpoint", str(middle), "--checkpoint",
                               str(run / "checkpoints" / f"step-{STEPS:08d}"), *sentences)
    assert code == 0 and len(out.splitlines()) == len(sentences), err

    root = tmp_path_factory.mktemp("others")
    # The same corpus and sizes learn the same two BPEs: another seed and width make an ensemble with it.
    sibling = train_run(root / "sibling", corpus, steps=1, d_model=32, seed=1, val_bleu=False)
    capsys.readouterr()  # what training wrote (its validation lines), before the command's output
    code, out, err = run_aiayn("translate", "--run", str(run), "--run", str(sibling), *sentences)
    assert code == 0 and len(out.splitlines()) == len(sentences) and out != alone, err

    joint = train_run(root / "joint", corpus, steps=1, val_bleu=False, vocabulary="joint", tgt_vocab_size=None)
    assert (joint / "tokenizer.json").is_file() and not (joint / "tokenizer.src.json").exists()
    other_target = train_run(root / "other-target", corpus, steps=1, val_bleu=False, tgt_vocab_size=TGT_VOCAB - 20)
    capsys.readouterr()  # what training wrote (its validation lines), before the commands' output
    for members, message in (
            ((run, joint), f"{run} has separate source and target vocabularies but {joint} one joint "
                           f"vocabulary; an ensemble's members share their vocabularies"),
            ((joint, run), f"{joint} has one joint vocabulary but {run} separate source and target"),
            ((run, other_target), f"{other_target} has another target vocabulary than {run} (their "
                                  f"tokenizer.tgt.json files differ)")):
        code, out, err = run_aiayn("translate", *(f"--run={m}" for m in members), "A man.")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_release_keeps_both_tokenizers_and_translates_as_its_float16_weights(run: Path, corpus: Path,
                                                                             tmp_path: Path, run_aiayn) -> None:
    from aiayn.tasks.shipped import write_release

    release = write_release(run, tmp_path / "release", dtype="float16")
    for name in ("tokenizer.src.json", "tokenizer.tgt.json"):
        assert (release / name).read_bytes() == (run / name).read_bytes()
    assert not (release / "tokenizer.json").exists()
    loaded = load_run(run, prepare=False)
    with torch.no_grad():  # what the release holds: the weights rounded to float16
        for parameter in loaded.model.parameters():
            parameter.copy_(parameter.half().float())
    source, target = loaded.task.load_tokenizers()
    sentences = read_lines(corpus / "val.en")[:5]
    expected = Translator(loaded.model, source, target_tokenizer=target).translate(sentences, DecodeOptions(beam_size=1))
    code, out, err = run_aiayn("translate", "--model", str(release), "--beam", "1", "--plain", "--device", "cpu",
                               *sentences)
    assert code == 0, err
    assert out.splitlines() == expected


def test_the_explorer_labels_each_side_with_its_vocabulary(run: Path) -> None:
    from aiayn.explore.models import display_token, load_explorable

    ex = load_explorable(run, device="cpu")
    source = BPETokenizer.load(run / "tokenizer.src.json").tokenizer
    target = BPETokenizer.load(run / "tokenizer.tgt.json").tokenizer
    ids = ex.tokens("A man and a dog.")
    assert ids == [*source.encode("A man and a dog.", add_special_tokens=False).ids, 2]
    assert [ex.source_label(i) for i in ids] == [display_token(source.id_to_token(i)) for i in ids]
    assert [ex.source_label(i) for i in ids] != [ex.label(i) for i in ids]  # two vocabularies
    target_ids = ex.tokens("Ein Mann und ein Hund.", target=True)
    assert target_ids == [*target.encode("Ein Mann und ein Hund.", add_special_tokens=False).ids, 2]
    assert [ex.label(i) for i in target_ids] == [display_token(target.id_to_token(i)) for i in target_ids]
    assert ex.decode(target_ids[:-1]) == "Ein Mann und ein Hund."


def test_the_attention_example_labels_each_side_with_its_vocabulary(run: Path) -> None:
    """``aiayn plot attention``'s example: cross-attention keys are source pieces, queries target ones."""
    loaded = load_run(run)
    source, target = loaded.task.load_tokenizers()
    example = loaded.task.attention_example(loaded.model, "A man and a dog.", kind="cross")
    src_ids = [*source.encode("A man and a dog."), source.eos_id]
    assert example.key_labels == [source.tokenizer.id_to_token(i) for i in src_ids]
    assert example.key_labels != [target.tokenizer.id_to_token(i) for i in src_ids]  # the side matters
    greedy = loaded.task.translator(loaded.model).translate_ids([src_ids], DecodeOptions(beam_size=1))[0]
    assert example.query_labels == [target.tokenizer.id_to_token(i) for i in [target.bos_id, *greedy]]
    assert len(example.weights) == 2  # one map per decoder layer
