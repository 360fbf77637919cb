"""``aiayn.interop`` refuses what it cannot convert, with messages that name the problem; and it
reads every supported file layout (safetensors, sharded index, ``pytorch_model.bin``).

No transformers needed: the checkpoints are aiayn's ``llama-tiny`` exported with ``export_hf``,
then edited.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from aiayn import build_model, get_preset
from aiayn.interop import InteropError, export_hf, load_hf

# What load_hf/export_hf accept and refuse from files, and the messages: the same on every device, so
# these run once, on the CPU (the parity on a device: test_hf_*.py).
pytestmark = pytest.mark.cpu_only

TOKENS = torch.tensor([[5, 17, 42, 8, 91, 3]])


@pytest.fixture(scope="module")
def source() -> tuple[torch.nn.Module, dict, dict]:
    """(aiayn model, its config.json dict, its tensors) as exported."""
    torch.manual_seed(0)
    model = build_model(get_preset("llama-tiny")).eval()
    return model, *_exported(model)


def _exported(model) -> tuple[dict, dict]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = export_hf(model, model.config, tmp)
        return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def write(path: Path, config: dict, tensors: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_unsupported_model_type(source, tmp_path):
    _, config, tensors = source
    path = write(tmp_path, {**config, "model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, tensors)
    with pytest.raises(InteropError, match=r"model_type 't5' .*not supported; aiayn.interop converts llama/mistral/qwen2 .*gpt2.*bert.*bart.*marian"):
        load_hf(path)


def test_unsupported_architecture(source, tmp_path):
    _, config, tensors = source
    path = write(tmp_path, {**config, "architectures": ["LlamaForSequenceClassification"]}, tensors)
    with pytest.raises(InteropError, match=r"architecture LlamaForSequenceClassification is not supported .*supported: LlamaForCausalLM"):
        load_hf(path)


def test_missing_tensor(source, tmp_path):
    _, config, tensors = source
    name = "model.layers.1.mlp.up_proj.weight"
    path = write(tmp_path, config, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(InteropError, match=rf"missing tensor\(s\) {name}"):
        load_hf(path)


def test_wrong_shape(source, tmp_path):
    _, config, tensors = source
    path = write(tmp_path, {**config, "intermediate_size": 40}, tensors)
    with pytest.raises(InteropError, match=r"model.layers.0.mlp.gate_proj.weight \+ model.layers.0.mlp.up_proj.weight "
                                           r"has shape \(37, 48\) \+ \(37, 48\), but aiayn's decoder.blocks.0.ffn.fc_in.weight "
                                           r"needs \(80, 48\); config.json and the weights disagree"):
        load_hf(path)


def test_unexpected_tensor(source, tmp_path):
    _, config, tensors = source
    path = write(tmp_path, config, {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(8)})
    with pytest.raises(InteropError, match=r"unexpected tensor\(s\) model.layers.0.self_attn.q_norm.weight"):
        load_hf(path)


def test_unsupported_rope_scaling(source, tmp_path):
    _, config, tensors = source
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    path = write(tmp_path, {**config, "rope_parameters": rope}, tensors)
    with pytest.raises(InteropError, match=r"RoPE scaling 'llama3' is not supported"):
        load_hf(path)


def test_tied_copy_that_differs(source, tmp_path):
    _, config, tensors = source
    embed = tensors["model.embed_tokens.weight"]
    path = write(tmp_path, {**config, "tie_word_embeddings": True}, {**tensors, "lm_head.weight": embed + 1})
    with pytest.raises(InteropError, match=r"lm_head.weight differs from model.embed_tokens.weight"):
        load_hf(path)


def test_no_config_or_no_weights(source, tmp_path):
    _, config, _ = source
    with pytest.raises(InteropError, match=r"no config.json"):
        load_hf(tmp_path)
    with pytest.raises(InteropError, match=r"no weights; looked for model.safetensors"):
        load_hf(write(tmp_path, config))
    with pytest.raises(InteropError, match=r"no such model directory"):
        load_hf(tmp_path / "absent")


def test_sharded_safetensors(source, tmp_path):
    model, config, tensors = source
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    write(tmp_path, config)
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, tmp_path / file, metadata={"format": "pt"})
    weight_map = {k: file for file, part in shards.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded, _ = load_hf(tmp_path)
    assert_close(loaded(TOKENS).logits, model(TOKENS).logits, rtol=0, atol=0)


def test_pytorch_model_bin(source, tmp_path):
    model, config, tensors = source
    torch.save(tensors, write(tmp_path, config) / "pytorch_model.bin")
    loaded, _ = load_hf(tmp_path)
    assert_close(loaded(TOKENS).logits, model(TOKENS).logits, rtol=0, atol=0)


class NotATensor:
    pass


def test_pytorch_model_bin_is_never_unpickled(source, tmp_path):
    _, config, tensors = source
    torch.save({**tensors, "evil": NotATensor()}, write(tmp_path, config) / "pytorch_model.bin")
    with pytest.raises(InteropError, match=r"weights_only=True.*never unpickles arbitrary objects"):
        load_hf(tmp_path)


def test_bf16_weights_load_as_float32_or_as_asked(source, tmp_path):
    _, config, tensors = source
    path = write(tmp_path, config, {k: v.to(torch.bfloat16) for k, v in tensors.items()})
    loaded, _ = load_hf(path)
    assert loaded.lm_head.weight.dtype == torch.float32
    assert load_hf(path, dtype=torch.bfloat16)[0].lm_head.weight.dtype == torch.bfloat16


def test_export_of_a_model_no_family_holds(tmp_path):
    config = get_preset("tiny")  # the paper's layout: interleaved sinusoids, no lm_head bias
    with pytest.raises(InteropError, match=r"no Hugging Face family can hold this model: .*positional='sinusoidal'"):
        export_hf(build_model(config), config, tmp_path)
