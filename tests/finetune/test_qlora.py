"""QLoRA (aiayn.finetune.qlora): a 4-bit layer with adapters computes what a LoraLinear over its
dequantised weight computes, with the same gradients; training moves the adapters and lowers the loss
while the 4-bit base stays as it is; a GGUF file's 4-bit blocks are kept, not re-quantised; ``aiayn train
--quantize q4`` saves adapters that load into a float model in PEFT's layout, resumes, and refuses what
cannot work in one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from aiayn.config import ConfigError, TrainConfig
from aiayn.fast import q4_build, switch
from aiayn.fast.q4 import BlockWeight, error_bound
from aiayn.finetune import qlora
from aiayn.finetune.lora import LoraConfig, LoraLinear, apply_lora, is_adapter_key, lora_state_dict
from aiayn.finetune.peft_format import load_adapter
from aiayn.finetune.qlora import (
    FrozenBlockLinear,
    QLoraLinear,
    apply_qlora,
    four_bit,
    gguf_blocks,
    qlora_adapt,
)
from aiayn.tasks.sources import load_source
from aiayn.train.checkpoint import latest_checkpoint
from aiayn.train.memory import model_counts

ROWS = {"q": (0, 32), "v": (64, 32)}  # two parts of a 96-row stacked projection, rows 32-63 left alone


def _lora_and_qlora() -> tuple[LoraLinear, QLoraLinear]:
    """(a LoraLinear over the dequantised weight, the QLoraLinear made from it), nonzero B's."""
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(64, 96))
    apply_lora(holder, LoraConfig(rank=4, alpha=8), sites={"0": ROWS})
    with torch.no_grad():
        for b in holder[0].lora_B.values():
            b.normal_()
    qlora = four_bit(copy.deepcopy(holder[0]))
    lora = holder[0]
    with torch.no_grad():
        lora.weight.copy_(qlora.dequantized())
    return lora, qlora


def _grads(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * g).sum().backward()
    params = [layer.lora_A[n] for n in ROWS] + [layer.lora_B[n] for n in ROWS]
    return (y.detach(), x.grad, *(p.grad for p in params))


@pytest.mark.parametrize("kernel", [False, True], ids=["plain-torch", "q4-kernel"])
def test_a_qlora_layer_computes_and_differentiates_as_lora_over_its_dequantised_weight(kernel):
    if kernel and q4_build.OPS is None:
        pytest.skip("the q4 kernel is not built here")
    lora, qlora = _lora_and_qlora()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(2))
    with switch.plain_torch() if not kernel else torch.enable_grad():
        got = _grads(qlora, x, g)
    want = _grads(lora, x, g)
    if kernel:  # activations quantised per block: within the kernel's bound (plus float32 rounding)
        bound = error_bound(x.reshape(-1, 64), qlora.weight_blocks).reshape(2, 5, 96)
        assert bool(((got[0] - want[0]).abs() <= bound + 1e-5).all())
    else:
        torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1:], want[1:], strict=True):  # x, A's, B's: the backward never uses the kernel
        torch.testing.assert_close(a, b)
    assert not any(b.requires_grad for b in qlora.buffers())  # the base: buffers, no gradient


