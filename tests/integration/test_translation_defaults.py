"""`aiayn train --task translation` without a recipe learns: its default settings are the
committed en->de recipe's, and a short run of exactly those settings on a small slice lowers the loss."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from aiayn.config import TrainConfig
from aiayn.data import data_dir
from aiayn.data.parallel import read_lines
from aiayn.tasks.runs import setup_run
from aiayn.train.optim import make_schedule, noam_lr, schedule_warning
from aiayn.train.trainer import train

MULTI30K = data_dir() / "multi30k"
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "multi30k-en-de.yaml"
N_PAIRS = 300


def test_default_translation_settings_are_the_recipes():
    default, recipe = setup_run("translation"), setup_run(recipe=RECIPE)
    assert default.model_config == recipe.model_config.replace(vocab_size=default.model_config.vocab_size)
    assert default.train_config == recipe.train_config
    # The schedule's peak (at the end of warmup) is a learning rate that trains: 3e-3, not Noam's
    # factor 1e-3 read as ~1e-6.
    cfg = default.train_config
    peak = make_schedule(cfg, total_steps=10_000, d_model=default.model_config.d_model)(cfg.warmup_steps)
    assert peak > 1e-3


def test_noam_with_a_tiny_factor_warns():
    """The old default (noam, lr=1e-3 read as the factor) is still allowed, with a warning saying why."""
    cfg = TrainConfig(schedule="noam", lr=1e-3, warmup_steps=4000)
    peak = noam_lr(4000, d_model=256, warmup=4000, factor=1e-3)
    assert peak == pytest.approx(9.9e-7, rel=0.01)
    warning = schedule_warning(cfg, d_model=256)
    assert warning is not None and f"peaks at a learning rate of {peak:.2g} at step 4000" in warning
    assert "--lr 1" in warning
    assert schedule_warning(cfg.replace(lr=1.0), d_model=256) is None  # the paper's factor: 9.9e-4
    assert schedule_warning(cfg.replace(schedule="cosine"), d_model=256) is None


@pytest.mark.slow
@pytest.mark.skipif(not (MULTI30K / "train.en").is_file(), reason="Multi30k not found (set AIAYN_DATA_DIR)")
def test_default_translation_run_lowers_the_loss(tmp_path):
    """The default model, optimiser and schedule on 300 pairs, cut to 40 steps of 512 tokens with a
    1,000-token BPE (9 s here): the training loss falls by more than 0.3 nats (measured: 7.37 ->
    6.92 between the first and last 10-step windows). Under the old default's Noam peak of ~1e-6
    (its learning rate over these steps: below 1e-8) it stayed put."""
    for lang in ("en", "de"):
        lines = read_lines(MULTI30K / f"train.{lang}")[:N_PAIRS]
        for split in ("train", "val", "test2016"):
            (tmp_path / f"{split}.{lang}").write_text("\n".join(lines[:60 if split != "train" else None]) + "\n",
                                                       encoding="utf-8")
    setup = setup_run("translation", max_tokens=512, train_options=dict(max_steps=40, eval_every=40,
                                                                        save_every=40, average_last=0))
    task, model_config = setup.task, setup.model_config.replace(vocab_size=1000)
    task.corpus_dir, task.vocab_size = str(tmp_path), 1000  # the default task on the slice
    task.val_bleu = False
    task.test_split = "val"  # the end-of-run beam search is not what this test is about
    result = train(task, model_config, setup.train_config, tmp_path / "run", progress=False,
                   make_plots=False, echo=lambda _: None)
    assert result.step == 40
    with open(tmp_path / "run" / "metrics.csv", newline="", encoding="utf-8") as handle:
        losses = [float(r["train_loss"]) for r in csv.DictReader(handle) if r["train_loss"]]
    assert len(losses) == 4
    assert losses[-1] < losses[0] - 0.3, losses
