"""Constrained decoding with llguidance (why: docs/structured-output.md): every answer parses as JSON
and validates against a JSON schema. A ``GrammarConstraint`` is one request's state: ``mask_logits``
before each choice, ``advance`` after. JSON is compact (a small model given free whitespace may emit
newlines for ever); end-of-text only once complete; open-ended values get caps (``JsonBounds``).

Shape letters: b rows, v the model's vocabulary, n the tokenizer's, w = ceil(n / 32) words of a
packed bitmask (bit j of word i allows token 32 i + j)."""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    import llguidance

    from aiayn.generate.sampling import SamplingConfig


class TextModel(Protocol):
    """What ``generate_constrained`` reads of a text model (``aiayn.textgen.TextModel``, a layer above)."""

    model: Any  # a DecoderOnly
    tokenizer: Any  # a tokenizers.Tokenizer
    eos_id: int | None
    context: int

    def prompt_ids(self, prompt: str, *, chat: bool = False) -> Tensor: ...

    def decode(self, ids: list[int]) -> str: ...


TOKENIZER_CACHE = 4  # tokenizer descriptions kept (one per served model, in practice)
GRAMMAR_CACHE = 64  # compiled schemas kept, least recently used dropped
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # compact


@dataclass(frozen=True)
class JsonBounds:
    """Caps on what a schema leaves open, so that an answer ends (a schema's own bounds win). A number
    without a minimum or maximum gets ``|x| < 10**integer_digits``, one without ``multipleOf`` gets
    ``10**-decimals``; a string without ``maxLength`` or ``format`` gets ``string_chars``, an array
    without ``maxItems`` ``array_items``. ``enum``, ``const`` and untyped values are left as they are."""

    integer_digits: int = 15
    decimals: int = 6
    string_chars: int = 1000
    array_items: int = 100

    def __post_init__(self) -> None:
        for name, (low, high) in BOUND_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be a whole number from {low} to {high}, got {value!r}")


# Past 15 digits a double no longer holds the cap exactly; llguidance refuses a multipleOf below 10**-10.
BOUND_RANGES = {"integer_digits": (1, 15), "decimals": (0, 10), "string_chars": (1, 1_000_000),
                "array_items": (1, 1_000_000)}
BOUNDS = JsonBounds()  # the caps every schema gets unless a caller passes its own (or None: none)
# Keywords whose value is a subschema, a list or a map of them ("not", "if": a cap would change them).
_ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "then", "else")
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def bounded_schema(schema: Any, bounds: JsonBounds | None = BOUNDS) -> Any:
    """``schema`` with ``bounds``' caps where it leaves a value open (a copy; None: unchanged)."""
    if bounds is None or not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bounded_schema(sub, bounds) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [bounded_schema(sub, bounds) for sub in value]
        elif key in _ONE_SCHEMA:
            out[key] = bounded_schema(value, bounds)
    if "enum" in schema or "const" in schema:
        return out
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if types & {"number", "integer"}:
        limit = 10 ** bounds.integer_digits
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["exclusiveMinimum"] = -limit
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["exclusiveMaximum"] = limit
    if "number" in types and "multipleOf" not in schema:
        out["multipleOf"] = 10.0 ** -bounds.decimals
    if "string" in types and "maxLength" not in schema and "format" not in schema:
        out["maxLength"] = bounds.string_chars
    if "array" in types and "maxItems" not in schema:
        out["maxItems"] = bounds.array_items
    return out


_lock = threading.Lock()  # the caches are shared by a server's request threads
_tokenizers: OrderedDict[tuple[int, int | None], tuple[Any, TokenizerInfo]] = OrderedDict()
# Keyed by the TokenizerInfo's id, which the entry keeps alive (so the id is not reused).
_grammars: OrderedDict[tuple[int, str], tuple[TokenizerInfo, llguidance.LLMatcher]] = OrderedDict()
_executor: list[Any] = []  # one llguidance.LLExecutor, made on first batched use
# 1 << j for the bits of an int32 word (1 << 31 wraps to the sign bit, as the packed words have it).
_BITS = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int32)  # (32,)


class ConstraintError(ValueError):
    """A token the grammar does not allow was given to ``advance`` (the logits were not masked)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError("structured output needs llguidance: pip install 'llguidance>=1.0'") from None
    return llguidance


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer as llguidance sees it, its vocabulary size n and the end-of-text id the grammar
    allows (None: the tokenizer's own stands in, never allowed)."""

    llg: Any
    n_vocab: int
    eos_id: int | None


