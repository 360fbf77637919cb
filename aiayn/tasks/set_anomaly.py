"""Find the odd one out in a set of images (UvA Deep Learning tutorial 6): 9 images of one class and 1 of
another, from scikit-learn's 8x8 digits split into disjoint train/val/test pools, scored by a
permutation-equivariant encoder (no positions, no mask).

Shape letters: b sets, n elements per set (10), f pixels per image (64), d d_model, h heads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.models.base import init_weights
from aiayn.models.blocks import TransformerBlock
from aiayn.nn.norm import make_norm
from aiayn.tasks.base import register
from aiayn.train.task import AttentionExample, Batch, Task, self_attention_example

N_FEATURES = 64  # 8x8 pixels


@dataclass
class SetAnomalyOutput:
    scores: Tensor  # (b, n) anomaly score of each element; logits over the n positions
    attentions: list[Tensor] = field(default_factory=list)  # per layer (b, h, n, n), on request


class SetAnomalyModel(nn.Module):
    """features (b, n, f) -> one score per element (b, n); permutation-equivariant in n."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.input_proj = nn.Linear(N_FEATURES, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        # No positional encoding and no mask: every element is treated alike, whatever its slot.
        self.blocks = nn.ModuleList(TransformerBlock(config, cross_attention=False)
                                    for _ in range(config.n_layers))
        self.final_norm = (make_norm(config.norm, config.d_model, config.norm_eps)
                           if config.final_norm else None)
        self.score = nn.Linear(config.d_model, 1)
        init_weights(self, config)

    def forward(self, features: Tensor, *, need_weights: bool = False) -> SetAnomalyOutput:
        if features.dim() != 3:
            raise ValueError(f"features must have shape (sets, elements, features), got {tuple(features.shape)}")
        x = self.dropout(self.input_proj(features))  # (b, n, d)
        attentions: list[Tensor] = []
        for block in self.blocks:
            x, weights, _ = block(x, need_weights=need_weights)  # (b, n, d), (b, h, n, n) | None
            if weights is not None:
                attentions.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
        scores = self.score(x).squeeze(-1)  # (b, n)
        return SetAnomalyOutput(scores=scores, attentions=attentions)


def load_digit_images() -> tuple[Tensor, Tensor]:
    """scikit-learn's bundled digits: images (1797, 64) float in [0, 1], classes (1797,) long."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values 0..16
    return images, torch.as_tensor(digits.target, dtype=torch.long)


def split_pools(classes: Tensor, fractions: tuple[float, float], generator: torch.Generator
                ) -> dict[str, Tensor]:
    """Disjoint train/val/test image indices, stratified per class (val/test fractions given)."""
    pools: dict[str, list[Tensor]] = {"train": [], "val": [], "test": []}
    for c in range(int(classes.max()) + 1):
        members = (classes == c).nonzero().squeeze(1)
        members = members[torch.randperm(len(members), generator=generator)]
        n_val, n_test = (round(f * len(members)) for f in fractions)
        n_train = len(members) - n_val - n_test
        pools["train"].append(members[:n_train])
        pools["val"].append(members[n_train : n_train + n_val])
        pools["test"].append(members[n_train + n_val :])
    return {split: torch.cat(parts).sort().values for split, parts in pools.items()}


def sample_sets(pool: Tensor, classes: Tensor, n_sets: int, set_size: int, num_classes: int,
                generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Sets drawn from one pool: image ids (n_sets, set_size), in random order, and the anomaly's slot."""
    normal = torch.randint(num_classes, (n_sets,), generator=generator)
    # Another class, uniform over the other num_classes - 1.
    odd = (normal + torch.randint(1, num_classes, (n_sets,), generator=generator)) % num_classes
    ids = torch.empty(n_sets, set_size, dtype=torch.long)
    for c in range(num_classes):
        members = pool[classes[pool] == c]  # (m,) images of class c in this pool
        rows = (normal == c).nonzero().squeeze(1)
        # set_size - 1 distinct members per set: the first columns of a random permutation.
        picks = torch.rand(len(rows), len(members), generator=generator).argsort(dim=1)[:, : set_size - 1]
        ids[rows, : set_size - 1] = members[picks]
        rows = (odd == c).nonzero().squeeze(1)
        ids[rows, set_size - 1] = members[torch.randint(len(members), (len(rows),), generator=generator)]
    order = torch.rand(n_sets, set_size, generator=generator).argsort(dim=1)  # (n_sets, set_size)
    ids = ids.gather(1, order)
    anomaly = (order == set_size - 1).float().argmax(dim=1)  # where the odd image went
    return ids, anomaly


