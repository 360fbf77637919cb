"""Reverse a sequence of digits (UvA Deep Learning tutorial 6): an encoder-only model labels each of 16
positions with the input at the mirrored one, an anti-diagonal in its attention map."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.tasks.base import GeneratedTask, register
from aiayn.train.task import AttentionExample, Batch, self_attention_example


@register
class ReverseTask(GeneratedTask):
    name = "reverse"
    attention_kinds = ("encoder",)
    description = "reverse 16 digits (UvA tutorial); encoder-only, per-position labels"

    def __init__(self, *, num_categories: int = 10, seq_len: int = 16, **options: Any) -> None:
        super().__init__(seq_len=seq_len, **options)
        self.num_categories = num_categories

    def model_config(self) -> ModelConfig:
        return ModelConfig(arch="encoder-only", vocab_size=self.num_categories, d_model=32, n_heads=1,
                           n_layers=1, d_ff=64, positional="sinusoidal", max_seq_len=self.seq_len,
                           pad_id=None, type_vocab_size=0, tie_output=False, name="reverse")

    def train_overrides(self) -> dict[str, Any]:
        # UvA's recipe with a higher rate (3e-3), which converges in half the epochs.
        return dict(epochs=5, batch_size=128, lr=3e-3, warmup_steps=50, schedule="cosine",
                    optimizer="adam", clip_grad_norm=5.0)

    def generate(self, n: int, generator: torch.Generator) -> Batch:
        inputs = torch.randint(self.num_categories, (n, self.seq_len), generator=generator)
        return {"inputs": inputs, "labels": inputs.flip(1)}

    def forward(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        return model(batch["inputs"]).logits, batch["labels"]

    @torch.no_grad()
    def examples(self, model: nn.Module, n: int = 3) -> list[str]:
        model.eval()
        batch = self.on_model(model, self.collate("test", torch.arange(n)))
        predicted = model(batch["inputs"]).logits.argmax(-1)
        return [f"{' '.join(map(str, x))}  ->  {' '.join(map(str, y))}"
                for x, y in zip(batch["inputs"].tolist(), predicted.tolist(), strict=True)]

    def attention_maps(self, model: nn.Module, text: str | None, kind: str) -> AttentionExample:
        inputs = (self.collate("test", torch.arange(1))["inputs"] if text is None
                  else self.parse_ids(text, low=0, high=self.num_categories, length=self.seq_len))
        out = model(self.on_model(model, {"inputs": inputs})["inputs"], need_weights=True)
        labels = [str(v) for v in inputs[0].tolist()]
        return self_attention_example(out, labels, "reverse: encoder self-attention")
