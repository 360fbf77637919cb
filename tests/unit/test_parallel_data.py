"""Parallel text: BPE round trip, length-bucketed batches, and clear errors for bad files."""

from __future__ import annotations

import pytest
import torch

from aiayn.data import data_dir
from aiayn.data.parallel import DataError, read_lines, read_parallel, token_batches
from aiayn.tokenizers import BPETokenizer

MULTI30K = data_dir() / "multi30k"
needs_multi30k = pytest.mark.skipif(not (MULTI30K / "train.en").is_file(),
                                    reason="Multi30k not found (set AIAYN_DATA_DIR)")


@pytest.fixture(scope="module")
def multi30k_bpe() -> tuple[BPETokenizer, dict[str, list[str]]]:
    text = {f"{split}.{lang}": read_lines(MULTI30K / f"{split}.{lang}")
            for split in ("train", "val", "test2016") for lang in ("en", "de")}
    return BPETokenizer.train([*text["train.en"], *text["train.de"]], vocab_size=8000), text


@needs_multi30k
def test_bpe_round_trip_reproduces_every_multi30k_sentence(multi30k_bpe):
    tok, text = multi30k_bpe
    assert tok.vocab_size == 8000
    for name, lines in text.items():
        ids = tok.encode_batch(lines)
        assert tok.decode_batch(ids) == lines, name  # casing, umlauts, punctuation, spacing
        if not name.startswith("train"):  # unseen text still splits into known pieces
            assert sum(i.count(tok.unk_id) for i in ids) <= 2, name


@needs_multi30k
def test_bpe_specials_and_save_load(multi30k_bpe, tmp_path):
    tok, _ = multi30k_bpe
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    sentence = "Zwei Männer überqueren die Straße, während ein Hund (braun) bellt!"
    ids = tok.encode(sentence)
    assert 0 not in ids and len(ids) < len(sentence) // 2  # merges were learned
    assert tok.decode(ids) == sentence
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == sentence
    tok.save(tmp_path / "tokenizer.json")
    again = BPETokenizer.load(tmp_path / "tokenizer.json")
    assert again.encode(sentence) == ids
    assert again.encode("a ☃ b").count(again.unk_id) == 1  # a character the vocabulary cannot spell


def test_bpe_load_errors(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        BPETokenizer.load(bad)


def random_lengths(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 60, (n,), generator=g), torch.randint(2, 60, (n,), generator=g)


@pytest.mark.parametrize("max_tokens", [64, 300, 4096])
def test_bucketing_covers_every_pair_exactly_once_within_budget(max_tokens):
    src, tgt = random_lengths(2_345)
    for epoch in range(3):
        batches = token_batches(src, tgt, max_tokens, seed=7, epoch=epoch)
        seen = torch.cat(batches)
        assert sorted(seen.tolist()) == list(range(2_345))  # each pair once per epoch
        for batch in batches:
            padded = len(batch) * int(torch.maximum(src[batch], tgt[batch]).max())
            assert padded <= max_tokens
        # similar lengths travel together: little padding
        real = sum(int(torch.maximum(src[b], tgt[b]).sum()) for b in batches)
        padded = sum(len(b) * int(torch.maximum(src[b], tgt[b]).max()) for b in batches)
        assert real / padded > (0.9 if max_tokens > 64 else 0.75)


def test_bucketing_is_a_function_of_seed_and_epoch():
    src, tgt = random_lengths(500)
    max_tokens = 512
    first = token_batches(src, tgt, max_tokens, seed=1, epoch=0)
    again = token_batches(src, tgt, max_tokens, seed=1, epoch=0)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other = token_batches(src, tgt, max_tokens, seed=1, epoch=1)
    assert [b.tolist() for b in first] != [b.tolist() for b in other]  # reshuffled each epoch
    fixed = token_batches(src, tgt, max_tokens, seed=None)  # evaluation: sorted, deterministic
    assert torch.equal(torch.cat(fixed), torch.cat(token_batches(src, tgt, max_tokens, seed=None)))


def test_bucketing_max_sentences_and_too_long_pair():
    src, tgt = random_lengths(300)
    for batch in token_batches(src, tgt, 100_000, seed=0, max_sentences=16):
        assert len(batch) <= 16
    with pytest.raises(DataError, match="does not fit in max_tokens=10"):
        token_batches(torch.tensor([3, 12]), torch.tensor([3, 4]), 10, seed=0)


def test_parallel_file_errors_name_file_and_line(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\nthree\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eins\nzwei\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"a\.en has 3 lines but .*a\.de has 2"):
        read_parallel(tmp_path / "a.en", tmp_path / "a.de")
    (tmp_path / "b.de").write_text("eins\n\ndrei\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"b\.de, line 2: empty line"):
        read_lines(tmp_path / "b.de")
    (tmp_path / "c.de").write_bytes("eins\nzwei\nGr\xfc\xdfe\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"c\.de, line 3: not UTF-8 \(byte 0xfc at column 3\)"):
        read_lines(tmp_path / "c.de")
    with pytest.raises(DataError, match="not found"):
        read_lines(tmp_path / "missing.en")


def test_fetch_multi30k_from_a_mirror_without_network(tmp_path):
    """The downloader reads gzipped {remote}.{lang}.gz files and checks each one's SHA-256 (here the
    fake files' own); a file:// mirror stands in for the public source (tests never use the network)."""
    import gzip
    import hashlib

    from aiayn.data.fetch import DATASETS, FetchError
    from aiayn.data.parallel import fetch_multi30k

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    hashes = {}
    for name, remote in DATASETS["multi30k"].files.items():
        text = f"{remote.name.removesuffix('.gz').replace('.', ' ')} Straße\nzwei\n".encode()
        with gzip.open(mirror / remote.name, "wb") as handle:
            handle.write(text)
        hashes[name] = hashlib.sha256(text).hexdigest()
    cache = fetch_multi30k(tmp_path / "cache", base_url=mirror.as_uri(), sha256=hashes)
    assert read_lines(cache / "test2016.de") == ["test_2016_flickr de Straße", "zwei"]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        DATASETS["multi30k"].files)
    with pytest.raises(FetchError, match="cannot download"):
        fetch_multi30k(tmp_path / "other", base_url=(tmp_path / "nowhere").as_uri(), sha256=hashes)
    assert not (tmp_path / "other").exists()  # nothing half-written, not even the folder
    with pytest.raises(FetchError, match="not the expected file"):  # the real hashes refuse fake files
        fetch_multi30k(tmp_path / "checked", base_url=mirror.as_uri())
    assert not (tmp_path / "checked").exists()
