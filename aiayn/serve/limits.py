"""How much one request may ask of ``aiayn serve`` (``--max-inputs``, ``--max-input-tokens``,
``--max-request-tokens``), and reading its texts into token ids; past a limit is a 400 naming it."""

from __future__ import annotations

from dataclasses import dataclass

from aiayn.serve.responses import APIError
from aiayn.textgen import TextModel

MAX_INPUTS = 2048  # OpenAI's: inputs of one embeddings request
MAX_INPUT_TOKENS = 8192  # OpenAI's: tokens of one input (a decoder's context, if smaller)
MAX_REQUEST_TOKENS = 300_000  # OpenAI's: tokens of one embeddings request, all inputs together


@dataclass(frozen=True)
class Limits:
    """The most one request may hold: ``inputs`` texts, ``input_tokens`` each, ``request_tokens`` in all."""

    inputs: int = MAX_INPUTS
    input_tokens: int = MAX_INPUT_TOKENS
    request_tokens: int = MAX_REQUEST_TOKENS

    def __post_init__(self) -> None:
        if min(self.inputs, self.input_tokens, self.request_tokens) < 1:
            raise ValueError("--max-inputs, --max-input-tokens and --max-request-tokens must be >= 1")

    def describe(self, why: str = "") -> str:
        """The start-up line; ``why``: where the per-input limit comes from, e.g. "the model's context"."""
        return (f"each request: at most {self.inputs:,} inputs or prompts, {self.input_tokens:,} tokens each"
                f"{f' ({why})' if why else ''}, {self.request_tokens:,} in all (then 400)")

    def check_count(self, n: int, param: str) -> None:
        """400 if a request holds more than ``inputs`` texts (``param``: "input" or "prompt")."""
        if n > self.inputs:
            raise APIError(400, f"{param}: {n:,} {param}s in one request, more than the {self.inputs:,} this server "
                                f"takes (--max-inputs); send at most {self.inputs:,} per request",
                           param=param, code=f"too_many_{param}s")


def prompt_ids(lm: TextModel, prompt: str | list[int], what: str) -> list[int]:
    """Token ids of a text (or given ids, checked against the vocabulary); 400 if empty or bad."""
    vocab = lm.model.config.vocab_size
    if isinstance(prompt, list):
        bad = [i for i in prompt if not 0 <= i < vocab]
        if bad:
            raise APIError(400, f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=what)
        return prompt
    try:
        ids = lm.encode(prompt)
    except ValueError as exc:  # a character-level vocabulary that lacks a character
        raise APIError(400, f"{what}: {exc}", param=what) from None
    if not ids:
        raise APIError(400, f"{what}: empty after tokenisation; give some text", param=what)
    return ids


def token_ids(lm: TextModel, texts: list[str | list[int]], param: str, limits: Limits,
              input_tokens: int | None) -> list[list[int]]:
    """Each text's ids, refused (400) at the first one over ``input_tokens`` or past ``request_tokens``."""
    out: list[list[int]] = []
    total = 0
    for i, text in enumerate(texts):
        where = f"{param}[{i}]" if len(texts) > 1 else param
        ids = prompt_ids(lm, text, where)
        if input_tokens is not None and len(ids) > input_tokens:
            raise too_long(where, len(ids), input_tokens, param)
        total += len(ids)
        if total > limits.request_tokens:
            raise APIError(400, f"{param}: more than {limits.request_tokens:,} tokens in one request (--max-request-"
                                f"tokens), passed at {where}; send fewer or shorter {param}s",
                           param=param, code="too_many_tokens")
        out.append(ids)
    return out


def too_long(where: str, n: int, most: int, param: str) -> APIError:
    return APIError(400, f"{where}: {n:,} tokens, more than the {most:,} one {param} may have (--max-input-tokens); "
                         f"shorten it", param=where, code="input_too_long")


def check_tokens(counts: list[int], param: str, limits: Limits) -> None:
    """The same limits on token counts known already (an encoder's, after its truncation)."""
    for i, n in enumerate(counts):
        if n > limits.input_tokens:
            raise too_long(f"{param}[{i}]" if len(counts) > 1 else param, n, limits.input_tokens, param)
    if sum(counts) > limits.request_tokens:
        raise APIError(400, f"{param}: {sum(counts):,} tokens in one request, more than {limits.request_tokens:,} "
                            f"(--max-request-tokens); send fewer or shorter {param}s", param=param,
                       code="too_many_tokens")
