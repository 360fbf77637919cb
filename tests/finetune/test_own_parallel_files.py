"""Parallel text of your own for the translation task: --src/--tgt files or a folder, each line checked
before training, validation split off (seeded, stated) when none is given; Multi30k's options unchanged."""

from __future__ import annotations

import re

import pytest

from aiayn.config import ConfigError
from aiayn.data.parallel import DataError
from aiayn.finetune.parallel import own_corpus
from aiayn.tasks import get_task

NAMES = {"train": "train", "val": "val", "test": "test2016"}
EN = [f"A man rides bike number {i}." for i in range(40)]
DE = [f"Ein Mann fährt Fahrrad Nummer {i}." for i in range(40)]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def corpus(src=None, tgt=None, folder=None, seed=0, said=None):
    return own_corpus(src, tgt, folder, ("en", "de"), NAMES, seed=seed,
                      echo=(said.append if said is not None else lambda _: None))


def test_a_pair_of_files_trains_and_a_seeded_share_validates(tmp_path):
    src, tgt = write(tmp_path / "a.en", EN), write(tmp_path / "a.de", DE)
    said: list[str] = []
    first, again = corpus(src, tgt, seed=4, said=said), corpus(src, tgt, seed=4, said=said)
    assert said == ["validation: 5% of the sentence pairs (2), seed 4; give a folder with val.en and val.de "
                    "to choose"] * 2
    assert first == again and set(first) == {"train", "val"}
    assert len(first["train"][0]) == 38 and len(first["val"][0]) == 2
    for sources, targets in first.values():  # the pairs stay aligned
        assert [DE[EN.index(s)] for s in sources] == targets
    assert corpus(src, tgt, seed=5)["val"] != first["val"]


def test_a_folder_gives_its_own_validation_and_test(tmp_path):
    for split in ("train", "val", "test"):
        write(tmp_path / f"{split}.en", EN[:5])
        write(tmp_path / f"{split}.de", DE[:5])
    said: list[str] = []
    text = corpus(folder=str(tmp_path), said=said)
    assert said == [] and set(text) == {"train", "val", "test"}
    (tmp_path / "test.en").unlink()
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'test.en'} not found")):
        corpus(folder=str(tmp_path))


@pytest.mark.parametrize(("src_lines", "tgt_lines", "message"), [
    (EN[:3], DE[:2], "misaligned parallel files: {src} has 3 lines but {tgt} has 2; line i of one must "
                     "translate line i of the other"),
    ([EN[0], "", EN[2]], DE[:3], "{src}, line 2: empty line; every line must hold a sentence (remove the line "
                                 "from both sides of the pair)"),
    (EN[:3], [DE[0], DE[1], "   "], "{tgt}, line 3: empty line"),
])
def test_bad_parallel_files_are_refused_naming_file_and_line(tmp_path, src_lines, tgt_lines, message):
    src, tgt = write(tmp_path / "a.en", src_lines), write(tmp_path / "a.de", tgt_lines)
    with pytest.raises(DataError, match=r"^" + re.escape(message.format(src=src, tgt=tgt))):
        corpus(src, tgt)


def test_a_file_not_utf8_is_refused_naming_its_line(tmp_path):
    (tmp_path / "a.en").write_bytes(b"one\ntw\xe9\n")
    tgt = write(tmp_path / "a.de", DE[:2])
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'a.en'}, line 2: not UTF-8 (byte 0xe9 at column 3)")):
        corpus(str(tmp_path / "a.en"), tgt)


def test_options_that_do_not_make_a_pair_are_refused(tmp_path):
    src = write(tmp_path / "a.en", EN)
    with pytest.raises(ConfigError, match=r"^parallel files come in pairs; give both --src FILE and --tgt FILE$"):
        corpus(src=src)
    with pytest.raises(ConfigError, match=r"^give the training pair either as --src/--tgt files or as a folder"):
        corpus(src, write(tmp_path / "a.de", DE), folder=str(tmp_path))
    with pytest.raises(DataError, match=r"is not a folder; give --data a folder of train.en and train.de"):
        corpus(folder=src)
    with pytest.raises(ConfigError, match=r"^translation reads one data folder, got 2"):
        get_task("translation", data=[str(tmp_path), str(tmp_path)])
    with pytest.raises(DataError, match=r"too few sentence pairs to split off a validation set \(1; it takes at "
                                        r"least 2\); add sentence pairs, or give a folder with val.en and val.de$"):
        corpus(write(tmp_path / "b.en", EN[:1]), write(tmp_path / "b.de", DE[:1]))


def test_multi30k_runs_record_the_options_they_always_did():
    assert set(get_task("translation").options) == {
        "src_lang", "tgt_lang", "corpus", "corpus_dir", "vocab_size", "max_tokens", "max_len", "train_split",
        "val_split", "test_split", "val_bleu", "beam_size", "length_penalty"}
    task = get_task("translation", src="a.en", tgt="a.de", data=None)
    assert task.options["src"] == "a.en" and "data" not in task.options and "init_from" not in task.options
