"""Reverse a sequence of digits (UvA Deep Learning tutorial 6).

Input: 16 tokens from 10 categories. Target at position i: the input at position 15 - i. An
encoder-only model labels every position; its single attention head must learn to look at the
mirrored position, which shows as an anti-diagonal in its attention map.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.tasks.base import register
from aiayn.train.task import AttentionExample, Batch, Task


@register
class ReverseTask(Task):
    name = "reverse"
    attention_kinds = ("encoder",)
    description = "reverse 16 digits (UvA tutorial); encoder-only, per-position labels"

    def __init__(self, *, num_categories: int = 10, seq_len: int = 16, n_train: int = 50_000,
                 n_val: int = 1_000, n_test: int = 10_000, **options: Any) -> None:
        super().__init__(**options)
        self.num_categories, self.seq_len = num_categories, seq_len
        self.sizes = {"train": n_train, "val": n_val, "test": n_test}

    def model_config(self) -> ModelConfig:
        return ModelConfig(arch="encoder-only", vocab_size=self.num_categories, d_model=32, n_heads=1,
                           n_layers=1, d_ff=64, positional="sinusoidal", max_seq_len=self.seq_len,
                           pad_id=None, type_vocab_size=0, tie_output=False, name="reverse")

    def train_overrides(self) -> dict[str, Any]:
        # UvA recipe: Adam 5e-4, warmup 50, cosine, 10 epochs of batch 128. A higher rate (3e-3)
        # reaches 100% in half the epochs, which matters on a CPU.
        return dict(epochs=5, batch_size=128, lr=3e-3, warmup_steps=50, schedule="cosine",
                    optimizer="adam", clip_grad_norm=5.0)

    def prepare(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for split, n in self.sizes.items():
            inputs = torch.randint(self.num_categories, (n, self.seq_len), generator=generator)
            self.splits[split] = {"inputs": inputs, "labels": inputs.flip(1)}

    def forward(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        return model(batch["inputs"]).logits, batch["labels"]

    @torch.no_grad()
    def examples(self, model: nn.Module, n: int = 3) -> list[str]:
        model.eval()
        batch = self.on_model(model, self.collate("test", torch.arange(n)))
        predicted = model(batch["inputs"]).logits.argmax(-1)
        lines = []
        for x, y in zip(batch["inputs"].tolist(), predicted.tolist(), strict=True):
            lines.append(f"{' '.join(map(str, x))}  ->  {' '.join(map(str, y))}")
        return lines

    @torch.no_grad()
    def attention_example(self, model: nn.Module, text: str | None = None,
                          kind: str | None = None) -> AttentionExample:
        self.attention_kind(kind)
        model.eval()
        inputs = (self.collate("test", torch.arange(1))["inputs"] if text is None
                  else self.parse_ids(text, low=0, high=self.num_categories, length=self.seq_len))
        out = model(self.on_model(model, {"inputs": inputs})["inputs"], need_weights=True)
        labels = [str(v) for v in inputs[0].tolist()]
        return AttentionExample(weights=[w[0] for w in out.attentions], query_labels=labels,
                                key_labels=labels, title="reverse: encoder self-attention")
