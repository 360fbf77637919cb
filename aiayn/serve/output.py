"""The serve engine's output stage: from each row's chosen token to its request's event (the
grammar advanced, text released, finish reason, metrics)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from aiayn.generate.constrain import ConstraintError
from aiayn.generate.text import IncrementalText
from aiayn.serve.metrics import Metrics
from aiayn.serve.request import Event, Request, TokenLogprob
from aiayn.serve.sampler import Chosen


class Output:
    """Detokenising and events for a tokenizer's ``decode`` and ``eos_id``."""

    def __init__(self, decode: Callable[[list[int]], str], eos_id: int | None, metrics: Metrics) -> None:
        self.decode, self.eos_id, self.metrics = decode, eos_id, metrics

    def start(self, request: Request) -> None:
        request.text = IncrementalText(self.decode, request.params.stop)

    def emit(self, requests: Sequence[Request], chosen: Sequence[tuple[int, Chosen | None]]) -> list[Request]:
        """Each request's token as an event; the requests that finished (their sampler state dropped)."""
        for request, (token, numbers) in zip(requests, chosen, strict=True):
            self._emit(request, token, numbers)
        finished = [r for r in requests if r.finished]
        for request in finished:
            request.release()
        return finished

    def _emit(self, request: Request, token: int, numbers: Chosen | None) -> None:
        now = time.monotonic()
        if request.first_token_at is None:
            request.first_token_at = now
            self.metrics.time_to_first_token.observe(now - request.arrived)
        else:
            self.metrics.inter_token_latency.observe(now - request.last_token_at)
        request.last_token_at, request.last_token = now, token
        request.generated += 1
        self.metrics.token_generated()
        text, finish, error = self._text(request, token)
        if finish is not None:
            request.finished = True
            self.metrics.finished(now - request.arrived)
        if not request.cancelled:
            info = None if numbers is None else TokenLogprob(
                self.decode([token]), numbers.logprob, [(self.decode([j]), v) for j, v in numbers.top])
            request.sink(Event(text, info, finish, error, token=token))

    def _text(self, request: Request, token: int) -> tuple[str, str | None, str | None]:
        """The text ``token`` adds, the finish reason and the error, if any."""
        assert request.text is not None
        grammar_done = False  # the structured answer is complete: nothing but end-of-text may follow
        if request.constraint is not None:
            try:
                request.constraint.advance(token)
                grammar_done = request.constraint.is_finished()
            except ConstraintError as exc:  # a bug (the logits were masked): this request alone fails
                return "", "error", f"internal error: {exc}"
        finish = None
        if token == self.eos_id:  # (a grammar allows it only once the answer is complete)
            text, finish = request.text.finish(), "stop"
        else:
            text, stopped = request.text.add(token)
            if stopped:
                finish = "stop"
            elif grammar_done:
                text, finish = text + request.text.finish(), "stop"
            elif request.generated >= request.params.max_tokens:
                text, finish = text + request.text.finish(), "length"
        return text, finish, None
