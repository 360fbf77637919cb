"""Model files and configs are checked for type, then range, before anything is allocated: GGUF
headers are bounded by the file's size, Hugging Face config.json keys by their types, a model's
size by the machine's memory; shard indexes stay inside their directory; unknown config keys are
named with the closest known one."""

from __future__ import annotations

import json
import math
import resource
import struct
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from aiayn import build_model
from aiayn.config import ConfigError, ModelConfig, TrainConfig
from aiayn.interop.gguf import GGUFError, check_header, load_gguf
from aiayn.interop.hf import load_hf
from aiayn.interop.mapping import InteropError


def string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def header(n_tensors: int, n_keys: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_keys)


LYING_GGUF = {
    "an array of 2^40 elements": (header(0, 1) + string("general.architecture") + struct.pack("<IIQ", 9, 0, 2**40),
                                  r"declares 1,099,511,627,776 elements"),
    "2^62 tensors": (header(2**62, 0), r"declares 4,611,686,018,427,387,904 tensors"),
    "2^40 metadata keys": (header(0, 2**40), r"metadata keys, more than"),
    "a key longer than the file": (header(0, 1) + struct.pack("<Q", 2**50) + bytes(16), r"a metadata key needs"),
    "version 7": (header(0, 0, version=7), r"GGUF version 7"),
    "an unknown value type": (header(0, 1) + string("k") + struct.pack("<I", 99), r"unknown GGUF value type 99"),
    "a tensor of 2^60 values": (header(1, 0) + string("t") + struct.pack("<IQQ", 2, 2**30, 2**30) + bytes(12),
                                r"tensor t claims 1,152,921,504,606,846,976 values"),
    "a tensor of 1,000 dimensions": (header(1, 0) + string("t") + struct.pack("<I", 1000) + bytes(32),
                                     r"1,000 dimensions"),
    "a truncated header": (header(0, 1)[:20], r"too short for a GGUF header"),
}


@pytest.mark.parametrize("name", LYING_GGUF)
def test_lying_gguf_header_is_refused_before_any_allocation(name, tmp_path):
    content, message = LYING_GGUF[name]
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(GGUFError, match=message):
        load_gguf(path)
    assert time.monotonic() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB


