"""A checkpoint whose state.json lost a key, or a GGUF file whose metadata holds a value of the
wrong type, gives one message naming the file, never a KeyError or ValueError traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiayn.interop.gguf import GGUFError, load_gguf
from aiayn.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from aiayn.train.trainer import train


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from aiayn.config import TrainConfig
    from aiayn.tasks import get_task

    task = get_task("reverse", n_train=64, n_val=16, n_test=16)
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    train(task, task.model_config(), TrainConfig(max_steps=2, batch_size=16, save_every=2, eval_every=1000),
          run_dir, progress=False, echo=lambda _: None, make_plots=False)
    return run_dir


@pytest.mark.parametrize("key", ["step", "epoch", "batch_in_epoch", "python_rng"])
def test_state_json_without_a_key(run, key, tmp_path):
    import shutil

    from aiayn.tasks import get_task

    checkpoint = latest_checkpoint(run / "checkpoints")
    assert checkpoint is not None
    copy = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, copy)
    state = json.loads((copy / "state.json").read_text())
    state.pop(key)
    (copy / "state.json").write_text(json.dumps(state))
    task = get_task("reverse", n_train=64, n_val=16, n_test=16)
    with pytest.raises(CheckpointError, match=rf"corrupt or truncated \(state.json: state.json lacks {key}"):
        load_checkpoint(copy, task.build_model(task.model_config()))


def test_gguf_metadata_of_the_wrong_type(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "wrong.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("llama.block_count", "two")  # a string where a count belongs
    for key, value in {"embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
                       "context_length": 128}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"metadata holds a value of the wrong type .*invalid literal"):
        load_gguf(path)


def test_a_metrics_window_of_junk_in_state_json_counts_as_empty():
    """The half-filled metrics row a checkpoint keeps (loss, steps, NLL, token counts): a value that
    is not a finite number, or a window that is not an object, is taken as 0 - the first row after
    the resume then averages fewer steps, and training goes on."""
    from aiayn.train.distributed import DistContext
    from aiayn.train.trainer import MetricsWindow

    one = DistContext()
    junk = {"loss": "x", "steps": float("nan"), "nll": [1.0], "tokens": True, "correct": float("inf")}
    window = MetricsWindow.restored(junk, one)
    assert (window.loss, window.steps, window.nll, window.tokens, window.correct) == (0, 0, 0, 0, 0)
    assert MetricsWindow.restored(["not", "an", "object"], one).steps == 0  # type: ignore[arg-type]
    kept = MetricsWindow.restored({"loss": 2.5, "steps": 3, "nll": 40.0, "tokens": 20, "correct": 7}, one)
    assert (kept.loss, kept.steps, kept.nll, kept.tokens, kept.correct) == (2.5, 3, 40.0, 20, 7)
    other_rank = MetricsWindow.restored({"loss": 2.5, "steps": 3, "nll": 40.0, "tokens": 20}, DistContext(1, 2))
    assert (other_rank.loss, other_rank.steps, other_rank.nll, other_rank.tokens) == (2.5, 3, 0, 0)
