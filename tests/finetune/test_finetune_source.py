"""``aiayn.finetune.source``: anything ``aiayn.load`` opens loads as a trainable float32 model with its
text front end (a Hugging Face directory, a GGUF file — dequantised, said once —, a shipped model,
a run); ``SourceOption`` loads it once and gives its weights to a new run only."""

from __future__ import annotations

import pytest
import torch
from finetune_helpers import CHAT_TEMPLATE, transformers
from torch.testing import assert_close

from aiayn.finetune.source import Source
from aiayn.tasks import get_task
from aiayn.tasks.sources import SourceOption, load_source
from aiayn.tasks.trained import RunInputError

SMALL = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--d-ff", "64", "--batch-size", "4")


def trainable(source: Source) -> bool:
    params = list(source.model.parameters())
    return source.model.training and all(p.requires_grad and p.dtype == torch.float32 for p in params)


def test_a_hugging_face_directory_loads_with_its_tokenizer_and_template(hf_dir):
    path = hf_dir("llama")
    source = load_source(path)
    assert (source.kind, source.name, source.path) == ("hf", str(path), path) and trainable(source)
    assert source.text.eos_id == 0 and str(source.text.chat_template) == CHAT_TEMPLATE
    assert source.text.encode("the quick fox") == source.text.tokenizer.encode("the quick fox").ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(source.model.eval()(tokens).logits, hf(tokens).logits)


def test_a_gguf_file_is_dequantised_and_said_so_once(tmp_path, text_file, run_aiayn):
    pytest.importorskip("gguf")
    from benchmarks.q4_scaling import LlamaShape, write_random_llama

    path = write_random_llama(tmp_path / "tiny.gguf", LlamaShape(d=64, layers=1, d_ff=64, heads=2, kv_heads=1,
                                                                 vocab=300, tied=True), kind="Q8_0")
    said: list[str] = []
    option = SourceOption(str(path), echo=said.append)
    source = option.get()
    assert option.get() is source and source.kind == "gguf" and trainable(source)
    assert said == ["tiny.gguf: quantised weights (8 Q8_0 tensors) dequantised to float32 for training"]

    code, out, err = run_aiayn("train", "--task", "text", "--data", str(text_file), "--init-from", str(path),
                               "--max-steps", "2", "--batch-size", "2", "--run-dir", str(tmp_path / "run"),
                               "--no-progress")
    assert code == 0, err
    assert out.count("dequantised to float32") == 1 and "finished 2 steps" in out


def test_a_shipped_model_and_a_run_load_with_their_task(tmp_path, text_file, run_aiayn):
    shipped = load_source("shakespeare-char")
    assert shipped.kind == "release" and trainable(shipped) and shipped.run.task.name == "shakespeare-char"
    assert shipped.text.decode(shipped.text.encode("To be")) == "To be"

    code, _, err = run_aiayn("train", "--task", "text", "--data", str(text_file), "--max-steps", "2", *SMALL,
                             "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert code == 0, err
    run = load_source(tmp_path / "run")
    assert run.kind == "run" and trainable(run) and run.config.name == "text"
    assert run.text.decode(run.text.encode("the fox")) == "the fox"


def test_what_is_not_a_model_is_refused_in_one_line(tmp_path):
    with pytest.raises(RunInputError, match="is neither a shipped model"):
        load_source("no-such-model")
    (tmp_path / "notes.txt").write_text("hello", encoding="utf-8")
    with pytest.raises(ValueError, match="a file that is not GGUF"):
        load_source(tmp_path / "notes.txt")


def test_only_a_new_run_starts_from_the_source_weights(hf_dir, text_file, tmp_path):
    path = hf_dir("gpt2")
    task = get_task("text", data=[str(text_file)], init_from=str(path), block_size=16)
    config = task.model_config()
    source = task.source.get()
    new_run = tmp_path / "new-run"
    new_run.mkdir()
    assert task.source.build_model(config, new_run) is source.model
    with_dropout = task.source.build_model(config.replace(dropout=0.1), new_run)
    assert with_dropout is not source.model and with_dropout.config.dropout == 0.1
    assert all(torch.equal(a, b) for a, b in zip(with_dropout.state_dict().values(),
                                                 source.model.state_dict().values(), strict=True))
    outside = task.source.build_model(config, None)  # outside a run (load_run): a checkpoint fills it in
    assert not torch.equal(outside.state_dict()["lm_head.weight"], source.model.state_dict()["lm_head.weight"])
