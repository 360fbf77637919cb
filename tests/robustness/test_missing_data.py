"""Missing data: one line naming ``aiayn fetch DATASET``, and a failed start leaves no run directory
behind, so the same command works once the data is there (no --overwrite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.data import dataset_file
from aiayn.data.parallel import DataError


def test_dataset_file_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAYN_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"get it with `aiayn fetch tinyshakespeare` \(or set "
                                                r"AIAYN_DATA_DIR") as caught:
        dataset_file("tinyshakespeare", "input.txt")
    assert isinstance(caught.value, DataError)  # exit code 2 in the CLI, like the other data errors
    with pytest.raises(FileNotFoundError) as caught:  # a folder no fetch command knows: no such hint
        dataset_file("my-corpus", "x.txt")
    assert "aiayn fetch" not in str(caught.value) and "AIAYN_DATA_DIR" in str(caught.value)


def test_cli_shakespeare_without_data_is_one_line(tmp_path, run_aiayn, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("AIAYN_DATA_DIR", str(tmp_path / "empty"))
    code, _, err = run_aiayn("train", "--task", "shakespeare-char", "--max-steps", "1", "--no-progress")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("Error: dataset file ") and "`aiayn fetch tinyshakespeare`" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no run directory left


def _corpus(folder: Path) -> None:
    """A tiny parallel corpus: train, val and test of the same 12 pairs."""
    folder.mkdir(parents=True, exist_ok=True)
    pairs = [(f"a small red house number {i}", f"ein kleines rotes haus nummer {i}") for i in range(12)]
    for split in ("train", "val", "test"):
        (folder / f"{split}.en").write_text("\n".join(en for en, _ in pairs) + "\n", encoding="utf-8")
        (folder / f"{split}.de").write_text("\n".join(de for _, de in pairs) + "\n", encoding="utf-8")


def test_a_failed_start_leaves_nothing_and_the_retry_needs_no_overwrite(tmp_path, run_aiayn, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("AIAYN_DATA_DIR", str(data))
    Path("recipe.yaml").write_text(
        "task: translation\n"
        "task_options: {test_split: test, vocab_size: 120, max_tokens: 256, val_bleu: false, beam_size: 1}\n"
        "model: {d_model: 16, n_heads: 2, n_layers: 1, n_decoder_layers: 1, d_ff: 32}\n"
        "train: {epochs: 1, average_last: 0}\n", encoding="utf-8")
    command = ["train", "--recipe", "recipe.yaml", "--run-dir", "runs/new/run", "--max-steps", "1", "--no-progress"]
    code, _, err = run_aiayn(*command)
    assert code == 2
    error = err.splitlines()[-1]
    assert error.startswith("Error: ") and "multi30k/train.en not found" in error
    assert "`aiayn fetch multi30k`" in error
    assert not Path("runs").exists()  # the run directory and the parents this start made are gone
    # A folder the user made stays, emptied of what the failed start wrote into it.
    Path("mine").mkdir()
    code, _, _ = run_aiayn(*command[:3], "--run-dir", "mine", *command[5:])
    assert code == 2 and list(Path("mine").iterdir()) == []
    _corpus(data / "multi30k")
    code, _, err = run_aiayn(*command)  # the same command, now with the data: no --overwrite
    assert code == 0, err
    run = tmp_path / "runs/new/run"
    assert (run / "checkpoints").is_dir()
    # An existing run is never removed by a failed start: here a replacement without data.
    before = sorted(str(p.relative_to(tmp_path)) for p in run.rglob("*"))
    (data / "multi30k" / "train.en").unlink()
    code, _, err = run_aiayn(*command, "--overwrite")
    assert code == 2 and "`aiayn fetch multi30k`" in err
    assert sorted(str(p.relative_to(tmp_path)) for p in run.rglob("*")) == before
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]  # no temporary sibling either