@register
class SetAnomalyTask(Task):
    name = "set-anomaly"
    attention_kinds = ("encoder",)
    description = ("find the odd digit in a set of 10 (UvA tutorial); permutation-equivariant "
                   "encoder, unseen test images")

    def __init__(self, *, set_size: int = 10, n_train: int = 25_600, n_val: int = 1_000,
                 n_test: int = 10_000, val_fraction: float = 0.2, test_fraction: float = 0.2,
                 **options: Any) -> None:
        super().__init__(**options)
        self.set_size = set_size
        self.sizes = {"train": n_train, "val": n_val, "test": n_test}
        self.fractions = (val_fraction, test_fraction)
        self.images = torch.empty(0, N_FEATURES)  # (N, 64), filled by prepare
        self.classes = torch.empty(0, dtype=torch.long)  # (N,)
        self.pools: dict[str, Tensor] = {}  # split -> image indices

    def model_config(self) -> ModelConfig:
        return ModelConfig(arch="encoder-only", vocab_size=1, d_model=128, n_heads=4, n_layers=2,
                           d_ff=256, positional="none", max_seq_len=self.set_size, pad_id=None,
                           type_vocab_size=0, tie_output=False, dropout=0.0, name="set-anomaly")

    def train_overrides(self) -> dict[str, Any]:
        # One pass over 25,600 sets, short warmup: this small problem needs far less than UvA's recipe.
        return dict(epochs=1, batch_size=128, lr=2e-3, warmup_steps=30, schedule="cosine",
                    optimizer="adam", clip_grad_norm=5.0, eval_every=50)

    def build_model(self, config: ModelConfig) -> nn.Module:
        return SetAnomalyModel(config)

    def prepare(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images, self.classes = load_digit_images()
        num_classes = int(self.classes.max()) + 1
        self.pools = split_pools(self.classes, self.fractions, generator)
        for split, n in self.sizes.items():
            ids, anomaly = sample_sets(self.pools[split], self.classes, n, self.set_size, num_classes,
                                       generator)
            self.splits[split] = {"image_ids": ids, "labels": anomaly}

    def collate(self, split: str, indices: Tensor) -> Batch:
        batch = super().collate(split, indices)
        batch["inputs"] = self.images[batch["image_ids"]]  # (b, n, 64)
        return batch

    def forward(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        scores = model(batch["inputs"]).scores  # (b, n)
        return scores.unsqueeze(1), batch["labels"].unsqueeze(1)  # (b, 1, n), (b, 1)

    def count_tokens(self, batch: Batch) -> int:
        return batch["image_ids"].numel()  # set elements

    def _labels(self, ids: Tensor, anomaly: int) -> list[str]:
        return [f"{c}*" if i == anomaly else str(c) for i, c in enumerate(self.classes[ids].tolist())]

    @torch.no_grad()
    def examples(self, model: nn.Module, n: int = 3) -> list[str]:
        model.eval()
        batch = self.collate("test", torch.arange(n))
        predicted = model(self.on_model(model, batch)["inputs"]).scores.argmax(-1).cpu()  # (n,)
        lines = []
        for ids, true, pred in zip(batch["image_ids"], batch["labels"].tolist(), predicted.tolist(),
                                   strict=True):
            labels = self._labels(ids, true)
            lines.append(f"{' '.join(labels)}  ->  predicted {pred} (class {self.classes[ids[pred]]}), "
                         f"true {true} (class {self.classes[ids[true]]})")
        return lines

    def attention_maps(self, model: nn.Module, text: str | None, kind: str) -> AttentionExample:
        """The attention on one test set: the first, or the set numbered ``text`` (0-based)."""
        n_test, index = self.split_size("test"), 0
        try:
            if text is not None:
                index = int(self.parse_ids(text, low=0, high=n_test, length=1))
        except ValueError:
            raise ValueError(f"input {text!r} must be the number of a test set, 0 to {n_test - 1}") from None
        batch = self.collate("test", torch.tensor([index]))
        out = model(self.on_model(model, batch)["inputs"], need_weights=True)
        labels = self._labels(batch["image_ids"][0], int(batch["labels"][0]))
        return self_attention_example(out, labels, f"set-anomaly: attention on test set {index} (* = odd one)")
