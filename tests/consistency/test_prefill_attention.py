"""The paged cache's prefill-chunk path (``aiayn.fast.prefill_attention``: the chunk's mask prepared
once per forward, not once per layer) equals the plain path it replaces.

* The function against the plain write + ``aiayn.nn.attention.scaled_dot_product_attention`` on
  the same cache: ragged rows of a chunk (padding queries), a query that sees no key (zeros), GQA
  and MHA, gathered rows and a lone row read as a view, no mask; the prepared mask is reused for
  the same mask tensor only.
* A model over the paged cache with the path equals the fixed slots (plain SDPA) and each row alone,
  forward by forward (test_paged_attention_kernel.py's staggered schedule), and the serve engine's
  greedy tokens with it equal those without it and those over the fixed slots.

float32, ``assert_close``'s default tolerances; spies prove the path ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_spies import count_calls
from random_weights import randomize_
from test_paged_attention_kernel import TwinDriver, engine_answers, kernel_model
from test_row_kv_cache import staggered_schedule
from torch.testing import assert_close

from aiayn.fast import optimize, plain_torch, prefill_attention, switch
from aiayn.fast.paged_attention import MAX_QUERIES
from aiayn.models import DecoderOnly, get_preset
from aiayn.nn.attention import AttentionInputs, scaled_dot_product_attention
from aiayn.nn.masks import key_mask, position_causal_mask
from aiayn.nn.paged_kv_cache import PagedKVCache
from aiayn.textgen import TextModel

# aiayn.fast's paths are CPU code: once, on the CPU.
pytestmark = pytest.mark.cpu_only


def chunk_over_cache(held: list[int], new: list[int], *, h_kv: int, d_h: int, seed: int):
    """A one-layer ``PagedKVCache`` (blocks of 4) whose rows hold ``held`` tokens of random keys and
    values, then reserve a right-padded chunk of ``new`` tokens per row: the layer, the chunk's
    k, v (b, h_kv, t, d_h) and its ``AttentionInputs`` as the stack builds them (key mask and
    position-causal mask, per-row slots)."""
    g = torch.Generator().manual_seed(seed)
    b = len(held)
    cache = PagedKVCache(n_layers=1, batch_size=b, n_kv_heads=h_kv, head_dim=d_h, max_len=64, n_blocks=64,
                         block_size=4)
    layer = cache.layers[0]
    for i, n in enumerate(held):  # fill each row alone, in a shuffled order of blocks
        if n:
            row = cache.rows(i, i + 1)
            slots = row.reserve(torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None])
            row.layers[0].store(*(torch.randn(1, h_kv, n, d_h, generator=g) for _ in range(2)), slots)
    t = max(new)
    valid = torch.arange(t)[None] < torch.tensor(new)[:, None]  # (b, t)
    positions = torch.tensor(held)[:, None] + torch.arange(t)[None]  # (b, t)
    slots = cache.reserve(valid, positions)
    keys_valid, key_positions = cache.valid[:, : cache.length], cache.positions[:, : cache.length]
    mask = key_mask(keys_valid) & position_causal_mask(positions, key_positions)  # (b, 1, t, t_k)
    k, v = (torch.randn(b, h_kv, t, d_h, generator=g) for _ in range(2))
    return layer, k, v, AttentionInputs(mask=mask, slots=slots)


def plain(q, k, v, layer, inputs):
    """The plain path of ``MultiHeadAttention``: write, then the attention function."""
    keys, values = layer.write(k, v, inputs.slots)
    return scaled_dot_product_attention(q, keys, values, mask=inputs.mask)[0]


@pytest.mark.parametrize(("h", "h_kv", "d_h"), [(9, 3, 64), (4, 4, 16), (4, 1, 8)])
def test_the_path_equals_the_plain_write_and_attention(h: int, h_kv: int, d_h: int) -> None:
    """Rows holding 0-13 tokens, then a chunk of 1-6 new tokens each (padding queries in the shorter
    rows); the cache ends holding the same keys either way."""
    layer, k, v, inputs = chunk_over_cache([5, 0, 13, 8], [6, 2, 1, 4], h_kv=h_kv, d_h=d_h, seed=h)
    q = torch.randn(4, h, 6, d_h, generator=torch.Generator().manual_seed(1))
    twin = copy.deepcopy(layer)
    assert prefill_attention.applies(q, layer, inputs, MAX_QUERIES)
    got = prefill_attention.prefill_cache_attention(q, k, v, layer, inputs)
    assert_close(got, plain(q, k, v, twin, inputs))
    assert torch.equal(layer.k, twin.k) and torch.equal(layer.v, twin.v)


def test_a_query_that_sees_no_key_gives_zeros_and_the_mask_is_prepared_once_per_tensor(monkeypatch) -> None:
    """A mask whose row 1 hides every key from its queries: zeros there, as the plain function gives.
    The same mask tensor again (the next layer) reuses the prepared mask; another tensor does not."""
    layer, k, v, inputs = chunk_over_cache([3, 6], [4, 4], h_kv=2, d_h=16, seed=2)
    mask = inputs.mask.clone()
    mask[1] = False
    inputs = AttentionInputs(mask=mask, slots=inputs.slots)
    q = torch.randn(2, 4, 4, 16, generator=torch.Generator().manual_seed(3))
    twin = copy.deepcopy(layer)
    calls = count_calls(monkeypatch, torch.Tensor, "masked_fill_")  # one per preparation
    got = prefill_attention.prefill_cache_attention(q, k, v, layer, inputs)
    assert_close(got, plain(q, k, v, twin, inputs))
    assert bool((got[1] == 0).all()) and bool(got[0].abs().sum() > 0)
    assert len(calls) == 1
    again = prefill_attention.prefill_cache_attention(q, k, v, copy.deepcopy(twin), inputs)
    assert len(calls) == 1  # the same mask tensor: prepared once
    assert torch.equal(again, got)
    other = AttentionInputs(mask=inputs.mask.clone(), slots=inputs.slots)
    other.mask[1, :, :, 0] = True  # a new tensor with row 1 seeing its first key
    got = prefill_attention.prefill_cache_attention(q, k, v, copy.deepcopy(twin), other)
    assert len(calls) == 2
    assert_close(got, plain(q, k, v, copy.deepcopy(twin), other))
    # Two masks taking turns (a ragged forward's parts in every layer): each prepared once.
    for _ in range(3):
        prefill_attention.prefill_cache_attention(q, k, v, copy.deepcopy(twin), inputs)
        prefill_attention.prefill_cache_attention(q, k, v, copy.deepcopy(twin), other)
    assert len(calls) == 2


def test_a_lone_row_of_consecutive_blocks_and_no_mask() -> None:
    """One row whose blocks are consecutive (the keys are a view of the pool, no gather), and the
    same call without a mask (every key)."""
    layer, k, v, inputs = chunk_over_cache([9], [5], h_kv=3, d_h=32, seed=4)
    assert layer.read_run is not None
    q = torch.randn(1, 6, 5, 32, generator=torch.Generator().manual_seed(5))
    twin = copy.deepcopy(layer)
    assert_close(prefill_attention.prefill_cache_attention(q, k, v, layer, inputs), plain(q, k, v, twin, inputs))
    bare = AttentionInputs(mask=None, slots=inputs.slots)
    assert_close(prefill_attention.prefill_cache_attention(q, k, v, copy.deepcopy(twin), bare),
                 plain(q, k, v, copy.deepcopy(twin), bare))


def test_it_stays_out_of_decode_steps_bias_plain_torch_and_when_turned_off() -> None:
    layer, _, _, inputs = chunk_over_cache([5, 7], [3, 3], h_kv=2, d_h=16, seed=6)
    q = torch.randn(2, 4, 3, 16)
    assert prefill_attention.applies(q, layer, inputs, MAX_QUERIES)
    assert not prefill_attention.applies(q[:, :, :1], layer, inputs, MAX_QUERIES)  # one query: the kernel's
    bias = AttentionInputs(mask=inputs.mask, bias=torch.zeros(1, 4, 3, inputs.mask.shape[-1]),
                           slots=inputs.slots)
    assert not prefill_attention.applies(q, layer, bias, MAX_QUERIES)
    with plain_torch():
        assert not prefill_attention.applies(q, layer, inputs, MAX_QUERIES)
    with switch.without("prefill_attention"):  # this kernel alone off (a benchmark's A/B)
        assert not prefill_attention.applies(q, layer, inputs, MAX_QUERIES)
        assert switch.kernel_enabled("paged_attention")
    assert prefill_attention.applies(q, layer, inputs, MAX_QUERIES)  # on again after the block
    with pytest.raises(ValueError, match="no kernel named linear; the ones that turn off alone"), switch.without("linear"):
        pass


@pytest.mark.parametrize(("positional", "n_kv_heads", "head_dim"), [("rope", 2, 8), ("rope", 1, 32), ("learned", None, 8)])
def test_a_model_over_the_paged_cache_equals_the_slots_and_the_rows_alone(
        monkeypatch, positional: str, n_kv_heads: int | None, head_dim: int) -> None:
    """Every forward of the staggered schedule (prefill chunks beside decoding rows, three widths in
    one forward, swaps, reused rows): the paged cache's logits through the path equal the fixed
    slots' (plain SDPA) and each row alone's."""
    calls = count_calls(monkeypatch, prefill_attention, "prefill_cache_attention")
    staggered_schedule(TwinDriver(kernel_model(positional, n_kv_heads, head_dim), rows=3, max_len=16))
    assert calls, "the prefill path never ran"


def test_the_serve_engine_gives_the_same_greedy_tokens_with_the_path(monkeypatch) -> None:
    """A LLaMA-style model (GQA) through aiayn.fast.optimize, prompts of 5-70 tokens in prefill chunks
    of 16 beside decoding rows: the same greedy tokens with the path, without it, and over the fixed slots."""
    torch.manual_seed(0)
    config = get_preset("llama-tiny", vocab_size=300, max_seq_len=128, d_model=128, n_heads=4, n_kv_heads=2)
    lm = TextModel(optimize(randomize_(DecoderOnly(config), 0).eval(), mode="inference"), lambda text: [],
                   lambda ids: " ".join(map(str, ids)), 128)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 40, 17, 70, 9)]
    calls = count_calls(monkeypatch, prefill_attention, "prefill_cache_attention")
    with_path = engine_answers(lm, prompts, paged=True)
    assert calls, "the prefill path never ran"
    monkeypatch.setattr(prefill_attention, "applies", lambda *args: False)
    calls.clear()
    assert engine_answers(lm, prompts, paged=True) == with_path
    assert engine_answers(lm, prompts, paged=False) == with_path
    assert not calls
