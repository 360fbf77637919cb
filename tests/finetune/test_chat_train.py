"""The chat task through the trainer: a tiny fine-tune moves the weights and its run loads back;
refusals come before any run directory is made."""

from __future__ import annotations

import json
import re

import pytest
import torch
from chat_fixtures import CONVERSATIONS, chat_source, write_chat_model, write_jsonl

from aiayn.config import ConfigError, TrainConfig
from aiayn.data.parallel import DataError
from aiayn.tasks import get_task
from aiayn.tasks.runs import setup_run
from aiayn.tasks.sources import SourceOption
from aiayn.tasks.trained import load_run
from aiayn.train.trainer import train


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("chat-model") / "model")


def fine_tune(task, run_dir):
    config = TrainConfig(task="chat", max_steps=3, batch_size=2, lr=1e-2, warmup_steps=0, eval_every=3,
                         save_every=3, average_last=0)
    return train(task, task.model_config(), config, run_dir, progress=False, make_plots=False,
                 echo=lambda _: None)


def test_a_tiny_fine_tune_moves_the_weights_and_loads_back(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    task = get_task("chat", data=str(data), init_from=str(model_dir), block_size=64)
    before = {k: v.clone() for k, v in task.source.get().model.state_dict().items()}
    result = fine_tune(task, tmp_path / "run")
    assert result.step == 3 and torch.isfinite(torch.tensor(result.final_loss))
    assert torch.isfinite(torch.tensor(result.test_metrics["nll"]))
    tuned = load_run(tmp_path / "run", prepare=False).model.state_dict()
    assert set(tuned) == set(before)
    assert any(not torch.equal(tuned[k], before[k]) for k in before)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["task_options"]["init_from"] == str(model_dir)


def test_a_bad_line_leaves_no_run_directory(tmp_path, model_dir):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(CONVERSATIONS[0]) + "\n{oops\n", encoding="utf-8")
    task = get_task("chat", data=str(data), init_from=str(model_dir))
    with pytest.raises(DataError, match=rf"^{re.escape(str(data))}:2: not JSON"):
        fine_tune(task, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_chat_task_needs_a_starting_model_with_a_chat_template(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    with pytest.raises(ConfigError, match=r"^the chat task fine-tunes a model that has a chat template; give --init-from"):
        get_task("chat", data=str(data))
    with pytest.raises(ConfigError, match=r"^the chat task trains on your conversations; give --data"):
        get_task("chat", init_from=str(model_dir))
    plain = chat_source(tmp_path / "plain")
    plain.text.chat_template = None
    task = get_task("chat", data=str(data), init_from=str(plain.path))
    task.source = SourceOption(None, injected=plain)
    with pytest.raises(ConfigError, match="has no chat template; the chat task renders conversations through it"):
        task.prepare(0)
    task = get_task("chat", data=str(data), init_from=str(model_dir), block_size=257)
    with pytest.raises(ConfigError, match=r"^block_size is 257 but the model's context is 256 positions"):
        task.prepare(0)


def test_lora_takes_the_chat_task_s_lora_learning_rate_unless_one_is_given(tmp_path, model_dir):
    """Full fine-tuning 2e-5; with LoRA (from the command line or a recipe) 2e-4; an --lr or a recipe's lr wins."""
    data = str(write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS))

    def lr(train_options: dict, recipe: str | None = None) -> float:
        path = None
        if recipe is not None:
            path = tmp_path / "recipe.yaml"
            path.write_text(recipe, encoding="utf-8")
        return setup_run("chat", recipe=path, train_options=train_options,
                         task_options={"data": [data], "init_from": str(model_dir)}).train_config.lr

    lora = {"lora": {"rank": 4}}
    assert lr({}) == 2e-5
    assert lr(lora) == 2e-4
    assert lr({**lora, "lr": 1e-3}) == 1e-3
    assert lr({}, "train:\n  lora: {rank: 4}\n") == 2e-4
    assert lr(lora, "train:\n  lr: 0.003\n") == 3e-3


def _chat_run(run_aiayn, source, data, run_dir, steps, *extra):
    return run_aiayn("train", "--task", "chat", "--init-from", str(source), "--data", str(data), "--val-data",
                     str(data), "--batch-size", "2", "--max-steps", str(steps),
                     "--run-dir", str(run_dir), "--no-progress", *extra)


def test_a_full_fine_tune_resumes_without_its_source_and_a_lora_one_names_it(tmp_path, model_dir, run_aiayn):
    """A full fine-tune's checkpoints hold every weight and the run keeps the tokenizer and template, so
    it resumes after its source has moved; a LoRA run's hold only the adapters: one line names the base."""
    import shutil

    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    source = shutil.copytree(model_dir, tmp_path / "source")
    for name, extra in (("full", ()), ("lora", ("--lora-rank", "2"))):
        code, _, err = _chat_run(run_aiayn, source, data, tmp_path / name, 1, *extra)
        assert code == 0, err
    source.rename(tmp_path / "moved")
    code, _, err = run_aiayn("train", "--resume", "--run-dir", str(tmp_path / "full"), "--max-steps", "2",
                             "--no-progress")
    assert code == 0, err
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["step"] == 2
    code, _, err = run_aiayn("train", "--resume", "--run-dir", str(tmp_path / "lora"), "--max-steps", "2",
                             "--no-progress")
    assert code != 0 and "Traceback" not in err
    assert f"hold only its LoRA adapters: it resumes on the model they go on, {source}; put it back there" in err
