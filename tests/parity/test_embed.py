"""Sentence embeddings (``aiayn.embed``, ``aiayn embed``) equal a reference computed with
transformers' BertModel and the pooling written out in torch, for a tiny random BERT saved in the
sentence-transformers layout (modules.json, 1_Pooling/config.json, an optional Normalize module).
sentence-transformers itself is not needed: the layout is written by hand, as it saves it.

CPU only but for ``pool``: ``SentenceEncoder.encode`` runs under ``aiayn.device.autocast``, bfloat16
on CUDA, so float32 parity with transformers holds on the CPU, where these tests load the encoder
(``device="cpu"``, ``--device cpu``; the default would take a GPU where there is one).
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import VOCAB, randomize_hf_, save
from torch.testing import assert_close

from aiayn.embed import EmbedError, load_sentence_encoder, pool

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *(f"w{i}" for i in range(4, VOCAB))]
TEXTS = ["w5 w17 w33 w4 w90 w61 w12 w7 w8", "w44", "w9 w10 w11 w98", "w20 w21 w22 w23 w24 w25"]
CPU = "cpu"
MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}


def write_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))


def write_st_layout(path, pooling: str, normalize: bool) -> None:
    """What sentence-transformers' save() writes: the pipeline, the pooling config, the model in root."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {key: name == pooling for name, key in MODES.items()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 48, **flags, "pooling_mode_mean_sqrt_len_tokens": False}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """(HF BertModel, its directory with a tokenizer, no sentence-transformers files yet)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6,
                                     num_hidden_layers=2, intermediate_size=37,
                                     max_position_embeddings=64, pad_token_id=0)
    hf = randomize_hf_(transformers.BertModel(config), seed=1)
    path = tmp_path_factory.mktemp("bert")
    save(hf, path)
    write_tokenizer(path)
    return hf, path


@torch.no_grad()
def reference(hf, texts: list[str], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' hidden states of a right-padded batch, pooled and normalised by hand."""
    ids = [[2, *(WORDS.index(w) for w in text.split()), 3] for text in texts]
    t = max(map(len, ids))
    tokens = torch.tensor([row + [0] * (t - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (t - len(row)) for row in ids])
    hidden = hf(tokens, attention_mask=mask).last_hidden_state  # (b, t, d)
    m = mask[..., None].float()
    if pooling == "mean":
        out = (hidden * m).sum(1) / m.sum(1)
    elif pooling == "cls":
        out = hidden[:, 0]
    else:
        out = hidden.masked_fill(m == 0, -1e9).max(1).values
    return out / out.norm(dim=-1, keepdim=True) if normalize else out


@pytest.mark.cpu_only
@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", False), ("max", True)])
def test_embeddings_match_transformers(bert, tmp_path, pooling, normalize):
    hf, path = bert
    write_st_layout(path, pooling, normalize)
    encoder = load_sentence_encoder(path, device=CPU)
    assert (encoder.pooling, encoder.normalize, encoder.max_length) == (pooling, normalize, 32)
    got = encoder.encode(TEXTS)  # one padded batch of 4 different lengths
    assert_close(got, reference(hf, TEXTS, pooling, normalize))
    # batch of 1 and batches of 3 + 1 give the same vectors as the padded batch of 4
    assert_close(encoder.encode(TEXTS, batch_size=3), got)
    assert_close(encoder.encode(TEXTS[1:2]), got[1:2])


@pytest.mark.cpu_only
def test_plain_directory_defaults_to_mean_and_l2(bert, tmp_path):
    hf, path = bert
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (plain / name).write_bytes((path / name).read_bytes())
    encoder = load_sentence_encoder(plain, device=CPU)
    assert (encoder.pooling, encoder.normalize) == ("mean", True)
    got = encoder.encode(TEXTS)
    assert_close(got, reference(hf, TEXTS, "mean", True))
    assert_close(got.norm(dim=-1), torch.ones(len(TEXTS)))
    assert_close(load_sentence_encoder(plain, pooling="cls", normalize=False, device=CPU).encode(TEXTS),
                 reference(hf, TEXTS, "cls", False))


def test_pool_ignores_padding(device):
    hidden = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0)).to(device)
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]], device=device)
    changed = hidden.clone()
    changed[1, 2:] = 1e4  # garbage at the padded positions must not matter
    for mode in ("mean", "cls", "max"):
        assert_close(pool(hidden, valid, mode), pool(changed, valid, mode))
    assert_close(pool(hidden, valid, "mean")[1], hidden[1, :2].mean(0))


@pytest.mark.cpu_only
def test_library_errors(bert, tmp_path):
    _, path = bert
    with pytest.raises(EmbedError, match="not a model directory"):
        load_sentence_encoder(tmp_path / "missing", device=CPU)
    write_st_layout(path, "mean", True)
    with pytest.raises(EmbedError, match="is empty"):
        load_sentence_encoder(path, device=CPU).encode(["w5", "  "])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer", "path": ".."}, {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]))
    (bad / "1_Pooling").mkdir()
    (bad / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(EmbedError, match="pooling_mode_weightedmean_tokens is not supported"):
        load_sentence_encoder(bad, device=CPU)


@pytest.mark.cpu_only
@pytest.mark.slow
def test_cli_prints_json_lines(bert, run_aiayn_process):
    hf, path = bert
    write_st_layout(path, "mean", True)
    result = run_aiayn_process("embed", "--model", str(path), "--device", "cpu", *TEXTS[:2])
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["text"] for line in lines] == TEXTS[:2]
    assert_close(torch.tensor([line["embedding"] for line in lines]), reference(hf, TEXTS[:2], "mean", True))
    piped = run_aiayn_process("embed", "--model", str(path), "--device", "cpu", "-", stdin="\n".join(TEXTS[:2]) + "\n")
    assert piped.returncode == 0 and piped.stdout == result.stdout


@pytest.mark.cpu_only
@pytest.mark.parametrize(("args", "needle"), [
    (["--model", "README.md", "hello"], "not a model directory"),
    (["--model", "tests", "hello"], "no config.json"),
    (["--model", "tests", ""], "text 1 of 1 is empty"),
    (["--model", "tests"], "Missing argument"),
    (["--model", "tests", "--pooling", "sum", "hi"], "Invalid value for '--pooling'"),
])
def test_cli_bad_input(run_aiayn, args, needle):
    code, out, err = run_aiayn("embed", *args)  # run_aiayn fails the test on a traceback
    assert code == 2, out + err
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
