"""A GGUF file's text side: its tokenizer (as a ``tokenizers.Tokenizer``) and its chat template (Jinja,
rendered in a sandbox)."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from aiayn.interop.mapping import InteropError

if TYPE_CHECKING:  # optional dependency, imported where used
    from tokenizers import Tokenizer

SUPPORTED_TOKENIZERS = ("gpt2",)
# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4


class GGUFError(InteropError):
    """A GGUF file aiayn cannot load; the one-line message names the file and what is wrong."""


def need_key(meta: dict[str, Any], key: str, source: str) -> Any:
    if meta.get(key) is None:
        raise GGUFError(f"{source}: metadata has no {key!r}, which a {meta.get('general.architecture')} model needs")
    return meta[key]


# llama.cpp's pre-tokenizers (llama-vocab.cpp, by tokenizer.ggml.pre), as `tokenizers` pieces.
_GPT2_REGEX_PRE = ("gpt2", "default", "mpt", "olmo", "jais", "trillion", "granite-docling")
_DIGITS_THEN_GPT2_PRE = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# llama.cpp matches a whole pre-token against the vocabulary before merging for these.
_IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3")


def _pre_tokenizer(pre: str | None, source: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre in _DIGITS_THEN_GPT2_PRE:  # every digit its own pre-token, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in (*_GPT2_REGEX_PRE, None):
        warnings.warn(f"{source}: tokenizer.ggml.pre={pre!r} is not known to aiayn; splitting text with "
                      f"GPT-2's regex, which may tokenize some text differently from llama.cpp", stacklevel=4)
    return byte_level


def gguf_tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    """The metadata's byte-level BPE tokenizer: control and user-defined tokens matched whole, BOS/EOS added
    as the metadata says."""
    model_kind = meta.get("tokenizer.ggml.model")
    if model_kind is None:
        raise GGUFError(f"{source}: the metadata holds no tokenizer (tokenizer.ggml.model); pass "
                        f"tokenizer=False to load the model alone")
    if model_kind not in SUPPORTED_TOKENIZERS:
        raise GGUFError(f"{source}: tokenizer.ggml.model={model_kind!r} is not supported; aiayn rebuilds "
                        f"{', '.join(SUPPORTED_TOKENIZERS)} (byte-level BPE) tokenizers — pass tokenizer=False "
                        f"to load the model alone")
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens: list[str] = list(need_key(meta, "tokenizer.ggml.tokens", source))
    merges = [tuple(m.split(" ", 1)) for m in need_key(meta, "tokenizer.ggml.merges", source)]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicated spelling keeps its first id
    pre = meta.get("tokenizer.ggml.pre")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     ignore_merges=pre in _IGNORE_MERGES_PRE))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre, source)
    tokenizer.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types, strict=False) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED])

    added = []  # what encode() puts around the text: [bos] text [eos], as the file asks
    for which in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
        if meta.get(f"tokenizer.ggml.add_{which}_token") and token_id is not None:
            added.append((which, tokens[token_id], token_id))
    if added:
        before = [t for which, t, _ in added if which == "bos"]
        after = [t for which, t, _ in added if which == "eos"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[*before, "$A", *after],
            pair=[*before, "$A", *after, *(f"{t}:1" for t in before), "$B:1", *(f"{t}:1" for t in after)],
            special_tokens=[(t, i) for _, t, i in added],
        )
    return tokenizer


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may refer to (``bos_token``, ...)."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.source

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text, as transformers' ``apply_chat_template(tokenize=False)`` renders it."""
        import jinja2

        _check_message_sizes(messages)
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        try:
            return _render_bounded(_compiled(self.source), dict(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables))
        except jinja2.TemplateError as exc:
            raise GGUFError(f"the model's chat template failed: {exc}; drop --chat, or fix the "
                            f"template") from None
        except (OverflowError, RecursionError) as exc:
            raise GGUFError(f"the model's chat template exceeds a limit ({exc}); it is refused") from None


# A chat template is code from a model file: it renders in Jinja's immutable sandbox within these budgets.
TEMPLATE_SECONDS = 2.0
TEMPLATE_MAX_CHARS = 1_000_000
TEMPLATE_MAX_MEMORY = 256 << 20  # bytes the process may grow by while rendering
# How often the budgets are checked: a line that grows the memory by much runs longer than this.
BUDGET_CHECK_SECONDS = 0.001


