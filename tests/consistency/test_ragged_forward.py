"""A ragged forward (``TransformerStack.forward_ragged``, ``aiayn.generate.step.decode_ragged``): some
rows decoding one token each and others feeding prompt chunks, in one pass over the weights, gives
every row what the model computes for that row alone.

Over a per-row cache (fixed slots and paged), rows 0-2 decode while rows 3-4 prefill right-padded
chunks of different lengths, step after step, as the serve engine's mixed step runs them; the
logits of every real token equal a full forward over that row's sequence alone (float32,
``assert_close``'s default tolerances), and the next steps' equality shows the cache holds what it
should. With ``aiayn.fast``'s kernels (the paged-attention kernel on the decoding rows, the
prepared-mask prefill path on the chunk) and, on CUDA, with a host-device sync made an error.
"""

from __future__ import annotations

import pytest
import torch
from test_row_kv_cache import decoder_only, sequences, sync_errors
from torch.testing import assert_close

from aiayn.device import model_device
from aiayn.generate.step import decode_ragged
from aiayn.models import DecoderOnly
from aiayn.models.blocks import RaggedBatch
from aiayn.nn.packing import Packing


def run_mixed_steps(model: DecoderOnly, *, paged: bool, no_sync: bool = False) -> None:
    device = model_device(model)
    extra = {"n_blocks": 40, "block_size": 4} if paged else {}
    cache = model.new_cache(5, 40, per_row=True, **extra)
    seqs = sequences([14, 9, 20, 31, 17], device=device)
    fed = [0] * 5
    with torch.no_grad():
        for row, n in enumerate([5, 3, 7]):  # rows 0-2 prefilled, alone, to different lengths
            model(seqs[row][None, :n], cache=cache.rows(row, row + 1).expect([n]))
            fed[row] = n
        alone = [model(seq[None]).logits[0] for seq in seqs]  # (n_i, v) each: the reference
        for chunk in ([6, 2], [4, 7], [9, 5], [12, 3]):  # rows 3-4: chunks per step (the last ends row 4)
            chunk = [min(n, len(seqs[3 + k]) - fed[3 + k]) for k, n in enumerate(chunk)]
            counts = [[1, 1, 1], chunk]
            batches, wanted = [], []  # wanted: (row, position) of each packed token, in order
            for first, row_counts in zip((0, 3), counts, strict=True):
                width = max(row_counts)
                tokens = torch.zeros(len(row_counts), width, dtype=torch.long, device=device)
                for k, n in enumerate(row_counts):
                    row = first + k
                    tokens[k, :n] = seqs[row][fed[row]: fed[row] + n]
                    wanted += [(row, fed[row] + j) for j in range(n)]
                batches.append(RaggedBatch(tokens, row_counts, cache.rows(first, first + len(row_counts))))
            at = torch.arange(len(wanted), device=device)
            with sync_errors(no_sync and device.type == "cuda"):
                logits = decode_ragged(model, batches, at)  # (n, v)
            for (row, position), got in zip(wanted, logits, strict=True):
                assert_close(got, alone[row][position], msg=lambda m, r=row, p=position: f"row {r} @ {p}: {m}")
            for k, row_counts in ((0, counts[0]), (3, counts[1])):
                for j, n in enumerate(row_counts):
                    fed[k + j] += n
    assert cache.host_lengths == fed


@pytest.mark.parametrize("paged", [False, True], ids=["slots", "paged"])
@pytest.mark.parametrize(("positional", "n_kv_heads"), [("rope", 2), ("learned", None), ("alibi", 2), ("t5", None)])
def test_each_row_of_a_mixed_step_equals_the_row_alone(positional: str, n_kv_heads: int | None, paged: bool,
                                                       device: torch.device) -> None:
    run_mixed_steps(decoder_only(positional, n_kv_heads, device=device), paged=paged, no_sync=True)


@pytest.mark.cpu_only  # aiayn.fast.optimize's kernels are CPU code
@pytest.mark.parametrize("paged", [False, True], ids=["slots", "paged"])
def test_with_the_fast_kernels(paged: bool) -> None:
    from aiayn.fast import optimize

    run_mixed_steps(optimize(decoder_only("rope", 2, device=torch.device("cpu")), mode="inference"), paged=paged)


@pytest.mark.cpu_only
def test_a_full_packing_is_a_reshape() -> None:
    x = torch.randn(3, 4, 5)
    full, ragged = Packing.of_counts([4, 4, 4], 4, torch.device("cpu")), Packing.of_counts([4, 1, 2], 4, torch.device("cpu"))
    assert full.full and not ragged.full
    assert full.pack(x).data_ptr() == x.data_ptr() and torch.equal(full.pack(x), x.reshape(12, 5))
    assert torch.equal(ragged.pack(x), torch.cat([x[0], x[1, :1], x[2, :2]]))
    assert torch.equal(full.unpack(full.pack(x)), x)
    assert torch.equal(ragged.unpack(ragged.pack(x))[2, :2], x[2, :2]) and not ragged.unpack(ragged.pack(x))[1, 1:].any()
    with pytest.raises(ValueError, match=r"counts \[5\] must lie in \[0, 4\]"):
        Packing.of_counts([5], 4, torch.device("cpu"))


def test_refusals(device: torch.device) -> None:
    model = decoder_only("rope", device=device)
    cache = model.new_cache(2, 16, per_row=True)
    tokens = torch.ones(2, 3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"a ragged batch of 2 rows needs 2 counts, each in \[1, 3\]"):
        model.decoder.forward_ragged([RaggedBatch(tokens, [3, 0], cache)])
    with pytest.raises(ValueError, match="a ragged batch of 2 rows needs 2 counts"):
        model.decoder.forward_ragged([RaggedBatch(tokens, [3], cache)])
    with pytest.raises(TypeError, match="forward_ragged needs per-row caches"):
        model.decoder.forward_ragged([RaggedBatch(tokens, [3, 3], model.new_cache(2, 16))])
