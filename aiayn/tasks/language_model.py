"""Language modelling on Tiny Shakespeare (``$AIAYN_DATA_DIR/tinyshakespeare/input.txt``): next-character
prediction (GPT) and masked-character prediction (BERT's 80/10/10 masking). The first 90% trains, the
last 10% validates in non-overlapping windows."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.data import dataset_file
from aiayn.finetune.source import TokenizersText
from aiayn.generate import SamplingConfig, generate_decoder_only
from aiayn.tasks.base import register
from aiayn.tokenizers import CharTokenizer
from aiayn.train.losses import IGNORE, LossInput
from aiayn.train.task import AttentionExample, Batch, Task, self_attention_example

CORPUS = ("tinyshakespeare", "input.txt")
ATTENTION_TOKENS = 48  # tokens an attention plot shows at most


class TextWindowsTask(Task):
    """Shared by the character-level tasks: a tokenizer, train/val token streams, windows."""

    specials: tuple[str, ...] = ()

    recorded_options = ("vocab",)  # the character vocabulary, kept in the run's config
    attention_needs_splits = False

    def __init__(self, *, block_size: int = 64, **options: Any) -> None:
        super().__init__(block_size=block_size, **options)
        self.block_size = block_size
        self.tokens: dict[str, Tensor] = {}
        self.tokenizer: Any = self.make_tokenizer()
        self.test_split = "val"  # Tiny Shakespeare has no test split; val is reported

    def make_tokenizer(self) -> Any:
        """The vocabulary the run's config records (learned the first time): no corpus is needed later."""
        if self.options.get("vocab") is None:
            self.options["vocab"] = CharTokenizer.from_text(dataset_file(*CORPUS).read_text(encoding="utf-8")).vocab
        return CharTokenizer(self.options["vocab"], specials=self.specials)

    def prepare(self, seed: int) -> None:
        text = dataset_file(*CORPUS).read_text(encoding="utf-8")
        cut = int(0.9 * len(text))  # characters: one token each for the character tokenizer
        self.tokens = {"train": self.tokenizer.encode(text[:cut]), "val": self.tokenizer.encode(text[cut:])}

    def split_size(self, split: str) -> int:
        return (len(self.tokens[split]) - 1) // self.block_size  # windows per pass

    def train_batches(self, epoch: int, batch_size: int, seed: int) -> list[Tensor]:
        """Random window starts; one epoch draws as many windows as fit the training text."""
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        high = len(self.tokens["train"]) - self.block_size - 1
        starts = torch.randint(0, high, (self.split_size("train"),), generator=generator)
        return list(starts.split(batch_size))

    def windows(self, split: str, starts: Tensor) -> tuple[Tensor, Tensor]:
        """starts (b,) -> inputs (b, block), next-token targets (b, block)"""
        offsets = starts[:, None] + torch.arange(self.block_size + 1)  # (b, block + 1)
        chunk = self.tokens[split][offsets]
        return chunk[:, :-1], chunk[:, 1:]

    def eval_batches(self, split: str, batch_size: int) -> list[Batch]:
        starts = torch.arange(self.split_size(split)) * self.block_size  # non-overlapping windows
        return [self.collate(split, chunk) for chunk in starts.split(batch_size)]

    def validation_start(self) -> Tensor:
        """The first ``ATTENTION_TOKENS`` tokens of the validation text, without encoding the whole corpus."""
        corpus = dataset_file(*CORPUS).read_text(encoding="utf-8")
        return self.tokenizer.encode(corpus[int(0.9 * len(corpus)):][: 4 * ATTENTION_TOKENS])[:ATTENTION_TOKENS]

    def attention_maps(self, model: nn.Module, text: str | None, kind: str) -> AttentionExample:
        """Self-attention over ``text`` or the start of the validation text (``ATTENTION_TOKENS`` at most)."""
        if text is None:
            ids = self.validation_start()
        else:
            ids = self.tokenizer.encode(text)[:ATTENTION_TOKENS]
            if ids.numel() == 0:
                raise ValueError(f"input {text!r} holds no token of the vocabulary")
        ids = ids[: self.block_size]
        out = model(self.on_model(model, {"ids": ids[None]})["ids"], need_weights=True)
        labels = [repr(self.tokenizer.decode(ids[i : i + 1]))[1:-1] for i in range(ids.numel())]
        what = "causal self-attention" if self.attention_kinds == ("decoder",) else "self-attention"
        return self_attention_example(out, labels, f"{self.name}: {what}")