MESSAGES_MAX_CHARS = TEMPLATE_MAX_CHARS // 2  # the rest is the template's own text around them


def _check_message_sizes(messages: Sequence[dict[str, Any]]) -> None:
    """Refuse messages too long for the template's output budget, naming the longest."""
    sizes = [len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in messages]
    if sum(sizes) <= MESSAGES_MAX_CHARS:
        return
    i = max(range(len(sizes)), key=sizes.__getitem__)
    which = f"message {i} ({messages[i].get('role', 'no role')})"
    if sizes[i] > MESSAGES_MAX_CHARS:
        raise GGUFError(f"{which} has {sizes[i]:,} characters, more than the {MESSAGES_MAX_CHARS:,} a chat prompt "
                        f"may hold; shorten it")
    raise GGUFError(f"the messages have {sum(sizes):,} characters in all (the longest, {which}, {sizes[i]:,}), more "
                    f"than the {MESSAGES_MAX_CHARS:,} a chat prompt may hold; shorten them")


def _resident_bytes() -> int | None:
    """This process's resident memory (Linux: /proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _render_bounded(template: Any, context: dict[str, Any]) -> str:
    """Render chunk by chunk within the budgets: a trace function on the template's frames checks the memory,
    then the time (so a template filling memory is named for that), every ``BUDGET_CHECK_SECONDS``."""
    deadline = time.monotonic() + TEMPLATE_SECONDS
    start = _resident_bytes()
    next_check = time.monotonic() + BUDGET_CHECK_SECONDS

    def in_template(frame: Any, event: str, arg: Any) -> Any:
        nonlocal next_check
        now = time.monotonic()
        if now < next_check:
            return in_template
        next_check = now + BUDGET_CHECK_SECONDS
        resident = _resident_bytes() if start is not None else None
        if resident is not None and start is not None and resident - start > TEMPLATE_MAX_MEMORY:
            raise GGUFError(f"the model's chat template took over {TEMPLATE_MAX_MEMORY >> 20} MiB of memory "
                            f"and was stopped; drop --chat, or fix the template")
        if now > deadline:
            raise GGUFError(f"the model's chat template ran for over {TEMPLATE_SECONDS:g} s and was "
                            f"stopped (an endless or huge loop?); drop --chat, or fix the template")
        return in_template

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return in_template if frame.f_code.co_filename == "<template>" else None

    pieces: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for piece in template.generate(**context):
            size += len(piece)
            if size > TEMPLATE_MAX_CHARS:
                raise GGUFError(f"the model's chat template wrote over {TEMPLATE_MAX_CHARS:,} characters "
                                f"and was stopped; drop --chat, or fix the template")
            pieces.append(piece)
    finally:
        sys.settrace(previous)
    return "".join(pieces)


@lru_cache(maxsize=16)  # compiling takes milliseconds; a chat task renders each conversation three times
def _compiled(source: str) -> Any:
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise GGUFError("rendering a chat template needs the 'jinja2' package: pip install jinja2") from exc

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja's class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox, with ``*``, ``**`` and ``+`` checked before they run (``'a' * 10**10``)."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise OverflowError(f"exponent {right} in '**'")
            sequences = isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple))
            if operator == "+" and sequences and len(left) + len(right) > TEMPLATE_MAX_CHARS:
                raise OverflowError(f"a sequence of {len(left) + len(right):,} items")
            if operator == "*":
                sized, count = (left, right) if isinstance(right, int) else (right, left)
                if (isinstance(sized, (str, list, tuple)) and isinstance(count, int)
                        and len(sized) * count > TEMPLATE_MAX_CHARS):
                    raise OverflowError(f"a sequence of {len(sized):,} x {count:,} items")
            return super().call_binop(context, operator, left, right)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def chat_template(meta: dict[str, Any]) -> ChatTemplate | None:
    source = meta.get("tokenizer.chat_template")
    if not source:
        return None
    tokens = meta.get("tokenizer.ggml.tokens") or []
    specials = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            specials[name] = tokens[token_id]
    return ChatTemplate(source, specials)


