"""The model an explorer looks inside, chosen at start-up (never by the browser). Kinds: ``translation``,
``decoder`` (a language-model run, GGUF file or HF directory), ``encoder`` (BERT-family or ``mlm``: attention
and positions only) and ``task`` (any other run: its attention example)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.device import model_device, resolve

# Most tokens the explorer shows attention over (a SmolLM2 layer at 256 tokens: 2.4 MB of weights).
MAX_TOKENS = 256

_DISPLAY = str.maketrans({"Ġ": "␣", "▁": "␣", " ": "␣", "Ċ": "⏎", "\n": "⏎", "\t": "⇥", "ĉ": "⇥"})


class ExploreInputError(ValueError):
    """Input the page sent that the model cannot take; the message says what to change."""


def display_token(piece: str) -> str:
    """A token as the page shows it: spaces, newlines and BPE space markers made visible."""
    return piece.translate(_DISPLAY) or "∅"


@dataclass
class Explorable:
    """A model with what the views need: its token functions, context, and where it came from."""

    kind: str
    name: str
    origin: str  # "run DIR" or "file PATH", for the page's header
    model: nn.Module
    config: ModelConfig
    encode: Callable[[str], list[int]]  # text -> ids, with the model's own special tokens
    piece: Callable[[int], str]  # id -> the tokenizer's piece (before display_token)
    decode: Callable[[list[int]], str]
    context: int  # the model's maximum sequence length
    run_dir: Path | None = None
    bos_id: int | None = None  # translation: the target's first token
    eos_id: int | None = None
    task: Any = None  # kind "task": the run's Task (its attention_example)
    default_text: str = ""
    chat: Callable[[str], str] | None = None
    # Separate vocabularies: encode, source_piece are the source's; target_encode, piece the target's.
    source_piece: Callable[[int], str] | None = None
    target_encode: Callable[[str], list[int]] | None = None
    # One model computation at a time (requests may come concurrently).
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def limit(self) -> int:
        return min(self.context, MAX_TOKENS)

    def label(self, token_id: int) -> str:
        return display_token(self.piece(token_id))

    def source_label(self, token_id: int) -> str:
        """A source (or prompt) token's label, from the source vocabulary where it has its own."""
        return display_token((self.source_piece or self.piece)(token_id))

    def tokens(self, text: str, what: str = "the text", *, target: bool = False) -> list[int]:
        """Ids of ``text`` (``target``: a translation's target side), refused when empty or too long."""
        if not text.strip():
            raise ExploreInputError(f"{what} is empty; type something")
        try:
            ids = (self.target_encode if target and self.target_encode else self.encode)(text)
        except ValueError as exc:  # e.g. a character a character-level vocabulary lacks
            raise ExploreInputError(f"{what}: {exc}") from None
        if not ids:
            raise ExploreInputError(f"{what} gives no token this model knows; type other text")
        if len(ids) > self.limit:
            why = (f"this model's context is {self.context} tokens" if self.limit == self.context else
                   f"the explorer shows at most {MAX_TOKENS} tokens (the model's context is {self.context})")
            raise ExploreInputError(f"{what} is {len(ids)} tokens; {why}. Shorten it.")
        return ids

    def prompt(self, text: str) -> tuple[list[int], int]:
        """A decoder's prompt ids and the room left for new tokens (at least 1, else refused)."""
        ids = self.tokens(text, "the prompt")
        room = self.context - len(ids)
        if room < 1:
            raise ExploreInputError(f"the prompt is {len(ids)} tokens and fills the model's context of "
                                    f"{self.context}; shorten it")
        return ids, room

    def unavailable(self, view: str) -> str | None:
        """Why the page's ``view`` cannot show this model (None: it can)."""
        generates = self.kind in ("translation", "decoder")
        an_arch = f"{'an' if self.config.arch[0] in 'aeiou' else 'a'} {self.config.arch}"  # "an encoder-only"
        return {"generate": None if generates else f"{an_arch} model does not generate text",
                "beam": None if generates else f"{an_arch} model does not generate text: no beam search",
                "training": None if self.run_dir is not None else
                "this model was loaded from a file, not trained here: it has no run to show"}.get(view)

    def summary(self) -> dict[str, Any]:
        """What the page shows about the model, and which views it has."""
        c = self.config
        views = {view: self.unavailable(view) for view in ("attention", "generate", "beam", "positions", "training")}
        return {"kind": self.kind, "name": self.name, "origin": self.origin, "arch": c.arch,
                "config": c.to_dict(), "layers": c.n_layers, "decoder_layers": c.n_decoder_layers,
                "heads": c.n_heads, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                "d_model": c.d_model, "positional": c.positional, "context": self.context,
                "limit": self.limit, "default_text": self.default_text, "chat": self.chat is not None,
                "eos": self.label(self.eos_id) if self.eos_id is not None else None,
                "parameters": sum(p.numel() for p in self.model.parameters()), "views": views}


