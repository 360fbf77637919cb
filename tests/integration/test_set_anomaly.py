"""The set-anomaly task: a permutation-equivariant model, disjoint image pools, and real learning."""

from __future__ import annotations

from pathlib import Path

import torch

from aiayn.config import TrainConfig
from aiayn.tasks import get_task
from aiayn.tasks.set_anomaly import SetAnomalyModel, SetAnomalyTask
from aiayn.train.trainer import train


def small_task(**sizes: int) -> SetAnomalyTask:
    task = get_task("set-anomaly", **{"n_train": 2_000, "n_val": 500, "n_test": 500, **sizes})
    assert isinstance(task, SetAnomalyTask)
    return task


def test_registered() -> None:
    from aiayn.tasks import TASKS

    assert TASKS["set-anomaly"] is SetAnomalyTask


def test_permutation_equivariance() -> None:
    torch.manual_seed(0)
    task = small_task()
    model = SetAnomalyModel(task.model_config().replace(dropout=0.1)).eval()
    x = torch.rand(4, 10, 64)  # (b, n, f)
    perm = torch.randperm(10)
    with torch.no_grad():
        out = model(x, need_weights=True)
        out_perm = model(x[:, perm], need_weights=True)
    # Permuting the set permutes the scores (and every attention map, on both axes) identically.
    torch.testing.assert_close(out_perm.scores, out.scores[:, perm])
    for w, w_perm in zip(out.attentions, out_perm.attentions, strict=True):  # (b, h, n, n)
        torch.testing.assert_close(w_perm, w[:, :, perm][:, :, :, perm])


def test_pools_disjoint_and_one_anomaly_per_set() -> None:
    task = small_task()
    task.prepare(seed=3)
    pools = {split: set(ids.tolist()) for split, ids in task.pools.items()}
    assert not pools["train"] & pools["val"]
    assert not pools["train"] & pools["test"]
    assert not pools["val"] & pools["test"]
    assert len(pools["train"] | pools["val"] | pools["test"]) == len(task.images) == 1797
    # Stratified: every class is in every pool.
    for ids in task.pools.values():
        assert set(task.classes[ids].tolist()) == set(range(10))

    for split in ("train", "val", "test"):
        ids, anomaly = task.splits[split]["image_ids"], task.splits[split]["labels"]  # (n, 10), (n,)
        assert set(ids.unique().tolist()) <= pools[split]  # sets use only their own pool
        classes = task.classes[ids]  # (n, 10)
        odd_class = classes.gather(1, anomaly[:, None])  # (n, 1)
        is_odd = classes != classes[torch.arange(len(ids)), (anomaly + 1) % 10][:, None]
        # Exactly one element differs from the others, it is at the labelled slot, and its class
        # differs from the 9 normal images, which are distinct images of one class.
        assert (is_odd.sum(1) == 1).all()
        assert is_odd.gather(1, anomaly[:, None]).all()
        assert ((classes == odd_class).sum(1) == 1).all()
        assert all(len(set(row)) == 10 for row in ids.tolist())
    # The anomaly slot is spread over all positions.
    assert set(task.splits["train"]["labels"].tolist()) == set(range(10))


def test_prepare_is_deterministic() -> None:
    a, b = small_task(), small_task()
    a.prepare(seed=5)
    b.prepare(seed=5)
    for split in a.splits:
        assert torch.equal(a.splits[split]["image_ids"], b.splits[split]["image_ids"])
        assert torch.equal(a.splits[split]["labels"], b.splits[split]["labels"])


def test_forward_examples_and_attention() -> None:
    task = small_task()
    task.prepare(seed=0)
    model = task.build_model(task.model_config())
    batch = task.collate("test", torch.arange(8))
    logits, targets = task.forward(model, batch)
    assert logits.shape == (8, 1, 10) and targets.shape == (8, 1)
    assert task.count_tokens(batch) == 80
    lines = task.examples(model, n=2)
    assert len(lines) == 2 and all("predicted" in line for line in lines)
    example = task.attention_example(model)
    cfg = task.model_config()
    assert len(example.weights) == cfg.n_layers
    assert example.weights[0].shape == (cfg.n_heads, 10, 10)
    assert sum(label.endswith("*") for label in example.query_labels) == 1


def test_short_training_finds_the_anomaly(tmp_path: Path) -> None:
    # 100 steps (~3 s on 2 idle cores), tested on unseen images: 0.94-0.975 over seeds 0-5 (0.968 at
    # the default seed 0); the default recipe (200 steps) reaches ~98%.
    task = small_task(n_train=12_800, n_val=500, n_test=2_000)
    train_config = TrainConfig(task="set-anomaly", **{**task.train_overrides(), "lr": 3e-3,
                                                      "warmup_steps": 20, "eval_every": 0})
    model_config = task.model_config().replace(d_model=64, d_ff=128)  # half the default width
    result = train(task, model_config, train_config, tmp_path / "run", progress=False,
                   make_plots=False, echo=lambda _: None)
    assert result.step == 100
    assert result.test_metrics["acc"] >= 0.9, result.test_metrics
