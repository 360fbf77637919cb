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
* A shipped ensemble release translates as its members together; releases kept from runs that are
  gone become a shipped model or an ensemble's members byte for byte (no second rounding).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.data import data_dir
from aiayn.tasks.trained import shipped_path, single_model

MULTI30K = data_dir() / "multi30k"
SENTENCES = ["A man is riding a bike.", "Two dogs are playing in the snow.", "A girl in a red dress."]


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``aiayn ARGS`` run in this process."""
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return int(info.value.code or 0), out, err


def shipped_label(name: str) -> str:
    """How an error names a shipped model: its name, or for an ensemble release NAME/FIRST-MEMBER (the
    member the check stopped at)."""
    first, note = single_model(shipped_path(name))
    return name if note is None else f"{name}/{first.name}"


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
    assert alone[1].splitlines()[0] == "Ein Mann fährt Fahrrad."


def test_the_shipped_opposite_directions_are_refused(capsys) -> None:
    """en->de and de->en share one tokenizer.json (a joint BPE): the language pair tells them apart."""
    # a single model's tokenizer.json, or an ensemble release's first member's (its members share one)
    en_de, de_en = (single_model(shipped_path(name))[0] for name in ("multi30k-en-de", "multi30k-de-en"))
    assert (en_de / "tokenizer.json").read_bytes() == (de_en / "tokenizer.json").read_bytes()
    assert_refused(run_main(["translate", "--model", "multi30k-en-de", "--model", "multi30k-de-en", "A man."],
                            capsys),
                   f"{shipped_label('multi30k-en-de')} translates en->de but {shipped_label('multi30k-de-en')} "
                   "de->en; an ensemble's members "
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
                   f"{shipped_label('multi30k-en-de')} has another vocabulary than")
    assert_refused(run_main(["translate", "--run", str(tiny_run), "--run", str(tiny_run), "--checkpoint", step,
                             "A man."], capsys),
                   "1 --checkpoint for 2 models; give one per --run (in order), or several with a single --run")


# ---- a shipped ensemble: one release of several members (aiayn.tasks.shipped.write_ensemble_release)
@pytest.fixture(scope="module")
def ensemble_release(tiny_run: Path) -> Path:
    """The tiny run's checkpoints 2 and 6 shipped as one ensemble release of members "early", "late"."""
    from aiayn.tasks.shipped import write_ensemble_release

    steps = [tiny_run / "checkpoints" / f"step-{step:08d}" for step in (2, 6)]
    return write_ensemble_release([(tiny_run, steps[0], "early"), (tiny_run, steps[1], "late")],
                                  tiny_run.parent / "shipped" / "tiny-ensemble",
                                  extra={"scores": {"val_bleu": 0.1}, "usage": "aiayn translate --model tiny-ensemble"},
                                  member_scores=[{"val_bleu": 0.01}, {"val_bleu": 0.02}])


def test_an_ensemble_release_translates_as_its_members_together(ensemble_release: Path, tiny_run: Path,
                                                                 tmp_path: Path, capsys) -> None:
    import json

    import aiayn
    from aiayn.generate import Ensemble
    from aiayn.tasks.trained import is_ensemble_release, is_release, release_members

    record = json.loads((ensemble_release / "release.json").read_text())
    assert record["members"] == ["early", "late"] and record["task"] == "translation"
    assert is_ensemble_release(ensemble_release) and not is_release(ensemble_release)
    members = release_members(ensemble_release)
    assert [m.name for m in members] == ["early", "late"] and all(is_release(m) for m in members)
    for member, score in zip(members, (0.01, 0.02), strict=True):  # each keeps its run's record and scores
        assert (member / "record" / "metrics.csv").is_file()
        own = json.loads((member / "release.json").read_text())
        assert own["member_of"] == "tiny-ensemble" and own["scores"] == {"val_bleu": score}
    assert record["parameters"] == sum(record["member_parameters"])

    corpus = tiny_run.parent / "corpus"
    data = ["--src", str(corpus / "val.en"), "--ref", str(corpus / "val.de")]
    outputs = {}
    for name, models in (("release", ["--model", str(ensemble_release)]),
                         ("members", ["--model", str(members[0]), "--model", str(members[1])])):
        code, out, err = run_main(["evaluate", *models, *data, "--out", str(tmp_path / name)], capsys)
        assert code == 0, err
        assert "an ensemble of 2 models" in out
        outputs[name] = (tmp_path / name).read_text(encoding="utf-8")
    assert outputs["release"] == outputs["members"]
    code, out, err = run_main(["evaluate", "--model", str(ensemble_release), "--run", str(tiny_run), *data], capsys)
    assert code == 0 and "an ensemble of 3 models" in out, err  # the run beside both members

    translator = aiayn.load(ensemble_release)  # the Python API: one Translator of both
    assert isinstance(translator.model, Ensemble) and len(translator.model) == 2
    sources = (corpus / "val.en").read_text(encoding="utf-8").splitlines()
    assert "\n".join(translator.translate(sources)) + "\n" == outputs["release"]


