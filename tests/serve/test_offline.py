"""Offline generation on the serve engine (``aiayn.serve.offline``): many prompts at once give each
prompt's own greedy answer, and a chat model prompted to translate (``aiayn evaluate --prompt``)."""

from __future__ import annotations

import pytest
from serve_helpers import tiny_text_model

from aiayn.api import generate_text
from aiayn.generate.sampling import SamplingConfig
from aiayn.serve.offline import PromptTranslator, complete_all
from aiayn.serve.request import SamplingParams

PROMPTS = ["The cat", "A much longer prompt about the weather in the hills", "Hello", "Two dogs play in the snow"]


@pytest.fixture(scope="module")
def lm():
    return tiny_text_model(context=256)


def test_prompts_batched_get_the_answers_each_gets_alone(lm):
    params = SamplingParams(12, SamplingConfig(temperature=0.0))
    together = complete_all(lm, [lm.encode(p) for p in PROMPTS], params, max_batch=3)  # rows are reused
    alone = [generate_text(lm, p, max_new_tokens=12).text for p in PROMPTS]
    assert together == alone and all(together)


def test_no_prompts_and_the_context_check(lm):
    assert complete_all(lm, [], SamplingParams(3)) == []
    with pytest.raises(ValueError, match="exceed the model's context of 256"):
        complete_all(lm, [[1] * 250], SamplingParams(10))


def test_a_chat_model_translates_what_it_is_asked_in_its_template(lm):
    translator = PromptTranslator(lm, "Translate to German: {src}", max_new_tokens=8)
    asked = lm.chat_template.render([{"role": "user", "content": "Translate to German: Two dogs"}])
    expected = generate_text(lm, asked, max_new_tokens=8).text.split("\n")[0].strip()
    assert translator.translate(["Two dogs", "A cat"])[0] == expected
    with pytest.raises(ValueError, match=r"has no \{src\}"):
        PromptTranslator(lm, "Translate to German")
    lm_without = tiny_text_model(context=256)
    lm_without.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        PromptTranslator(lm_without, "{src}")


def test_the_cli_refuses_what_a_prompt_does_not_take(run_aiayn, tmp_path):
    (tmp_path / "s.en").write_text("a\n")
    for extra, says in ((["--beam", "4"], "drop --beam"), (["--model", "a", "--model", "b"], "drop 2 models")):
        code, _, err = run_aiayn("evaluate", "--prompt", "T: {src}", "--src", str(tmp_path / "s.en"), "--ref",
                                 str(tmp_path / "s.en"), *(["--model", "m"] if extra[0] != "--model" else []), *extra)
        assert code == 2 and says in err, err
