"""``aiayn serve --compile``: the engine's decode steps through one compiled graph per batch-size
bucket (``aiayn.serve.compiled_step``) give the eager engine's tokens, compile once per bucket and
never again, break no graph and read nothing back from the device but the chosen tokens.

The schedule makes rows join and leave while others prefill in chunks beside them, so the decoding
rows fill buckets 1, 2 and 4 with and without padding rows (a bucket of 4 for 3 rows pads over a
prefilling row or a free one), greedy and seeded sampling side by side. Compiling costs about a
minute per bucket on a loaded 2-core CPU, so the main test compiles three graphs of one tiny
model and checks everything on them; the variations are marked slow. On CUDA (``AIAYN_TEST_DEVICES=cuda``)
the same code replays each bucket as a CUDA graph (``test_cuda_graphs_replay_the_buckets``).
"""

from __future__ import annotations

import pytest
import torch
from serve_helpers import step_until, tiny_text_model
from torch._dynamo.utils import counters, guard_failures

from aiayn.fast import compiled_decode
from aiayn.generate import SamplingConfig
from aiayn.serve.compiled_step import bucket_sizes
from aiayn.serve.engine import Engine, Request, SamplingParams, slot_plan
from aiayn.textgen import TextModel

# (arrives at step, prompt length, max_tokens, temperature): 6 requests on 4 slots; prompts longer
# than the prefill chunk of 8 are read over several steps beside the decoding rows.
SCHEDULE = [(0, 5, 9, 0.0), (0, 13, 4, 0.9), (3, 3, 12, 0.0), (4, 21, 6, 0.7), (9, 7, 3, 0.0), (10, 2, 8, 1.0)]


def run_schedule(engine: Engine, *, spy: bool = False) -> tuple[list[list[int]], list[str]]:
    """Step ``engine`` through ``SCHEDULE`` to the end: each request's tokens and (``spy``) every
    read of a device value into Python meanwhile."""
    events: list[list] = [[] for _ in SCHEDULE]

    def arrive(step: int) -> None:
        for i, (arrives, n, max_tokens, temperature) in enumerate(SCHEDULE):
            if arrives == step:
                prompt = torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(i)).tolist()
                sampling = SamplingConfig(temperature=temperature, top_p=0.95, seed=i)
                engine.submit(Request(prompt, SamplingParams(max_tokens=max_tokens, sampling=sampling),
                                      events[i].append))

    # (a request not arrived yet has no events: not done before the last one has arrived)
    reads = step_until(engine, lambda: all(e and e[-1].finish_reason for e in events), spy=spy,
                       before_step=arrive)
    assert all(e[-1].finish_reason == "length" for e in events)
    return [[ev.token for ev in e] for e in events], reads


def guard_failure_count() -> int:
    """Every guard failure Dynamo has recorded (each one sends a call to compile again)."""
    return sum(len(reasons) for reasons in guard_failures.values())


def new_engine(lm: TextModel, *, compile: bool) -> Engine:
    plan = slot_plan(lm, max_batch=4, context=48, budget=1 << 30, kv_cache=None)
    return Engine(lm, plan, prefill_chunk=8, compile=compile)


@pytest.fixture(scope="module")
def lm() -> TextModel:
    return tiny_text_model(context=48)


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(4) == [1, 2, 4]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]


def test_compiled_engine_equals_eager_and_compiles_once_per_bucket(lm: TextModel) -> None:
    """Both compiled runs take the device's code path (``device_path``: what a GPU step runs,
    nothing read back for checks), the first compiling, the second warm: rows join and leave at
    other lengths of the reused cache, and no graph is compiled, no guard fails, and the only reads
    of device values are the chosen tokens' (``choose``, once per forward that samples)."""
    eager, _ = run_schedule(new_engine(lm, compile=False))
    compiled_decode.forget_compiled(lm.model)
    engine = new_engine(lm, compile=True)
    assert engine.compiled is not None
    steps: list[tuple[int, int]] = []  # (decoding rows, rows in use) at each compiled step
    step = engine.compiled.step

    def noted(last_tokens: list[int]):
        steps.append((len(last_tokens), len(engine.rows)))
        return step(last_tokens)

    engine.compiled.step = noted  # type: ignore[method-assign]
    graphs = counters["stats"]["unique_graphs"]
    tokens, _ = run_schedule(engine, spy=True)
    assert tokens == eager  # greedy and seeded sampling alike
    assert engine.compiled.compiled_buckets == {1, 2, 4}  # the schedule passes through every bucket
    # The padding rows were free rows and rows still reading their prompts: 3 decoding rows in a
    # bucket of 4 beside a prefilling row, 1 in a bucket of 1 beside prefilling rows.
    assert (3, 4) in steps and any(n == 1 and used > 1 for n, used in steps)
    assert counters["stats"]["unique_graphs"] - graphs == 3  # one graph per bucket
    graphs, frames, failures = counters["stats"]["unique_graphs"], counters["frames"]["total"], guard_failure_count()
    again, reads = run_schedule(engine, spy=True)
    assert again == eager
    assert counters["stats"]["unique_graphs"] == graphs and counters["frames"]["total"] == frames
    assert guard_failure_count() == failures
    assert {r.split(" ")[0] for r in reads} <= {"choose"}, "\n".join(r for r in reads if not r.startswith("choose "))


