"""The chat task's data: every refusal names the file and line, the loss mask covers the assistant
turns token by token (against a hand-derived mask and transformers' own), and packing."""

from __future__ import annotations

import json
import re

import pytest
import torch
from chat_fixtures import CONVERSATIONS, END_OF_TURN, TEXT, chat_source, conversation, write_jsonl
from tokenizer_helpers import CHAT_TEMPLATE, train_tokenizer

from aiayn.data.parallel import DataError
from aiayn.finetune.chat import encode_conversation, pack_rows, read_conversations
from aiayn.interop.gguf_text import ChatTemplate
from aiayn.tasks import get_task
from aiayn.tasks.sources import SourceOption
from aiayn.train.losses import IGNORE

GOOD = json.dumps(conversation("What is two plus two?", "It is four."))
BAD_LINES = [
    (b"\xff\xfe{}", "not UTF-8 (byte 0xff at column 1); convert the file to UTF-8"),
    (b'{"messages": [', "not JSON (Expecting value at column 15); write one JSON object per line"),
    (b'[1, 2]', 'expected an object with "messages"'),
    (b'{"prompt": "hi"}', 'expected an object with "messages"'),
    (json.dumps({**json.loads(GOOD), "weight": 1}).encode(), 'unknown key(s) "weight"; a line holds only "messages"'),
    (b'{"messages": []}', '"messages" must be a non-empty list of messages'),
    (b'{"messages": "hi"}', '"messages" must be a non-empty list of messages'),
    (b'{"messages": ["hi"]}', 'message 1: expected an object {"role": ..., "content": ...}'),
    (b'{"messages": [{"role": "user", "content": "hi", "name": "x"}]}',
     'message 1: unknown key(s) "name"; a message holds only "role" and "content"'),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hi"}]}',
     'message 2: role "bot" is not one of system, user, assistant, tool; give one of them'),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}',
     'message 2: "content" must be a string (the message text)'),
    (b'{"messages": [{"role": "user", "content": "hi"}]}',
     "no assistant message; the loss counts the assistant turns, so give at least one"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES, ids=[m.split(";")[0][:30] for _, m in BAD_LINES])