def test_qlora_training_moves_only_the_adapters_and_lowers_the_loss(tiny_llama, tokens):
    model = copy.deepcopy(tiny_llama[2]).train()
    apply_qlora(model, LoraConfig(rank=4, targets=("q", "v")))
    four_bits = [m for m in model.modules() if isinstance(m, FrozenBlockLinear)]
    assert len(four_bits) == 6  # qkv_proj (q and v adapted), out_proj, fc_in per layer
    assert sum(isinstance(m, QLoraLinear) for m in four_bits) == 2
    assert type(model.decoder.blocks[0].ffn.fc_out) is nn.Linear  # 40 inputs: no 32-wide blocks, stays float
    assert all(not p.requires_grad for n, p in model.named_parameters() if not is_adapter_key(n))
    base = {n: b.clone() for n, b in model.named_buffers()}
    start = {n: p.clone() for n, p in lora_state_dict(model).items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    losses = []
    for _ in range(6):
        logits = model(tokens[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        assert model.decoder.blocks[0].self_attn.qkv_proj.lora_B["q"].grad.abs().sum() > 0  # via 4-bit layers
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(not torch.equal(p, start[n]) for n, p in lora_state_dict(model).items() if "lora_B" in n)
    assert all(torch.equal(b, base[n]) for n, b in model.named_buffers())


def test_the_memory_check_counts_the_4bit_base_in_its_bytes(tiny_llama):
    model, config = tiny_llama[2], tiny_llama[3]

    class Built:  # the one Task method model_counts calls
        @staticmethod
        def build_model(_config):
            return model

    lora = LoraConfig(rank=4, targets=("q", "v"))
    float_counts = model_counts(Built, config, adapt=lambda m: apply_lora(m, lora))
    four_bit_counts = model_counts(Built, config, adapt=qlora_adapt(lora, None))
    assert four_bit_counts.trainable == float_counts.trainable
    assert four_bit_counts.weights < float_counts.weights
    assert not any(isinstance(m, LoraLinear) for m in model.modules())  # the source model stays as it was


def _q4_gguf(tmp_path):
    """A random one-layer LLaMA GGUF, every matrix Q4_0, with a 300-token tokenizer."""
    pytest.importorskip("gguf")
    from benchmarks.q4_scaling import LlamaShape, write_random_llama

    return write_random_llama(tmp_path / "tiny.gguf", LlamaShape(d=64, layers=1, d_ff=64, heads=2, kv_heads=1,
                                                                 vocab=300, tied=True), kind="Q4_0")


def test_a_gguf_files_4bit_blocks_are_kept_not_requantised(tmp_path):
    path = _q4_gguf(tmp_path)
    source = load_source(path, echo=lambda _: None)
    floats = {n: m.weight.detach().clone() for n, m in source.model.named_modules() if isinstance(m, nn.Linear)}
    blocks = gguf_blocks(path)
    qlora_adapt(LoraConfig(rank=2), source.path)(source.model)
    layers = {n: m for n, m in source.model.named_modules() if isinstance(m, FrozenBlockLinear)}
    assert len(layers) == 4  # qkv_proj, out_proj, fc_in (gate and up), fc_out
    for name, layer in layers.items():
        kept: BlockWeight = blocks[name]
        assert layer.kind == "Q4_0" and torch.equal(layer.q, kept.q) and torch.equal(layer.scale, kept.scale)
        torch.testing.assert_close(layer.dequantized(), floats[name], rtol=0, atol=0)  # the file's values


LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,k,v,o")
QUIET = ("--batch-size", "4", "--no-progress", "--lr", "1e-2", "--schedule", "constant", "--save-every", "2")


def _train(run_aiayn, run_dir, source_dir, text_file, steps, *extra):
    code, _, err = run_aiayn("train", "--task", "text", "--data", str(text_file), "--init-from", str(source_dir),
                             "--max-steps", str(steps), "--run-dir", str(run_dir), *LORA, *QUIET, *extra)
    assert code == 0, err
    return load_file(latest_checkpoint(run_dir / "checkpoints") / "model.safetensors")


def test_a_qlora_run_keeps_adapters_that_load_into_the_float_model_and_resumes_exactly(
        tmp_path, text_file, run_aiayn, monkeypatch):
    source_dir = _q4_gguf(tmp_path)
    read = []  # the GGUF files whose blocks the trainer kept
    monkeypatch.setattr(qlora, "gguf_blocks", lambda path: read.append(path) or gguf_blocks(path))
    straight = _train(run_aiayn, tmp_path / "straight", source_dir, text_file, 4, "--quantize", "q4")
    assert straight and all(is_adapter_key(k) for k in straight)
    assert json.loads((tmp_path / "straight" / "config.json").read_text())["train"]["quantize"] == "q4"
    assert read == [source_dir]

    _train(run_aiayn, tmp_path / "resumed", source_dir, text_file, 2, "--quantize", "q4")
    code, _, err = run_aiayn("train", "--resume", "--run-dir", str(tmp_path / "resumed"), "--max-steps", "4",
                             "--no-progress")
    assert code == 0, err
    resumed = load_file(latest_checkpoint(tmp_path / "resumed" / "checkpoints") / "model.safetensors")
    assert resumed.keys() == straight.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)

    code, _, err = run_aiayn("adapter", "--run", str(tmp_path / "straight"), "--out", str(tmp_path / "adapter"))
    assert code == 0, err
    source = load_source(source_dir, echo=lambda _: None)
    load_adapter(source.model, source.config, tmp_path / "adapter")  # PEFT's layout, on the float model
    loaded = lora_state_dict(source.model)
    assert loaded.keys() == straight.keys() and all(torch.equal(loaded[k], straight[k]) for k in straight)


def test_a_train_config_with_quantize_needs_lora_and_knows_only_q4():
    with pytest.raises(ConfigError, match="quantize='q4' needs lora"):
        TrainConfig(quantize="q4")
    with pytest.raises(ConfigError, match="quantize='q8' is not known; choose one of q4"):
        TrainConfig(quantize="q8", lora={"rank": 4})
    assert TrainConfig.from_dict(TrainConfig(quantize="q4", lora={"rank": 4}).to_dict()).quantize == "q4"


def test_quantize_without_lora_or_a_loaded_model_is_refused_in_one_line(tmp_path, text_file, hf_dir, run_aiayn):
    code, _, err = run_aiayn("train", "--task", "text", "--data", str(text_file), "--init-from",
                             str(hf_dir("llama")), "--quantize", "q4", "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "--quantize q4 needs --lora-rank" in err and not (tmp_path / "run").exists()
    code, _, err = run_aiayn("train", "--quantize", "q4", "--lora-rank", "4", "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "give init_from (--init-from)" in err and not (tmp_path / "run").exists()
    code, _, err = run_aiayn("train", "--quantize", "q8", "--lora-rank", "4", "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "'q8' is not 'q4'" in err
