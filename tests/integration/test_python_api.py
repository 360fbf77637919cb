"""``aiayn.load``, ``aiayn.generate_text`` and ``aiayn.train_run`` (docs/python-api.md): each source
kind loads in one call as the object the command line uses for it, and gives what that verb gives.
(The real GGUF file and sentence-transformers directory: docs/python-api.md's examples, run by
tests/docs/test_doc_examples.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aiayn
from aiayn.api import Generation, LoadedModel, LoadError, source_kind
from aiayn.embed import SentenceEncoder
from aiayn.generate.sampling import SamplingConfig
from aiayn.tasks.runs import LoadedRun, RunInputError, load_text_model, load_translator
from aiayn.tasks.trained import shipped_path
from aiayn.textgen import TextModel, export_text_model, stream_text
from aiayn.translate import DecodeOptions, Translator

SENTENCE = "A man is riding a bike down the street."


def test_a_shipped_translation_model_translates_as_its_loader_does():
    translator = aiayn.load("multi30k-en-de", device="cpu")
    assert isinstance(translator, Translator)
    _, reference = load_translator(shipped_path("multi30k-en-de"), device="cpu")
    out = translator.translate([SENTENCE])
    assert out == reference.translate([SENTENCE]) and out[0]
    # It searches as aiayn translate does by default: the run's own beam size and length penalty.
    task, _ = load_translator(shipped_path("multi30k-en-de"), device="cpu")
    assert translator.options == task.decode and task.decode.length_penalty != DecodeOptions().length_penalty
    assert out == reference.translate([SENTENCE], task.decode)


def test_a_shipped_language_model_generates_what_stream_text_does():
    lm = aiayn.load("shakespeare-char", device="cpu")
    assert isinstance(lm, TextModel)
    result = aiayn.generate_text(lm, "ROMEO:", max_new_tokens=12)
    pieces: list[str] = []
    stream_text(lm, lm.prompt_ids("ROMEO:"), on_text=pieces.append, max_new_tokens=12,
                sampling=SamplingConfig(temperature=0))
    assert result == Generation("".join(pieces), 12, "length")
    sampled = [aiayn.generate_text(lm, "ROMEO:", max_new_tokens=12, temperature=0.8, seed=5).text for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed makes sampling repeatable


def test_generation_slides_past_the_context_unless_told_not_to():
    lm = aiayn.load("shakespeare-char", device="cpu")  # a 64-character context
    long = aiayn.generate_text(lm, "ROMEO:", max_new_tokens=80)
    assert (long.tokens, long.stop_reason, len(long.text)) == (80, "length", 80) and long.slides >= 1
    short = aiayn.generate_text(lm, "ROMEO:", max_new_tokens=80, slide=False)
    assert short.stop_reason == "context" and short.slides == 0 and long.text.startswith(short.text)


def test_a_stop_string_ends_the_text_before_it():
    lm = aiayn.load("shakespeare-char", device="cpu")
    full = aiayn.generate_text(lm, "ROMEO:", max_new_tokens=30).text
    stop = full[5:7]
    cut = aiayn.generate_text(lm, "ROMEO:", max_new_tokens=30, stop=[stop])
    assert cut.stop_reason == "stop" and full.startswith(cut.text) and stop not in cut.text


def test_a_hugging_face_decoder_directory_is_a_text_model(tmp_path):
    pytest.importorskip("transformers")
    shipped = load_text_model(model_path=shipped_path("shakespeare-char"), plain=True, device="cpu")
    hf_dir = export_text_model(shipped, tmp_path / "hf")
    assert source_kind(hf_dir) == "hf"
    lm = aiayn.load(hf_dir, device="cpu")
    assert isinstance(lm, TextModel)
    assert aiayn.generate_text(lm, "ROMEO:", max_new_tokens=10) == aiayn.generate_text(shipped, "ROMEO:", max_new_tokens=10)


def test_a_bert_directory_is_a_sentence_encoder(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[UNK]", "a", "dog", "cat", "runs"]
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(words), hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                     intermediate_size=37, max_position_embeddings=32, pad_token_id=0)
    transformers.BertModel(config).save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    encoder = aiayn.load(tmp_path, device="cpu")
    assert isinstance(encoder, SentenceEncoder)
    vectors = encoder.encode(["a dog runs", "a cat"])
    assert vectors.shape == (2, 32) and torch.allclose(vectors.norm(dim=-1), torch.ones(2))


def test_a_hugging_face_encoder_decoder_is_a_loaded_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.MarianConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
                                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                       decoder_ffn_dim=24, max_position_embeddings=32, pad_token_id=39,
                                       decoder_start_token_id=39)
    torch.manual_seed(0)
    transformers.MarianMTModel(config).save_pretrained(tmp_path)
    loaded = aiayn.load(tmp_path, device="cpu")
    assert isinstance(loaded, LoadedModel) and loaded.config.arch == "encoder-decoder"
    assert not loaded.model.training
    with pytest.raises(LoadError, match=r"^quantize='int8' applies to text models only .* holds an encoder-decoder "
                                        r"model: leave quantize='none'$"):
        aiayn.load(tmp_path, quantize="int8")


def test_train_from_python_then_load_the_run(tmp_path):
    result = aiayn.train_run("reverse", tmp_path / "run", train={"max_steps": 12, "eval_every": 1000},
                             progress=False, plots=False, device="cpu")
    assert result.step == 12 and result.run_dir == tmp_path / "run"
    run = aiayn.load(result.run_dir, device="cpu")
    assert isinstance(run, LoadedRun) and run.task.name == "reverse" and not run.model.training
    assert source_kind(result.run_dir) == "run"
    with pytest.raises(LoadError, match="holds a reverse model: leave quantize='none'"):
        aiayn.load(result.run_dir, quantize="q4", device="cpu")


def test_quantize_is_refused_for_a_translation_model():
    """quantize= quantizes text models only: a translation run asked for int8 is one ValueError
    naming what it applies to, not a float32 translator that looks quantized."""
    with pytest.raises(ValueError, match=r"^quantize='int8' applies to text models only \(a language-model run, a "
                                         r"GGUF file, a Hugging Face decoder-only directory\); .*multi30k-en-de holds (a "
                                         r"translation model|an ensemble of translation models): leave quantize='none'$"):
        aiayn.load("multi30k-en-de", quantize="int8", device="cpu")


def test_sources_it_cannot_open_are_one_clear_error(tmp_path):
    with pytest.raises(RunInputError, match="neither a shipped model"):
        aiayn.load("no-such-model")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(LoadError, match="a file that is not GGUF"):
        aiayn.load(text)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="neither an aiayn run"):
        aiayn.load(tmp_path / "empty")
    with pytest.raises(LoadError, match="checkpoint= is for runs"):
        aiayn.load("multi30k-en-de", checkpoint=tmp_path)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        aiayn.generate_text(aiayn.load("shakespeare-char", device="cpu"), "A", max_new_tokens=0)


def test_import_aiayn_stays_light():
    """``aiayn.load`` and friends import on first use: ``import aiayn`` loads no tokenizer or server code."""
    import subprocess
    import sys

    code = "import sys, aiayn; print(sorted(m for m in ('aiayn.api', 'tokenizers', 'fastapi') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_unknown_attributes_still_fail():
    with pytest.raises(AttributeError, match="no attribute 'lod'"):
        aiayn.lod  # noqa: B018
    assert Path(aiayn.api.__file__).name == "api.py"
