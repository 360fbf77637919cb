"""Parallel text of your own for translation (domain adaptation): a pair of files (``--src``/``--tgt``) or a
folder of ``{split}.{lang}`` files as Multi30k's, checked by ``aiayn.data.parallel.read_parallel``. Without
validation files a seeded share of the training pairs is held out (``aiayn.finetune.split``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from aiayn.config import ConfigError
from aiayn.data.parallel import DataError, read_parallel, split_paths
from aiayn.finetune.split import split_examples

Pairs = tuple[list[str], list[str]]


def own_corpus(src: str | None, tgt: str | None, folder: str | None, languages: tuple[str, str],
               names: Mapping[str, str], *, seed: int, echo: Callable[[str], None]) -> dict[str, Pairs]:
    """{split: (sources, targets)} of "train", "val" and, where a folder has one, "test". ``folder``'s files
    carry the ``languages``' suffixes, each named as ``names`` gives or by the split itself."""
    if (src is None) != (tgt is None):
        raise ConfigError("parallel files come in pairs; give both --src FILE and --tgt FILE")
    if src is not None and folder is not None:
        raise ConfigError("give the training pair either as --src/--tgt files or as a folder (--data), not both")
    corpus: dict[str, Pairs] = {}
    if folder is not None:
        root = Path(folder)
        if not root.is_dir():
            raise DataError(f"{root} is not a folder; give --data a folder of {names['train']}.{languages[0]} "
                            f"and {names['train']}.{languages[1]}, or give --src and --tgt files")
        for split in ("train", "val", "test"):  # each under its split name's option, else its own name
            found = [split_paths(root, name, *languages) for name in dict.fromkeys((names[split], split))]
            paths = next((pair for pair in found if any(path.is_file() for path in pair)), found[0])
            if split == "train" or any(path.is_file() for path in paths):  # a lone side is read, and refused
                corpus[split] = read_parallel(*paths)
    else:
        corpus["train"] = read_parallel(src, tgt)
    if "val" not in corpus:
        sources, targets = corpus["train"]
        split = split_examples(len(sources), seed=seed, what="sentence pairs",
                               instead=f"give a folder with {names['val']}.{languages[0]} and "
                                       f"{names['val']}.{languages[1]}")
        corpus["train"] = ([sources[i] for i in split.train], [targets[i] for i in split.train])
        corpus["val"] = ([sources[i] for i in split.val], [targets[i] for i in split.val])
        echo(split.statement)
    return corpus

