"""Separate vocabularies (task option ``vocabulary: separate``): what contradicts them is one error
line from ``aiayn train`` (exit code 2, no traceback, nothing trained), and what does not ask for
them is as it was (a joint run records no new option; an old run loads as joint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.config import ConfigError
from aiayn.data import data_dir
from aiayn.data.parallel import read_lines
from aiayn.tasks import get_task

MULTI30K = data_dir() / "multi30k"


def recipe(path: Path, task_options: dict[str, object], model: dict[str, object] | None = None) -> Path:
    """A translation recipe of ``task_options`` (and ``model`` fields) of one training step."""
    lines = ["task: translation", "task_options:", *(f"  {k}: {v}" for k, v in task_options.items())]
    if model:
        lines += ["model:", *(f"  {k}: {v}" for k, v in model.items())]
    path.write_text("\n".join([*lines, "train:", "  max_steps: 1", ""]), encoding="utf-8")
    return path


@pytest.mark.parametrize(("task_options", "model", "message"), [
    ({"vocabulary": "both"}, None, "vocabulary must be one of joint, separate, got 'both'"),
    ({"tgt_vocab_size": 300}, None,
     "tgt_vocab_size=300 sizes the target BPE of vocabulary: separate; a joint vocabulary has one size, "
     "vocab_size (set vocabulary: separate, or drop tgt_vocab_size)"),
    ({"vocabulary": "separate", "tgt_vocab_size": 3}, None,
     "tgt_vocab_size must be an integer above 4 (the special tokens), got 3"),
    # Equal sizes: ModelConfig would let shared embeddings through; the task does not.
    ({"vocabulary": "separate", "vocab_size": 200, "tgt_vocab_size": 200}, {"share_embeddings": "true"},
     "vocabulary: separate gives the source and the target a BPE each, but the model has "
     "share_embeddings=True (one embedding for both); set share_embeddings: false, or vocabulary: joint"),
    ({"vocabulary": "separate", "vocab_size": 200, "tgt_vocab_size": 260}, {"share_embeddings": "true"},
     "share_embeddings=True needs one vocabulary, but vocab_size=200 and tgt_vocab_size=260"),
    ({"vocabulary": "separate", "vocab_size": 200}, {"vocab_size": 100},
     "the model's vocab_size is 100 but the task's source BPE has up to 200 tokens"),
    ({"vocabulary": "separate", "tgt_vocab_size": 300}, {"tgt_vocab_size": 299},
     "the model's tgt_vocab_size is 299 but the task's target BPE has up to 300 tokens"),
])
def test_contradictions_are_one_line(task_options: dict[str, object], model: dict[str, object] | None,
                                     message: str, tmp_path: Path, run_aiayn) -> None:
    code, _, err = run_aiayn("train", "--recipe", str(recipe(tmp_path / "r.yaml", task_options, model)),
                               "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


@pytest.mark.skipif(not (MULTI30K / "train.en").is_file(), reason="Multi30k not found (set AIAYN_DATA_DIR)")
@pytest.mark.parametrize(("options", "message"), [
    ({"vocabulary": "separate", "vocab_size": 200, "tgt_vocab_size": 20},
     ("the target BPE has", "but tgt_vocab_size is 20; raise tgt_vocab_size")),
    ({"vocab_size": 20}, ("the joint BPE has", "but vocab_size is 20; raise vocab_size")),
], ids=["separate", "joint"])
def test_a_size_below_the_alphabet_is_one_line(options: dict[str, object], message: tuple[str, str],
                                               tmp_path: Path, run_aiayn) -> None:
    """Known only once the BPE is learned: its alphabet alone is more than 20 tokens."""
    for lang in ("en", "de"):
        lines = read_lines(MULTI30K / f"train.{lang}")[:20]
        for split in ("train", "val", "test"):
            (tmp_path / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    options = {**options, "corpus_dir": str(tmp_path), "test_split": "test"}
    code, _, err = run_aiayn("train", "--recipe", str(recipe(tmp_path / "r.yaml", options)),
                               "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message[0] in err and message[1] in err, err


def test_the_task_refuses_shared_embeddings_when_called_directly() -> None:
    """Through the Python API (no recipe): building the model is refused too."""
    task = get_task("translation", vocabulary="separate", vocab_size=200, tgt_vocab_size=200)
    config = task.model_config()
    assert (config.vocab_size, config.tgt_vocab_size, config.share_embeddings, config.tie_output) == \
        (200, 200, False, True)
    with pytest.raises(ConfigError, match="share_embeddings=True"):
        task.build_model(config.replace(share_embeddings=True))


def test_joint_runs_are_as_they_were() -> None:
    joint = get_task("translation")
    assert "vocabulary" not in joint.options and "tgt_vocab_size" not in joint.options  # config.json unchanged
    assert joint.vocabulary == "joint" and joint.model_config().share_embeddings
    assert joint.model_config().tgt_vocab_size == joint.model_config().vocab_size == 8000
    separate = get_task("translation", vocabulary="separate")  # the target as large as the source
    assert separate.options["vocabulary"] == "separate" and separate.model_config().tgt_vocab_size == 8000


def test_a_shipped_joint_model_loads_its_one_tokenizer_on_both_sides() -> None:
    """The shipped releases' config.json predates separate vocabularies: joint, tokenizer.json (the
    en->de ensemble's first member, the model shipped alone before it)."""
    from aiayn.tasks.runs import load_translator
    from aiayn.tasks.trained import shipped_path, single_model

    task, translator = load_translator(single_model(shipped_path("multi30k-en-de"))[0], device="cpu")
    assert task.vocabulary == "joint" and translator.target_tokenizer is translator.tokenizer
    assert translator.translate(["A man is riding a bike."], translator.options) == ["Ein Mann fährt auf einem Fahrrad."]
