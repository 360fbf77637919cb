"""What a streamed answer may show after each token: half characters and possible stop strings wait,
a stop string is never shown, and what is shown is always a prefix of the final text."""

from __future__ import annotations

import pytest

from aiayn.generate.text import IncrementalText


def byte_decode(ids: list[int]) -> str:
    """A byte-level 'tokenizer': each id is one byte (a broken UTF-8 tail decodes as U+FFFD)."""
    return bytes(ids).decode("utf-8", errors="replace")


def feed(text: IncrementalText, data: bytes) -> tuple[list[str], bool]:
    shown, stopped = [], False
    for byte in data:
        piece, stopped = text.add(byte)
        shown.append(piece)
        if stopped:
            break
    return shown, stopped


def test_a_stop_string_across_tokens_is_held_back_and_never_shown():
    text = IncrementalText(byte_decode, ["###"])
    shown, stopped = feed(text, b"ab###cd")
    assert stopped and "".join(shown) == "ab"
    assert shown == ["a", "b", "", "", ""]  # each '#' waited: it could start the stop string


def test_a_false_start_is_released_once_it_cannot_be_a_stop():
    text = IncrementalText(byte_decode, ["##x"])
    shown, stopped = feed(text, b"a##b")
    assert not stopped and shown == ["a", "", "", "##b"]
    assert text.finish() == ""


def test_a_multibyte_character_waits_for_its_last_byte():
    text = IncrementalText(byte_decode)
    shown, _ = feed(text, "é€!".encode())
    assert shown == ["", "é", "", "", "€", "!"]


def test_the_earliest_of_several_stops_wins_and_finish_releases_the_rest():
    text = IncrementalText(byte_decode, ["world", "lo"])
    shown, stopped = feed(text, b"hello world")
    assert stopped and "".join(shown) == "hel"
    held = IncrementalText(byte_decode, ["xyz"])
    shown, stopped = feed(held, b"abcxy")
    assert not stopped and "".join(shown) == "abc" and held.finish() == "xy"


@pytest.mark.parametrize("data", [b"plain text, no stop", b"stop at the end STOP", b"S-T-O-P STO STOP tail"])
def test_shown_text_is_always_a_prefix_of_the_final_text(data):
    text = IncrementalText(byte_decode, ["STOP"])
    shown, stopped = feed(text, data)
    final = "".join(shown) + ("" if stopped else text.finish())
    cut = data.decode().find("STOP")
    assert final == (data.decode() if cut < 0 else data.decode()[:cut])