def load_explorable(run_dir: Path | None = None, model_path: Path | None = None, *,
                    device: torch.device | str | None = None) -> Explorable:
    """The model of a run directory or of a file/directory (GGUF, Hugging Face); exactly one."""
    if (run_dir is None) == (model_path is None):
        raise ValueError("load_explorable takes one of run_dir and model_path")
    from aiayn.tasks.trained import is_ensemble_release, is_release, single_model

    where = resolve(device)  # before loading: a missing device fails at once
    if run_dir is None and model_path is not None and (is_release(Path(model_path))
                                                       or is_ensemble_release(Path(model_path))):
        run_dir = model_path  # a shipped model is a run in miniature
    if run_dir is not None:
        member, note = single_model(Path(run_dir))  # the views show one model: an ensemble's first
        ex = _from_run(member)
        if note is not None:
            ex.name, ex.origin = f"{Path(run_dir).name} (member {member.name})", f"{note}: run {member}"
    else:
        assert model_path is not None
        ex = _from_path(Path(model_path), where)
    ex.model.to(where)  # (a task's attention_example moves its inputs to the model: Task.on_model)
    return ex


def _from_run(run_dir: Path) -> Explorable:
    from aiayn.tasks.trained import load_run_or_release
    from aiayn.tasks.translation import TranslationTask
    from aiayn.tokenizers import CharTokenizer

    run = load_run_or_release(run_dir)
    model, config, task = run.model.eval(), run.model_config, run.task
    name = run_dir.name if task.name in run_dir.name else f"{task.name} ({run_dir.name})"
    common = dict(name=name, origin=f"run {run_dir}", model=model, config=config, context=config.max_seq_len,
                  run_dir=run_dir)
    if isinstance(task, TranslationTask):
        tok, target = task.load_tokenizers()  # one object twice for a joint vocabulary
        separate = target is not tok
        return Explorable(kind="translation", encode=lambda text: [*tok.encode(text), tok.eos_id],
                          piece=target.tokenizer.id_to_token, decode=target.decode, bos_id=tok.bos_id,
                          eos_id=tok.eos_id, default_text="A man is riding a bike down the street.",
                          source_piece=tok.tokenizer.id_to_token if separate else None,
                          target_encode=(lambda text: [*target.encode(text), target.eos_id]) if separate else None,
                          **common)
    tokenizer = getattr(task, "tokenizer", None)
    if tokenizer is not None and config.arch in ("decoder-only", "encoder-only"):
        char = isinstance(tokenizer, CharTokenizer)  # its encode gives a tensor; a BPETokenizer's a list
        kind = "decoder" if config.arch == "decoder-only" else "encoder"
        if char:
            encode, piece = (lambda text: tokenizer.encode(text).tolist()), (lambda i: tokenizer.decode([i]))
        else:
            encode, piece = tokenizer.encode, tokenizer.tokenizer.id_to_token
        return Explorable(kind=kind, encode=encode, piece=piece, decode=tokenizer.decode,
                          default_text="ROMEO:\nWhat light through yonder window breaks?", **common)
    # The task's test example is the default input; when its data is missing the page needs an input.
    with contextlib.suppress(Exception):
        task.prepare(run.train_config.seed)
    return Explorable(kind="task", encode=lambda text: [], piece=str,
                      decode=lambda ids: " ".join(map(str, ids)), task=task, **common)


def _from_path(path: Path, device: torch.device) -> Explorable:
    from aiayn.textgen import TextModelError, is_gguf, read_text_model

    if is_gguf(path):
        lm = read_text_model(path, device=device)
        return Explorable(kind="decoder", name=path.name, origin=f"file {path}", model=lm.model.eval(),
                          config=lm.model.config, encode=lm.encode, piece=lm.tokenizer.id_to_token, decode=lm.decode,
                          context=lm.context, eos_id=lm.eos_id, chat=lm.chat,
                          default_text="The capital of France is Paris. The capital of Germany is")
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise TextModelError(f"{path} is neither a GGUF file nor a Hugging Face model directory "
                             f"(config.json + weights + tokenizer)")
    if (path / "modules.json").is_file() or _hf_model_type(path) in ("bert", "roberta", "distilbert"):
        return _sentence_encoder(path, device)
    from tokenizers import Tokenizer

    from aiayn.interop import load_hf

    model, config = load_hf(path)
    if config.arch == "encoder-only":
        return _sentence_encoder(path, device)
    if config.arch != "decoder-only":
        raise TextModelError(f"{path} is a Hugging Face {config.arch} model; aiayn explore opens decoder-only "
                             f"and encoder-only model directories (for a translation model, give --run)")
    if not (path / "tokenizer.json").is_file():
        raise TextModelError(f"{path} has no tokenizer.json")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return Explorable(kind="decoder", name=_dir_name(path), origin=f"directory {path}", model=model.eval(), config=config,
                      encode=lambda text: tok.encode(text, add_special_tokens=False).ids, piece=tok.id_to_token,
                      decode=tok.decode, context=config.max_seq_len, default_text="Once upon a time")


def _dir_name(path: Path) -> str:
    """A model directory's name; a package's "model" folder is named with its package."""
    path = path.resolve()
    return f"{path.parent.name}/{path.name}" if path.name == "model" else path.name


def _hf_model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # load_hf names the problem


def _sentence_encoder(path: Path, device: torch.device) -> Explorable:
    from aiayn.embed import load_sentence_encoder

    encoder = load_sentence_encoder(path, device=device)
    tok = encoder.tokenizer
    tok.no_truncation()  # the explorer refuses a long text instead of cutting it silently
    config = encoder.model.config
    return Explorable(kind="encoder", name=_dir_name(path), origin=f"directory {path}", model=encoder.model,
                      config=config, encode=lambda text: tok.encode(text).ids, piece=tok.id_to_token,
                      decode=tok.decode, context=encoder.max_length,
                      default_text="The cat sat on the mat because it was warm.")
