"""The paged-attention kernel (``aiayn.fast.paged_attention``: attention read through a paged KV
cache's block table, no gathered copy) equals the plain path it replaces.

* The op itself against the plain gather (``index_select`` of whole blocks, as
  ``LayerKVCache.gather`` of a block pool) + ``aiayn.nn.attention.scaled_dot_product_attention``, and against
  the same keys laid out in fixed slots as the per-row ``KVCache`` holds them: random pools, ragged row
  lengths, rows sharing prefix blocks, rows with no key (padding rows: zeros), GQA and MQA, one
  query or several under a position-causal mask, masks broadcast or not.
* A model over ``PagedKVCache`` with the kernel equals the same model over the per-row ``KVCache`` (the
  staggered schedules of test_row_kv_cache.py, step by step) and each row equals the row alone.
* The serve engine over the paged cache gives the same greedy tokens with the kernel as without
  it, and as over the fixed slots.

float32, ``assert_close``'s default tolerances (rtol 1.3e-6, atol 1e-5); spies prove the kernel ran.
"""

from __future__ import annotations

import pytest
import torch
from kernel_spies import count_calls
from random_weights import randomize_
from test_paged_kv_cache import BLOCK, PagedDriver
from test_row_kv_cache import decoder_only, sequences, staggered_schedule
from torch.testing import assert_close

from aiayn.fast import optimize, paged_attention, plain_torch
from aiayn.fast.paged_attention_build import kernel_ops
from aiayn.generate import SamplingConfig
from aiayn.models import DecoderOnly, get_preset
from aiayn.nn.attention import MultiHeadAttention, scaled_dot_product_attention
from aiayn.nn.block_pool import NULL_BLOCK
from aiayn.serve.blocks import block_plan
from aiayn.serve.engine import Engine, Request, SamplingParams, slot_plan
from aiayn.textgen import TextModel

# The kernel is CPU code (aiayn.fast): once, on the CPU.
pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def ops():
    built = kernel_ops()
    assert built is not None, "the paged-attention kernel did not build (a C++ compiler and ninja are needed)"
    return built


def random_pool(lengths: list[int], *, h_kv: int, d_h: int, block: int, share: int, seed: int):
    """Pools (n_blocks, block, h_kv, d_h) of random keys and values, and a block table (b, n) for rows
    of ``lengths`` tokens, padded with the null block; rows 1 and 2 share their first ``share``
    blocks (a common prompt prefix). The blocks are handed out in a shuffled order (a used pool)."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lengths) // block)
    n_blocks = 1 + sum(-(-n // block) for n in lengths)
    k, v = (torch.randn(n_blocks, block, h_kv, d_h, generator=g) for _ in range(2))
    free = (torch.randperm(n_blocks - 1, generator=g) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lengths]
    tables[2][:share] = tables[1][:share]
    table = torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables], dtype=torch.long)
    return k, v, table


def gathered(pool: torch.Tensor, table: torch.Tensor, t_k: int) -> torch.Tensor:
    """The plain path's copy: (b, h_kv, t_k, d_h), as ``LayerKVCache.gather`` of a block pool."""
    b, n = table.shape
    _, block, h_kv, d_h = pool.shape
    return pool.index_select(0, table.reshape(-1)).view(b, n * block, h_kv, d_h)[:, :t_k].transpose(1, 2)


