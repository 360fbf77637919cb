"""Copy a sequence (The Annotated Transformer's first example): an encoder-decoder reproduces 10 random
symbols (ids 2..10; 0 padding, 1 start), scored by exact greedy copies."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.generate import greedy_encoder_decoder
from aiayn.tasks.base import GeneratedTask, register
from aiayn.train.losses import IGNORE, LossInput
from aiayn.train.task import AttentionExample, Batch, encoder_decoder_example

PAD, BOS = 0, 1


@register
class CopyTask(GeneratedTask):
    name = "copy"
    attention_kinds = ("cross", "encoder", "decoder")
    description = "copy 10 symbols (Annotated Transformer); encoder-decoder, greedy decoding"

    def __init__(self, *, vocab_size: int = 11, seq_len: int = 10, **options: Any) -> None:
        super().__init__(seq_len=seq_len, **options)
        self.vocab_size = vocab_size

    def generate(self, n: int, generator: torch.Generator) -> Batch:
        return {"src": torch.randint(2, self.vocab_size, (n, self.seq_len), generator=generator)}

    def model_config(self) -> ModelConfig:
        return ModelConfig(arch="encoder-decoder", vocab_size=self.vocab_size, d_model=64, n_heads=4,
                           n_layers=2, d_ff=128, positional="sinusoidal", max_seq_len=self.seq_len + 2,
                           pad_id=PAD, name="copy")

    def train_overrides(self) -> dict[str, Any]:
        return dict(epochs=2, batch_size=64, lr=2e-3, schedule="cosine", warmup_steps=100,
                    optimizer="adam", label_smoothing=0.0, clip_grad_norm=1.0)

    def forward(self, model: nn.Module, batch: Batch) -> tuple[LossInput, Tensor]:
        src = batch["src"]
        tgt_in = F.pad(src[:, :-1], (1, 0), value=BOS)  # teacher forcing: shift right
        return model(src, tgt_in), src.masked_fill(src == PAD, IGNORE)  # the loss applies the output layer

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, batch_size: int = 500) -> dict[str, float]:
        metrics = super().evaluate(model, split, batch_size)
        exact = total = 0
        for batch in self.eval_batches(split, batch_size):
            batch = self.on_model(model, batch)
            out = greedy_encoder_decoder(model, batch["src"], bos_id=BOS, max_new_tokens=self.seq_len)
            exact += int((out.tokens == batch["src"]).all(dim=1).sum())
            total += batch["src"].shape[0]
        metrics["greedy_exact"] = exact / total
        return metrics

    @torch.no_grad()
    def examples(self, model: nn.Module, n: int = 3) -> list[str]:
        model.eval()
        src = self.on_model(model, self.collate("test", torch.arange(n)))["src"]
        out = greedy_encoder_decoder(model, src, bos_id=BOS, max_new_tokens=self.seq_len)
        return [f"{' '.join(map(str, s))}  ->  {' '.join(map(str, o))}"
                for s, o in zip(src.tolist(), out.tokens.tolist(), strict=True)]

    def attention_maps(self, model: nn.Module, text: str | None, kind: str) -> AttentionExample:
        src = (self.collate("test", torch.arange(1))["src"] if text is None
               else self.parse_ids(text, low=2, high=self.vocab_size, length=self.seq_len))
        src = self.on_model(model, {"src": src})["src"]
        out = model(src, F.pad(src[:, :-1], (1, 0), value=BOS), need_weights=True)
        return encoder_decoder_example(out, kind, [str(v) for v in src[0].tolist()],
                                       ["<s>", *map(str, src[0, :-1].tolist())], "copy")
