"""Text in, text out with a decoder-only model: what ``aiayn generate`` runs.

``TextModel`` is a model with its tokenizer, context length, end-of-text id and chat template, read
from a GGUF file or a Hugging Face directory (``read_text_model``); ``stream_text`` generates through
the incremental detokeniser ``aiayn serve`` uses too. Errors a user can fix raise ``TextModelError``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from aiayn.device import autocast, model_device, resolve
from aiayn.generate.text import IncrementalText
from aiayn.interop.mapping import InteropError

if TYPE_CHECKING:
    from aiayn.generate import SamplingConfig
    from aiayn.generate.decoder_only import RowConstraint

# Weight quantisations that only aiayn.fast's CPU kernels run (int8 rows, packed 4-bit blocks).
CPU_QUANTIZE = ("int8", "q4")


class TextModelError(InteropError):
    """A model path that does not hold a text model generation can use."""


@dataclass
class TextModel:
    """A decoder-only model with the text functions generation needs."""

    model: nn.Module
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    context: int  # tokens the model can attend over (prompt + generated)
    eos_id: int | None = None  # generation stops when the model produces it
    chat: Callable[[str], str] | None = None  # a user message -> the prompt in the chat template
    chat_template: Any = None  # the template itself (``render(messages)``), e.g. a ChatTemplate
    tokenizer: Any = None  # the ``tokenizers.Tokenizer`` encode/decode use, when there is one

    def prompt_ids(self, prompt: str, *, chat: bool = False) -> Tensor:
        """(1, t) token ids of ``prompt`` on the model's device (in the chat template with ``chat``).
        ValueError when the tokenizer refuses it or it leaves no room in the context."""
        text = self.chat(prompt) if chat and self.chat else prompt
        tokens = self.encode(text)
        if not tokens:  # e.g. only characters a character-level vocabulary lacks
            raise ValueError("the prompt is empty after tokenisation (the model's vocabulary has none of its "
                             "characters); give some text it knows")
        ids = torch.tensor([tokens], dtype=torch.long, device=model_device(self.model))
        if ids.shape[1] >= self.context:
            raise ValueError(f"the prompt is {ids.shape[1]} tokens, the model's context is {self.context}; "
                             f"shorten it")
        return ids


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes."""
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"


def placement(device: torch.device | str | None = None, quantize: str = "none") -> tuple[torch.device, str]:
    """(where a text model loaded with ``quantize`` runs, the quantisation it gets there). "auto" is
    ``aiayn.device.resolve``'s choice, but the CPU for int8 and q4 (CPU kernels); off the CPU,
    quantize "auto" keeps float weights and int8 / q4 are a ValueError."""
    auto = device is None or (isinstance(device, str) and device.strip().lower() == "auto")
    where = torch.device("cpu") if auto and quantize in CPU_QUANTIZE else resolve(device)
    if where.type == "cpu":
        return where, quantize
    if quantize in CPU_QUANTIZE:
        raise ValueError(f"{quantize} weights run on aiayn.fast's CPU kernels only; on {where} use bf16 "
                         f"or none, or run on the CPU (--device cpu)")
    return where, "none" if quantize == "auto" else quantize


def read_text_model(path: Path, *, quantize: str = "none", device: torch.device | str | None = None) -> TextModel:
    """The text model in a GGUF file or a Hugging Face model directory, as stored: float32, eval mode,
    on ``device`` (``placement``). ``quantize="auto"`` or ``"q4"`` loads a GGUF file's matrices in
    blocks on the CPU; other models ignore it here."""
    where, quantize = placement(device, quantize)
    lm = _read_on_cpu(path, quantize)
    lm.model = lm.model.to(where)  # moved whole: tied weights stay tied
    return lm


