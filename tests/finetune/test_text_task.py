"""The ``text`` task and ``aiayn train``'s fine-tuning options: files checked before training (one
line naming the file and line, nothing written), the seeded validation split, a vocabulary learned
from scratch or the loaded model's, runs that generate without their data or source, exact resume,
and the one-line refusals."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from finetune_helpers import CHAT_TEMPLATE, write_text

from aiayn.api import generate_text
from aiayn.config import TrainConfig
from aiayn.data.parallel import DataError
from aiayn.tasks import get_task
from aiayn.tasks.runs import load_text_model
from aiayn.tasks.sources import load_source
from aiayn.tasks.text import read_text_files, split_text
from aiayn.tasks.trained import load_run
from aiayn.train.trainer import train

QUIET = ("--batch-size", "4", "--no-progress")
SMALL = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--d-ff", "64", *QUIET)


@pytest.mark.parametrize(("content", "message"), [
    (b"fine\nstill fine\nbad \xe9t\xe9\n", "bad.txt:3: not UTF-8 (byte 0xe9 at column 5)"),
    (b"fine\nhas a \x00 here\n", "bad.txt:2: a NUL byte at column 7"),
    (b"\n  \n", "bad.txt:1: the file holds no text"),
])
def test_each_file_is_checked_with_its_line(content, message, tmp_path, text_file):
    (tmp_path / "bad.txt").write_bytes(content)
    with pytest.raises(DataError, match=re.escape(message)):
        read_text_files([str(text_file), str(tmp_path / "bad.txt")])


@pytest.mark.parametrize("init_from", [False, True], ids=["scratch", "init-from"])
def test_a_bad_line_stops_the_run_before_anything_is_written(init_from, tmp_path, text_file, hf_dir, run_aiayn):
    (tmp_path / "bad.txt").write_bytes(b"good\nbad \xff\n")
    start = ("--init-from", str(hf_dir("llama"))) if init_from else ()
    code, _, err = run_aiayn("train", "--task", "text", "--data", str(text_file), "--val-data",
                               str(tmp_path / "bad.txt"), *start, "--run-dir", str(tmp_path / "run"), *SMALL[-1:])
    assert code == 2 and err.strip().splitlines() == [
        f"Error: {tmp_path / 'bad.txt'}:2: not UTF-8 (byte 0xff at column 5); convert the file to UTF-8, "
        f"e.g. iconv -f latin1 -t utf-8"]
    assert not (tmp_path / "run").exists()


def test_a_folder_given_as_data_is_named_as_such(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}: a folder; give a text file")):
        read_text_files([str(tmp_path)])


def test_the_split_is_seeded_and_keeps_every_line_once(text_file):
    text = text_file.read_text(encoding="utf-8")
    train_part, val_part = split_text(text, 0.1, seed=0)
    assert split_text(text, 0.1, seed=0) == (train_part, val_part)
    assert split_text(text, 0.1, seed=1) != (train_part, val_part)
    assert sorted((train_part + val_part).splitlines()) == sorted(text.splitlines())
    assert 10 <= len(val_part.splitlines()) <= 20  # 10 of 100 runs of whole lines (of 120 lines: 1 or 2 each)
    with pytest.raises(DataError, match="give --val-data"):
        split_text("one line\n", 0.1, seed=0)


def test_from_scratch_bpe_run_generates_without_its_data(tmp_path, run_aiayn):
    data = write_text(tmp_path / "data.txt")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("task: text\ntask_options: {tokenizer: bpe, vocab_size: 300}\n", encoding="utf-8")
    code, out, err = run_aiayn("train", "--recipe", str(recipe), "--data", str(data), "--max-steps", "2",
                               "--seed", "3", *SMALL, "--run-dir", str(tmp_path / "run"))
    assert code == 0, err
    assert ("validation: 10% of the text (runs of whole lines chosen with seed 3); give --val-data FILE to "
            "choose it yourself") in out.splitlines()
    options = json.loads((tmp_path / "run" / "config.json").read_text())["task_options"]
    assert options["tokenizer"] == "bpe" and json.loads(options["bpe"])["model"]["type"] == "BPE"
    data.unlink()
    code, out, err = run_aiayn("generate", "--run", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "4")
    assert code == 0 and out.startswith("the"), err


def test_a_fine_tuned_run_generates_its_own_output_without_its_source(tmp_path, text_file, hf_dir, run_aiayn):
    source_dir = hf_dir("llama")
    code, out, err = run_aiayn("train", "--task", "text", "--data", str(text_file), "--init-from", str(source_dir),
                               "--max-steps", "3", "--lr", "1e-2", "--run-dir", str(tmp_path / "run"), *QUIET)
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["task_options"]["init_from"] == str(source_dir)
    tuned = load_source(source_dir).text  # the source's front end with the run's trained weights
    tuned.model.load_state_dict(load_run(tmp_path / "run", prepare=False).model.state_dict())
    expected = generate_text(tuned, "the quick", max_new_tokens=8).text
    shutil.rmtree(source_dir)
    lm = load_text_model(tmp_path / "run", plain=True)
    assert lm.eos_id == 0 and str(lm.chat_template) == CHAT_TEMPLATE
    assert generate_text(lm, "the quick", max_new_tokens=8).text == expected
    code, out, err = run_aiayn("generate", "--run", str(tmp_path / "run"), "--prompt", "the quick",
                               "--max-new-tokens", "8", "--temperature", "0")
    assert code == 0 and out.startswith("the quick" + expected), err


def test_a_resumed_fine_tune_equals_an_uninterrupted_one(tmp_path, text_file, hf_dir):
    source_dir = hf_dir("gpt2")

    def run(run_dir, steps, *, resume=False):
        task = get_task("text", data=[str(text_file)], init_from=str(source_dir), block_size=16)
        config = load_run(run_dir, prepare=False).model_config if resume else task.model_config()
        cfg = TrainConfig(**{**task.train_overrides(), "max_steps": steps, "batch_size": 4, "schedule": "constant",
                             "save_every": 2, "eval_every": 2})
        return train(task, config, cfg, run_dir, resume=resume, progress=False, make_plots=False, device="cpu")

    run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    shutil.rmtree(source_dir)  # resuming needs the run only
    assert run(tmp_path / "resumed", 4, resume=True).step == 4
    straight = load_run(tmp_path / "straight", prepare=False).model.state_dict()
    resumed = load_run(tmp_path / "resumed", prepare=False).model.state_dict()
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)


def test_refusals_are_one_line(tmp_path, text_file, hf_dir, run_aiayn):
    source = str(hf_dir("llama"))
    run = tmp_path / "run"
    cases = [
        (("--task", "text", "--data", str(text_file), "--init-from", source, "--d-model", "64"),
         f"Error: --d-model would change the shape of the model --init-from {source} loads (its weights set "
         f"it); drop it (with --init-from only --attention-dropout, --dropout, --padding-free may change) "
         f"(see 'aiayn train --help')"),
        (("--task", "reverse", "--data", str(text_file)), "Error: task 'reverse' does not take --data; tasks "
                                                          "that do: chat, text, translation (see 'aiayn train --help')"),
        (("--task", "text",), "Error: task text needs the text to learn from: give --data FILE (one or more)"),
        (("--task", "text", "--run-dir", str(run), "--resume", "--init-from", source),
         "Error: --init-from cannot change when resuming (the run keeps its task options); drop it (see 'aiayn "
         "train --help')"),
    ]
    for args, message in cases:
        code, _, err = run_aiayn("train", *args, *SMALL[-1:])
        assert (code, err.strip().splitlines()) == (2, [message])
    assert not run.exists()