@settings(max_examples=80, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=300), counts=st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)))
def test_random_gguf_headers_fail_only_with_gguf_error(body, counts, tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(header(*counts) + body)
    try:
        check_header(path)
    except GGUFError as exc:
        assert "\n" not in str(exc)


def test_block_count_of_3e8_is_refused_by_size(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "huge.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 300_000_000, "embedding_length": 64, "feed_forward_length": 128,
                       "attention.head_count": 4, "context_length": 128}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", torch.zeros(32, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    start = time.monotonic()
    with pytest.raises(GGUFError, match=r"llama.block_count is 300,000,000 but the file holds only 1 tensors"):
        load_gguf(path)
    assert time.monotonic() - start < 10


# ---- Hugging Face directories ---------------------------------------------------------------------
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def model_dir(tmp_path: Path, config: dict, tensors: dict | None = None, index: dict | None = None) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if index is not None:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    else:
        save_file(tensors or {"x": torch.zeros(1)}, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_size": 2**20}, r"would need about .* GiB .*d_model=1048576, .* choose smaller sizes"),
    ({"num_hidden_layers": 10**8}, r"would need about .* n_layers=100000000"),
    ({"max_position_embeddings": 10**12}, r"would need about .* max_seq_len=1000000000000"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false, got 'false'"),
    ({"hidden_size": "32"}, r"hidden_size must be a whole number >= 0, got '32'"),
    ({"num_hidden_layers": True}, r"num_hidden_layers must be a whole number"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a finite number"),
])
def test_hf_config_is_checked_before_the_model_is_built(change, message, tmp_path):
    start = time.monotonic()
    with pytest.raises((InteropError, ConfigError), match=message):
        load_hf(model_dir(tmp_path, {**LLAMA, **change}))
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(("shard", "message"), [
    ("../outside.safetensors", r"not a weights file name"),
    ("/etc/passwd", r"not a weights file name"),
    ("model.safetensors.index.json", r"nested indexes are refused"),
    ("missing.safetensors", r"lists shard missing.safetensors, which is not in"),
])
def test_shard_index_stays_in_its_directory(shard, message, tmp_path):
    (tmp_path / "outside.safetensors").write_bytes(b"")
    with pytest.raises(InteropError, match=message):
        load_hf(model_dir(tmp_path, LLAMA, index={"model.embed_tokens.weight": shard}))


def test_integer_weights_are_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")}))
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
    with pytest.raises(InteropError, match=r"model.norm.weight|norm.*hold torch.int32 values where floating-point"):
        load_hf(model_dir(tmp_path, LLAMA, tensors))


# torch's safe unpickler warns about the protocol of the pickle this test writes on purpose
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_pickle_checkpoint_advice_never_says_weights_only_false(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04not a real pickle")
    with pytest.raises(InteropError) as info:
        load_hf(directory)
    assert "weights_only=False" not in str(info.value) and "safetensors" in str(info.value)


# ---- configs ------------------------------------------------------------------------------------
def test_unknown_keys_are_named_with_the_closest_known_one():
    with pytest.raises(ConfigError, match=r"d_modle \(did you mean d_model\?\)"):
        ModelConfig.from_dict({"d_modle": 64})
    with pytest.raises(ConfigError, match=r"lrr \(did you mean lr\?\)"):
        TrainConfig.from_dict({"lrr": 0.1})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("lr", float("nan"), r"lr must be a finite number"), ("lr", "0.1", r"lr must be a number, got '0.1'"),
    ("eps", float("inf"), r"eps must be a finite number"), ("seed", 2**70, r"seed must be an integer in \[0, 2\*\*32\)"),
    ("bf16", "false", r"bf16 must be true or false"), ("clip_grad_norm", float("nan"), r"clip_grad_norm"),
    ("betas", (0.9, float("nan")), r"each of betas must be a finite number"),
])
def test_train_config_type_then_range(field, value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{field: value})


@pytest.mark.parametrize(("sizes", "field"), [({"d_model": 2**20, "n_heads": 8}, "d_model=1048576"),
                                              ({"n_layers": 10**7}, "n_layers=10000000"),
                                              ({"vocab_size": 10**11}, "vocab_size=100000000000"),
                                              ({"max_seq_len": 10**11}, "max_seq_len=100000000000")])
def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(sizes, field):
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"would need about .* GiB .*{field}"):
        build_model(ModelConfig(arch="decoder-only", **sizes))
    assert time.monotonic() - start < 2


values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                   st.text(max_size=8), st.lists(st.integers(), max_size=3))


@settings(max_examples=100, deadline=2000)
@given(data=st.dictionaries(st.sampled_from(["d_model", "n_heads", "n_layers", "d_ff", "vocab_size", "dropout",
                                             "max_seq_len", "tie_output", "bias", "positional", "n_kv_heads",
                                             "activation", "norm", "padding_free"]), values, max_size=4))
def test_random_model_configs_fail_only_with_config_error(data):
    try:
        config = ModelConfig.from_dict(data)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    for name in ("d_model", "n_heads", "n_layers", "d_ff", "vocab_size", "max_seq_len"):
        assert isinstance(getattr(config, name), int) and not isinstance(getattr(config, name), bool)
    assert math.isfinite(config.dropout)


def test_unknown_task_options_and_names_are_refused_with_the_closest_one(capsys):
    from aiayn.tasks.base import UnknownTaskError, get_task

    with pytest.raises(UnknownTaskError, match=r"task 'reverse' has no option seq_lenn \(did you mean seq_len\?\)"):
        get_task("reverse", seq_lenn=5)
    with pytest.raises(UnknownTaskError, match=r"unknown task 'revers' \(did you mean reverse\?\)"):
        get_task("revers")
    assert get_task("reverse", seq_len=5).seq_len == 5


def test_unknown_recipe_keys_are_named_with_the_closest_one(tmp_path, capsys):
    from aiayn.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("task: reverse\ntrian:\n  lr: 0.1\n", encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        main(["train", "--recipe", str(recipe), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "got trian (did you mean train?)" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
