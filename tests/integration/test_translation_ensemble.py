"""``aiayn translate`` / ``aiayn evaluate`` with several models: an ensemble searched over the mean
of their log-probabilities (``aiayn.generate.ensemble``; the proofs of the search itself are in
tests/consistency/test_ensemble.py).

* Two copies of the shipped en->de model translate exactly as the model alone (beam and greedy).
* Members that do not share a vocabulary and a direction are refused in one line, exit code 2,
  nothing on stdout: the shipped en->de and de->en models share their joint BPE (the same
  tokenizer.json), so the language pair refuses them; a run with its own BPE is refused for its
  vocabulary; checkpoints that cannot be paired with the runs are a usage error.
* ``evaluate --run R --checkpoint A --checkpoint B`` scores an ensemble of one run's checkpoints
  (a tiny run trained here for 6 steps, 3 checkpoints kept), and an ensemble of one checkpoint
  twice writes the hypotheses of that checkpoint alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.data import data_dir

MULTI30K = data_dir() / "multi30k"
SENTENCES = ["A man is riding a bike.", "Two dogs are playing in the snow.", "A girl in a red dress."]


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``aiayn ARGS`` run in this process."""
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return int(info.value.code or 0), out, err


def assert_refused(result: tuple[int, str, str], message: str) -> None:
    code, out, err = result
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("Error: ") and message in err, err


@pytest.mark.parametrize("beam", ["5", "1"])
def test_two_copies_of_the_shipped_model_translate_as_the_model(beam: str, capsys) -> None:
    alone = run_main(["translate", "--model", "multi30k-en-de", "--beam", beam, *SENTENCES], capsys)
    together = run_main(["translate", "--model", "multi30k-en-de", "--model", "multi30k-en-de", "--beam", beam,
                         *SENTENCES], capsys)
    assert alone[0] == 0 and together[0] == 0, (alone[2], together[2])
    assert together[1] == alone[1] and len(alone[1].splitlines()) == len(SENTENCES)
    assert alone[1].splitlines()[0] == "Ein Mann fährt auf einem Fahrrad."


def test_the_shipped_opposite_directions_are_refused(capsys) -> None:
    """en->de and de->en share one tokenizer.json (a joint BPE): the language pair tells them apart."""
    shipped = Path(__file__).resolve().parents[2] / "aiayn" / "pretrained"
    assert (shipped / "multi30k-en-de" / "tokenizer.json").read_bytes() == \
        (shipped / "multi30k-de-en" / "tokenizer.json").read_bytes()
    assert_refused(run_main(["translate", "--model", "multi30k-en-de", "--model", "multi30k-de-en", "A man."],
                            capsys),
                   "multi30k-en-de translates en->de but multi30k-de-en de->en; an ensemble's members "
                   "translate one language pair in one direction")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An en->de run with its own 300-token BPE, trained 6 steps on 40 Multi30k pairs, a checkpoint
    every 2 steps (all 3 kept): random-ish weights, enough to tell checkpoints apart."""
    if not (MULTI30K / "train.en").is_file():
        pytest.skip("Multi30k not found (set AIAYN_DATA_DIR)")
    from aiayn.config import TrainConfig
    from aiayn.data.parallel import read_lines
    from aiayn.tasks import get_task
    from aiayn.train.trainer import train

    root = tmp_path_factory.mktemp("ensemble")
    corpus = root / "corpus"
    corpus.mkdir()
    for lang in ("en", "de"):
        lines = read_lines(MULTI30K / f"train.{lang}")[:40]
        for split, chosen in (("train", lines), ("val", lines[:8]), ("test", lines[:2])):
            (corpus / f"{split}.{lang}").write_text("\n".join(chosen) + "\n", encoding="utf-8")
    task = get_task("translation", corpus_dir=str(corpus), test_split="test", vocab_size=300, max_tokens=512,
                    max_len=48, beam_size=2, val_bleu=False)
    model_config = task.model_config().replace(d_model=32, n_heads=4, n_layers=2, n_decoder_layers=2, d_ff=37,
                                               dropout=0.0, attention_dropout=0.0)
    train_config = TrainConfig(**{**task.train_overrides(), "max_steps": 6, "warmup_steps": 2, "save_every": 2,
                                  "keep_checkpoints": 3, "average_last": 0})
    train(task, model_config, train_config, root / "run", progress=False, make_plots=False, echo=lambda _: None)
    return root / "run"


def test_evaluate_an_ensemble_of_one_runs_checkpoints(tiny_run: Path, tmp_path: Path, capsys) -> None:
    corpus = tiny_run.parent / "corpus"
    data = ["--src", str(corpus / "val.en"), "--ref", str(corpus / "val.de")]
    first, last = (tiny_run / "checkpoints" / f"step-{step:08d}" for step in (2, 6))
    assert first.is_dir() and last.is_dir()

    code, out, err = run_main(["evaluate", "--run", str(tiny_run), "--checkpoint", str(first), "--checkpoint",
                               str(last), *data, "--out", str(tmp_path / "both.de")], capsys)
    assert code == 0, err
    assert "BLEU = " in out and "chrF2 = " in out and "beam 2, length penalty 0.6, an ensemble of 2 models" in out
    assert len((tmp_path / "both.de").read_text(encoding="utf-8").splitlines()) == 8

    # One checkpoint twice, or the run twice (its latest each): that checkpoint's own hypotheses.
    hypotheses = {}
    for name, members in (("alone", ["--run", str(tiny_run), "--checkpoint", str(last)]),
                          ("twice", ["--run", str(tiny_run), "--checkpoint", str(last), "--checkpoint", str(last)]),
                          ("runs", ["--run", str(tiny_run), "--run", str(tiny_run)])):
        code, out, err = run_main(["evaluate", *members, *data, "--out", str(tmp_path / name)], capsys)
        assert code == 0, err
        hypotheses[name] = (tmp_path / name).read_text(encoding="utf-8")
    assert hypotheses["twice"] == hypotheses["alone"] == hypotheses["runs"]


def test_members_that_cannot_be_an_ensemble_are_refused(tiny_run: Path, capsys) -> None:
    step = str(tiny_run / "checkpoints" / "step-00000002")
    assert_refused(run_main(["translate", "--run", str(tiny_run), "--model", "multi30k-en-de", "A man."], capsys),
                   "multi30k-en-de has another vocabulary than")
    assert_refused(run_main(["translate", "--run", str(tiny_run), "--run", str(tiny_run), "--checkpoint", step,
                             "A man."], capsys),
                   "1 --checkpoint for 2 models; give one per --run (in order), or several with a single --run")
