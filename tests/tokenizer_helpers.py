"""A tiny real tokenizer for tests of text models (imported as ``tokenizer_helpers``: tests/ is on
``sys.path`` through tests/conftest.py): byte-level BPE trained in a fraction of a second on the
caller's text by Hugging Face ``tokenizers``, with the ChatML special tokens and chat template that
SmolLM2 uses, so encoding, decoding, chat prompts and end-of-text behave as a real model's do."""

from __future__ import annotations

from tokenizers import Tokenizer

from aiayn.generate.constrain import ConstraintError, GrammarConstraint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(text: str, *, vocab_size: int = 320) -> Tokenizer:
    """Byte-level BPE (GPT-2's pre-tokenizer, no prefix space) trained on ``text``: the 256 byte
    symbols, ``SPECIALS`` and merges up to ``vocab_size`` tokens; any string encodes."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def grammar_accepts(constraint: GrammarConstraint, tokenizer, text: str) -> bool:
    """Whether ``text``, encoded by ``tokenizer``, is a whole answer under ``constraint`` (from its start)."""
    constraint.reset()
    for token in tokenizer.encode(text, add_special_tokens=False).ids:
        try:
            constraint.advance(token)
        except ConstraintError:
            return False
    return constraint.is_complete()