def _read_on_cpu(path: Path, quantize: str) -> TextModel:
    if is_gguf(path):
        from aiayn.interop import load_gguf

        loaded = load_gguf(path, quantize=quantize if quantize in ("auto", "q4") else "none")
        return _with_tokenizer(loaded.model, loaded.tokenizer, loaded.config.max_seq_len, loaded.eos_id,
                               loaded.chat_template)
    if path.is_dir() and (path / "config.json").is_file():
        from tokenizers import Tokenizer

        from aiayn.interop import load_hf

        model, config = load_hf(path)
        if config.arch != "decoder-only":
            raise TextModelError(f"{path} is a {config.arch} model; generation needs a decoder-only one")
        if not (path / "tokenizer.json").is_file():
            raise TextModelError(f"{path} has no tokenizer.json")
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        template, eos_id = hf_chat_settings(path, tok)
        return _with_tokenizer(model.eval(), tok, config.max_seq_len, eos_id, template)
    raise TextModelError(f"{path} is neither a GGUF file nor a Hugging Face model directory "
                         f"(config.json + safetensors)")


def _with_tokenizer(model: nn.Module, tok: Any, context: int, eos_id: int | None, template: Any) -> TextModel:
    """A ``TextModel`` over a ``tokenizers.Tokenizer`` and its chat template (None: none)."""
    chat = None if template is None else lambda text: template.render([{"role": "user", "content": text}])
    return TextModel(model, lambda text: tok.encode(text, add_special_tokens=False).ids, lambda ids: tok.decode(ids),
                     context, eos_id, chat, template, tok)


