"""Full fine-tuning from a Hugging Face directory trains as transformers does: the first 3 steps of
``aiayn.train`` on a tiny random LLaMA and GPT-2 (saved with ``save_pretrained``) have the losses of
transformers' model on the same batches, stepped by the same AdamW (same lr, no warmup, no dropout,
no clipping), within float32 tolerance. And fine-tuning changes the model (nanoGPT #161's silent
no-op cannot happen): after training the weights and the logits differ from the source's."""

from __future__ import annotations

import csv

import pytest
import torch
from finetune_helpers import transformers
from torch.testing import assert_close

from aiayn.config import TrainConfig
from aiayn.tasks import get_task
from aiayn.tasks.sources import load_source
from aiayn.tasks.trained import load_run
from aiayn.train.trainer import train

STEPS, BATCH, BLOCK, LR, SEED = 3, 4, 16, 1e-3, 0


def fine_tune(hf_path, text_file, run_dir, *, fast: bool):
    task = get_task("text", data=[str(text_file)], init_from=str(hf_path), block_size=BLOCK)
    cfg = TrainConfig(**{**task.train_overrides(), "max_steps": STEPS, "batch_size": BATCH, "lr": LR,
                         "schedule": "constant", "warmup_steps": 0, "clip_grad_norm": None, "log_every": 1,
                         "eval_every": 1000, "save_every": 1000, "bf16": False, "seed": SEED})
    train(task, task.model_config(), cfg, run_dir, progress=False, make_plots=False, fast=fast, device="cpu")
    with open(run_dir / "metrics.csv", encoding="utf-8") as handle:
        return task, cfg, [float(row["train_loss"]) for row in csv.DictReader(handle) if row["train_loss"]]


def transformers_losses(hf_path, task, cfg) -> list[float]:
    """The same batches through transformers' model (labels = inputs: it shifts them itself) and
    torch's AdamW with the trainer's settings."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    losses = []
    for indices in task.train_batches(0, cfg.batch_size, cfg.seed)[:STEPS]:
        batch = task.collate("train", indices)
        chunk = torch.cat([batch["tokens"], batch["targets"][:, -1:]], dim=1)  # the window and its next token
        loss = model(input_ids=chunk, labels=chunk).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast"])
def test_first_steps_have_transformers_losses(kind, fast, hf_dir, text_file, tmp_path):
    path = hf_dir(kind)
    task, cfg, ours = fine_tune(path, text_file, tmp_path / "run", fast=fast)
    assert len(ours) == STEPS
    theirs = transformers_losses(path, task, cfg)
    assert_close(torch.tensor(ours), torch.tensor(theirs))  # metrics.csv keeps 6 significant digits
    assert ours[2] < ours[0]  # it learns


def test_fine_tuning_changes_the_weights_and_the_logits(hf_dir, text_file, tmp_path):
    path = hf_dir("llama")
    fine_tune(path, text_file, tmp_path / "run", fast=True)
    before = load_source(path).model.eval()
    after = load_run(tmp_path / "run", prepare=False).model
    changed = [name for name, p in after.state_dict().items() if not torch.equal(p, before.state_dict()[name])]
    assert len(changed) == len(before.state_dict())  # every tensor was trained
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (after(tokens).logits - before(tokens).logits).abs().max() > 1e-3