def tokenizer_info(tokenizer: Any, eos_id: int | None) -> TokenizerInfo:
    """The (cached) llguidance description of a ``tokenizers.Tokenizer``, built from its JSON."""
    key = (id(tokenizer), eos_id)
    with _lock:
        if key in _tokenizers:
            _tokenizers.move_to_end(key)
            return _tokenizers[key][1]
    if tokenizer is None or not hasattr(tokenizer, "to_str"):
        raise ValueError("structured output needs a model with a `tokenizers` tokenizer (BPE, GGUF or Hugging "
                         "Face); this model's is character-level")
    n_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if eos_id is not None and not 0 <= eos_id < n_vocab:
        raise ValueError(f"end-of-text id {eos_id} is outside the tokenizer's vocabulary of {n_vocab}")
    llg = _llguidance()
    try:
        lltok = llg.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos_id)
    except ValueError as exc:
        raise ValueError(f"llguidance cannot read this tokenizer: {str(exc).splitlines()[0]}") from None
    info = TokenizerInfo(lltok, n_vocab, eos_id)
    with _lock:
        _tokenizers[key] = (tokenizer, info)  # the tokenizer kept alive, so its id is not reused
        while len(_tokenizers) > TOKENIZER_CACHE:
            _tokenizers.popitem(last=False)
    return info


def schema_text(schema: Any) -> str:
    """The JSON text of a JSON schema (None: any JSON object's); ValueError, one line, otherwise."""
    if schema is None:
        schema = {"type": "object"}
    elif not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be a JSON object (a dict), got {type(schema).__name__}")
    try:
        return json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from None


def _template(info: TokenizerInfo, schema: Any, bounds: JsonBounds | None = None) -> llguidance.LLMatcher:
    """The compiled, cached grammar of ``schema`` (None: any JSON object) under ``bounds``, to copy."""
    schema_text(schema)  # (a schema that is not one is refused before it is bounded)
    text = schema_text(bounded_schema(schema, bounds))
    return _compiled(info, text, lambda llg: llg.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS),
                     "invalid JSON schema")


def _compiled(info: TokenizerInfo, key_text: str, build: Any, what: str) -> llguidance.LLMatcher:
    """The matcher of ``build(llguidance)``'s grammar, cached by ``key_text``; ValueError "{what}: why"."""
    key = (id(info), key_text)
    with _lock:
        if key in _grammars:
            _grammars.move_to_end(key)
            return _grammars[key][1]
    llg = _llguidance()
    try:
        grammar = build(llg)
    except ValueError as exc:  # (a Lark grammar that does not parse)
        raise ValueError(f"{what}: {' '.join(str(exc).split())}") from None
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, info.llg)
    if error:
        raise ValueError(f"{what}: {' '.join(messages[0].split())}")
    matcher = llg.LLMatcher(info.llg, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"{what}: {' '.join(matcher.get_error().split())}")
    with _lock:
        _grammars[key] = (info, matcher)
        while len(_grammars) > GRAMMAR_CACHE:
            _grammars.popitem(last=False)
    return matcher


def clear_caches() -> None:
    """Forget every cached tokenizer description and compiled schema (tests, benchmarks)."""
    with _lock:
        _tokenizers.clear()
        _grammars.clear()