def test_a_bad_line_is_refused_naming_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\n" + line + b"\n" + GOOD.encode() + b"\n")
    with pytest.raises(DataError) as caught:
        read_conversations(path)
    assert str(caught.value).startswith(f"{path}:3: ")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_missing_or_empty_file_is_refused(tmp_path):
    with pytest.raises(DataError, match="not found; give a JSONL file of conversations"):
        read_conversations(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="holds no conversation"):
        read_conversations(tmp_path / "empty.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXT)


def encode_with(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def test_the_mask_is_the_assistant_reply_and_its_end_of_turn_token(tokenizer):
    messages = conversation("What is two plus two?", "It is four.")["messages"]
    ids, trained = encode_conversation(ChatTemplate(CHAT_TEMPLATE), encode_with(tokenizer), END_OF_TURN, messages)
    # By hand: the ChatML prompt up to the assistant's header, the reply and <|im_end|>, then "\n".
    prompt = encode_with(tokenizer)("<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n")
    reply = encode_with(tokenizer)("It is four.")
    assert ids == [*prompt, *reply, END_OF_TURN, *encode_with(tokenizer)("\n")]
    assert trained == [False] * len(prompt) + [True] * (len(reply) + 1) + [False]


def test_every_assistant_turn_is_trained_and_nothing_else(tokenizer):
    messages = CONVERSATIONS[2]["messages"]
    ids, trained = encode_conversation(ChatTemplate(CHAT_TEMPLATE), encode_with(tokenizer), END_OF_TURN, messages)
    kept = tokenizer.decode([i for i, keep in zip(ids, trained, strict=True) if keep], skip_special_tokens=False)
    assert kept == "Hello, how are you?<|im_end|>Blue.<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=False) == ChatTemplate(CHAT_TEMPLATE).render(
        messages, add_generation_prompt=False)


# The same ChatML text, its assistant turns tagged for transformers' assistant mask.
TAGGED_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")


@pytest.mark.parametrize("index", range(3))
def test_the_mask_is_transformers_assistant_mask_token_by_token(tokenizer, index):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.chat_template = TAGGED_TEMPLATE
    messages = CONVERSATIONS[index]["messages"]
    expected = fast.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, trained = encode_conversation(ChatTemplate(CHAT_TEMPLATE), encode_with(tokenizer), END_OF_TURN, messages)
    assert ids == expected["input_ids"]
    assert trained == [bool(m) for m in expected["assistant_masks"]]


def test_a_template_that_does_not_render_turn_by_turn_is_refused(tokenizer):
    reversed_template = ChatTemplate("{% for m in messages | reverse %}{{ m['content'] }};{% endfor %}")
    messages = CONVERSATIONS[2]["messages"]
    with pytest.raises(ValueError, match="does not render the conversation turn by turn"):
        encode_conversation(reversed_template, encode_with(tokenizer), END_OF_TURN, messages)


def test_packing_puts_whole_examples_in_first_fitting_rows():
    # An example of n tokens takes n - 1 positions.
    assert pack_rows([5, 5, 5, 3, 9], 8) == [[0, 1], [2, 3], [4]]
    assert pack_rows([2, 2, 2], 100) == [[0, 1, 2]]
    assert pack_rows([], 8) == []


def first_fit_by_scan(lengths: list[int], block: int) -> list[list[int]]:
    """First fit by its definition: each example into the lowest-numbered row with room, scanning them all."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, length in enumerate(lengths):
        fit = next((r for r, free in enumerate(room) if free >= length - 1), None)
        if fit is None:
            rows.append([i])
            room.append(block - (length - 1))
        else:
            rows[fit].append(i)
            room[fit] -= length - 1
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_packing_is_first_fit_by_its_definition(seed):
    """On random lengths (one-token examples and ones past a window too): the rows the scan makes."""
    g = torch.Generator().manual_seed(seed)
    block = int(torch.randint(1, 64, (1,), generator=g))
    count = int(torch.randint(1, 400, (1,), generator=g))
    lengths = torch.randint(1, block + 3, (count,), generator=g).tolist()
    assert pack_rows(lengths, block) == first_fit_by_scan(lengths, block)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return chat_source(tmp_path_factory.mktemp("chat-model") / "model")


def chat_task(source, data, **options):
    task = get_task("chat", data=str(data), init_from=str(source.path), **options)
    task.source = SourceOption(None, injected=source)
    task.echo = lambda _: None
    return task


@pytest.mark.parametrize("pack", [True, False])
def test_a_row_holds_its_conversations_one_after_another(tmp_path, source, pack):
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS[:3])
    task = chat_task(source, data, val_data=str(data), block_size=80, pack=pack)
    task.prepare(0)
    examples = task.examples_of["train"]
    assert task.rows["train"] == ([[0, 1], [2]] if pack else [[0], [1], [2]])
    batch = task.collate("train", torch.arange(task.split_size("train")))
    first = task.rows["train"][0]
    tokens = [t for i in first for t in examples[i].ids[:-1]]
    targets = [t if keep else IGNORE for i in first for t, keep in zip(examples[i].ids[1:], examples[i].trained[1:],
                                                                           strict=True)]
    assert batch["tokens"][0, : len(tokens)].tolist() == tokens
    assert batch["targets"][0].tolist() == targets + [IGNORE] * (batch["targets"].shape[1] - len(targets))
    assert batch["valid"].sum(1).tolist() == [sum(len(examples[i].ids) - 1 for i in row) for row in task.rows["train"]]
    assert task.count_tokens(batch) == int(batch["valid"].sum())


def test_a_conversation_longer_than_a_window_is_refused_naming_its_line(tmp_path, source):
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS[:3])
    task = chat_task(source, data, val_data=str(data), block_size=20)
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / 'chat.jsonl'))}:1: the conversation is \d+ tokens, more than "
                                        r"a window's 21; shorten or split it, or raise block_size \(up to the model's "
                                        r"context, 256\)$"):
        task.prepare(0)


def test_without_validation_data_a_seeded_share_is_held_out_and_stated(tmp_path, source):
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS * 5)  # 60 conversations
    said: list[str] = []
    splits = []
    for _ in range(2):
        task = chat_task(source, data, block_size=64, pack=False)
        task.echo = said.append
        task.prepare(3)
        splits.append([e.ids for e in task.examples_of["val"]])
    assert said == ["validation: 5% of the conversations (3), seed 3; give --val-data to choose"] * 2
    assert splits[0] == splits[1] and len(splits[0]) == 3
    assert len(task.examples_of["train"]) == 57
