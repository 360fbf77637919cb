"""benchmarks/staggered.py's transformers peer (static batching) on a tiny random LLaMA: a batch
waits for its arrivals, each row's own tokens are counted (up to its max_tokens or end-of-text),
and a row's TTFT runs from its arrival; the workload is seeded. The whole
benchmark needs SmolLM2 and minutes: it is not run here."""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.staggered import Job, static_batches, workload


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config).eval()


def test_static_batches_wait_count_and_time(tiny_llama):
    jobs = [Job(0.0, [5, 6, 7], 3), Job(0.05, [8, 9], 6), Job(0.3, [10, 11, 12, 13], 2)]
    r = static_batches(tiny_llama, jobs, 2, None, 1)
    # Batches [0, 1] (started once job 1 arrived) and [2]; no end-of-text: every row its own answer.
    assert r["tokens"] == 3 + 6 + 2 and r["most_running"] == 2
    assert r["seconds"] >= 0.3 and r["tokens_per_s"] == r["tokens"] / r["seconds"]
    # Job 0 waited for job 1 (0.05 s) before its first token; p99 is the largest TTFT.
    assert r["ttft_p99"] >= 0.05 and r["ttft_p50"] <= r["ttft_p99"]


def test_static_batches_count_to_end_of_text(tiny_llama):
    prompt = [5, 6, 7]
    with torch.no_grad():
        first = int(tiny_llama(torch.tensor([prompt])).logits[0, -1].argmax())  # greedy's first token
    r = static_batches(tiny_llama, [Job(0.0, prompt, 5)], 1, first, 1)
    assert r["tokens"] == 1  # the end-of-text token, counted as the engine counts it


def test_workload_is_seeded_and_in_range():
    import argparse

    args = argparse.Namespace(seed=3, requests=20, short=[4, 8], long=[30, 40], long_share=0.5, answer=[2, 5])
    jobs = workload(args, 2.0)
    assert [(j.at, j.prompt, j.answer) for j in jobs] == [(j.at, j.prompt, j.answer) for j in workload(args, 2.0)]
    assert all(a.at < b.at for a, b in itertools.pairwise(jobs))
    assert all(4 <= len(j.prompt) <= 8 or 30 <= len(j.prompt) <= 40 for j in jobs)
    assert all(2 <= j.answer <= 5 for j in jobs)
    # Another rate: the same requests, their arrival times scaled by the ratio of the rates.
    slower = workload(args, 0.5)
    assert [(j.prompt, j.answer) for j in slower] == [(j.prompt, j.answer) for j in jobs]
    assert [j.at for j in slower] == pytest.approx([4 * j.at for j in jobs])