class GrammarConstraint:
    """One request's grammar state (one row of a batch); not thread-safe."""

    def __init__(self, matcher: llguidance.LLMatcher, info: TokenizerInfo) -> None:
        self._matcher = matcher
        self.info = info
        self._words = torch.empty((info.n_vocab + 31) // 32, dtype=torch.int32)  # (w,) this state's mask

    @classmethod
    def from_schema(cls, tokenizer: Any, schema: dict[str, Any] | None, *, eos_id: int | None,
                    bounds: JsonBounds | None = BOUNDS) -> GrammarConstraint:
        """Answers that validate against ``schema``, within ``bounds`` where it leaves a value open; ``eos_id``:
        the model's end-of-text id (None: none). ValueError, one line, for an invalid schema."""
        info = tokenizer_info(tokenizer, eos_id)
        return cls(_template(info, schema, bounds).deep_copy(), info)

    @classmethod
    def from_lark(cls, tokenizer: Any, grammar: str, *, eos_id: int | None) -> GrammarConstraint:
        """Answers in the language of ``grammar``, in llguidance's Lark dialect (``aiayn.serve.tool_calls``)."""
        info = tokenizer_info(tokenizer, eos_id)
        return cls(_compiled(info, "lark:" + grammar, lambda llg: llg.LLMatcher.grammar_from_lark(grammar),
                             "invalid grammar").deep_copy(), info)

    @classmethod
    def json_object(cls, tokenizer: Any, *, eos_id: int | None) -> GrammarConstraint:
        """Answers that are a JSON object (any keys and values)."""
        return cls.from_schema(tokenizer, None, eos_id=eos_id, bounds=None)

    @classmethod
    def from_response_format(cls, tokenizer: Any, response_format: Any, *, eos_id: int | None,
                             bounds: JsonBounds | None = BOUNDS) -> GrammarConstraint | None:
        """OpenAI's ``response_format``: "text" or None -> None, "json_object", or "json_schema" (enforced,
        strict or not, within ``bounds``); ValueError for anything else."""
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if response_format is None or kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(tokenizer, eos_id=eos_id)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                                 '{...}}}')
            return cls.from_schema(tokenizer, spec.get("schema", {}), eos_id=eos_id, bounds=bounds)
        raise ValueError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')

    def bitmask(self) -> Tensor:
        """The tokens allowed next, packed (w,) int32 on the CPU, in this state's buffer."""
        words = self._words
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        _block_standin_eos(words, self.info)
        return words

    def mask_logits(self, logits: Tensor) -> Tensor:
        """Set the logits (v,) or (b, v) of every token not allowed next to -inf, in place, and return them."""
        apply_bitmask(logits, self.bitmask(), self.info.n_vocab)
        return logits

    def advance(self, token: int) -> None:
        """Move past ``token``; ConstraintError when not allowed, the state left as it was
        (``consume_token`` would leave an error that ``reset`` does not clear)."""
        token = int(token)
        if self._matcher.is_stopped():  # only end-of-text may follow, any number of times
            if token != self.info.eos_id:
                raise ConstraintError(f"token {token} does not fit the grammar (nothing can follow)")
        elif self._matcher.try_consume_tokens([token]) == 0:
            raise ConstraintError(f"token {token} does not fit the grammar (not allowed here)")

    def is_finished(self) -> bool:
        """True once nothing can follow but end-of-text, or end-of-text was given."""
        return bool(self._matcher.is_stopped())

    def is_complete(self) -> bool:
        """True when the tokens so far are a whole valid answer."""
        return bool(self._matcher.is_accepting())

    def reset(self) -> None:
        """Back to the start: no token given yet."""
        self._matcher.reset()

    def copy(self) -> GrammarConstraint:
        """An independent state at the same point (e.g. for n > 1 choices of one request)."""
        return GrammarConstraint(self._matcher.deep_copy(), self.info)

    def allowed(self) -> Tensor:
        """(n,) bool: the tokens allowed next (tests and debugging)."""
        return unpack_bitmask(self.bitmask()[None], self.info.n_vocab)[0]


def _block_standin_eos(words: Tensor, info: TokenizerInfo) -> None:
    """Clear the stand-in end-of-text's bit in ``words`` (w,): it is never the model's to emit."""
    if info.eos_id is None:
        eos = info.llg.eos_token
        words[eos // 32] &= ~int(_BITS[eos % 32])


def unpack_bitmask(words: Tensor, n: int, *, invert: bool = False) -> Tensor:
    """Packed (b, w) int32 -> (b, n) bool, True where the bit is set (``invert``: where it is not)."""
    if words.device.type == "cpu" and sys.byteorder == "little":  # bit j of word i = bit j % 8 of byte 4 i + j // 8
        packed = words.contiguous().numpy().view(np.uint8)  # (b, 4 w)
        bits = np.unpackbits(~packed if invert else packed, axis=-1, count=n, bitorder="little")  # (b, n) 0/1
        return torch.from_numpy(bits.view(np.bool_))
    bits = unpack_by_shifts(words, n)
    return ~bits if invert else bits


def unpack_by_shifts(words: Tensor, n: int) -> Tensor:
    """``unpack_bitmask`` in torch ops, on any device: (b, w) int32 -> (b, n) bool."""
    return ((words.unsqueeze(-1) & _BITS.to(words.device)) != 0).view(words.shape[0], -1)[:, :n]  # (b, 32 w) -> (b, n)


def apply_bitmask(logits: Tensor, words: Tensor, n: int) -> None:
    """logits (v,) or (b, v) in place: -inf where the mask (w,) or (b, w) has a 0 bit, and from n on."""
    rows = logits if logits.dim() == 2 else logits.unsqueeze(0)  # (b, v), a view
    words = words if words.dim() == 2 else words.unsqueeze(0)  # (1 or b, w)
    v = rows.shape[-1]
    m = min(v, n)
    # 4 bytes per 32 tokens cross to the device (none on the CPU); the bits are unpacked there.
    blocked = unpack_bitmask(words.to(rows.device, non_blocking=True), m, invert=True)  # (1 or b, m)
    rows[:, :m].masked_fill_(blocked, float("-inf"))
    if v > n:
        rows[:, n:] = float("-inf")


def mask_rows(logits: Tensor, constraints: Sequence[GrammarConstraint | None]) -> Tensor:
    """Mask each row of logits (b, v) in place with its constraint (None: free), in parallel; return them."""
    if len(constraints) != logits.shape[0]:
        raise ValueError(f"{len(constraints)} constraints for {logits.shape[0]} rows of logits")
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    if len(rows) == 1:
        constraints[rows[0]].mask_logits(logits[rows[0]])  # type: ignore[union-attr]
        return logits
    chosen: list[GrammarConstraint] = [constraints[i] for i in rows]  # type: ignore[misc]
    words = torch.empty(len(rows), chosen[0]._words.numel(), dtype=torch.int32)  # (r, w)
    with _lock:
        if not _executor:
            _executor.append(_llguidance().LLExecutor())
    _executor[0].unsafe_compute_mask_ptr([(c._matcher, k) for k, c in enumerate(chosen)],
                                         words.data_ptr(), words.shape[1] * 4, len(rows))
    for k, c in enumerate(chosen):
        _block_standin_eos(words[k], c.info)
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)  # (r, v)
    apply_bitmask(sub, words, chosen[0].info.n_vocab)
    logits.index_copy_(0, index, sub)
    return logits