def test_aiayn_models_says_a_release_is_an_ensemble(ensemble_release: Path, capsys,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from aiayn.tasks import trained

    monkeypatch.setattr(trained, "SHIPPED_DIR", ensemble_release.parent)
    code, out, err = run_main(["models"], capsys)
    assert code == 0, err
    line, usage = out.splitlines()
    assert line.startswith("tiny-ensemble      translation        an ensemble of 2 models (early, late), ")
    assert "M parameters each (float16)  val_bleu 0.1" in line and usage.strip() == "aiayn translate --model tiny-ensemble"
    code, out, err = run_main(["translate", "--model", "tiny-ensemble", "A man."], capsys)  # by its shipped name
    assert code == 0 and len(out.splitlines()) == 1, err


def test_views_of_one_model_show_an_ensembles_first_member(ensemble_release: Path, tmp_path: Path, capsys) -> None:
    from aiayn.explore import load_explorable

    explorable = load_explorable(model_path=ensemble_release)
    assert explorable.kind == "translation" and explorable.name == "tiny-ensemble (member early)"
    assert explorable.run_dir == ensemble_release / "early"
    code, _, err = run_main(["plot", "attention", "--model", str(ensemble_release), "--input", "A man.",
                               "--out", str(tmp_path / "a.png")], capsys)
    assert code == 0, err
    assert err.strip() == "tiny-ensemble is an ensemble of 2 models; showing its first member, early"
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_ensemble_releases_are_refused(ensemble_release: Path, tiny_run: Path, tmp_path: Path, capsys) -> None:
    import json
    import shutil

    from aiayn.tasks.runs import RunInputError
    from aiayn.tasks.shipped import write_ensemble_release
    from aiayn.tasks.trained import load_run_or_release

    step = tiny_run / "checkpoints" / "step-00000002"
    assert_refused(run_main(["translate", "--model", str(ensemble_release), "--checkpoint", str(step), "A man."],
                            capsys), "is a shipped ensemble (one set of weights per member); drop --checkpoint")
    assert_refused(run_main(["generate", "--model", str(ensemble_release), "--prompt", "A"], capsys),
                   "tiny-ensemble is an ensemble of translation models; generation needs a decoder-only")
    with pytest.raises(RunInputError, match="is an ensemble of 2 models, not one"):
        load_run_or_release(ensemble_release)

    broken = Path(shutil.copytree(ensemble_release, tmp_path / "broken"))
    shutil.rmtree(broken / "late")
    assert_refused(run_main(["translate", "--model", str(broken), "A man."], capsys),
                   "member late is missing or has no release.json and model.safetensors")
    record = json.loads((broken / "release.json").read_text())
    (broken / "release.json").write_text(json.dumps({**record, "members": ["early", "../../etc"]}))
    assert_refused(run_main(["translate", "--model", str(broken), "A man."], capsys),
                   "member '../../etc' is not a folder name inside the release")

    # Members that cannot be one ensemble are refused before anything is written.
    swapped = Path(shutil.copytree(tiny_run, tmp_path / "swapped", ignore=shutil.ignore_patterns("checkpoints")))
    shutil.copytree(tiny_run / "checkpoints" / "step-00000006", swapped / "checkpoints" / "step-00000006")
    config = json.loads((swapped / "config.json").read_text())
    config["task_options"].update(src_lang="de", tgt_lang="en")
    (swapped / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunInputError, match=r"translates en->de but .* de->en"):
        write_ensemble_release([(tiny_run, None, "a"), (swapped, None, "b")], tmp_path / "mixed")
    for members, message in (([(tiny_run, None, "a")], "at least two members"),
                             ([(tiny_run, None, "a"), (tiny_run, None, "a")], "distinct folder names")):
        with pytest.raises(ValueError, match=message):
            write_ensemble_release(members, tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists() and not (tmp_path / "mixed.tmp").exists()


def test_releases_become_a_shipped_model_or_members_byte_for_byte(ensemble_release: Path, tmp_path: Path,
                                                                   capsys) -> None:
    """A kept release (results/issue36/NAME, a shipped model) is shipped again, alone or as an
    ensemble's member, by copying it: the same weight bytes, no second rounding; its release.json
    takes the new name and scores. Even the release it replaces can be a member (the shipped model
    becoming seed 0 of its own ensemble)."""
    import json
    import re
    import shutil

    from aiayn.tasks.shipped import write_ensemble_release, write_release
    from aiayn.tasks.trained import release_members

    early, late = release_members(ensemble_release)
    single = write_release(late, tmp_path / "kept", name="kept", extra={"scores": {"val_bleu": 0.5}})
    assert (single / "model.safetensors").read_bytes() == (late / "model.safetensors").read_bytes()
    assert sorted(p.name for p in single.rglob("*")) == sorted(p.name for p in late.rglob("*"))
    record = json.loads((single / "release.json").read_text())
    assert record["name"] == "kept" and record["scores"] == {"val_bleu": 0.5} and "member_of" not in record
    assert record["parameters"] == json.loads((late / "release.json").read_text())["parameters"]

    shipped = Path(shutil.copytree(early, tmp_path / "pretrained" / "tiny"))  # the model shipped alone so far
    again = write_ensemble_release([(shipped, None, "seed0"), (single, None, "seed1")], shipped, name="tiny",
                                   member_scores=[{"val_bleu": 0.01}, {"val_bleu": 0.5}])
    assert json.loads((again / "release.json").read_text())["members"] == ["seed0", "seed1"]
    assert (again / "seed0" / "model.safetensors").read_bytes() == (early / "model.safetensors").read_bytes()
    assert json.loads((again / "seed1" / "release.json").read_text())["member_of"] == "tiny"
    assert not (again / "model.safetensors").exists() and not (tmp_path / "pretrained" / "tiny.tmp").exists()

    corpus = ensemble_release.parent.parent / "corpus"
    data = ["--src", str(corpus / "val.en"), "--ref", str(corpus / "val.de")]
    outputs = {}
    for name, models in (("copied", ["--model", str(again)]), ("original", ["--model", str(ensemble_release)])):
        code, _, err = run_main(["evaluate", *models, *data, "--out", str(tmp_path / name)], capsys)
        assert code == 0, err
        outputs[name] = (tmp_path / name).read_text(encoding="utf-8")
    assert outputs["copied"] == outputs["original"]  # the same members, the same translations

    with pytest.raises(ValueError, match="is stored in float16, not bfloat16"):
        write_release(late, tmp_path / "b", dtype="bfloat16")
    with pytest.raises(ValueError, match=re.escape("is a release (one set of weights); give no checkpoint")):
        write_release(late, tmp_path / "b", checkpoint=late)
    with pytest.raises(ValueError, match=re.escape("is an ensemble release itself; give its members (early, late)")):
        write_ensemble_release([(ensemble_release, None, "a"), (late, None, "b")], tmp_path / "b")
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.tmp").exists()
