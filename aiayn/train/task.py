"""The Task protocol the trainer drives: data splits, a default model and recipe, a forward that yields the
loss's input and targets, and an evaluation. Tasks register in ``aiayn.tasks``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.device import model_device, to_device
from aiayn.models import build_model
from aiayn.train.losses import LossInput, sequence_loss

Batch = dict[str, Tensor]


@dataclass
class AttentionExample:
    """Attention maps of one input: per layer (h, t_q, t_k), with axis labels."""

    weights: list[Tensor]
    query_labels: list[str]
    key_labels: list[str]
    title: str

    def __post_init__(self) -> None:  # on the CPU, for plotting, whatever device made them
        self.weights = [w.detach().cpu() for w in self.weights]


ATTENTION_KINDS = ("encoder", "decoder", "cross")  # what ``aiayn plot attention --kind`` can show


def encoder_decoder_example(out: Any, kind: str, src_labels: list[str], tgt_labels: list[str],
                            title: str) -> AttentionExample:
    """The ``kind`` maps (encoder, decoder or cross) of an encoder-decoder's output for one example."""
    weights, queries, keys, what = {
        "encoder": (out.encoder_attentions, src_labels, src_labels, "encoder self-attention"),
        "decoder": (out.attentions, tgt_labels, tgt_labels, "decoder self-attention (causal)"),
        "cross": (out.cross_attentions, tgt_labels, src_labels, "decoder cross-attention")}[kind]
    return AttentionExample(weights=[w[0] for w in weights], query_labels=queries, key_labels=keys,
                            title=f"{title}: {what}")


def self_attention_example(out: Any, labels: list[str], title: str) -> AttentionExample:
    """The self-attention maps of a one-example forward (``need_weights=True``) over ``labels``."""
    return AttentionExample(weights=[w[0] for w in out.attentions], query_labels=labels, key_labels=labels,
                            title=title)


class Task:
    """Base class. Subclasses fill ``splits`` in ``prepare`` and implement ``forward``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    test_split: ClassVar[str] = "test"  # the split reported at the end of training
    # Options a task writes into the run's config (a learned vocabulary), accepted when loaded.
    recorded_options: ClassVar[tuple[str, ...]] = ()
    attention_kinds: ClassVar[tuple[str, ...]] = ()  # ``attention_example``'s maps, the first by default
    attention_needs_splits: ClassVar[bool] = True  # False: ``attention_example`` reads what it needs itself

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.splits: dict[str, Batch] = {}
        self.run_dir: Path | None = None  # set by the trainer before ``prepare``; None outside a run

    def model_config(self) -> ModelConfig:
        raise NotImplementedError

    def train_overrides(self) -> dict[str, Any]:
        """TrainConfig fields this task's default recipe sets."""
        return {}

    def lora_overrides(self) -> dict[str, Any]:
        """TrainConfig fields that replace ``train_overrides``' when the run trains LoRA adapters."""
        return {}

    def build_model(self, config: ModelConfig) -> nn.Module:
        return build_model(config)

    def prepare(self, seed: int) -> None:
        """Build ``self.splits`` deterministically from ``seed``."""
        raise NotImplementedError

    def split_size(self, split: str) -> int:
        return next(iter(self.splits[split].values())).shape[0]

    def train_batches(self, epoch: int, batch_size: int, seed: int) -> list[Tensor]:
        """Index batches of one epoch, fixed by (seed, epoch) so a resumed run sees the same ones."""
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(self.split_size("train"), generator=generator)
        return list(order.split(batch_size))

    def memory_batches(self, batches: list[Tensor]) -> list[Tensor]:
        """The index batches whose shapes bound a step's memory: by default the one with the most examples."""
        return [max(batches, key=len)] if batches else []

    def collate(self, split: str, indices: Tensor) -> Batch:
        return {key: value[indices] for key, value in self.splits[split].items()}

    def eval_batches(self, split: str, batch_size: int) -> list[Batch]:
        n = self.split_size(split)
        return [self.collate(split, torch.arange(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]

    def forward(self, model: nn.Module, batch: Batch) -> tuple[LossInput, Tensor]:
        """(the model's output or logits (b, t, c), targets (b, t) with IGNORE where nothing counts)."""
        raise NotImplementedError

    def count_tokens(self, batch: Batch) -> int:
        """Input tokens in a batch, for the tokens/s figure."""
        return sum(v.numel() for k, v in batch.items() if k in ("src", "tgt", "tokens", "inputs"))

    @staticmethod
    def on_model(model: nn.Module, batch: Batch) -> Batch:
        """``batch`` on ``model``'s device (``aiayn.device.to_device``; as it is on the CPU)."""
        return to_device(batch, model_device(model))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, batch_size: int = 500) -> dict[str, float]:
        """Teacher-forced loss, perplexity, token and sequence accuracy on a split."""
        model.eval()
        # Summed on the model's device and read once at the end (one sync, not one per batch).
        nll, tokens, correct, seq_correct, seqs = 0.0, 0, 0, 0, 0
        for batch in self.eval_batches(split, batch_size):
            logits, targets = self.forward(model, self.on_model(model, batch))
            out = sequence_loss(logits, targets)
            nll, tokens = out.nll_sum.double() + nll, out.n_tokens + tokens
            correct, seq_correct = out.n_correct + correct, out.n_seq_correct + seq_correct
            seqs += out.n_seqs
        nll, tokens, correct, seq_correct = float(nll), int(tokens), int(correct), int(seq_correct)
        return {"nll": nll / max(tokens, 1), "acc": correct / max(tokens, 1),
                "seq_acc": seq_correct / max(seqs, 1)}

    def examples(self, model: nn.Module, n: int = 3) -> list[str]:
        """A few test inputs with the model's predictions, for the end-of-run summary."""
        return []

    @torch.no_grad()
    def attention_example(self, model: nn.Module, text: str | None = None,
                          kind: str | None = None) -> AttentionExample | None:
        """Attention maps on ``text`` (ValueError if unparsable) or a test example; None without kinds."""
        if not self.attention_kinds:
            return None
        kind = self.attention_kind(kind)
        model.eval()
        return self.attention_maps(model, text, kind)

    def attention_maps(self, model: nn.Module, text: str | None, kind: str) -> AttentionExample:
        """``attention_example``'s maps of a checked ``kind``, the model in eval mode, without gradients."""
        raise NotImplementedError

    def attention_kind(self, kind: str | None) -> str:
        """``kind``, or the task's default; ValueError naming the kinds the task has."""
        if not self.attention_kinds:
            raise ValueError(f"task {self.name} has no attention plot")
        if kind is None:
            return self.attention_kinds[0]
        if kind not in self.attention_kinds:
            raise ValueError(f"task {self.name} has {' and '.join(self.attention_kinds)} attention, not "
                             f"{kind}; choose --kind {' or '.join(self.attention_kinds)}")
        return kind

    @staticmethod
    def parse_ids(text: str, *, low: int, high: int, length: int | None = None) -> Tensor:
        """'3 1 4 1 5' -> tensor([[3, 1, 4, 1, 5]]), checking every id is in [low, high)."""
        try:
            ids = [int(tok) for tok in text.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"input {text!r} must be space-separated integers") from None
        if not ids or any(not low <= i < high for i in ids):
            raise ValueError(f"input {text!r} must hold integers in [{low}, {high})")
        if length is not None and len(ids) != length:
            raise ValueError(f"input {text!r} must hold exactly {length} integers, got {len(ids)}")
        return torch.tensor([ids])
