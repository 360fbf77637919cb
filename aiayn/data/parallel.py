"""Parallel text: aligned ``{split}.{lang}`` sentence files, their checks, and length-bucketed token-count
batches; every fixable problem raises ``DataError`` naming the file and line."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence


class DataError(ValueError):
    """Input text a user must fix: missing, misaligned, empty lines or not UTF-8."""


class MissingDataError(DataError, FileNotFoundError):
    """A dataset file that is not there: a DataError that is still a FileNotFoundError."""


def read_lines(path: str | Path) -> list[str]:
    """The stripped lines of a UTF-8 text file; an error names the file and line of any problem."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} not found" + ("" if path.parent.is_dir() else
                                               f" (no folder {path.parent})"))
    raw = path.read_bytes()
    lines: list[str] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}, line {number}: not UTF-8 (byte 0x{line[exc.start]:02x} at column "
                            f"{exc.start + 1}); convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8") from None
        if not text:
            raise DataError(f"{path}, line {number}: empty line; every line must hold a sentence "
                            f"(remove the line from both sides of the pair)")
        lines.append(text.removeprefix("\ufeff") if number == 1 else text)
    return lines


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    """Aligned source and target sentences; their line counts must agree."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        if not lines:
            raise DataError(f"{path} is empty; it must hold one sentence per line")
    if len(src) != len(tgt):
        raise DataError(f"misaligned parallel files: {src_path} has {len(src)} lines but {tgt_path} "
                        f"has {len(tgt)}; line i of one must translate line i of the other")
    return src, tgt


def split_paths(corpus_dir: str | Path, split: str, src_lang: str, tgt_lang: str) -> tuple[Path, Path]:
    corpus_dir = Path(corpus_dir)
    return corpus_dir / f"{split}.{src_lang}", corpus_dir / f"{split}.{tgt_lang}"


def fetch_multi30k(cache_dir: str | Path, *, base_url: str | None = None,
                   sha256: Mapping[str, str] | None = None) -> Path:
    """Download Multi30k task 1 into ``cache_dir`` as ``{split}.{lang}``, from ``base_url`` (default: as
    ``aiayn.data.fetch``)."""
    from aiayn.data.fetch import DATASETS, dataset_sources, fetch_files

    remotes = DATASETS["multi30k"].files
    files = {name: (f"{base_url}/{remotes[name].name}" if base_url else url,
                    sha256[name] if sha256 is not None else digest, gzipped)
             for name, (url, digest, gzipped) in dataset_sources("multi30k").items()}
    fetch_files(Path(cache_dir), files)
    return Path(cache_dir)


def token_batches(src_lengths: Tensor, tgt_lengths: Tensor, max_tokens: int, *, seed: int | None, epoch: int = 0,
                  max_sentences: int | None = None) -> list[Tensor]:
    """Index batches of similar-length pairs, each within ``max_tokens`` padded tokens (n_sentences x longest
    side: fairseq's --max-tokens), in an order shuffled by (seed, epoch); ``seed=None`` keeps sorted order."""
    n = src_lengths.shape[0]
    if seed is None:
        order = torch.arange(n)
    else:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(n, generator=generator)
    # Stable sorts, the last the primary key: by target length, then by the longer side (the padded size).
    longest_side = torch.maximum(src_lengths, tgt_lengths)
    order = order[torch.sort(tgt_lengths[order], stable=True).indices]
    order = order[torch.sort(longest_side[order], stable=True).indices]
    longest = longest_side[order].tolist()
    batches: list[Tensor] = []
    start, batch_max = 0, 0
    for i, length in enumerate(longest):
        if length > max_tokens:
            raise DataError(f"a pair of {length} tokens does not fit in max_tokens={max_tokens}; "
                            f"raise max_tokens or lower the maximum sentence length")
        batch_max = max(batch_max, length)
        count = i - start + 1
        if batch_max * count > max_tokens or (max_sentences is not None and count > max_sentences):
            batches.append(order[start:i])
            start, batch_max = i, length
    if start < n:
        batches.append(order[start:])
    if seed is not None:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch + 1)
        batches = [batches[j] for j in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def pad_batch(sequences: list[list[int]], pad_id: int) -> Tensor:
    """Right-pad id lists into (b, longest)."""
    return pad_sequence([torch.tensor(s, dtype=torch.long) for s in sequences], batch_first=True,
                        padding_value=pad_id)