class CausalTextTask(TextWindowsTask):
    """Next-token prediction over windows of a text (GPT), nanoGPT's shakespeare-char recipe by default."""

    attention_kinds = ("decoder",)

    def model_config(self) -> ModelConfig:
        # nanoGPT's CPU recipe for shakespeare-char: 4 layers, 4 heads, 128 wide, 64 characters of context.
        return ModelConfig(arch="decoder-only", vocab_size=self.tokenizer.vocab_size, d_model=128,
                           n_heads=4, n_layers=4, d_ff=512, activation="gelu", norm_position="pre",
                           positional="learned", scale_embeddings=False, max_seq_len=self.block_size,
                           pad_id=None, dropout=0.0, name=self.name)

    def train_overrides(self) -> dict[str, Any]:
        return dict(max_steps=3600, batch_size=12, lr=1e-3, schedule="cosine", warmup_steps=100,
                    optimizer="adamw", weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8,
                    clip_grad_norm=1.0, eval_every=500, save_every=500)

    def collate(self, split: str, indices: Tensor) -> Batch:
        tokens, targets = self.windows(split, indices)
        return {"tokens": tokens, "targets": targets}

    def forward(self, model: nn.Module, batch: Batch) -> tuple[LossInput, Tensor]:
        # The model's output, not its logits: the loss applies the output layer (aiayn.train.losses).
        return model(batch["tokens"]), batch["targets"]

    def sample(self, model: nn.Module, prompt: str, *, max_new_tokens: int,
               sampling: SamplingConfig) -> str:
        model.eval()
        ids = self.on_model(model, {"ids": self.tokenizer.encode(prompt)[None]})["ids"]
        new = generate_decoder_only(model, ids, max_new_tokens=max_new_tokens, sampling=sampling)
        return self.tokenizer.decode(new[0])

    def examples(self, model: nn.Module, n: int = 1) -> list[str]:
        text = self.sample(model, "\n", max_new_tokens=min(200, self.block_size - 1),
                           sampling=SamplingConfig(temperature=0.8, top_k=40, seed=0))
        return [f"sample: {text!r}"]


@register
class ShakespeareCharTask(CausalTextTask):
    name = "shakespeare-char"
    description = "character-level GPT on Tiny Shakespeare (nanoGPT's shakespeare-char)"


@register
class ShakespeareCharLongTask(ShakespeareCharTask):
    """A longer shakespeare-char recipe: nanoGPT's context and dropout on a 4-layer, d_model 256 model, bf16."""

    name = "shakespeare-char-long"
    description = "character-level GPT on Tiny Shakespeare, the ~60-minute recipe (256-character context)"

    def __init__(self, *, block_size: int = 256, **options: Any) -> None:
        super().__init__(block_size=block_size, **options)

    def model_config(self) -> ModelConfig:
        return super().model_config().replace(d_model=256, n_heads=4, n_layers=4, d_ff=1024, dropout=0.2)

    def train_overrides(self) -> dict[str, Any]:
        return {**super().train_overrides(), "max_steps": 8000, "batch_size": 24, "warmup_steps": 200,
                "eval_every": 1000, "save_every": 1000, "bf16": True}


