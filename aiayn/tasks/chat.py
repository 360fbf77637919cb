"""Fine-tune a chat model on your conversations (OpenAI's fine-tuning JSONL), rendered through its chat
template, the loss on the assistant turns only. With ``pack`` short conversations share a window of
``block_size`` positions under plain causal attention (no document mask); a conversation longer than a
window is refused, naming its line."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from aiayn.config import ConfigError, ModelConfig
from aiayn.finetune.chat import (
    ChatExample,
    check_lengths,
    encode_conversations,
    pack_rows,
    read_conversations,
)
from aiayn.finetune.source import TokenizersText
from aiayn.finetune.split import split_examples
from aiayn.tasks.base import register
from aiayn.tasks.sources import SourceOption
from aiayn.train.losses import IGNORE, LossInput
from aiayn.train.task import Batch, Task

DEFAULT_BLOCK = 1024  # positions of a window when block_size is not given (less if the model's context is)


def as_list(value: str | list[str] | None) -> list[str]:
    """A file option given once (a string) or several times (a list)."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)


@register
class ChatTask(Task):
    name = "chat"
    description = "fine-tune a chat model (--init-from) on your conversations (OpenAI's JSONL), loss on the replies"

    def __init__(self, *, data: str | list[str] | None = None, val_data: str | list[str] | None = None,
                 init_from: str | None = None, block_size: int | None = None, pack: bool = True,
                 **options: Any) -> None:
        super().__init__(data=data, val_data=val_data, init_from=init_from, block_size=block_size, pack=pack,
                         **options)
        if init_from is None:
            raise ConfigError("the chat task fine-tunes a model that has a chat template; give --init-from "
                              "(a Hugging Face directory or a GGUF file)")
        if not as_list(data):
            raise ConfigError("the chat task trains on your conversations; give --data FILE.jsonl (OpenAI's "
                              'fine-tuning format, {"messages": [...]} per line)')
        self.init_from, self.block_size, self.pack = init_from, block_size, pack
        self.data, self.val_data = as_list(data), as_list(val_data)
        self.source = SourceOption(init_from)  # the starting point, loaded once
        self.echo = print  # where the task states how it made the validation set
        self.examples_of: dict[str, list[ChatExample]] = {}
        self.rows: dict[str, list[list[int]]] = {}  # per split: the examples each row holds
        self.test_split = "val"  # your data has no test split; validation is reported

    def model_config(self) -> ModelConfig:
        self.source.text()  # refuses a model without a tokenizer now, before a run is made
        return self.source.get().config

    def build_model(self, config: ModelConfig) -> nn.Module:
        return self.source.build_model(config, self.run_dir)

    @property
    def tokenizer(self) -> TokenizersText:
        return TokenizersText(self.source.front(self.run_dir).tokenizer)

    @property
    def eos_id(self) -> int | None:
        return self.source.front(self.run_dir).eos_id

    @property
    def chat_template(self) -> Any:
        return self.source.front(self.run_dir).chat_template

    def train_overrides(self) -> dict[str, Any]:
        """A fine-tune's settings: a few epochs at a small AdamW learning rate, short warm-up, cosine."""
        return dict(epochs=3, batch_size=8, lr=2e-5, optimizer="adamw", betas=(0.9, 0.999), eps=1e-8,
                    weight_decay=0.0, schedule="cosine", warmup_steps=10, clip_grad_norm=1.0)

    def lora_overrides(self) -> dict[str, Any]:
        """LoRA's rate (litgpt's, PEFT's examples): ten times the full fine-tune's."""
        return {"lr": 2e-4}

    def window(self) -> int:
        """Positions of a row: ``block_size``, else the model's context up to ``DEFAULT_BLOCK``."""
        context = self.source.context(self.run_dir)
        if self.block_size is None:
            return min(DEFAULT_BLOCK, context)
        if not 1 <= self.block_size <= context:
            raise ConfigError(f"block_size is {self.block_size} but the model's context is {context} "
                              f"positions; give a block_size from 1 to {context}")
        return self.block_size

    def prepare(self, seed: int) -> None:
        front = self.source.front(self.run_dir)
        if front.chat_template is None:
            raise ConfigError(f"{self.init_from} has no chat template; the chat task renders conversations "
                              f"through it (fine-tune on plain text with the text task)")
        read = {name: [c for path in paths for c in read_conversations(path)]
                for name, paths in (("train", self.data), ("val", self.val_data))}
        if not read["val"]:
            split = split_examples(len(read["train"]), seed=seed, what="conversations")
            read = {"train": [read["train"][i] for i in split.train], "val": [read["train"][i] for i in split.val]}
            self.echo(split.statement)
        block = self.window()
        context = self.source.context(self.run_dir)
        hint = (f"raise block_size (up to the model's context, {context})" if block < context
                else "the model's context cannot hold it")
        if self.run_dir is not None:  # the run keeps the tokenizer and template: it generates without its source
            self.source.keep_front(self.run_dir)

        def encode(text: str) -> list[int]:
            return front.tokenizer.encode(text, add_special_tokens=False).ids
        for split_name, conversations in read.items():
            examples = encode_conversations(conversations, front.chat_template, encode, front.eos_id)
            check_lengths(examples, block, hint)
            self.examples_of[split_name] = examples
            lengths = [len(e.ids) for e in examples]
            self.rows[split_name] = pack_rows(lengths, block) if self.pack else [[i] for i in range(len(examples))]

    def split_size(self, split: str) -> int:
        return len(self.rows[split])

    def collate(self, split: str, indices: Tensor) -> Batch:
        """tokens, targets (b, t): each row's conversations one after another, the targets the next tokens
        where the loss counts them (IGNORE elsewhere); valid (b, t): False at the padding."""
        examples = self.examples_of[split]
        tokens, targets = [], []
        for row in indices.tolist():
            chosen = [examples[i] for i in self.rows[split][row]]
            tokens.append(torch.tensor([t for e in chosen for t in e.ids[:-1]], dtype=torch.long))
            targets.append(torch.tensor([t if keep else IGNORE for e in chosen for t, keep in
                                         zip(e.ids[1:], e.trained[1:], strict=True)], dtype=torch.long))
        lengths = torch.tensor([len(t) for t in tokens])
        return {"tokens": pad_sequence(tokens, batch_first=True),
                "targets": pad_sequence(targets, batch_first=True, padding_value=IGNORE),
                "valid": torch.arange(int(lengths.max())) < lengths[:, None]}

    def memory_batches(self, batches: list[Tensor]) -> list[Tensor]:
        """The batch of the most rows and the one of the longest row."""
        if not batches:
            return []
        length = torch.tensor([sum(len(self.examples_of["train"][i].ids) - 1 for i in row)
                               for row in self.rows["train"]])
        return [max(batches, key=len), max(batches, key=lambda indices: int(length[indices].max()))]

    def count_tokens(self, batch: Batch) -> int:
        return int(batch["valid"].sum())

    def forward(self, model: nn.Module, batch: Batch) -> tuple[LossInput, Tensor]:
        # The model's output, not its logits: the loss applies the output layer.
        return model(batch["tokens"], valid=batch["valid"]), batch["targets"]