def _read_json(path: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TextModelError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TextModelError(f"{path}: must hold a JSON object")
    return data


def hf_chat_settings(directory: Path, tok: Any) -> tuple[Any, int | None]:
    """A Hugging Face directory's chat template and end-of-text id (generation_config.json, else
    config.json, else tokenizer_config.json); None where absent."""
    from aiayn.interop.gguf_text import ChatTemplate

    files = {name: _read_json(directory / name) if (directory / name).is_file() else {}
             for name in ("tokenizer_config.json", "generation_config.json", "config.json")}
    settings = files["tokenizer_config.json"]
    specials = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = settings.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    source = settings.get("chat_template")
    template = ChatTemplate(source, specials) if isinstance(source, str) and source else None
    eos_id = None
    for name in ("generation_config.json", "config.json"):
        value = files[name].get("eos_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            eos_id = value
            break
    if eos_id is None and "eos_token" in specials:
        eos_id = tok.token_to_id(specials["eos_token"])
    return template, eos_id


@dataclass
class StreamStats:
    """How a ``stream_text`` call went: tokens produced, time taken and why it stopped."""

    tokens: int
    seconds: float
    # With a compiled decode step: seconds from the second token on (the first step compiles).
    seconds_after_compile: float | None = None
    # Why it stopped: "length", "eos", "stop", "context" (slide=False) or "complete" (the constraint).
    stop: str = "length"
    slides: int = 0  # times the window slid past the model's context (``aiayn.generate.window``)
    context: int | None = None  # the model's context, for the summary

    def summary(self) -> str:
        """'N tokens in S s, R tokens/s; stopped: WHY' (and the rate after compiling, the slides)."""
        from aiayn.generate.window import keep_tokens

        rate = f"{self.tokens / self.seconds:.1f} tokens/s"
        if self.seconds_after_compile is not None and self.tokens > 2:
            rate += f"; {(self.tokens - 2) / self.seconds_after_compile:.1f} tokens/s after the compiling step"
        why = {"length": "stopped: the token limit (max new tokens)", "eos": "stopped: the model's end-of-text",
               "stop": "stopped: a stop string", "complete": "stopped: the answer is complete (its grammar ends)",
               "context": f"stopped: the model's context of {self.context} tokens is full"}[self.stop]
        if self.slides and self.context is not None:
            times = "once" if self.slides == 1 else f"{self.slides} times"
            why += (f"; the window slid past the {self.context}-token context {times} (each time keeping "
                    f"the last {keep_tokens(self.context)} tokens, recomputed)")
        return f"{self.tokens} tokens in {self.seconds:.2f} s, {rate}; {why}"


def stream_text(lm: TextModel, ids: Tensor, *, on_text: Callable[[str], None], max_new_tokens: int,
                sampling: SamplingConfig, stops: Sequence[str] = (), kv_cache: str | None = None,
                compile: bool = False, slide: bool = True,
                constraint: RowConstraint | None = None) -> StreamStats:
    """Continue ``ids`` (1, t), calling ``on_text`` with each new piece of text as it is decoded, up to
    ``max_new_tokens``, end-of-text, or just before one of ``stops``. Past the context the window
    slides; ``slide=False`` stops there instead. The other options are ``stream_decoder_only``'s."""
    from aiayn.generate import stream_decoder_only

    device = model_device(lm.model)
    ids = ids.to(device)
    room = lm.context - ids.shape[1]
    cut_by_context = not slide and max_new_tokens > room
    if cut_by_context:
        max_new_tokens = room
    produced: list[int] = []
    text = IncrementalText(lm.decode, stops)  # holds back half characters and what may become a stop
    stop, slides = "length", 0
    second_token_at: float | None = None  # with compile: the first (compiling) step ends here
    start = time.perf_counter()
    steps = stream_decoder_only(lm.model, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                kv_cache=kv_cache, compile=compile, slide=slide,
                                constraints=None if constraint is None else [constraint])
    with autocast(device):  # the loop's forwards run as each step is taken, inside this block
        for step in steps:
            slides += step.slid
            token = int(step.tokens[0])  # back to the CPU: one id
            if lm.eos_id is not None and token == lm.eos_id:
                stop = "eos"
                break
            produced.append(token)
            if len(produced) == 2:
                second_token_at = time.perf_counter()
            new, stopped = text.add(token)
            if new:
                on_text(new)
            if stopped:  # the answer ends just before the stop string, which is not shown
                stop = "stop"
                break
            if constraint is not None and constraint.is_finished():
                stop = "complete"
    if stop != "stop" and (rest := text.finish()):  # what was held back: the answer ended another way
        on_text(rest)
    end = time.perf_counter()
    after = end - second_token_at if compile and second_token_at is not None else None
    if cut_by_context and len(produced) == max_new_tokens:
        stop = "context"
    return StreamStats(len(produced), end - start, after, stop, slides, lm.context)


def export_text_model(lm: TextModel, out_dir: Path) -> Path:
    """Write ``lm`` (its plain model) as a Hugging Face directory another server can load (vLLM, TGI,
    transformers), tokenizer and chat template included; TextModelError without a ``tokenizers``
    tokenizer, or when ``out_dir`` is a file or a non-empty directory."""
    import json

    from aiayn.interop import export_hf

    if lm.tokenizer is None or not hasattr(lm.tokenizer, "to_str"):
        raise TextModelError("this model's tokenizer is not a `tokenizers` tokenizer (a character-level run?), "
                             "so there is no tokenizer.json to write; export a GGUF/Hugging Face model or a "
                             "BPE run (shakespeare-bpe)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise TextModelError(f"{out_dir} exists and is not an empty directory; give a new directory")
    tok = lm.tokenizer
    specials = dict(getattr(lm.chat_template, "special_tokens", {}) or {})
    if lm.eos_id is not None:
        specials["eos_token"] = tok.id_to_token(lm.eos_id)
    ids = {f"{key.removesuffix('_token')}_token_id": tok.token_to_id(value) for key, value in specials.items()
           if key in ("bos_token", "eos_token", "pad_token")}
    out = export_hf(lm.model, lm.model.config, out_dir)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config.update(ids)
    files = {
        "config.json": config,
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": lm.context,
                                  "clean_up_tokenization_spaces": False, **specials,
                                  **({"chat_template": str(lm.chat_template)} if lm.chat_template is not None else {})},
        "generation_config.json": {"_from_model_config": False, **ids},
    }
    for name, data in files.items():
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tok.save(str(out / "tokenizer.json"))
    return out