@register
class MaskedCharTask(TextWindowsTask):
    """BERT's masked-language-model objective on characters: 15% of positions chosen, 80% of those masked, 10%
    randomised, 10% kept; the model predicts the originals."""

    name = "mlm"
    attention_kinds = ("encoder",)
    description = "masked-character BERT pretraining on Tiny Shakespeare (80/10/10 masking)"
    specials = ("[MASK]",)
    mask_rate = 0.15

    def model_config(self) -> ModelConfig:
        # RoPE, not BERT's learned positions: with those the model stays at the unigram loss far longer.
        return ModelConfig(arch="encoder-only", vocab_size=self.tokenizer.vocab_size, d_model=128,
                           n_heads=4, n_layers=4, d_ff=512, activation="gelu", norm_position="post",
                           positional="rope", scale_embeddings=False, embedding_norm=True,
                           max_seq_len=self.block_size, pad_id=None, type_vocab_size=0, dropout=0.0,
                           name="mlm")

    def train_overrides(self) -> dict[str, Any]:
        return dict(max_steps=2000, batch_size=16, lr=1e-3, schedule="cosine", warmup_steps=200,
                    optimizer="adamw", weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6,
                    clip_grad_norm=1.0, eval_every=500, save_every=500)

    def collate(self, split: str, indices: Tensor) -> Batch:
        tokens, _ = self.windows(split, indices)  # (b, block)
        # The masking of a batch is a function of its windows, so a resumed run masks the same way.
        seed = (int(indices[0]) * 1_000_003 + int(indices.sum()) + (0 if split == "train" else 7)) % 2**62
        generator = torch.Generator().manual_seed(seed)
        chosen = torch.rand(tokens.shape, generator=generator) < self.mask_rate
        action = torch.rand(tokens.shape, generator=generator)
        random_chars = torch.randint(len(self.tokenizer.vocab), tokens.shape, generator=generator)
        inputs = torch.where(chosen & (action < 0.8), self.tokenizer.special_id("[MASK]"), tokens)
        inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_chars, inputs)
        targets = tokens.masked_fill(~chosen, IGNORE)
        return {"tokens": inputs, "targets": targets}

    def forward(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        return model(batch["tokens"]).logits, batch["targets"]

    def examples(self, model: nn.Module, n: int = 2) -> list[str]:
        model.eval()
        batch = self.eval_batches("val", n)[0]
        with torch.no_grad():
            predicted = model(self.on_model(model, batch)["tokens"][:n]).logits.argmax(-1).cpu()
        lines = []
        for inputs, targets, guess in zip(batch["tokens"][:n], batch["targets"][:n], predicted, strict=True):
            shown = self.tokenizer.decode(inputs[:60]).replace("[MASK]", "_")
            filled = torch.where(targets[:60] != IGNORE, guess[:60], inputs[:60])
            lines.append(f"{shown!r} -> {self.tokenizer.decode(filled)!r}")
        return lines


class BPETokenizer(TokenizersText):
    """Byte-level BPE over the ``tokenizers`` library, with the interface of ``CharTokenizer``."""

    def __init__(self, tokenizer_json: str) -> None:
        from tokenizers import Tokenizer

        super().__init__(Tokenizer.from_str(tokenizer_json))
        self.json = tokenizer_json
        # characters each id stands for (Tiny Shakespeare is ASCII: one byte, one character)
        self.chars_per_id = torch.tensor([len(self.tokenizer.decode([i])) for i in range(self.vocab_size)])

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([text], trainer=trainer)
        return cls(tok.to_str())


@register
class ShakespeareBPETask(ShakespeareCharTask):
    """GPT on Tiny Shakespeare with a byte-level BPE learned on the training split and saved in the run's
    options; validation also reports loss per character (``nll_per_char``, ``bits_per_char``)."""

    name = "shakespeare-bpe"
    description = "GPT on Tiny Shakespeare with a byte-level BPE vocabulary (loss per token and per character)"

    recorded_options = ("tokenizer",)  # the learned BPE tokenizer's JSON, kept in the run's config

    def __init__(self, *, block_size: int = 64, vocab_size: int = 1024, **options: Any) -> None:
        super().__init__(block_size=block_size, vocab_size=vocab_size, **options)

    def make_tokenizer(self) -> BPETokenizer:
        if self.options.get("tokenizer") is None:
            text = dataset_file(*CORPUS).read_text(encoding="utf-8")
            self.options["tokenizer"] = BPETokenizer.train(text[: int(0.9 * len(text))], self.options["vocab_size"]).json
        return BPETokenizer(self.options["tokenizer"])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, batch_size: int = 500) -> dict[str, float]:
        metrics = super().evaluate(model, split, batch_size)
        n_tokens = self.split_size(split) * self.block_size  # the targets evaluate() scored
        targets = self.tokens[split][1 : n_tokens + 1]
        chars = int(self.tokenizer.chars_per_id[targets].sum())
        metrics["nll_per_char"] = metrics["nll"] * n_tokens / chars
        metrics["bits_per_char"] = metrics["nll_per_char"] / math.log(2)
        return metrics
