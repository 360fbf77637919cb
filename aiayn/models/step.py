"""The one decode step function: a step input in, next-token logits out (gpt-fast's
``decode_one_token``, litgpt's ``next_token``).

A ``StepInput`` is built on the host before the stack runs: the new tokens, what every block
reads of them (their positions and validity, the cache slots they write, the key mask of what
each row may see: ``StackInputs``) and which positions need logits. ``run_step`` runs the
decoder's stack on it and applies the output layer there. The decode paths differ only in how
they build the input and whether ``torch.compile`` wraps ``run_step``: the eager step
(``aiayn.generate.step.decode_step``: ``TransformerStack.prepare``), the compiled steps
(``aiayn.fast.compiled_decode``: inputs made in the graph from host-built tensors) and the packed
step of several batches (``decode_ragged``, whose stack pass is ``forward_ragged``: ``logits_at``).

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
    """One decode step's input, built on the host (module docstring)."""

    tokens: Tensor  # (b, t) long: the new tokens
    inputs: StackInputs  # positions, validity, cache slots, key mask, (cross-attention memory)
    at: At = None  # the positions whose logits are wanted


def run_step(model: DecoderOnly | EncoderDecoder, step: StepInput, cache: KVCache | None) -> Tensor:
    """The decoder's stack on ``step`` into ``cache``, then the output layer on the positions
    ``step.at`` names -> logits (b, v) or (m, v)."""
    hidden = model.decoder.run(step.tokens, step.inputs, cache=cache).hidden  # (b, t, d)
    return logits_at(model, hidden, step.at)


def logits_at(model: DecoderOnly | EncoderDecoder, hidden: Tensor, at: At) -> Tensor:
    """The output layer on the positions that need logits only (the output projection is the
    largest matmul of a small model's step): each row's last of hidden (b, t, d) (``at`` None), or
    ``hidden[at]`` -> (b, v) or (m, v)."""
    return model.lm_head(hidden[:, -1] if at is None else hidden[at])