def test_the_row_step_is_one_graph(lm: TextModel) -> None:
    """``torch._dynamo.explain`` of the bucket step, on a bucket with padding rows: no graph break."""
    engine = new_engine(lm, compile=True)
    assert engine.compiled is not None
    view = engine.compiled._view(2)
    tokens = torch.tensor([[5], [0]])
    live = torch.tensor([True, False])
    positions = view.lengths[:, None].clone()
    slots = view.expect([1, 0]).reserve(live[:, None], positions)
    explained = torch._dynamo.explain(compiled_decode._row_step)(lm.model, tokens, positions, slots, view.valid,
                                                                 view.positions, view)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_compile_refuses_the_paged_layout_and_a_quantised_cache(lm: TextModel) -> None:
    from aiayn.serve.blocks import block_plan

    plan = block_plan(lm, max_batch=4, context=48, budget=1 << 30, kv_cache=None, block_size=16,
                      prefix_caching=True)
    with pytest.raises(ValueError, match="--kv-layout slots"):
        Engine(lm, plan, compile=True)
    slots = slot_plan(lm, max_batch=4, context=48, budget=1 << 30, kv_cache="int8")
    with pytest.raises(ValueError, match="float KV cache"):
        Engine(lm, slots, kv_cache="int8", compile=True)


def test_compile_takes_the_fixed_slots_and_says_so_at_start_up(tiny_dir) -> None:
    """Without --kv-layout, --compile serves from fixed slots (the paged default is not compiled)."""
    from aiayn.serve import build_state, load_served_model
    from aiayn.serve.engine import SlotPlan

    state, lines = build_state(load_served_model(tiny_dir), max_batch=6, context=48, compile=True)
    assert state.engine is not None and state.engine.compiled is not None
    assert isinstance(state.engine.plan, SlotPlan)
    assert "decode steps compiled, a graph per batch size of 1, 2, 4, 6 rows" in "\n".join(lines)


def test_the_cli_refuses_compile_with_the_paged_layout(run_aiayn, tiny_dir) -> None:
    """One line, exit 2, before the model loads (the paged cache's step is not compiled yet)."""
    code, _, err = run_aiayn("serve", "--model", str(tiny_dir), "--compile", "--kv-layout", "paged")
    assert code == 2 and "--compile works with --kv-layout slots only" in err
    code, _, err = run_aiayn("serve", "--model", str(tiny_dir), "--compile", "--kv-cache", "int8")
    assert code == 2 and "float KV cache" in err


@pytest.mark.slow
def test_padding_rows_over_free_rows_stay_harmless(lm: TextModel) -> None:
    """A bucket of 4 over 1 decoding row and 3 free ones (never used), then those rows used: the
    eager tokens (a free row's padding attends to its own new key only: no NaN left behind)."""
    eager = new_engine(lm, compile=False)
    engine = new_engine(lm, compile=True)
    assert engine.compiled is not None
    engine.compiled.bucket = lambda n: 4  # type: ignore[method-assign]  # always the largest bucket
    assert run_schedule(engine)[0] == run_schedule(eager)[0]
    assert engine.compiled.compiled_buckets == {4}
    for layer in engine.cache.layers:
        assert torch.isfinite(layer.k).all() and torch.isfinite(layer.v).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (AIAYN_TEST_DEVICES=cuda on a GPU)")
def test_cuda_graphs_replay_the_buckets(device: torch.device) -> None:
    """On CUDA: the compiled engine equals the eager one, and no bucket's graph was refused a CUDA
    graph (Inductor counts each refusal: a mutated input not static, a host read, ...); warm, the
    schedule again compiles nothing."""
    if device.type != "cuda":
        pytest.skip("a CUDA test")
    lm = tiny_text_model(context=48)
    lm.model.to(device)
    eager, _ = run_schedule(new_engine(lm, compile=False))
    engine = new_engine(lm, compile=True)
    skips = counters["inductor"]["cudagraph_skips"]
    assert run_schedule(engine)[0] == eager
    assert counters["inductor"]["cudagraph_skips"] == skips
    graphs = counters["stats"]["unique_graphs"]
    assert run_schedule(engine)[0] == eager  # warm: replays only
    assert counters["stats"]["unique_graphs"] == graphs
