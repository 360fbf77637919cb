"""Domain adaptation: a shipped translation model fine-tuned on parallel files of your own through the
trainer; refusals come before any run directory is made."""

from __future__ import annotations

import json
import re

import pytest
import torch

from aiayn.config import ConfigError, TrainConfig
from aiayn.data.parallel import DataError
from aiayn.tasks import get_task
from aiayn.tasks.trained import RunInputError, load_release, shipped_path
from aiayn.train.trainer import train

SHIPPED = "multi30k-de-en"
DE = [f"Ein Mann mit {n} Hunden geht im Park spazieren." for n in range(2, 22)]
EN = [f"A man with {n} dogs walks in the park." for n in range(2, 22)]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def fine_tune(task, run_dir):
    config = TrainConfig(task="translation", max_steps=3, batch_size=8, lr=1e-3, warmup_steps=0, eval_every=3,
                         save_every=3, average_last=0)
    return train(task, task.model_config(), config, run_dir, progress=False, make_plots=False, echo=lambda _: None)


def adaptation(tmp_path, **options):
    task = get_task("translation", src=write(tmp_path / "d.de", DE), tgt=write(tmp_path / "d.en", EN),
                    init_from=SHIPPED, src_lang="de", tgt_lang="en", beam_size=1, **options)
    task.echo = lambda _: None
    return task


def test_a_shipped_model_fine_tuned_on_your_files_moves_and_keeps_its_tokenizer(tmp_path):
    task = adaptation(tmp_path)
    result = fine_tune(task, tmp_path / "run")
    assert result.step == 3 and torch.isfinite(torch.tensor(result.final_loss))
    assert set(result.test_metrics) >= {"nll", "bleu"} and task.test_split == "val"
    shipped = load_release(shipped_path(SHIPPED)).model.state_dict()
    tuned = task.source.model.state_dict()
    assert any(not torch.equal(tuned[k], shipped[k]) for k in shipped)
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (shipped_path(SHIPPED) / "tokenizer.json").read_bytes()


def test_a_bad_line_leaves_no_run_directory(tmp_path):
    task = adaptation(tmp_path)
    write(tmp_path / "d.en", [*EN[:4], "", *EN[5:]])
    with pytest.raises(DataError, match=r"^" + re.escape(f"{tmp_path / 'd.en'}, line 5: empty line")):
        fine_tune(task, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_languages_default_to_the_starting_models():
    task = get_task("translation", init_from=SHIPPED)
    assert (task.src_lang, task.tgt_lang) == ("de", "en") and task.options["src_lang"] == "de"
    assert task.model_config() == load_release(shipped_path(SHIPPED)).model_config
    assert (get_task("translation").src_lang, get_task("translation").tgt_lang) == ("en", "de")
    one_given = get_task("translation", init_from=SHIPPED, src_lang="de")  # the other from the model
    assert (one_given.src_lang, one_given.tgt_lang) == ("de", "en")


def test_a_starting_model_that_does_not_fit_the_options_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^multi30k-de-en translates de->en but the task's languages are en->de; "
                                          r"leave the languages out \(--src-lang, --tgt-lang; a recipe's src_lang, "
                                          r"tgt_lang\) to take de->en from it$"):
        get_task("translation", init_from=SHIPPED, src_lang="en", tgt_lang="de").model_config()
    with pytest.raises(ConfigError, match=r"^multi30k-de-en has a joint vocabulary; give vocabulary: joint$"):
        get_task("translation", init_from=SHIPPED, src_lang="de", tgt_lang="en", vocabulary="separate").model_config()
    with pytest.raises(RunInputError, match=r"is an ensemble of 2 models, not one"):
        get_task("translation", init_from="multi30k-en-de").model_config()


def test_a_translation_fine_tune_resumes_and_loads_without_its_source(tmp_path, run_aiayn):
    """Full checkpoints hold every weight: a run started from another run resumes, and evaluates, after
    that run has moved; a LoRA run's checkpoints hold only adapters, so one line names its base."""
    common = ("--src", write(tmp_path / "d.de", DE), "--tgt", write(tmp_path / "d.en", EN), "--max-steps", "1",
              "--warmup-steps", "1", "--batch-size", "8", "--average-last", "0", "--no-progress")
    start = tmp_path / "start"  # de -> en: the languages come from the starting model
    code, _, err = run_aiayn("train", "--task", "translation", "--init-from", SHIPPED, *common,
                             "--run-dir", str(start))
    assert code == 0, err
    for name, extra in (("full", ()), ("lora", ("--lora-rank", "2"))):
        code, _, err = run_aiayn("train", "--task", "translation", "--init-from", str(start), *common, *extra,
                                 "--run-dir", str(tmp_path / name))
        assert code == 0, err
    start.rename(tmp_path / "moved")
    code, _, err = run_aiayn("train", "--resume", "--run-dir", str(tmp_path / "full"), "--max-steps", "2",
                             "--no-progress")
    assert code == 0, err
    code, out, err = run_aiayn("evaluate", "--run", str(tmp_path / "full"), "--src", str(tmp_path / "d.de"),
                               "--ref", str(tmp_path / "d.en"), "--beam", "1")
    assert code == 0 and "BLEU" in out, err
    code, _, err = run_aiayn("train", "--resume", "--run-dir", str(tmp_path / "lora"), "--max-steps", "2",
                             "--no-progress")
    assert code != 0
    assert f"hold only its LoRA adapters: it resumes on the model they go on, {start}; put it back there" in err


def test_a_from_scratch_run_on_a_folder_of_another_pair_takes_its_languages(tmp_path, run_aiayn):
    """``--data FOLDER`` with ``--src-lang/--tgt-lang``: the folder's train.de and train.en, the model
    named for the pair, the languages kept for resuming; a code that is not one is refused in one line."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    write(folder / "train.de", DE)
    write(folder / "train.en", EN)
    common = ("--task", "translation", "--data", str(folder), "--max-steps", "1", "--warmup-steps", "1",
              "--batch-size", "8", "--average-last", "0", "--no-progress")
    code, out, err = run_aiayn("train", *common, "--src-lang", "de", "--tgt-lang", "en",
                               "--run-dir", str(tmp_path / "run"))
    assert code == 0, err
    assert "give a folder with val.de and val.en to choose" in out
    configs = json.loads((tmp_path / "run" / "config.json").read_text(encoding="utf-8"))
    assert (configs["task_options"]["src_lang"], configs["task_options"]["tgt_lang"]) == ("de", "en")
    assert configs["model"]["name"] == "de-en"
    code, _, err = run_aiayn("train", *common, "--src-lang", "../de", "--run-dir", str(tmp_path / "bad"))
    assert code == 2 and err.strip().splitlines() == [
        "Error: language '../de': give a code of letters, digits, '-' or '_' (en, pt-BR)"]
    assert not (tmp_path / "bad").exists()
