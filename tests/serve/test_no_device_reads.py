"""The serve engine's step reads nothing back from the device but its tokens.

On a GPU every read of a device value into Python (``int(t)``, ``bool(t)``, ``t.item()``,
``t.tolist()``, ``t.cpu()``) makes the host wait for the stream. This machine has no GPU, so the
tests take the GPU's code path on the CPU (``serve_helpers.device_path``):
``aiayn.nn.data_checks.reads_data`` is patched to say False (as it does for a CUDA tensor: no
data-dependent checks, masks always built), and every way a tensor's value reaches Python is
patched to note where it was called from. The engine's prefill
and decode steps, and the per-row cache's own operations (``KVCache.reserve``, ``rows``,
``swap_rows``, ``clear_row``, ``reorder`` and the layers' writes), then read nothing, except the one
read the engine must make: the chosen token ids (with the log-probabilities asked for), once per
forward in ``aiayn.serve.sampler.choose`` (before ``Output.emit``), to detokenise them. And the results equal the ordinary
(reading) path's.
"""

from __future__ import annotations

import pytest
import torch
from serve_helpers import device_path, step_until, tiny_text_model
from torch.testing import assert_close

from aiayn.generate import SamplingConfig
from aiayn.models import DecoderOnly, get_preset
from aiayn.nn.kv_cache import KVCache
from aiayn.serve.engine import Engine, Request, SamplingParams, slot_plan


# ---- the cache on its own ----------------------------------------------------------------------
def schedule(model: DecoderOnly, cache: KVCache) -> list[torch.Tensor]:
    """Rows join, prefill right-padded chunks beside decoding rows through views, swap, leave and are
    reused; each forward's counts are told to the cache (``expect``). The logits of every forward."""
    g = torch.Generator().manual_seed(0)
    out = []

    def forward(start: int, counts: list[int]) -> None:
        t = max(counts)
        tokens = torch.randint(0, 99, (len(counts), t), generator=g)
        valid = torch.arange(t)[None, :] < torch.tensor(counts)[:, None]  # right-padded (b, t)
        view = cache.rows(start, start + len(counts)).expect(counts)
        out.append(model(tokens, valid=valid, cache=view).logits)

    forward(0, [4])
    forward(0, [1, 5])
    forward(0, [1, 1])
    cache.clear_row(2)
    forward(2, [3])
    forward(0, [2, 3, 4])
    cache.swap_rows(0, 2)
    forward(0, [1, 1, 1])
    cache.clear_row(1)
    forward(1, [6, 1])
    cache.reorder([2, 0, 1])  # host ints: nothing to read
    forward(0, [1, 1, 1])
    return out


@torch.no_grad()
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_the_row_cache_reads_nothing_and_computes_the_same(quantize: str | None) -> None:
    torch.manual_seed(0)
    model = DecoderOnly(get_preset("gpt-tiny", positional="alibi")).eval()
    expected = schedule(model, model.new_cache(3, 24, per_row=True, quantize=quantize))
    cache = model.new_cache(3, 24, per_row=True, quantize=quantize)
    with device_path() as reads:
        got = schedule(model, cache)
    assert reads == []
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, rtol=0, atol=0)
    assert cache.host_lengths == cache.lengths.tolist()


def test_the_harness_sees_a_read_and_the_device_checks_the_counts() -> None:
    """Without counts the cache must read the validity back (once, and the spy sees it); with counts
    that the data contradicts, the device's own assert fails (on the CPU at once)."""
    cache = KVCache(n_layers=1, batch_size=2, n_kv_heads=1, head_dim=4, max_len=8, per_row=True)
    valid = torch.tensor([[True, True], [True, False]])
    with device_path() as reads:
        cache.reserve(valid, torch.zeros(2, 2, dtype=torch.long))
    assert [r.split(" ")[0] for r in reads] == ["_real_counts"] * len(reads) and reads
    assert cache.host_lengths == [2, 1]
    with device_path() as reads, pytest.raises(RuntimeError, match="right-padded"):
        cache.reserve(valid, torch.zeros(2, 2, dtype=torch.long), counts=[2, 2])
    assert reads == []


# ---- the engine ----------------------------------------------------------------------------------
def run_engine(lm, *, spy: bool) -> tuple[list[list[int]], list[list], list[str], int]:
    """Five requests on 3 slots (prompts chunked by 8 beside decoding rows; greedy and seeded
    sampling; log-probabilities with 0 to 3 alternatives) stepped to the end: each one's tokens and
    log-probabilities, the reads seen, and how many times the engine sampled."""
    plan = slot_plan(lm, max_batch=3, context=64, budget=1 << 30, kv_cache=None)
    engine = Engine(lm, plan, prefill_chunk=8)
    samples = 0
    emit = engine.output.emit

    def counted(*args):
        nonlocal samples
        samples += 1
        return emit(*args)

    engine.output.emit = counted  # type: ignore[method-assign]
    events: list[list] = [[] for _ in range(5)]
    for i, n in enumerate([5, 19, 11, 3, 14]):
        prompt = torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        sampling = SamplingConfig(temperature=0.0 if i % 2 == 0 else 0.8, top_p=0.9, seed=i)
        params = SamplingParams(max_tokens=6 + i, sampling=sampling, logprobs=[None, 0, 3, None, 1][i])
        engine.submit(Request(prompt, params, events[i].append))
    reads = step_until(engine, lambda: all(e and e[-1].finish_reason for e in events), spy=spy, limit=200)
    assert all(e[-1].finish_reason == "length" for e in events)
    logprobs = [[(ev.logprob.logprob, ev.logprob.top) if ev.logprob else None for ev in e] for e in events]
    return [[ev.token for ev in e] for e in events], logprobs, reads, samples


@pytest.mark.parametrize("positional", [
    "alibi",
    "rope",  # (positional.py's range check reads only where data_checks.reads_data allows)
])
def test_the_engine_step_reads_only_its_tokens(positional: str) -> None:
    lm = tiny_text_model(positional=positional)
    tokens, logprobs, _, _ = run_engine(lm, spy=False)
    got_tokens, got_logprobs, reads, samples = run_engine(lm, spy=True)
    assert got_tokens == tokens and got_logprobs == logprobs
    where = {r.split(" ")[0] for r in reads}
    # aiayn.serve.sampler.choose, once per forward that samples (its tokens go to Output.emit)
    assert where <= {"choose"}, "\n".join(r for r in reads if not r.startswith("choose "))
    assert len(reads) == samples  # one read per forward that chose tokens
