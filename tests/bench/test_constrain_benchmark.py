"""benchmarks/constrain.py still runs: a tiny random model with a real byte-level BPE tokenizer,
llguidance and xgrammar (outlines-core's "any object" automaton takes seconds to build, even
here), one round of a few tokens; the figures are not checked, the table's shape is."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from aiayn.interop.gguf_text import ChatTemplate
from aiayn.models import DecoderOnly, get_preset
from aiayn.textgen import TextModel
from benchmarks import constrain

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_lm() -> TextModel:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"name": "Ada", "age": 36, "tags": ["a", "b"]} Paris, France.'] * 8, trainer=trainer)
    torch.manual_seed(0)
    model = DecoderOnly(get_preset("llama-tiny", vocab_size=tok.get_vocab_size(), max_seq_len=256)).eval()
    return TextModel(model, lambda text: tok.encode(text, add_special_tokens=False).ids, lambda ids: tok.decode(ids),
                     256, tok.token_to_id("<|im_end|>"), None, ChatTemplate(CHAT, {"eos_token": "<|im_end|>"}), tok)


def test_constrain_benchmark_runs(capsys):
    pytest.importorskip("llguidance")
    figures = constrain.run(tiny_lm(), rounds=1, max_new_tokens=6, compiles=1, names=["llguidance", "xgrammar"])
    out = capsys.readouterr().out
    assert "| llguidance | schema |" in out and "grammar / decode" in out and "outlines-core" not in out
    assert set(figures) >= {("llguidance", "schema"), ("llguidance", "json_object")}
    assert all(f["answers"] == 1 for f in figures.values())
