"""Ensemble decoding: several encoder-decoders searched as one (fairseq's ``--path a.pt:b.pt``,
Marian's ``--models``). An ``Ensemble`` has what the decode loops need of a model (``encode``,
``new_cache``, ``decode``, ``config``); ``decode_step`` runs every member's step on its own encoder
output and cache and returns ``mean_log_probs``.

The mean of log-probabilities is a product of experts (Marian's default; fairseq averages
probabilities). Unnormalised, it still serves as logits: argmax and softmax ignore the constant,
and beam search's log_softmax(mean) is the normalised product, whose log-probabilities it scores.
Members share one vocabulary (checked: output width, pad_id); max_seq_len is the smallest member's.

Shape letters: M members, b rows, s source tokens, t target tokens, v vocabulary, d_m member m's
d_model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.device import model_device
from aiayn.models.encoder_decoder import Encoded, EncoderDecoder
from aiayn.nn.kv_cache import KVCache


def mean_log_probs(logits: Sequence[Tensor]) -> Tensor:
    """M members' logits (each (..., v)) -> the mean of their log_softmax (..., v), in float32."""
    return torch.stack([torch.log_softmax(x.float(), dim=-1) for x in logits]).mean(dim=0)


@dataclass
class EnsembleEncoded:
    """Every member's encoding of one batch of sources."""

    memory: tuple[Tensor, ...]  # per member (b, s, d_m): its encoder output
    valid: Tensor  # (b, s) bool: the real source tokens, the same for every member (one pad_id)
    attentions: list[Tensor] = field(default_factory=list)  # none: an ensemble has no one map

    def member(self, m: int) -> Encoded:
        return Encoded(memory=self.memory[m], valid=self.valid)


@dataclass
class EnsembleOutput:
    logits: Tensor  # (b, t, v) float32 mean of the members' log-probabilities


class EnsembleCache:
    """One ``KVCache`` per member, moved together by beam search."""

    def __init__(self, members: list[KVCache]) -> None:
        self.members = members

    def reorder(self, indices: Tensor, *, cross: bool = True) -> None:
        for cache in self.members:
            cache.reorder(indices, cross=cross)

    def repeat_interleave(self, n: int) -> None:
        for cache in self.members:
            cache.repeat_interleave(n)


class Ensemble(nn.Module):
    """Encoder-decoders decoded as one model; ValueError when their output vocabularies or pad ids
    differ, or they are not on one device."""

    def __init__(self, members: Sequence[EncoderDecoder]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one model")
        for model in members:
            if not isinstance(model, EncoderDecoder):
                raise ValueError(f"an ensemble is of encoder-decoders, got a {type(model).__name__}")
        first = members[0].config
        for m, model in enumerate(members[1:], start=2):
            config = model.config
            if config.tgt_vocab_size != first.tgt_vocab_size:
                raise ValueError(f"member 1 predicts {first.tgt_vocab_size} target tokens but member {m} "
                                 f"{config.tgt_vocab_size}; an ensemble's members share one vocabulary")
            if config.pad_id != first.pad_id:
                raise ValueError(f"member 1 pads with id {first.pad_id} but member {m} with "
                                 f"{config.pad_id}; an ensemble's members share one vocabulary")
        devices = {str(model_device(model)) for model in members}
        if len(devices) > 1:
            raise ValueError(f"an ensemble's members must be on one device, got {', '.join(sorted(devices))}")
        self.members = nn.ModuleList(members)
        # The loops read pad_id and max_seq_len: the smallest context fits every member.
        self.config = first.replace(max_seq_len=min(model.config.max_seq_len for model in members))

    def __len__(self) -> int:
        return len(self.members)

    def encode(self, src: Tensor, *, src_valid: Tensor | None = None) -> EnsembleEncoded:
        """src (b, s) -> every member's memory (b, s, d_m), each member's encoder run once."""
        encoded = [model.encode(src, src_valid=src_valid) for model in self.members]
        # One pad_id (checked above): every member marks the same source tokens real.
        return EnsembleEncoded(memory=tuple(e.memory for e in encoded), valid=encoded[0].valid)

    def decode(self, tgt: Tensor, encoded: EnsembleEncoded, *, tgt_valid: Tensor | None = None) -> EnsembleOutput:
        """tgt (b, t) -> the mean log-probabilities (b, t, v) without a cache (the cached step's reference)."""
        return EnsembleOutput(logits=mean_log_probs([
            model.decode(tgt, encoded.member(m), tgt_valid=tgt_valid).logits
            for m, model in enumerate(self.members)]))

    def new_cache(self, batch_size: int, max_len: int | None = None, *, dtype: torch.dtype | None = None,
                  quantize: str | None = None, group_size: int | None = None) -> EnsembleCache:
        """A KV cache per member (``EncoderDecoder.new_cache``), each in its member's layout."""
        return EnsembleCache([model.new_cache(batch_size, max_len, dtype=dtype, quantize=quantize,
                                              group_size=group_size) for model in self.members])
