"""What ``aiayn serve`` says at start-up about the model it serves."""

from __future__ import annotations

import pytest
from serve_helpers import tiny_text_model

from aiayn.fast.quantize import lower_precision
from aiayn.models import count_parameters
from aiayn.serve import ServedModel, build_state


@pytest.mark.parametrize("quantize", ["int8", "q4"])
def test_the_start_up_line_counts_lowered_weights_as_the_float_model_has_them(quantize):
    """--quantize keeps weights as buffers (int8 rows, 4-bit blocks): the line still gives the float
    model's number of parameters, the lowered ones' share and type, and float32 activations."""
    lm = tiny_text_model(d_model=64, n_heads=4, n_kv_heads=2, d_ff=64)  # widths of whole 32-blocks
    total = count_parameters(lm.model)
    float_line = build_state(ServedModel("tiny", lm=lm), max_batch=2)[1][0]
    assert f"{total:,} parameters, float32," in float_line, float_line
    lm.model = lower_precision(lm.model, quantize)
    line = build_state(ServedModel("tiny", lm=lm), max_batch=2)[1][0]
    assert f"{total:,} parameters (" in line and f" {quantize} weights), float32 activations" in line, line