def in_slots(pool: torch.Tensor, table: torch.Tensor, lengths: list[int], t_k: int) -> torch.Tensor:
    """The same keys as the per-row ``KVCache`` holds them, (b, h_kv, t_k, d_h): row i's slot s is its token s,
    written token by token from the pool (zeros past its length)."""
    _, block, h_kv, d_h = pool.shape
    slots = torch.zeros(len(lengths), h_kv, t_k, d_h)
    for i, n in enumerate(lengths):
        for s in range(n):
            slots[i, :, s] = pool[table[i, s // block], s % block]
    return slots


@pytest.mark.parametrize("d_h", [64, 16])  # 64: the AVX-512 path where the CPU has it; 16: the plain loops
@pytest.mark.parametrize("t_q", [1, 3])
@pytest.mark.parametrize(("h", "h_kv"), [(4, 4), (6, 2), (4, 1)])
def test_the_kernel_equals_the_gather_and_the_slots(ops, h: int, h_kv: int, t_q: int, d_h: int) -> None:
    """Ragged rows (a padding row with no key among them), two sharing a prefix; t_q > 1 under a
    position-causal mask (each row's queries are its last t_q tokens)."""
    lengths, block = [7, 13, 16, 0, 1, 30], 4
    k, v, table = random_pool(lengths, h_kv=h_kv, d_h=d_h, block=block, share=2, seed=h + h_kv + t_q)
    b, t_k = len(lengths), max(lengths)
    q = torch.randn(b, h, t_q, d_h, generator=torch.Generator().manual_seed(7))
    valid = torch.arange(t_k)[None] < torch.tensor(lengths)[:, None]  # (b, t_k)
    mask = valid[:, None, None, :]  # (b, 1, 1, t_k)
    if t_q > 1:
        query_pos = torch.tensor(lengths)[:, None] - t_q + torch.arange(t_q)  # (b, t_q)
        mask = mask & (torch.arange(t_k)[None, None, :] <= query_pos[:, :, None])[:, None]  # (b, 1, t_q, t_k)
    scale = 0.3
    out = ops.attention(q, k, v, table, t_k, mask, scale)
    expected, _ = scaled_dot_product_attention(q, gathered(k, table, t_k), gathered(v, table, t_k), mask=mask,
                                               scale=scale)
    assert_close(out, expected)
    slots, _ = scaled_dot_product_attention(q, in_slots(k, table, lengths, t_k), in_slots(v, table, lengths, t_k),
                                            mask=mask, scale=scale)
    assert_close(out, slots)
    assert bool((out[3] == 0).all())  # the row with no key: zeros, not NaN


@pytest.mark.parametrize("d_h", [32, 8])
def test_without_a_mask_and_with_a_wider_strided_mask(ops, d_h: int) -> None:
    """No mask: every slot [0, t_k) is a key. A mask that is a slice of a wider buffer (the cache's
    ``valid[:, :length]``, strided) and broadcast over the rows."""
    lengths, block = [12, 12, 12], 4
    k, v, table = random_pool(lengths, h_kv=2, d_h=d_h, block=block, share=3, seed=1)
    q = torch.randn(3, 4, 1, d_h, generator=torch.Generator().manual_seed(2))
    keys, values = gathered(k, table, 12), gathered(v, table, 12)
    assert_close(ops.attention(q, k, v, table, 12, None, d_h**-0.5), scaled_dot_product_attention(q, keys, values)[0])
    wide = torch.rand(1, 20, generator=torch.Generator().manual_seed(3)) < 0.7  # (1, 20): one row's valid
    mask = wide[:, :12][:, None, None, :]  # (1, 1, 1, 12), strided
    assert_close(ops.attention(q, k, v, table, 12, mask, d_h**-0.5),
                 scaled_dot_product_attention(q, keys, values, mask=mask)[0])


def test_the_avx512_path_is_built_where_the_cpu_has_it(ops) -> None:
    with open("/proc/cpuinfo") as f:
        assert ops.has_avx512() == ("avx512f" in f.read())


def test_it_splits_its_work_over_torch_threads_with_the_same_result(ops) -> None:
    """Built with OpenMP (at::parallel_for runs serially without it); each task owns whole rows x
    key/value heads, so the result does not depend on the thread count."""
    assert ops.parallel(), "the kernel was built without OpenMP: it runs on one thread"
    lengths = [9, 33, 20, 5]
    k, v, table = random_pool(lengths, h_kv=3, d_h=128, block=8, share=1, seed=4)
    q = torch.randn(4, 9, 1, 128, generator=torch.Generator().manual_seed(5))
    mask = (torch.arange(33)[None] < torch.tensor(lengths)[:, None])[:, None, None, :]
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outputs.append(ops.attention(q, k, v, table, 33, mask, 0.25))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[0], outputs[1])


def test_the_op_is_registered_for_torch_compile(ops) -> None:
    """torch.library's own checks of the op (schema, fake shape function, autograd registration),
    and a fullgraph trace through it (aot_eager: the graph without Inductor's C++ build)."""
    lengths = [5, 12, 0]
    k, v, table = random_pool(lengths, h_kv=2, d_h=32, block=4, share=1, seed=6)
    q = torch.randn(3, 4, 1, 32, generator=torch.Generator().manual_seed(8))
    mask = (torch.arange(12)[None] < torch.tensor(lengths)[:, None])[:, None, None, :]
    torch.library.opcheck(torch.ops.aiayn_paged.attention.default, (q, k, v, table, 12, mask, 0.25))
    compiled = torch.compile(lambda q: ops.attention(q, k, v, table, 12, mask, 0.25), fullgraph=True,
                             backend="aot_eager")
    assert_close(compiled(q), ops.attention(q, k, v, table, 12, mask, 0.25))


def test_bad_input_gets_one_clear_error(ops) -> None:
    k, v, table = random_pool([8, 8, 8], h_kv=2, d_h=8, block=4, share=0, seed=0)
    q = torch.randn(3, 4, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.attention(q, k, v, table + 100, 8, None, 1.0)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.attention(q, k, v, table, 9, None, 1.0)
    with pytest.raises(RuntimeError, match="not a multiple"):
        ops.attention(torch.randn(3, 3, 1, 8), k, v, table, 8, None, 1.0)


# ---- through the model -------------------------------------------------------------------------
def kernel_model(positional: str = "rope", n_kv_heads: int | None = 2, head_dim: int = 8):
    """test_row_kv_cache.py's seeded gpt-tiny (heads of 8: the kernel's plain loops), or with two
    query heads of ``head_dim`` (32: its AVX-512 path), through ``aiayn.fast.optimize``."""
    if head_dim == 8:
        model = decoder_only(positional, n_kv_heads, device=torch.device("cpu"))
    else:
        torch.manual_seed(0)
        config = get_preset("gpt-tiny", positional=positional, n_kv_heads=n_kv_heads, pad_id=None,
                            d_model=2 * head_dim, n_heads=2)
        model = randomize_(DecoderOnly(config), 0).eval()
    return optimize(model, mode="inference")


class TwinDriver(PagedDriver):
    """``PagedDriver`` that also feeds every forward's tokens to a per-row ``KVCache`` read by the plain
    path: each paged forward's logits (the kernel's) equal the fixed slots' and the row alone's."""

    def __init__(self, model, rows: int, max_len: int) -> None:
        super().__init__(model, rows, max_len)
        self.slots = model.new_cache(rows, max_len, per_row=True)

    def start(self, row, seq):
        super().start(row, seq)
        self.slots.clear_row(row)

    def swap(self, i, j):
        super().swap(i, j)
        self.slots.swap_rows(i, j)

    @torch.no_grad()
    def forward(self, start, counts):
        t, stop = max(counts), start + len(counts)
        tokens = torch.randint(0, 99, (len(counts), t))  # junk where padded
        valid = torch.zeros(len(counts), t, dtype=torch.bool)
        for k, n in enumerate(counts):
            tokens[k, :n] = self.seqs[start + k][self.fed[start + k]: self.fed[start + k] + n]
            valid[k, :n] = True
        paged = self.model(tokens, valid=valid, cache=self.cache.rows(start, stop)).logits
        with plain_torch():  # the fixed slots, plain SDPA
            slots = self.model(tokens, valid=valid, cache=self.slots.rows(start, stop)).logits
        for k, n in enumerate(counts):
            row, end = start + k, self.fed[start + k] + n
            assert_close(paged[k, :n], slots[k, :n])
            assert_close(paged[k, :n], self.alone(self.seqs[row][:end])[self.fed[row]:end])
            self.fed[row] = end


@pytest.mark.parametrize(("positional", "n_kv_heads", "head_dim"),
                         [("rope", 2, 8), ("rope", None, 8), ("learned", 1, 8), ("rope", 1, 32), ("rope", None, 32)])
def test_a_model_over_the_paged_cache_equals_the_slots_and_the_rows_alone(
        ops, monkeypatch, positional: str, n_kv_heads: int | None, head_dim: int) -> None:
    """Rows join, prefill beside decoding rows, swap, leave and are reused (blocks of 4): at every
    forward the kernel's logits equal the fixed slots' (plain SDPA) and each row equals the row alone."""
    calls = count_calls(monkeypatch, paged_attention, "kernel_ops")
    staggered_schedule(TwinDriver(kernel_model(positional, n_kv_heads, head_dim), rows=3, max_len=16))
    assert calls, "the kernel never ran"


def test_the_plain_path_stays_where_the_kernel_does_not_apply(ops, monkeypatch) -> None:
    """Prefill chunks (t > 1), a lone row of consecutive blocks (a view, no gather), an additive
    position bias (ALiBi), ``plain_torch()``: the gather + SDPA, and the rows still equal the rows alone."""
    calls = count_calls(monkeypatch, paged_attention, "kernel_ops")
    driver = PagedDriver(kernel_model(head_dim=32), rows=2, max_len=24)
    a, b = sequences([12, 12], device=torch.device("cpu"))
    driver.start(0, a)
    driver.forward(0, [5])  # a prefill chunk
    driver.forward(0, [1])  # one row, blocks 1-2: read as a view of the pool
    assert not calls
    driver.start(1, b)
    driver.forward(1, [3])
    with plain_torch():
        driver.forward(0, [1, 1])
    assert not calls
    driver.forward(0, [1, 1])  # two rows decode: the kernel
    assert calls
    calls.clear()
    alibi = PagedDriver(kernel_model("alibi", 1), rows=2, max_len=24)
    for row, seq in enumerate((a, b)):
        alibi.start(row, seq)
    alibi.forward(0, [4, 6])
    alibi.forward(0, [1, 1])
    assert not calls


def test_shared_prefix_rows_decode_with_the_kernel(ops, monkeypatch) -> None:
    """Rows that adopt another row's prompt blocks (a prefix-cache hit) decode step by step with the
    kernel and equal the row alone."""
    calls = count_calls(monkeypatch, paged_attention, "kernel_ops")
    driver = PagedDriver(kernel_model(head_dim=32), rows=3, max_len=24)
    a, b, c = sequences([20, 22, 21], device=torch.device("cpu"))
    b[: 2 * BLOCK], c[: 2 * BLOCK] = a[: 2 * BLOCK], a[: 2 * BLOCK]
    driver.start(0, a)
    driver.forward(0, [9])
    blocks = driver.cache.table(0)[:2]
    driver.adopt(1, b, blocks)
    driver.adopt(2, c, blocks)
    driver.forward(0, [1, 3, 2])
    for _ in range(8):
        driver.forward(0, [1, 1, 1])
    assert calls, "the kernel never ran"


# ---- the serve engine --------------------------------------------------------------------------
def engine_answers(lm: TextModel, prompts: list[list[int]], *, paged: bool) -> list[list[int]]:
    """Each prompt's 12 greedy tokens from the serve engine (paged blocks of 8, or the fixed slots),
    the prompts submitted two steps apart (prefill chunks of 16 beside decoding rows)."""
    kwargs = dict(max_batch=4, context=128, budget=1 << 30, kv_cache=None)
    plan = block_plan(lm, block_size=8, **kwargs) if paged else slot_plan(lm, **kwargs)
    engine = Engine(lm, plan, prefill_chunk=16)
    sinks: list[list] = []
    for ids in prompts:
        events: list = []
        engine.submit(Request(ids, SamplingParams(sampling=SamplingConfig(temperature=0.0), max_tokens=12),
                              events.append))
        sinks.append(events)
        engine.step()
        engine.step()
    for _ in range(500):
        if all(events and events[-1].finish_reason is not None for events in sinks):
            return [[e.token for e in events] for events in sinks]
        engine.step()
    raise AssertionError("the engine did not finish")


def test_the_serve_engine_gives_the_same_greedy_tokens_with_the_kernel(ops, monkeypatch) -> None:
    """A LLaMA-style model (GQA, heads of 32) through aiayn.fast.optimize, as ``aiayn serve`` loads
    it: over the paged cache its greedy tokens with the kernel equal those without it (the gather)
    and those over the fixed slots."""
    torch.manual_seed(0)
    config = get_preset("llama-tiny", vocab_size=300, max_seq_len=128, d_model=128, n_heads=4, n_kv_heads=2)
    model = optimize(randomize_(DecoderOnly(config), 0).eval(), mode="inference")
    lm = TextModel(model, lambda text: [], lambda ids: " ".join(map(str, ids)), 128)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 40, 17, 70, 9)]
    calls = count_calls(monkeypatch, paged_attention, "kernel_ops")
    with_kernel = engine_answers(lm, prompts, paged=True)
    assert calls, "the kernel never ran"
    calls.clear()
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            monkeypatch.setattr(module, "cache_kernel", None)
    assert engine_answers(lm, prompts, paged=True) == with_kernel
    assert engine_answers(lm, prompts, paged=False) == with_kernel
    assert not calls
