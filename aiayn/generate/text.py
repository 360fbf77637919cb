"""Token ids to text as they come, for ``aiayn generate`` and ``aiayn serve``: half a character (U+FFFD)
and text that could still grow into a stop string wait; a stop string is never shown."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalText:
    """The text of a growing list of token ids, released piece by piece: ``add(token)`` -> (the new
    text safe to show, whether a stop string ended the answer); ``finish()`` -> what was held back."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.shown = ""  # text released so far
        self.text = ""  # the decoded text of every id so far (complete characters)

    def add(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):  # half a character: wait for the rest
            return "", False
        self.text = text
        cut = self._first_stop(text)
        if cut is not None:
            return self._release(text[:cut]), True
        return self._release(text[: len(text) - self._held_back(text)]), False

    def finish(self) -> str:
        """Everything not shown yet (the answer ended without a stop string)."""
        return self._release(self.decode(self.ids) if self.ids else "")

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string in ``text`` starts, or None."""
        found = [i for stop in self.stops
                 if (i := text.find(stop, max(0, len(self.shown) - len(stop) + 1))) >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that begin some stop string (they may complete it)."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _release(self, upto: str) -> str:
        new = upto[len(self.shown):]  # (a decode that rewrote shown text cannot take it back)
        if len(upto) > len(self.shown):
            self.shown = upto
        return new
