"""LoRA runs through the trainer: only the adapters in the optimiser, only the adapters in the
checkpoints of a run whose task loads its base again (``init_from``), ``load_run`` rebuilding base +
adapters, and exact resume."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aiayn.config import ConfigError, TrainConfig
from aiayn.finetune.lora import LoraConfig, LoraLinear, apply_lora, is_adapter_key
from aiayn.tasks.base import TASKS, get_task
from aiayn.tasks.reverse import ReverseTask
from aiayn.tasks.trained import load_run
from aiayn.train.checkpoint import latest_checkpoint
from aiayn.train.optim import make_optimizer
from aiayn.train.trainer import train

LORA = {"rank": 2, "alpha": 4.0, "dropout": 0.1, "targets": ["q", "v", "o", "down"]}


class LoadedBaseTask(ReverseTask):
    """The reverse task with a starting model it rebuilds the same each time, as a task with
    ``init_from`` loads its model again."""

    name = "reverse-loaded-base"

    def __init__(self, *, init_from: str | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.options["init_from"] = init_from

    def build_model(self, config):
        with torch.random.fork_rng():
            torch.manual_seed(1234)
            return super().build_model(config)


@pytest.fixture
def loaded_base_task(monkeypatch):
    monkeypatch.setitem(TASKS, LoadedBaseTask.name, LoadedBaseTask)
    return get_task(LoadedBaseTask.name, init_from="a-base", n_train=256, n_val=64, n_test=64)


def _config(steps: int) -> TrainConfig:
    return TrainConfig(max_steps=steps, batch_size=32, lr=1e-2, schedule="constant", warmup_steps=1, eval_every=1000, save_every=2,
                       keep_checkpoints=5, lora=LORA)


def _train(task, run_dir, steps, **kw):
    return train(task, task.model_config(), _config(steps), run_dir, progress=False, make_plots=False,
                 echo=lambda _: None, **kw)


def _weights(run_dir):
    return load_file(latest_checkpoint(run_dir / "checkpoints") / "model.safetensors")


def test_from_scratch_lora_run_trains_only_adapters(tmp_path):
    task = get_task("reverse", n_train=256, n_val=64, n_test=64)
    _train(task, tmp_path / "run", 4)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    moments = load_file(ckpt / "optimizer.safetensors")
    run = load_run(tmp_path / "run", prepare=False)
    adapters = [n for n, p in run.model.named_parameters() if is_adapter_key(n)]
    assert len({k.split(".")[1] for k in moments if k.startswith("state.")}) == len(adapters) > 0
    # No init_from: the random base cannot be rebuilt, so the checkpoint keeps it.
    assert "weights" not in json.loads((ckpt / "state.json").read_text())
    assert not all(is_adapter_key(k) for k in _weights(tmp_path / "run"))
    assert any(isinstance(m, LoraLinear) for m in run.model.modules())
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["lora"] == LORA


def test_adapter_only_checkpoints_load_and_resume_exactly(tmp_path, loaded_base_task):
    task = loaded_base_task
    result = _train(task, tmp_path / "straight", 6)
    saved = _weights(tmp_path / "straight")
    assert saved and all(is_adapter_key(k) for k in saved)
    ckpt = latest_checkpoint(tmp_path / "straight" / "checkpoints")
    assert json.loads((ckpt / "state.json").read_text())["weights"] == "adapters"
    run = load_run(tmp_path / "straight", prepare=False)  # base from the task, adapters from the checkpoint
    assert task.evaluate(run.model, "test") == pytest.approx(result.test_metrics)  # (the same data)
    base = task.build_model(task.model_config()).state_dict()
    for name, value in run.model.state_dict().items():
        torch.testing.assert_close(value, saved[name] if is_adapter_key(name) else base[name], rtol=0, atol=0)

    _train(task, tmp_path / "resumed", 2)
    _train(task, tmp_path / "resumed", 6, resume=True)
    resumed = _weights(tmp_path / "resumed")
    assert resumed.keys() == saved.keys()
    for name in saved:
        torch.testing.assert_close(resumed[name], saved[name], rtol=0, atol=0)


def test_adapters_take_the_multi_tensor_step_with_the_per_tensor_arithmetic():
    """Beside a frozen base the optimiser steps all the adapters in one multi-tensor call, bit for bit
    what the per-tensor step gives; a whole model keeps the per-tensor step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    cfg = TrainConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert not make_optimizer(model, cfg).param_groups[0]["foreach"]
    apply_lora(model, LoraConfig(rank=2, targets=("q", "v")), {"0": {"q": (0, 3), "v": (3, 3)}})
    ours = make_optimizer(model, cfg)
    assert ours.param_groups[0]["foreach"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    copies = [p.detach().clone().requires_grad_() for p in trainable]
    per_tensor = torch.optim.AdamW(copies, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                   foreach=False)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in trainable]
        for params, optimizer in ((trainable, ours), (copies, per_tensor)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
    for p, q in zip(trainable, copies, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_bad_lora_config_fails_before_the_run_directory(tmp_path):
    task = get_task("reverse", n_train=64, n_val=16, n_test=16)
    with pytest.raises(ConfigError, match="lora rank"):
        train(task, task.model_config(), _config(2).replace(lora={"rank": 0}), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_lora_run_s_adapter_loads_in_peft(tmp_path, monkeypatch, run_aiayn, tiny_gpt2):
    """``aiayn adapter --run``: the run's adapters in PEFT's layout give PEFT the run's logits."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from aiayn.interop import export_hf

    class Gpt2BaseTask(LoadedBaseTask):
        name = "reverse-gpt2-base"

        def model_config(self):
            return tiny_gpt2[3]

    monkeypatch.setitem(TASKS, Gpt2BaseTask.name, Gpt2BaseTask)
    task = get_task(Gpt2BaseTask.name, init_from="a-gpt2", n_train=256, n_val=64, n_test=64)
    train(task, task.model_config(), _config(4).replace(lora={"rank": 2, "targets": ["qkv", "down"]}),
          tmp_path / "run", progress=False, make_plots=False, echo=lambda _: None)
    code, out, _ = run_aiayn("adapter", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "adapter"))
    assert code == 0 and "adapter_model.safetensors" in out
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "a-gpt2"
    hf = transformers.GPT2LMHeadModel.from_pretrained(
        export_hf(task.build_model(task.model_config()), task.model_config(), tmp_path / "base")).eval()
    tokens = torch.randint(0, 10, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = load_run(tmp_path / "run", prepare=False).model(tokens).logits
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        torch.testing.assert_close(theirs(tokens).logits, expected)
    code, _, err = run_aiayn("adapter", "--run", str(tmp_path / "base"), "--out", str(tmp_path / "x"))
    assert code == 2 and "is not an aiayn run config" in err  # a Hugging Face directory is not a run
