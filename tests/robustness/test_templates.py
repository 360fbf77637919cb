"""A chat template is code from a model file: hostile or broken ones fail fast, with one message,
inside the sandbox's budgets of time, output and memory (aiayn.interop.gguf_text)."""

from __future__ import annotations

import resource
import time

import pytest

from aiayn.interop import gguf_text
from aiayn.interop.gguf_text import BUDGET_CHECK_SECONDS, TEMPLATE_SECONDS, ChatTemplate, GGUFError

MESSAGES = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "nested loops that print nothing": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran for over"),
    "a range past the sandbox's limit": ("{% for i in range(10**12) %}x{% endfor %}", "Range too big"),
    "a string multiplied to 10 GB": ("{{ 'a' * 10**10 }}", "1 x 10,000,000,000 items"),
    "a huge power": ("{{ 2 ** 100000000 }}", "exponent"),
    # 26,000 characters an iteration: the cap is passed in 39 iterations, long before the time
    # budget even on a loaded machine (26 a time needed 38,000 slow iterations there)
    "output past the cap": ("{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' * 1000 }}{% endfor %}",
                            "wrote over 1,000,000 characters"),
    "a string doubled in a namespace (~)": (
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
        "{{ ns.s|length }}", "MiB of memory"),
    "a string doubled in a namespace (+)": (
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "a sequence of"),
    "endless recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
    "a syntax error": ("{% for %}", "chat template failed: Expected an expression"),
    "raise_exception": ("{{ raise_exception('no system role') }}", "chat template failed: no system role"),
    "Python internals": ("{{ messages.__class__.__mro__ }}", "unsafe"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_fails_fast_with_one_message(name: str) -> None:
    source, message = HOSTILE[name]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(GGUFError, match=message) as info:
        ChatTemplate(source).render(MESSAGES)
    assert time.monotonic() - start < TEMPLATE_SECONDS + 2
    message = str(info.value)
    assert "\n" not in message and ("drop --chat" in message or "refused" in message)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss: KiB
    assert grown_mib < 1024, f"the process grew by {grown_mib:.0f} MiB"


def test_an_ordinary_template_still_renders() -> None:
    source = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert ChatTemplate(source).render(MESSAGES) == "<|user|>hi\n<|assistant|>"
    assert ChatTemplate("{{ 'ab' * 3 }}{{ [1] + [2] }}{{ 2 ** 10 }}").render(MESSAGES) == "ababab[1, 2]1024"


def test_the_memory_is_read_once_per_check_not_every_line(monkeypatch) -> None:
    """Reading the process's memory is a file read: an ordinary template's many short lines do not each pay it."""
    reads = []
    resident_bytes = gguf_text._resident_bytes

    def counted() -> int | None:
        reads.append(1)
        return resident_bytes()

    monkeypatch.setattr(gguf_text, "_resident_bytes", counted)
    start = time.monotonic()
    text = ChatTemplate("{% for i in range(20000) %}{{ i }}{% endfor %}").render(MESSAGES)
    elapsed = time.monotonic() - start
    assert text.endswith("19999")
    assert len(reads) <= 2 + elapsed / BUDGET_CHECK_SECONDS  # the start, then at most one a check


def test_memory_over_budget_is_named_before_time_over_budget(monkeypatch) -> None:
    """Both budgets passed at one check: the memory is named (a slow machine makes a template that fills
    the memory slow too)."""
    if gguf_text._resident_bytes() is None:
        pytest.skip("this system does not tell a process its resident memory")
    monkeypatch.setattr(gguf_text, "TEMPLATE_SECONDS", 0.0)
    monkeypatch.setattr(gguf_text, "TEMPLATE_MAX_MEMORY", -(1 << 40))  # passed from the start
    with pytest.raises(GGUFError, match="MiB of memory"):
        ChatTemplate("{% for i in range(100000) %}{% endfor %}").render(MESSAGES)
