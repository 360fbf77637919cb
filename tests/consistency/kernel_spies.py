"""Shared by the kernel tests: a spy that records the calls of a function, and the mark for tests
that need oneDNN's linear op."""

from __future__ import annotations

import pytest

from aiayn.fast import onednn

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear op")


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[tuple]:
    """Wrap ``module.name`` (its callers look it up at call time, so the wrapper is what they call):
    each call appends its ``(args, kwargs)`` to the returned list and then runs the real function."""
    calls: list[tuple] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
