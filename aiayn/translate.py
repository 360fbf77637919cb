"""Translating text with a trained encoder-decoder: tokenise, batch by length, decode, detokenise.
A source too long for the model is cut, with a warning; the target may run to ``max_len_a *
source_length + max_len_b`` tokens (fairseq's convention), never past the model's maximum."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.data.parallel import pad_batch
from aiayn.device import autocast, model_device
from aiayn.generate import (
    Ensemble,
    SamplingConfig,
    beam_search_encoder_decoder,
    greedy_encoder_decoder,
    max_target_lengths,
    sample_encoder_decoder,
)
from aiayn.models.encoder_decoder import EncoderDecoder
from aiayn.tokenizers import BPETokenizer


class InputTooLongWarning(UserWarning):
    """A source sentence was cut to the model's maximum length."""


@dataclass
class DecodeOptions:
    """How targets are searched for. beam_size 1 = greedy; ``sampling`` draws instead of searching."""

    beam_size: int = 5
    length_penalty: float = 0.6  # GNMT alpha: score / ((5 + len) / 6) ** alpha
    max_len_a: float = 1.2
    max_len_b: int = 10
    sampling: SamplingConfig | None = None
    # Beam search also keeps the greedy hypothesis (never a lower score than greedy; one greedy pass).
    keep_greedy: bool = True
    # Greedy and beam search run their steps after the first through the compiled decode step.
    compile: bool = False

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam size must be >= 1, got {self.beam_size}")
        if self.length_penalty < 0:
            raise ValueError(f"length penalty must be >= 0, got {self.length_penalty}")
        if self.max_len_a < 0 or self.max_len_b < 1:
            raise ValueError(f"max length a*src+b needs a >= 0 and b >= 1, got a={self.max_len_a}, "
                             f"b={self.max_len_b}")


class Translator:
    """A trained ``EncoderDecoder`` (or an ``Ensemble`` of them) and its BPE tokenizer(s), ready to
    translate sentences; ``target_tokenizer`` decodes the targets of a run of separate vocabularies."""

    def __init__(self, model: EncoderDecoder | Ensemble, tokenizer: BPETokenizer, *,
                 target_tokenizer: BPETokenizer | None = None, max_tokens: int = 4096,
                 max_sentences: int = 128, options: DecodeOptions | None = None) -> None:
        self.model = model.eval()
        # The special ids are the same in every BPETokenizer: the source tokenizer's serve both sides.
        self.tokenizer = tokenizer
        self.target_tokenizer = target_tokenizer or tokenizer
        self.options = options or DecodeOptions()  # how ``translate`` searches when not told (a run's own)
        self.max_tokens, self.max_sentences = max_tokens, max_sentences
        self.max_len = model.config.max_seq_len

    def source_ids(self, text: str) -> list[int]:
        """BPE ids of a source sentence + </s>, cut to the model's maximum length (with a warning)."""
        ids = self.tokenizer.encode(text)
        if len(ids) + 1 > self.max_len:
            preview = text if len(text) <= 60 else text[:57] + "..."
            warnings.warn(f"source of {len(ids) + 1} tokens is longer than the model's maximum of "
                          f"{self.max_len}; translating its first {self.max_len - 1} tokens only: "
                          f"{preview!r}", InputTooLongWarning, stacklevel=3)
            ids = ids[: self.max_len - 1]
        return [*ids, self.tokenizer.eos_id]

    def translate(self, texts: list[str], options: DecodeOptions | None = None) -> list[str]:
        """Translate sentences (any order and lengths); empty input gives empty output. ``options``:
        how to search (None: ``self.options``, the run's own for a loaded run)."""
        options = options or self.options
        out = [""] * len(texts)
        sources = {i: self.source_ids(t) for i, t in enumerate(texts) if t.strip()}
        for indices in self._batches(sources):
            hyps = self.translate_ids([sources[i] for i in indices], options)
            for i, hyp in zip(indices, hyps, strict=True):
                out[i] = self.target_tokenizer.decode(hyp)
        return out

    def _batches(self, sources: dict[int, list[int]]) -> Iterator[list[int]]:
        """Indices of similar-length sources, at most max_tokens padded source tokens a batch."""
        order = sorted(sources, key=lambda i: len(sources[i]))
        batch: list[int] = []
        for i in order:
            longest = len(sources[i])  # sorted by length: the newest is the longest
            if batch and (longest * (len(batch) + 1) > self.max_tokens or len(batch) >= self.max_sentences):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    @torch.inference_mode()
    def translate_ids(self, sources: list[list[int]], options: DecodeOptions) -> list[list[int]]:
        """Source id lists (each ending in </s>) -> target id lists (without <s> and </s>)."""
        tok = self.tokenizer
        device = model_device(self.model)
        src = pad_batch(sources, tok.pad_id).to(device)  # (b, s)
        src_valid = src != tok.pad_id
        # a * source length + b target tokens (</s> included), within the model's maximum (less <s>)
        limits = max_target_lengths(src_valid, max_len_a=options.max_len_a, max_len_b=options.max_len_b,
                                    cap=self.max_len - 1)
        with autocast(device):  # bfloat16 on CUDA; nothing on the CPU
            if options.sampling is not None:
                tokens = sample_encoder_decoder(self.model, src, bos_id=tok.bos_id, eos_id=tok.eos_id,
                                                max_new_tokens=limits, sampling=options.sampling,
                                                src_valid=src_valid, compile=options.compile)
                return [self._cut(row) for row in tokens.cpu()]  # one copy back, not one per row
            if options.beam_size == 1:
                result = greedy_encoder_decoder(self.model, src, bos_id=tok.bos_id, eos_id=tok.eos_id,
                                                max_new_tokens=limits, src_valid=src_valid, compile=options.compile)
                return [self._cut(row) for row in result.tokens.cpu()]
            beams = beam_search_encoder_decoder(
                self.model, src, bos_id=tok.bos_id, eos_id=tok.eos_id, beam_size=options.beam_size,
                length_penalty=options.length_penalty, max_len_a=options.max_len_a,
                max_len_b=options.max_len_b, src_valid=src_valid, keep_greedy=options.keep_greedy,
                compile=options.compile)
        return [self._cut(torch.tensor(ids, dtype=torch.long)) for ids in beams.token_lists(eos_id=tok.eos_id)]

    def _cut(self, row: Tensor) -> list[int]:
        """Ids up to (not including) the first </s>, with any padding dropped."""
        ids = row.tolist()
        if self.tokenizer.eos_id in ids:
            ids = ids[: ids.index(self.tokenizer.eos_id)]
        return [i for i in ids if i != self.tokenizer.pad_id]


def decode_options(defaults: DecodeOptions, *, beam_size: int | None = None,
                   length_penalty: float | None = None, temperature: float | None = None,
                   top_k: int | None = None, top_p: float | None = None,
                   seed: int | None = None, compile: bool = False) -> DecodeOptions:
    """Decoding options given on top of ``defaults`` (a run's recipe); any of ``temperature``,
    ``top_k``, ``top_p`` samples instead of searching (temperature 1 unless given)."""
    sampling = None
    if temperature is not None or top_k is not None or top_p is not None:
        sampling = SamplingConfig(temperature=1.0 if temperature is None else temperature,
                                  top_k=top_k, top_p=top_p, seed=seed)
    return DecodeOptions(beam_size=defaults.beam_size if beam_size is None else beam_size,
                         length_penalty=defaults.length_penalty if length_penalty is None else length_penalty,
                         sampling=sampling, compile=compile)
