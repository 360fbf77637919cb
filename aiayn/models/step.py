"""The one decode step function: a ``StepInput`` in, next-token logits out (gpt-fast's
``decode_one_token``). The decode paths differ only in how they build the input: the eager step
(``aiayn.generate.step.decode_step``), the compiled steps (``aiayn.fast.compiled_decode``, which
also compile ``run_step``) and the packed step of several batches (``decode_ragged``: ``logits_at``).

Shape letters: b rows, t new tokens per row, d d_model, v vocabulary, m positions asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from aiayn.models.blocks import StackInputs
from aiayn.nn.kv_cache import KVCache

if TYPE_CHECKING:
    from aiayn.models.decoder_only import DecoderOnly
    from aiayn.models.encoder_decoder import EncoderDecoder

# Which positions need logits: None (each row's last), (rows (m,), positions (m,)) of hidden
# (b, t, d), or indices (m,) into packed hidden (n, d).
At = tuple[Tensor, Tensor] | Tensor | None


@dataclass
class StepInput:
    """One decode step's input, built on the host: the new tokens, what every block reads of them and
    which positions need logits."""

    tokens: Tensor  # (b, t) long: the new tokens
    inputs: StackInputs  # positions, validity, cache slots, key mask, (cross-attention memory)
    at: At = None  # the positions whose logits are wanted


def run_step(model: DecoderOnly | EncoderDecoder, step: StepInput, cache: KVCache | None) -> Tensor:
    """The decoder's stack on ``step`` into ``cache``, then the output layer at ``step.at`` -> (b, v) or (m, v)."""
    hidden = model.decoder.run(step.tokens, step.inputs, cache=cache).hidden  # (b, t, d)
    return logits_at(model, hidden, step.at)


def logits_at(model: DecoderOnly | EncoderDecoder, hidden: Tensor, at: At) -> Tensor:
    """The output layer (a small model's largest matmul) on the positions that need logits only: each
    row's last of hidden (b, t, d) (``at`` None), or ``hidden[at]`` -> (b, v) or (m, v)."""
    return model.lm_head(hidden[:, -1] if at is None else hidden[at])