@dataclass
class ConstrainedResult:
    """What ``generate_constrained`` made, and why it stopped: "finished", "eos" or "length" (cut)."""

    text: str
    tokens: list[int]
    stop: str

    @property
    def complete(self) -> bool:
        return self.stop != "length"


def generate_constrained(lm: TextModel, prompt: str, constraint: GrammarConstraint, *, max_new_tokens: int,
                         sampling: SamplingConfig | None = None, chat: bool = True) -> ConstrainedResult:
    """Continue ``prompt`` (in the chat template with ``chat``) under ``constraint`` until it is finished,
    end-of-text or ``max_new_tokens`` (cut to the context: sliding would drop the instructions)."""
    from aiayn.device import autocast, model_device
    from aiayn.generate.sampling import TokenChooser
    from aiayn.generate.step import decode_step

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    constraint.reset()
    ids = lm.prompt_ids(prompt, chat=chat)  # (1, t) on the model's device
    device, t = model_device(lm.model), ids.shape[1]
    max_new_tokens = min(max_new_tokens, lm.context - t)
    chooser = TokenChooser(sampling, device)
    produced: list[int] = []
    stop = "length"
    with torch.inference_mode(), autocast(device):
        history = torch.empty(1, t + max_new_tokens, dtype=torch.long, device=device)  # (1, t + new) ids fed
        history[:, :t] = ids
        cache = lm.model.new_cache(1, t + max_new_tokens)
        inputs = ids  # the prompt, then each new token (1, 1)
        for _ in range(max_new_tokens):
            logits = decode_step(lm.model, inputs, cache).float()  # (1, v)
            constraint.mask_logits(logits)
            fed = cache.length
            token = int(chooser.choose(logits, history[:, :fed] if chooser.needs_history else None)[0])
            constraint.advance(token)
            if lm.eos_id is not None and token == lm.eos_id:
                stop = "eos"
                break
            produced.append(token)
            if constraint.is_finished():
                stop = "finished"
                break
            history[0, fed] = token
            inputs = history[:, fed:fed + 1]
    return ConstrainedResult(lm.decode(produced), produced, stop)


def generate_json(lm: TextModel, prompt: str, schema: dict[str, Any] | None = None, *, max_new_tokens: int = 256,
                  sampling: SamplingConfig | None = None, chat: bool = True) -> Any:
    """The JSON value the model answers ``prompt`` with, validating against ``schema`` (None: any object).
    ValueError for an invalid schema or an answer cut before it was complete."""
    tokenizer = lm.tokenizer
    constraint = (GrammarConstraint.json_object(tokenizer, eos_id=lm.eos_id) if schema is None
                  else GrammarConstraint.from_schema(tokenizer, schema, eos_id=lm.eos_id))
    result = generate_constrained(lm, prompt, constraint, max_new_tokens=max_new_tokens, sampling=sampling, chat=chat)
    if not result.complete:
        raise ValueError(f"the answer was cut after {len(result.tokens)} tokens, before its JSON was complete; "
                         f"raise max_new_tokens")
    return json.loads(result.text)
