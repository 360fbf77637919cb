"""Many prompts at once without a server: the serve engine's continuous batching, stepped on the
calling thread until every prompt has its answer (vLLM's offline ``LLM.generate``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from aiayn.generate.sampling import SamplingConfig
from aiayn.serve.blocks import slot_plan
from aiayn.serve.engine import Engine
from aiayn.serve.request import Event, Request, SamplingParams
from aiayn.textgen import TextModel

KV_BUDGET = 1 << 30  # bytes of KV cache; fewer rows than ``max_batch`` when they do not fit


def complete_all(lm: TextModel, prompts: Sequence[list[int]], params: SamplingParams, *,
                 max_batch: int = 16) -> list[str]:
    """The text each of ``prompts`` (token ids) continues with under ``params``, in order. ValueError,
    one line, when a prompt and ``params.max_tokens`` exceed the model's context; RuntimeError if the
    engine fails."""
    if not prompts:
        return []
    longest = max(len(p) for p in prompts) + params.max_tokens
    if longest > lm.context:
        raise ValueError(f"a prompt of {longest - params.max_tokens} tokens + {params.max_tokens} new tokens "
                         f"exceed the model's context of {lm.context}; shorten it or ask for fewer tokens")
    plan = slot_plan(lm, max_batch=min(max_batch, len(prompts)), context=longest, budget=KV_BUDGET, kv_cache=None)
    engine = Engine(lm, plan, max_queue=len(prompts))
    texts: list[list[str]] = [[] for _ in prompts]
    requests = [Request(list(p), params, _collect(texts[i])) for i, p in enumerate(prompts)]
    for request in requests:
        engine.submit(request)
    while not all(r.finished for r in requests):
        engine.step()
    return ["".join(parts) for parts in texts]


def _collect(parts: list[str]) -> Callable[[Event], None]:
    """A request's sink: its text pieces into ``parts``; an error raised."""
    def sink(event: Event) -> None:
        if event.error is not None:
            raise RuntimeError(event.error)
        parts.append(event.text)
    return sink


class PromptTranslator:
    """A chat model that translates: each source put into ``template`` (where ``{src}`` stands for
    it) as a user message in the model's chat template, answered greedily; the answer's first line
    is the translation (the ``translate`` of ``aiayn.translate.Translator``, for ``aiayn evaluate``)."""

    def __init__(self, lm: TextModel, template: str, *, max_new_tokens: int = 128, max_batch: int = 16) -> None:
        if "{src}" not in template:
            raise ValueError(f"the prompt {template!r} has no {{src}} where the source goes; e.g. "
                             f"'Translate to German: {{src}}'")
        if lm.chat_template is None:
            raise ValueError("the model has no chat template; a prompt to translate needs an instruction-tuned "
                             "chat model")
        self.lm, self.template, self.max_batch = lm, template, max_batch
        self.params = SamplingParams(max_new_tokens, SamplingConfig(temperature=0.0), stop=("\n",))

    def translate(self, texts: list[str], options: object = None) -> list[str]:
        """The translations of ``texts``, in order (``options`` is not used: decoding is greedy)."""
        template = self.lm.chat_template
        prompts = [self.lm.encode(template.render([{"role": "user", "content": self.template.replace("{src}", text)}]))
                   for text in texts]
        answers = complete_all(self.lm, prompts, self.params, max_batch=self.max_batch)
        return [answer.strip() for answer in answers]
