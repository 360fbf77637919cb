"""The pieces of aiayn.train.distributed that need no process group: sharding and option checks."""

from __future__ import annotations

import pytest

from aiayn.train.distributed import (
    DistContext,
    DistributedError,
    ParallelOptions,
    check_options,
    check_world_size,
    shard,
)


def test_each_rank_takes_every_world_th_batch_of_the_window():
    window = list(range(6))  # world 3 x grad_accum 2
    parts = [shard(window, DistContext(rank=r, world_size=3)) for r in range(3)]
    assert parts == [[0, 3], [1, 4], [2, 5]]
    assert sorted(i for part in parts for i in part) == window  # a partition: no overlap, nothing lost


def test_world_larger_than_the_epoch_is_refused():
    check_world_size(DistContext(rank=0, world_size=2), batches_per_epoch=4, grad_accum=2)
    with pytest.raises(DistributedError, match="4 processes x grad_accum 1 need 4 batches per step, "
                                               "but an epoch has only 3 batches"):
        check_world_size(DistContext(rank=0, world_size=4), batches_per_epoch=3, grad_accum=1)


@pytest.mark.parametrize("rank", [0, 2])
def test_under_torchrun_rank_0_reports_the_world_size_error_before_any_rank_leaves(monkeypatch, capsys, rank):
    # torchrun stops every worker once one exits, so a rank that raised at once could end the job
    # before rank 0 printed the line (seen once in CI under load): rank 0 prints, then all meet.
    import aiayn.train.distributed as distributed

    events = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "barrier", lambda: events.append(("barrier", capsys.readouterr().err)))
    with pytest.raises(DistributedError) as caught:
        check_world_size(DistContext(rank=rank, world_size=3), batches_per_epoch=2, grad_accum=1)
    said = "Error: 3 processes x grad_accum 1 need 3 batches per step, but an epoch has only 2 batches"
    assert events == [("barrier", f"{said}; use fewer processes, a smaller --batch-size or --grad-accum\n"
                                  if rank == 0 else "")]  # said before the barrier, by rank 0 only
    assert caught.value.reported  # the command line does not say it again


@pytest.mark.parametrize(("options", "world", "compile", "needle"), [
    (ParallelOptions(fsdp=True), 1, False, "--fsdp shards over several processes"),
    (ParallelOptions(), 2, True, "--compile is not supported with multi-process training"),
    (ParallelOptions(fsdp=True), 2, True, "--compile is not supported with multi-process training"),
])
def test_incompatible_options(options, world, compile, needle):
    with pytest.raises(DistributedError, match=needle):
        check_options(options, world_size=world, compile=compile)


def test_compatible_options_pass():
    check_options(ParallelOptions(fsdp=True), world_size=2, compile=False)
    check_options(None, world_size=1, compile=True)
