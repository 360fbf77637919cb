"""Conversations to fine-tune a chat model on: OpenAI's fine-tuning JSONL (``{"messages": [{"role": "user",
"content": "..."}, ...]}`` a line) checked line by line, rendered through the model's chat template with a
mask of the assistant turns the loss counts, and packed into windows of whole conversations. Every problem
is a ``DataError`` naming ``FILE:LINE``, raised before any training step."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.data.parallel import DataError

ROLES = ("system", "user", "assistant", "tool")
Messages = list[dict[str, str]]


@dataclass
class Conversation:
    """One checked line and its ``FILE:LINE``."""

    messages: Messages
    where: str


@dataclass
class ChatExample:
    """A rendered conversation's token ids and, per token, whether the loss counts it."""

    ids: list[int]
    trained: list[bool]
    where: str


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL file, each line checked (blank lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} {'is a folder' if path.is_dir() else 'not found'}; give a JSONL file of conversations")
    conversations = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                            f"convert the file to UTF-8") from None
        if text.strip():
            conversations.append(Conversation(check_line(text.removeprefix("\ufeff"), where), where))
    if not conversations:
        raise DataError(f"{path} holds no conversation; write one JSON object per line, "
                        f'{{"messages": [...]}}')
    return conversations


def check_line(text: str, where: str) -> Messages:
    """The messages of one JSONL line, or a ``DataError`` saying what is wrong with it."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); write one JSON object "
                        f"per line") from None
    if not isinstance(line, dict) or "messages" not in line:
        raise DataError(f'{where}: expected an object with "messages"; write {{"messages": '
                        f'[{{"role": "user", "content": "..."}}, ...]}}')
    if extra := sorted(set(line) - {"messages"}):
        raise DataError(f"{where}: unknown key(s) {', '.join(map(json.dumps, extra))}; a line holds "
                        f'only "messages"')
    messages = line["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list of messages')
    for i, message in enumerate(messages):
        check_message(message, f"{where}: message {i + 1}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message; the loss counts the assistant turns, so give "
                        f"at least one")
    return messages


def check_message(message: Any, where: str) -> None:
    """One message: an object of a known ``role`` and a string ``content``, nothing else."""
    if not isinstance(message, dict):
        raise DataError(f'{where}: expected an object {{"role": ..., "content": ...}}')
    if extra := sorted(set(message) - {"role", "content"}):
        raise DataError(f"{where}: unknown key(s) {', '.join(map(json.dumps, extra))}; a message holds "
                        f'only "role" and "content"')
    if message.get("role") not in ROLES:
        raise DataError(f"{where}: role {json.dumps(message.get('role'))} is not one of {', '.join(ROLES)}; "
                        f"give one of them")
    if not isinstance(message.get("content"), str):
        raise DataError(f'{where}: "content" must be a string (the message text)')


def render_spans(template: Any, messages: Messages) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and each assistant turn's (start, end) characters: from the end of the
    generation prompt after the messages before it to the end of the text of the messages up to it."""
    text = template.render(messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(before) and text.startswith(upto) and len(before) <= len(upto)):
            raise ValueError(f"the chat template does not render the conversation turn by turn (the text "
                             f"of its first {i} messages is not a prefix of the whole); it cannot mark "
                             f"the assistant turns")
        spans.append((len(before), len(upto)))
    return text, spans


def encode_conversation(template: Any, encode: Callable[[str], list[int]], end_id: int | None,
                        messages: Messages) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and the loss mask: True on each assistant turn's tokens up to
    its first ``end_id`` (the end-of-turn token), all of it without one. Turns are encoded apart, so no token
    straddles an edge."""
    text, spans = render_spans(template, messages)
    ids: list[int] = []
    trained: list[bool] = []
    cursor = 0
    for start, end in spans:
        prompt = encode(text[cursor:start])
        turn = encode(text[start:end])
        stop = turn.index(end_id) + 1 if end_id in turn else len(turn)
        ids += prompt + turn
        trained += [False] * len(prompt) + [True] * stop + [False] * (len(turn) - stop)
        cursor = end
    rest = encode(text[cursor:])
    return ids + rest, trained + [False] * len(rest)


def encode_conversations(conversations: Sequence[Conversation], template: Any,
                         encode: Callable[[str], list[int]], end_id: int | None) -> list[ChatExample]:
    """``encode_conversation`` of each; a template failure names the line."""
    examples = []
    for conversation in conversations:
        try:
            ids, trained = encode_conversation(template, encode, end_id, conversation.messages)
        except ValueError as exc:  # the template's own errors (GGUFError) are ValueErrors too
            raise DataError(f"{conversation.where}: {exc}") from None
        if not any(trained[1:]):
            raise DataError(f"{conversation.where}: the assistant turns render to no token; give them "
                            f"some content")
        examples.append(ChatExample(ids, trained, conversation.where))
    return examples


def check_lengths(examples: Sequence[ChatExample], block: int, context: str) -> None:
    """Refuse a conversation longer than a window of ``block`` predictions; ``context``: how to raise it."""
    for example in examples:
        if len(example.ids) - 1 > block:
            raise DataError(f"{example.where}: the conversation is {len(example.ids)} tokens, more than a "
                            f"window's {block + 1}; shorten or split it, or {context}")


def pack_rows(lengths: Sequence[int], block: int) -> list[list[int]]:
    """Rows of whole examples (their indices) of at most ``block`` positions, an example of length n taking
    n - 1, by first fit in order. A tournament tree finds the row: ``most[size + r]`` is row r's room, inner
    ``most[k]`` the larger of its children's; from the root down the left child is taken if it has room."""
    size = 1
    while size < len(lengths):
        size *= 2
    most = [-math.inf] * (2 * size)  # -inf: no row there yet
    rows: list[list[int]] = []
    for i, length in enumerate(lengths):
        need = length - 1
        node = 1
        if most[1] >= need:
            while node < size:
                node = 2 * node if most[2 * node] >= need else 2 * node + 1
            rows[node - size].append(i)
        else:
            node = size + len(rows)
            rows.append([i])
            most[node] = block
        most[node] -= need
        while node > 1:  # up to the root, while the largest room changes
            node //= 2
            largest = max(most[2 * node], most[2 * node + 1])
            if most[node] == largest:
                break
            most[node] = largest
    return rows


def translation_conversations(sources: Sequence[str], targets: Sequence[str], prompt: str) -> list[Messages]:
    """Parallel sentences as conversations: ``prompt`` with the source for ``{src}``, the target as answer."""
    if "{src}" not in prompt:
        raise ValueError(f"the prompt {prompt!r} has no {{src}} where the source goes; e.g. "
                         f"'Translate to German: {{src}}'")
    return [[{"role": "user", "content": prompt.replace("{src}", src)}, {"role": "assistant", "content": tgt}]
            for src, tgt in zip(sources, targets, strict=True)]


def conversations_jsonl(conversations: Sequence[Messages]) -> str:
    """``conversations`` in OpenAI's fine-tuning JSONL: one ``{"messages": [...]}`` per line."""
    return "".join(json.dumps({"messages": messages}, ensure_ascii=False) + "\n" for messages in conversations)
