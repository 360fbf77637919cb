"""The random LLaMA GGUF that ``benchmarks/q4_scaling.py`` writes (a tiny one here) is a file aiayn
loads packed (``quantize="auto"``), tokenizer included, and computes right: with the kernel off its
logits equal the float loader's (the dequantised model) exactly; with it, every layer's output is
within the kernel's stated bound (tests/parity/q4_helpers.py). The bytes the benchmark counts as
read per decoded token are the bytes of aiayn's block layers (plus the norms)."""

from __future__ import annotations

import pytest
import torch
from q4_helpers import block_layers, check_bounds_on

from aiayn.fast import plain_torch
from aiayn.fast.q4 import BlockEmbedding
from aiayn.interop.gguf import load_gguf
from benchmarks.q4_scaling import LlamaShape, bytes_per_token, write_random_llama

pytest.importorskip("gguf")

# The 4-bit blocks and their C++ kernel are CPU code (aiayn.fast.q4): once, on the CPU.
pytestmark = pytest.mark.cpu_only

# odd head count and GQA as in SmolLM2 (9/3); rows multiples of 16, so no padding in aiayn's groups
SHAPES = {"untied": LlamaShape(d=96, layers=2, d_ff=160, heads=3, kv_heads=1, vocab=400, tied=False),
          "tied": LlamaShape(d=64, layers=1, d_ff=96, heads=2, kv_heads=2, vocab=320, tied=True)}


@pytest.mark.parametrize("which", list(SHAPES))
def test_written_file_loads_packed_and_computes_within_the_bound(which, tmp_path):
    shape = SHAPES[which]
    path = write_random_llama(tmp_path / "random.gguf", shape, seed=3)
    loaded = load_gguf(path, quantize="auto")  # the tokenizer too: the metadata must be one aiayn accepts
    assert loaded.tokenizer.encode("ab", add_special_tokens=False).ids == [259]  # the one merge
    assert loaded.tokenizer.get_vocab_size() == shape.vocab
    packed = loaded.model
    layers = block_layers(packed)
    assert len(layers) == 4 * shape.layers + 1 and all(m.kind == "Q4_0" for m in layers)  # qkv, out, gate+up, down
    assert isinstance(packed.embedding, BlockEmbedding)
    assert (packed.lm_head.q is packed.embedding.q) == shape.tied

    total, streamed = bytes_per_token(path)
    norms = len(shape.norms()) * shape.d * 4
    assert streamed == sum(m.weight_blocks.nbytes for m in layers) + norms
    assert total - streamed == (0 if shape.tied else packed.embedding.weight_blocks.nbytes)

    tokens = torch.randint(0, shape.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    floats = load_gguf(path, tokenizer=False).model
    with torch.no_grad(), plain_torch():
        assert torch.equal(packed(tokens).logits, floats(tokens).logits)
    assert check_bounds_on(packed, tokens) == len(layers)
