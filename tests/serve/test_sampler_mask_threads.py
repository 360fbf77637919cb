"""The grammar mask in ``aiayn.serve.sampler.choose`` runs on one torch thread on the CPU
(``one_thread``: a tiny op that would otherwise open OpenMP parallel regions, which cost tens of
milliseconds on shared cores) and masks exactly as ``mask_rows`` does on the engine's threads."""

from __future__ import annotations

import pytest
import torch
from tokenizer_helpers import train_tokenizer

from aiayn.generate import SamplingConfig
from aiayn.generate.constrain import GrammarConstraint, mask_rows
from aiayn.serve import sampler
from aiayn.serve.engine import Request, SamplingParams

TEXT = '{"name": "Ada", "age": 36, "tags": ["math", "engines"], "ok": true}\nThe quick brown fox. 12345\n' * 4
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.cpu_only
def test_choose_masks_on_one_thread_as_mask_rows_does(monkeypatch):
    tok = train_tokenizer(TEXT)
    eos = tok.token_to_id("<|im_end|>")
    started = GrammarConstraint.from_schema(tok, SCHEMA, eos_id=eos)
    for token in tok.encode('{"name": "A', add_special_tokens=False).ids:
        started.advance(token)  # rows at different points of their grammars
    constraints = [GrammarConstraint.from_schema(tok, SCHEMA, eos_id=eos), None, started,
                   GrammarConstraint.json_object(tok, eos_id=eos)]
    # A padded output layer, so that the rows past the vocabulary (masked too) are over torch's
    # 32,768-element grain: an op that opens a parallel region at 2 threads.
    v = tok.get_vocab_size() + 40_000
    logits = torch.randn(len(constraints), v, generator=torch.Generator().manual_seed(0))  # (m, v)
    torch.set_num_threads(2)  # the test harness gives the count back
    expected = mask_rows(logits.clone(), [c and c.copy() for c in constraints])  # on 2 threads
    calls: list[tuple[int, torch.Tensor]] = []

    def recording(rows: torch.Tensor, cs: list) -> torch.Tensor:
        out = mask_rows(rows, cs)
        calls.append((torch.get_num_threads(), out.clone()))
        return out

    monkeypatch.setattr(sampler, "mask_rows", recording)
    greedy = SamplingParams(max_tokens=8, sampling=SamplingConfig(temperature=0.0))
    requests = [Request([5, 6, 7], greedy, lambda event: None, constraint=c)
                for c in constraints]
    chosen = sampler.choose(logits.clone(), requests)
    assert [threads for threads, _ in calls] == [1] and torch.get_num_threads() == 2
    masked = calls[0][1]
    assert masked.equal(expected) and torch.isinf(masked[[0, 2, 3]]).any(dim=1).all()
    assert masked[1].equal(logits[1])  # the free row untouched
    assert [token for token, _ in chosen] == expected.argmax(dim=-1).tolist()


def test_one_thread_gives_the_count_back():
    torch.set_num_threads(2)
    with pytest.raises(RuntimeError, match="inside"), sampler.one_thread(torch.device("cpu")):
        assert torch.get_num_threads() == 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2
    with sampler.one_thread(torch.device("meta")):  # not the CPU: left as it is
        assert torch.get_num_threads() == 2
